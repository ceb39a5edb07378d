"""Checks that need a GPU (they skip on CPU, saying why): a CUDA-graph replay of the Triton
absorbed call after :meth:`MLAPlan.refresh_` is bit-identical to the eager call on the new
step (Triton, and FlashInfer through its seam implementation), and FlashInfer's MLA paged
wrapper (driven as ``python -m benchmarks gpu`` drives it: our cache's r / rope columns
as its two caches, its LSE converted to natural log) agrees with our Triton kernel and with
the float64 reference.

Run them with ``MLA_TEST_DEVICE=cuda`` on a CUDA machine.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from triton_case import ON_GPU, TCase, TritonKernels, assert_matches, load_benchmark  # noqa: E402

import mla_backend as mb  # noqa: E402
from mla_backend.ops.flashinfer import Kernels as FlashInferKernels  # noqa: E402
from mla_backend.ops.flashinfer import wrapper as fi  # noqa: E402

pytestmark = pytest.mark.skipif(
    not ON_GPU, reason="needs a CUDA GPU (MLA_TEST_DEVICE=cuda); the interpreter has no graphs"
)


def _impl(name: str):
    if name == "triton":
        return TritonKernels()
    if not fi.available():
        pytest.skip("flashinfer's MLA wrapper is not importable")
    return FlashInferKernels()


@pytest.mark.parametrize("impl", ["triton", "flashinfer"])
def test_cuda_graph_replay_after_refresh_is_bit_identical(impl: str) -> None:
    kw = dict(H=16, r=512, rope=64, page_size=64, q_dtype=torch.bfloat16,
              cache_dtype=torch.bfloat16, phase=mb.Phase.DECODE, nope=128, v=128)
    first = TCase([5, 1000, 64, 130], [1, 1, 1, 1], seed=1, **kw)
    second = TCase([40, 900, 3, 180], [1, 1, 1, 1], seed=2, **kw)  # the next step
    first.scale = second.scale = first.dims.default_softmax_scale  # what FlashInfer plans
    pages = max(first.kv_cache.shape[0], second.kv_cache.shape[0])
    cache = torch.full((pages, *first.kv_cache.shape[1:]), float("nan"),
                       dtype=first.kv_cache.dtype, device=first.device)
    cache[: first.kv_cache.shape[0]].copy_(first.kv_cache)
    kernels = _impl(impl)
    plan = first.plan(kernels)
    q_lat, q_pe = first.q_lat.clone(), first.q_pe.clone()

    def call():
        return mb.absorbed_attention(q_lat, q_pe, cache, plan, first.scale)

    eager_first = call()  # also compiles the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_g, lse_g = call()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(o_g, eager_first[0]) and torch.equal(lse_g, eager_first[1])
    # the next step, written where the captured call reads: cache, queries, plan tensors
    cache[: second.kv_cache.shape[0]].copy_(second.kv_cache)
    plan.refresh_(second.batch)
    q_lat.copy_(second.q_lat)
    q_pe.copy_(second.q_pe)
    graph.replay()
    torch.cuda.synchronize()
    eager = mb.absorbed_attention(second.q_lat, second.q_pe, cache, second.plan(kernels),
                                  second.scale)
    assert torch.equal(o_g, eager[0]) and torch.equal(lse_g, eager[1])
    assert_matches(second, (o_g, lse_g))


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("q_len", [1, 2])
def test_flashinfer_matches_triton_and_reference(page_size: int, q_len: int) -> None:
    pytest.importorskip("flashinfer", reason="flashinfer is not installed")
    bench = load_benchmark()
    case = TCase([7, 300, 64, 1000], [q_len] * 4, H=16, r=512, rope=64, page_size=page_size,
                 q_dtype=torch.bfloat16, cache_dtype=torch.bfloat16, seed=page_size + q_len,
                 phase=mb.Phase.DECODE if q_len == 1 else mb.Phase.TARGET_VERIFY,
                 nope=128, v=128)
    kv_lens = [p + n for p, n in zip(case.prefix, case.new, strict=True)]
    run = bench.flashinfer_runner(bench.SameData(
        case.q_lat, case.q_pe, case.kv_cache, case.batch.host_block_table(), kv_lens, q_len,
        case.scale))
    if isinstance(run, str):
        pytest.skip(run)
    o_fi, lse_fi = run()
    assert_matches(case, (o_fi, lse_fi))
    o_tr, lse_tr = case.triton()
    torch.testing.assert_close(o_fi.float(), o_tr.float(), atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(lse_fi, lse_tr, atol=1e-3, rtol=1e-3)
    # the same through the seam implementation: the plan holds a planned wrapper
    case.scale = case.dims.default_softmax_scale
    plan = case.plan(FlashInferKernels())
    assert plan.step.work.state.wrapper is not None
    assert_matches(case, mb.absorbed_attention(case.q_lat, case.q_pe, case.kv_cache, plan,
                                               case.scale))


@pytest.mark.parametrize("H,q_len", [(16, 1), (16, 2), (32, 2), (64, 1), (128, 1), (128, 2)])
@pytest.mark.parametrize("splits", [None, 7])
def test_gluon_kernel_matches_reference(
    H: int, q_len: int, splits: int | None, monkeypatch
) -> None:
    """The Gluon kernel (Hopper) on ragged batches with NaN-poisoned unwritten rows (last
    pages partly written), several pieces per request, against the float64 reference."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the Gluon kernel needs Hopper (sm_90a) or newer")
    case = TCase([1, 63, 64, 700, 2047], [q_len] * 5, H=H, r=512, rope=64, page_size=64,
                 q_dtype=torch.bfloat16, cache_dtype=torch.bfloat16, seed=H + q_len,
                 phase=mb.Phase.DECODE if q_len == 1 else mb.Phase.TARGET_VERIFY,
                 nope=128, v=128)
    from triton_case import tops

    launched = []
    real = tops.gluon.launch_gluon_attention
    monkeypatch.setattr(tops.gluon, "launch_gluon_attention",
                        lambda *a, **k: launched.append(1) or real(*a, **k))
    kernels = TritonKernels(gluon=True, num_kv_splits=splits)
    out = mb.absorbed_attention(case.q_lat, case.q_pe, case.kv_cache, case.plan(kernels),
                                case.scale)
    assert launched, "the Gluon kernel did not serve the call"
    assert_matches(case, out)
    tr = case.triton(num_kv_splits=splits)
    torch.testing.assert_close(out[0].float(), tr[0].float(), atol=3e-2, rtol=3e-2)
