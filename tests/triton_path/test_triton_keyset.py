"""The attention over key sets on the Triton path (:mod:`mla_backend.ops.triton.keyset`), under
the interpreter on CPU tensors or compiled on a GPU (``MLA_TEST_DEVICE=cuda``), against the
float64 oracle (:func:`mla_backend.testing.reference.reference_keyset_attention`): windows
(1, 4, larger than the context), index lists with -1 padding into the main cache and into a
second cache with its own pages, sinks (none / mixed / large / -inf), value = key over a 512-wide
row with rope 64, every latent layout, pages 1 / 16 / 64 shuffled with NaN in never-written rows,
an empty key set (o = 0, lse = sink), out-of-range indices refused; dense MLA and DSA as its
cases (the same results as the Triton absorbed / sparse attention)."""

from __future__ import annotations

import pytest
import torch
from triton_case import DEVICE, TritonKernels

import mla_backend as mb
from mla_backend.ops import KeyCache
from mla_backend.testing.cases import KeySetCase, make_keyset_case
from mla_backend.testing.keyset_checks import check_keyset
from mla_backend.testing.reference import reference_keyset_attention

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered in cast")
DIMS = mb.MLADims(4, 40, 8, 8, 8)  # odd r: a partial fp8_ds_mla tile
RAGGED = ([0, 9, 70, 3, 130], [5, 1, 6, 0, 2])
LENS2 = [2, 3, 17, 0, 33]
SINK = torch.tensor([0.5, 30.0, float("-inf"), -2.0])


def _indices(T: int, k: int, lens: list[int], new: list[int], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    out = torch.full((T, k), -1, dtype=torch.int32)
    req = [i for i, n in enumerate(new) for _ in range(n)]
    for t, i in enumerate(req):
        if lens[i]:
            out[t] = torch.randint(0, lens[i], (k,), generator=g, dtype=torch.int32)
    out[torch.rand(T, k, generator=g) < 0.35] = -1
    return out


def _run(d: KeySetCase, *, window=None, causal_range=True, k1=0, k2=0, sink=None,
         value_is_key=False):  # fmt: skip
    """Triton's result (on CPU) and the oracle's."""
    c = d.case
    T, new = c.batch.num_tokens, list(c.batch.new_lens)
    idx = _indices(T, k1, list(c.batch.kv_lens), new, 1) if k1 else None
    idx2 = _indices(T, k2, d.extra.lens.tolist(), new, 2) if k2 else None
    D = d.q_lat.shape[-1] + d.q_pe.shape[-1]
    plan = mb.plan(c.batch, c.dims, mb.Policy("absorb"), device=DEVICE, impl=TritonKernels(),
                   window=window)  # fmt: skip
    ex = d.extra
    extra = KeyCache(ex.kv_cache.to(DEVICE), ex.block_table.to(DEVICE), ex.lens.to(DEVICE))
    on = lambda t: t.to(DEVICE) if t is not None else None  # noqa: E731
    o, lse = mb.keyset_attention(
        d.q_lat.to(DEVICE), d.q_pe.to(DEVICE), c.kv_cache.to(DEVICE), plan, D**-0.5,
        on(c.kv_scale), causal_range=causal_range, indices=on(idx),
        extra=extra if k2 else None, extra_indices=on(idx2), sink=on(sink),
        value_is_key=value_is_key,
    )  # fmt: skip
    windows = [window] * len(new) if window is not None else None
    ro, rl = reference_keyset_attention(
        torch.cat([d.q_lat, d.q_pe], -1).float(), d.rows, new, D**-0.5,
        causal_range=causal_range, windows=windows, indices=idx, rows2=d.rows2,
        extra_indices=idx2, sink=sink, value_width=None if value_is_key else d.q_lat.shape[-1],
    )  # fmt: skip
    return o.cpu(), lse.cpu(), ro, rl


@pytest.mark.parametrize("window", [None, 1, 4, 1000])
def test_window_ranges_with_sink(window):
    d = make_keyset_case(DIMS, *RAGGED, 16, LENS2, 16)
    check_keyset(*_run(d, window=window, sink=SINK), torch.float32)


@pytest.mark.parametrize("qdt,cdt,page,page2", [
    (torch.float32, torch.float32, 1, 64), (torch.bfloat16, torch.bfloat16, 64, 1),
    (torch.bfloat16, mb.FP8_DTYPE, 16, 16), (torch.bfloat16, torch.uint8, 16, 4),
])  # fmt: skip
def test_window_indices_and_extra_cache(qdt, cdt, page, page2):
    """V4's CSA shape (window + second-cache entries + sink) plus DSA-style indices, over
    every latent layout."""
    d = make_keyset_case(DIMS, *RAGGED, page, LENS2, page2, qdt, cdt, seed=page)
    check_keyset(*_run(d, window=4, k1=3, k2=9, sink=SINK), qdt)


def test_value_is_key_v4_row():
    d = make_keyset_case(mb.MLADims(3, 448, 8, 64, 8), [0, 40], [2, 1], 16, [1, 10], 16,
                         torch.bfloat16)  # fmt: skip
    sink = torch.tensor([1.0, float("-inf"), -3.0])
    o, lse, ro, rl = _run(d, window=8, k2=4, sink=sink, value_is_key=True)
    assert o.shape == (3, 3, 512)
    check_keyset(o, lse, ro, rl, torch.bfloat16)


def test_empty_key_sets_and_large_sink():
    d = make_keyset_case(DIMS, *RAGGED, 16, LENS2, 16)
    check_keyset(*_run(d, causal_range=False, k1=2, sink=torch.full((4,), 40.0)), torch.float32)
    plan = mb.plan(d.case.batch, DIMS, mb.Policy("absorb"), device=DEVICE, impl=TritonKernels())
    T = plan.num_tokens
    none = torch.full((T, 3), -1, dtype=torch.int32, device=DEVICE)
    o, lse = mb.keyset_attention(d.q_lat.to(DEVICE), d.q_pe.to(DEVICE),
                                 d.case.kv_cache.to(DEVICE), plan, 0.3, causal_range=False,
                                 indices=none, sink=SINK.to(DEVICE))  # fmt: skip
    assert (o.cpu() == 0).all()  # lse = the sink, to the base-2 round trip's rounding
    torch.testing.assert_close(lse.cpu(), SINK.expand(T, 4), rtol=1e-6, atol=1e-6)


def test_dense_and_dsa_cases_equal_the_existing_ops():
    d = make_keyset_case(DIMS, *RAGGED, 16, LENS2, 16)
    c = d.case
    T = c.batch.num_tokens
    plan = mb.plan(c.batch, DIMS, mb.Policy("absorb"), device=DEVICE, impl=TritonKernels(),
                   indexer=mb.IndexerDims(2, 16, 5))  # fmt: skip
    q_lat, q_pe, kv = d.q_lat.to(DEVICE), d.q_pe.to(DEVICE), c.kv_cache.to(DEVICE)
    o, lse = mb.keyset_attention(q_lat, q_pe, kv, plan, 0.2)
    ao, al = mb.absorbed_attention(q_lat, q_pe, kv, plan, 0.2)
    torch.testing.assert_close(o, ao, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, al, rtol=1e-5, atol=1e-5)
    idx = _indices(T, 5, list(c.batch.kv_lens), list(c.batch.new_lens), 3).to(DEVICE)
    o, lse = mb.keyset_attention(q_lat, q_pe, kv, plan, 0.2, causal_range=False, indices=idx)
    so, sl = mb.sparse_absorbed_attention(q_lat, q_pe, kv, plan, idx, 0.2)
    torch.testing.assert_close(o, so, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, sl, rtol=1e-5, atol=1e-5)


def test_out_of_range_refused():
    d = make_keyset_case(DIMS, *RAGGED, 16, LENS2, 16)
    plan = mb.plan(d.case.batch, DIMS, mb.Policy("absorb"), device=DEVICE, impl=TritonKernels())
    T = plan.num_tokens
    bad = torch.zeros(T, 1, dtype=torch.int32)
    bad[0, 0] = 2  # request 0 has 2 second-cache entries
    ex = d.extra
    with pytest.raises(RuntimeError, match="out of range"):
        mb.keyset_attention(d.q_lat.to(DEVICE), d.q_pe.to(DEVICE), d.case.kv_cache.to(DEVICE),
                            plan, 0.3, extra=KeyCache(ex.kv_cache.to(DEVICE),
                                                      ex.block_table.to(DEVICE),
                                                      ex.lens.to(DEVICE)),
                            extra_indices=bad.to(DEVICE))  # fmt: skip
        torch.cuda.synchronize() if DEVICE != "cpu" else None
