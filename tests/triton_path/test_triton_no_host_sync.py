"""The per-layer calls on the Triton path read no tensor data on the host (issue 8, item 2):
the Triton counterpart of ``tests/test_no_host_sync.py`` (same scenarios and checks, with
``mla_backend.ops.triton.Kernels`` plans), plus checks of the custom ops themselves.

- Under ``FakeTensorMode`` (every tensor argument and the plan's index tensors fake) the calls
  give outputs of the right shape and dtype: the Triton ops' fake implementation is the op's
  own code (``torch.library.triton_op``); under the interpreter it launches nothing, on a GPU
  ``wrap_triton`` records the launch instead of running it.
- A real run (bf16 and fp8 caches, with ``kv_scale``) dispatches no ``aten._local_scalar_dense``,
  neither around the ops nor inside their bodies.
- ``torch.compile(fullgraph=True)`` traces the Triton call (a GPU compiles it with the
  ``aot_eager`` and ``inductor`` backends; the interpreter only allows the ``eager`` backend).
"""

from __future__ import annotations

import pytest
import torch
from torch._library.triton import set_wrap_triton_enabled

triton = pytest.importorskip("triton")

from test_no_host_sync import (  # noqa: E402  (tests/, on sys.path through tests/conftest.py)
    CACHES,
    CALLS,
    DSA_CALLS,
    SCENARIOS,
    CountSyncs,
    _dsa_inputs,
    build,
    check_dsa_call,
    check_fake,
    check_no_sync,
)
from triton_case import DEVICE, ON_GPU, TCase, TritonKernels, assert_matches, tops  # noqa: E402

import mla_backend as mb  # noqa: E402
from mla_backend.ops.triton import dsa  # noqa: E402


@pytest.mark.parametrize("cache_dtype", CACHES, ids=["bf16", "fp8"])
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_triton_path_runs_under_fake_tensor_mode(name: str, cache_dtype: torch.dtype) -> None:
    check_fake(name, cache_dtype, TritonKernels(num_kv_splits=2), DEVICE, calls=CALLS)


@pytest.mark.parametrize("cache_dtype", CACHES, ids=["bf16", "fp8"])
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_triton_path_reads_no_tensor_data_on_host(name: str, cache_dtype: torch.dtype) -> None:
    outs = check_no_sync(name, cache_dtype, TritonKernels(num_kv_splits=2), DEVICE, calls=CALLS)
    # the same step on the torch path (CPU) agrees
    case, plan = build(name, cache_dtype, "torch")
    want = mb.MLAAttention(case.dims, case.weights, chunk_tokens=8)(
        case.q_nope, case.q_pe, case.kv_cache, plan, case.kv_scale
    )
    torch.testing.assert_close(outs["MLAAttention"].cpu().float(), want.float(),
                               atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("cache_dtype", CACHES, ids=["bf16", "fp8"])
def test_op_bodies_read_no_tensor_data_on_host(cache_dtype: torch.dtype) -> None:
    """The ops' implementations themselves, called directly (a dispatch mode sees a custom op
    as one call and not what runs inside it)."""
    case, plan = build("extend", cache_dtype, TritonKernels(num_kv_splits=3), DEVICE)
    part, work = plan.step, plan.step.work
    q_lat = torch.randn(case.q_nope.shape[0], 3, 32, device=DEVICE).to(case.q_nope.dtype)
    scale = None if case.kv_scale is None else case.kv_scale.float().reshape(())
    args = (q_lat, case.q_pe, case.kv_cache, part.block_table, part.prefix_lens_t,
            part.new_lens_t, part.cu_new_t, work.q_block_req, work.q_block_start,
            work.state.part_meta, work.state.split_base, scale, 0.125, work.block_q, 16, 16,
            False, 128, 0, 0, False, False)
    c_kv = torch.ones(2, 32, device=DEVICE, dtype=case.q_nope.dtype)
    k_pe = torch.ones(2, 16, device=DEVICE, dtype=case.q_nope.dtype)
    slots = torch.tensor([3, -1], device=DEVICE)
    # as the op runs them eagerly: kernels launched directly, not through the tracing wrapper
    with set_wrap_triton_enabled(False), CountSyncs() as counter:
        o, lse = tops.absorbed.absorbed_attention_op(*args)
        tops.write.write_latent_op(case.kv_cache, c_kv, k_pe, slots, scale, False)
    assert counter.sites == []
    o2, lse2 = torch.ops.mla_backend.triton_absorbed_attention(*args)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)


def _compile_case() -> tuple[TCase, mb.MLAPlan]:
    case = TCase([5, 30, 0], [1, 2, 4], H=4, r=32, rope=16, page_size=16, seed=2,
                 q_dtype=torch.bfloat16, cache_dtype=mb.FP8_DTYPE)
    return case, case.plan(num_kv_splits=2)


BACKENDS = ["aot_eager", "inductor"] if ON_GPU else ["eager"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_compile_traces_the_triton_call(backend: str) -> None:
    torch._dynamo.reset()
    case, plan = _compile_case()
    scale = case.scale

    def step(q_lat, q_pe, kv_cache, kv_scale):
        o, lse = mb.absorbed_attention(q_lat, q_pe, kv_cache, plan, scale, kv_scale)
        return o.float() * 2.0, lse

    compiled = torch.compile(step, backend=backend, fullgraph=True)
    o, lse = compiled(case.q_lat, case.q_pe, case.kv_cache, case.kv_scale)
    o_eager, lse_eager = step(case.q_lat, case.q_pe, case.kv_cache, case.kv_scale)
    torch.testing.assert_close(o, o_eager, atol=0, rtol=0)
    torch.testing.assert_close(lse, lse_eager, atol=0, rtol=0)
    assert_matches(case, ((o / 2).to(case.q_lat.dtype), lse))


def test_cache_write_under_compile_mutates_the_cache() -> None:
    """The cache write declares its mutation, so a compiled step sees the new rows."""
    if not ON_GPU:
        pytest.skip("torch.compile beyond the eager backend needs a GPU (interpreted kernels)")
    torch._dynamo.reset()
    kv = torch.zeros(2, 4, 24, device=DEVICE, dtype=torch.bfloat16)
    c_kv = torch.randn(3, 16, device=DEVICE, dtype=torch.bfloat16)
    k_pe = torch.randn(3, 8, device=DEVICE, dtype=torch.bfloat16)
    slots = torch.tensor([5, -1, 0], device=DEVICE)

    def write(kv, c_kv, k_pe, slots):
        mb.write_latent(kv, c_kv, k_pe, slots, impl=TritonKernels())
        return kv.float().sum()

    total = torch.compile(write, backend="aot_eager", fullgraph=True)(kv, c_kv, k_pe, slots)
    flat = kv.view(-1, 24)
    assert torch.equal(flat[5], torch.cat([c_kv[0], k_pe[0]]))
    assert torch.equal(flat[0], torch.cat([c_kv[2], k_pe[2]]))
    assert float(total) == pytest.approx(float(flat.float().sum()))


# ---- DSA: the index-key write, the indexer's logits / top-k and the sparse attention ------------
DSA_CASES = [(call, torch.bfloat16) for call in DSA_CALLS] + [
    ("sparse_absorbed_attention", mb.FP8_DTYPE),  # the latent layout matters to it alone
    ("sparse_absorbed_attention", torch.uint8),
]


@pytest.mark.parametrize("call,cache_dtype", DSA_CASES, ids=lambda v: str(v))
def test_dsa_calls_read_no_tensor_data_on_host(call: str, cache_dtype: torch.dtype) -> None:
    """The DSA calls on Triton plans: no host read in a real run, and they run under
    FakeTensorMode (the custom ops' fake implementations are their own code)."""
    check_dsa_call(call, *_dsa_inputs(cache_dtype, TritonKernels(sparse_splits=2), DEVICE))


def test_dsa_op_bodies_read_no_tensor_data_on_host() -> None:
    """The DSA ops' implementations themselves, called directly (a dispatch mode sees a
    custom op as one call and not what runs inside it), split lists included."""
    t, plan = _dsa_inputs(torch.bfloat16, TritonKernels(), DEVICE)
    part, sp = plan.step, plan.sparse
    index_args = (t["q_I"], t["w"], t["index_cache"], part.block_table, sp.token_req_t,
                  sp.token_pos_t, 32)  # fmt: skip
    with set_wrap_triton_enabled(False), CountSyncs() as counter:
        dsa._write_index_keys_op(t["index_cache"], t["k_I"], t["slots"], 32, False)
        lg = dsa._indexer_logits_op(*index_args, sp.max_kv_len, False)
        idx = dsa._indexer_topk_op(*index_args, sp.max_kv_len, 5, False)
        o, lse = dsa._sparse_attention_op(t["q_lat"], t["q_pe"], t["kv_cache"],
                                          part.block_table, part.kv_lens_t, sp.token_req_t,
                                          t["idx"], None, 0.1, 0, 0, 2, 1, False)  # fmt: skip
    assert counter.sites == []
    assert lg.shape == (plan.num_tokens, sp.max_kv_len) and idx.shape == (plan.num_tokens, 5)
    assert torch.isfinite(o.float()).all() and o.shape == t["q_lat"].shape
