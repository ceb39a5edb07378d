"""Attention over key sets (:func:`mla_backend.keyset_attention`) against the float64 oracle
(:func:`mla_backend.testing.reference.reference_keyset_attention`, which writes each token's key
list out), on the torch path and the native kernels at every ISA level this CPU runs
(``MLA_BACKEND_TEST_ISAS`` restricts them): causal ranges with windows (1, 4, larger than the
context), index lists with -1 padding into the main cache and into a second cache with its own
pages, sinks (none / large / -inf / mixed), value = key (width 512, rope 64), ragged batches with
prefixes, pages 1 / 16 / 64 shuffled with NaN in never-written rows, kv splits; dense MLA and DSA
as its cases (equal to ``absorbed_attention`` / ``sparse_absorbed_attention``); bad input named."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mla_backend as mb
from mla_backend.cache_layout import CacheLayout
from mla_backend.config import current
from mla_backend.ops import AbsorbedCall, KeyCache, KeySetCall, KeyWindow, native
from mla_backend.ops.native import ops as native_ops
from mla_backend.selection import get_impl
from mla_backend.testing.cases import KeySetCase, make_keyset_case
from mla_backend.testing.keyset_checks import check_keyset
from mla_backend.testing.reference import reference_keyset_attention

DIMS = mb.MLADims(4, 40, 8, 8, 8)  # H, r, nope, rope, v: odd r (a partial fp8_ds_mla tile)
V4 = mb.MLADims(3, 448, 8, 64, 8)  # the 512-wide row of DeepSeek-V4 (448 + rope 64)
RAGGED = ([0, 9, 70, 3, 130], [5, 1, 6, 0, 2])  # fresh extend, decodes, an empty request
LENS2 = [2, 3, 17, 0, 33]  # second-cache entries per request
PATHS = ["torch", "native"]


def _first_test_level() -> str:
    want = {x.strip() for x in current().test_isas.split(",") if x.strip()}
    return next((x for x in native.host_isas() if not want or x in want), "")


@pytest.fixture(params=PATHS)
def kernels(request: pytest.FixtureRequest, isa: str) -> object:
    """The torch implementation (once, at the first level tested) or native at ``isa``."""
    if request.param == "torch":
        if isa != _first_test_level():
            pytest.skip("the torch path runs once")
        return get_impl(torch.device("cpu"), "torch")
    return native.Kernels(isa=isa)


def _case(dims=DIMS, page=16, page2=16, dtype=torch.float32, cache_dtype=None, seed=0,
          prefix=RAGGED[0], new=RAGGED[1], lens2=LENS2) -> KeySetCase:  # fmt: skip
    return make_keyset_case(dims, list(prefix), list(new), page, list(lens2), page2, dtype,
                            cache_dtype, seed)  # fmt: skip


def _indices(T: int, k: int, lens: list[int], new: list[int], seed: int) -> torch.Tensor:
    """[T, k] int32: random entries (repeats allowed: each counts once) of each token's request,
    about a third -1."""
    g = torch.Generator().manual_seed(seed)
    req = [i for i, n in enumerate(new) for _ in range(n)]
    out = torch.full((T, k), -1, dtype=torch.int32)
    for t, i in enumerate(req):
        if lens[i] > 0:
            out[t] = torch.randint(0, lens[i], (k,), generator=g, dtype=torch.int32)
    out[torch.rand(T, k, generator=g) < 0.35] = -1
    return out


def _run(d: KeySetCase, kern, *, window=None, causal_range=True, k1=0, k2=0, sink=None,
         value_is_key=False, seed=0, scale=None):  # fmt: skip
    """Run the call on ``kern`` and the oracle; returns (o, lse, ref_o, ref_lse)."""
    c = d.case
    T = c.batch.num_tokens
    new, kvl = list(c.batch.new_lens), list(c.batch.kv_lens)
    idx = _indices(T, k1, kvl, new, seed + 1) if k1 else None
    idx2 = _indices(T, k2, d.extra.lens.tolist(), new, seed + 2) if k2 else None
    D = d.q_lat.shape[-1] + d.q_pe.shape[-1]
    scale = D**-0.5 if scale is None else scale
    plan = d.plan(impl=kern, window=window)
    o, lse = mb.keyset_attention(
        d.q_lat, d.q_pe, c.kv_cache, plan, scale, c.kv_scale, causal_range=causal_range,
        indices=idx, extra=d.extra if k2 else None, extra_indices=idx2, sink=sink,
        value_is_key=value_is_key,
    )  # fmt: skip
    windows = None
    if window is not None:
        windows = [window] * len(new) if isinstance(window, int) else list(window)
    ref_o, ref_lse = reference_keyset_attention(
        torch.cat([d.q_lat, d.q_pe], -1).float(), d.rows, new, scale, causal_range=causal_range,
        windows=windows, indices=idx, rows2=d.rows2, extra_indices=idx2, sink=sink,
        value_width=None if value_is_key else d.q_lat.shape[-1],
    )  # fmt: skip
    return o, lse, ref_o, ref_lse


SINKS = {
    "none": None,
    "mixed": torch.tensor([0.5, 30.0, float("-inf"), -2.0]),
    "large": torch.full((4,), 40.0),
    "neginf": torch.full((4,), float("-inf")),
}


# ---- the fast grid ---------------------------------------------------------------------------
@pytest.mark.parametrize("window", [None, 1, 4, 1000])
@pytest.mark.parametrize("sink", ["none", "mixed"])
def test_window_ranges_match_oracle(kernels, window, sink):
    """Causal ranges with a start: windows of 1, 4 and larger than every context (the dense
    case), with and without sinks."""
    d = _case()
    check_keyset(*_run(d, kernels, window=window, sink=SINKS[sink]), torch.float32)


@pytest.mark.parametrize("page,page2", [(1, 64), (16, 1), (64, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_window_plus_extra_cache_matches_oracle(kernels, page, page2, dtype):
    """V4's CSA / HCA shape: a window of the main cache plus indices (-1 padding, repeats) into
    a second cache with its own page size and pages, with a sink; ragged, prefixes."""
    d = _case(page=page, page2=page2, dtype=dtype)
    o, lse, ro, rl = _run(d, kernels, window=4, k2=9, sink=SINKS["mixed"])
    check_keyset(o, lse, ro, rl, dtype)


@pytest.mark.parametrize("causal_range", [False, True])
def test_indices_into_both_caches_match_oracle(kernels, causal_range):
    """Index lists into the main cache (DSA) and the second cache together, with or without
    the causal range (the lists repeat positions and, with the range, hold positions inside it:
    each distinct position of a cache counts once, as the oracle's sets)."""
    d = _case(page=16, page2=64)
    check_keyset(*_run(d, kernels, causal_range=causal_range, k1=7, k2=5, sink=SINKS["mixed"]),
           torch.float32)  # fmt: skip


@pytest.mark.parametrize("sink", ["large", "neginf"])
def test_sinks_match_oracle(kernels, sink):
    """A large sink (o -> ~0, lse ~ sink) and -inf (no sink); tokens whose key set is empty
    (DSA lists of only -1) get o = 0 and lse = sink."""
    d = _case()
    T = d.case.batch.num_tokens
    o, lse, ro, rl = _run(d, kernels, causal_range=False, k1=3, sink=SINKS[sink])
    check_keyset(o, lse, ro, rl, torch.float32)
    plan = d.plan(impl=kernels)
    none = torch.full((T, 2), -1, dtype=torch.int32)
    o, lse = mb.keyset_attention(d.q_lat, d.q_pe, d.case.kv_cache, plan, 0.3, causal_range=False,
                                 indices=none, sink=SINKS[sink])  # fmt: skip
    assert (o == 0).all()
    assert torch.equal(lse, SINKS[sink].expand(T, 4))


@pytest.mark.parametrize("causal_range", [False, True])
def test_repeated_positions_count_once(kernels, causal_range):
    """Each distinct position of a cache counts once: lists full of repeats (and, with the
    causal range, of positions the range already holds) give what the lists of their distinct
    entries outside the range give, and the oracle over sets."""
    d = _case(page=3, page2=4)
    c = d.case
    T = c.batch.num_tokens
    new, kvl = list(c.batch.new_lens), list(c.batch.kv_lens)
    lens2 = d.extra.lens.tolist()
    req = [i for i, n in enumerate(new) for _ in range(n)]
    pos = [kvl[i] - new[i] + j for i, n in enumerate(new) for j in range(n)]
    idx = torch.full((T, 6), -1, dtype=torch.int32)
    idx2 = torch.full((T, 4), -1, dtype=torch.int32)
    clean = torch.full((T, 6), -1, dtype=torch.int32)
    clean2 = torch.full((T, 4), -1, dtype=torch.int32)
    for t, i in enumerate(req):
        a, b = 0, max(0, pos[t] - 2)  # b: inside the causal range (window 4)
        idx[t] = torch.tensor([a, b, a, -1, b, a], dtype=torch.int32)
        keep = [a] if not causal_range or a < pos[t] - 3 else []
        keep += [b] if not causal_range and b != a else []
        clean[t, : len(keep)] = torch.tensor(keep, dtype=torch.int32)
        if lens2[i]:
            e = lens2[i] - 1
            idx2[t] = torch.tensor([e, e, -1, e], dtype=torch.int32)
            clean2[t, 0] = e
    plan = d.plan(impl=kernels, window=4 if causal_range else None)

    def run(i1, i2):
        return mb.keyset_attention(d.q_lat, d.q_pe, c.kv_cache, plan, 0.3,
                                   causal_range=causal_range, indices=i1, extra=d.extra,
                                   extra_indices=i2, sink=SINKS["mixed"])  # fmt: skip

    o, lse = run(idx, idx2)
    co, clse = run(clean, clean2)
    torch.testing.assert_close(o, co, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, clse, rtol=1e-5, atol=1e-6)
    ro, rl = reference_keyset_attention(
        torch.cat([d.q_lat, d.q_pe], -1).float(), d.rows, new, 0.3, causal_range=causal_range,
        windows=[4] * len(new) if causal_range else None, indices=idx, rows2=d.rows2,
        extra_indices=idx2, sink=SINKS["mixed"], value_width=d.q_lat.shape[-1],
    )  # fmt: skip
    check_keyset(o, lse, ro, rl, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_value_is_key_v4_width(kernels, dtype):
    """value = key: the whole 512-wide row (448 + rope 64) is the value; window + second cache
    + sink, as V4's compressed layers."""
    d = _case(dims=V4, dtype=dtype, prefix=[0, 40, 6], new=[3, 1, 2], lens2=[1, 10, 2])
    sink = torch.tensor([1.0, float("-inf"), -3.0])
    o, lse, ro, rl = _run(d, kernels, window=8, k2=4, sink=sink, value_is_key=True)
    assert o.shape == (6, 3, 512)
    check_keyset(o, lse, ro, rl, dtype)


@pytest.mark.parametrize("cache_dtype", [mb.FP8_DTYPE, torch.uint8])
def test_fp8_layouts_match_oracle(kernels, cache_dtype):
    """Per-tensor fp8 (kv_scale) and fp8_ds_mla rows in both caches."""
    d = _case(dtype=torch.bfloat16, cache_dtype=cache_dtype, page2=1)
    check_keyset(*_run(d, kernels, window=4, k1=2, k2=6, sink=SINKS["mixed"]), torch.bfloat16)


def test_kv_splits_merge_with_sink(isa):
    """Native kv splits (forced: 3 per token / request) merged through their LSE with the
    sink applied once, on the windowed path and the dense path."""
    kern = native.Kernels(isa=isa, num_kv_splits=3)
    d = _case(prefix=[200, 0], new=[2, 70], lens2=[50, 4])
    for window, k2 in ((None, 0), (64, 20)):
        check_keyset(*_run(d, kern, window=window, k2=k2, sink=SINKS["mixed"]), torch.float32)


# ---- dense MLA and DSA as cases of the primitive ----------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_case_equals_absorbed_attention(kernels, dtype):
    """causal_range from 0, no index, no sink == absorbed_attention (bit for bit on the native
    kernels: one engine path; to fp32 rounding on torch's different schedule)."""
    d = _case(dtype=dtype)
    c = d.case
    plan = d.plan(impl=kernels)
    o, lse = mb.keyset_attention(d.q_lat, d.q_pe, c.kv_cache, plan, 0.2, c.kv_scale)
    ao, alse = mb.absorbed_attention(d.q_lat, d.q_pe, c.kv_cache, plan, 0.2, c.kv_scale)
    if isinstance(kernels, native.Kernels):
        assert torch.equal(o, ao) and torch.equal(lse, alse)
    else:
        torch.testing.assert_close(o, ao, rtol=1e-5 if dtype == torch.float32 else 1e-2,
                                   atol=1e-5 if dtype == torch.float32 else 1e-2)  # fmt: skip
        torch.testing.assert_close(lse, alse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_case_equals_sparse_absorbed_attention(kernels, dtype):
    """indices only == sparse_absorbed_attention on a DSA plan (bit for bit on the native
    kernels: the same engines and split rule)."""
    d = _case(dtype=dtype)
    c = d.case
    T = c.batch.num_tokens
    idx = _indices(T, 11, list(c.batch.kv_lens), list(c.batch.new_lens), 5)
    dsa = mb.plan(c.batch, c.dims, mb.Policy("absorb"), impl=kernels,
                  indexer=mb.IndexerDims(2, 16, 11))  # fmt: skip
    o, lse = mb.keyset_attention(d.q_lat, d.q_pe, c.kv_cache, dsa, 0.2, causal_range=False,
                                 indices=idx)  # fmt: skip
    so, slse = mb.sparse_absorbed_attention(d.q_lat, d.q_pe, c.kv_cache, dsa, idx, 0.2)
    if isinstance(kernels, native.Kernels):
        assert torch.equal(o, so) and torch.equal(lse, slse)
    else:
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(o, so, rtol=tol, atol=tol)
        torch.testing.assert_close(lse, slse, rtol=1e-5, atol=1e-5)


# ---- hypothesis-drawn shapes ------------------------------------------------------------------
@settings(max_examples=8, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(
    data=st.data(),
    H=st.integers(1, 5),
    page=st.sampled_from([1, 3, 16]),
    page2=st.sampled_from([1, 4, 64]),
)
def test_hypothesis_key_sets(kernels, data, H, page, page2):
    """Random ragged batches, windows per request, index widths, sinks and value widths."""
    B = data.draw(st.integers(1, 3))
    prefix = data.draw(st.lists(st.integers(0, 40), min_size=B, max_size=B))
    new = data.draw(st.lists(st.integers(0, 5), min_size=B, max_size=B))
    lens2 = data.draw(st.lists(st.integers(0, 12), min_size=B, max_size=B))
    window = data.draw(st.one_of(st.none(), st.lists(st.integers(1, 50), min_size=B, max_size=B)))
    k1, k2 = data.draw(st.integers(0, 4)), data.draw(st.integers(0, 4))
    causal_range = data.draw(st.booleans()) or (k1 == 0 and k2 == 0)
    vk = data.draw(st.booleans())
    sink = None
    if data.draw(st.booleans()):
        sink = torch.tensor(data.draw(st.lists(
            st.sampled_from([float("-inf"), -5.0, 0.0, 3.0, 25.0]), min_size=H, max_size=H)))
    dims = mb.MLADims(H, 24, 8, 8, 8)
    d = _case(dims=dims, page=page, page2=page2, prefix=prefix, new=new, lens2=lens2,
              seed=data.draw(st.integers(0, 99)))  # fmt: skip
    check_keyset(*_run(d, kernels, window=window, causal_range=causal_range, k1=k1, k2=k2,
                    sink=sink, value_is_key=vk), torch.float32)  # fmt: skip


# ---- bad input ---------------------------------------------------------------------------------
def test_bad_input_is_named(kernels):
    d = _case()
    c = d.case
    T = c.batch.num_tokens
    plan = d.plan(impl=kernels)
    call = lambda **kw: mb.keyset_attention(d.q_lat, d.q_pe, c.kv_cache, plan, 0.3, **kw)  # noqa: E731
    with pytest.raises(ValueError, match="window=0"):
        d.plan(impl=kernels, window=0)
    with pytest.raises(ValueError, match="sequence of 5"):
        d.plan(impl=kernels, window=[4, 4])
    with pytest.raises(ValueError, match="empty key set"):
        call(causal_range=False)
    with pytest.raises(ValueError, match=r"sink torch.float64 \(4,\)"):
        call(sink=torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"sink torch.float32 \(3,\)"):
        call(sink=torch.zeros(3))
    with pytest.raises(ValueError, match=r"indices torch.float32"):
        call(indices=torch.zeros(T, 2))
    with pytest.raises(ValueError, match="give both or neither"):
        call(extra=d.extra)
    bad = KeyCache(d.extra.kv_cache[..., :-1], d.extra.block_table, d.extra.lens)
    with pytest.raises(ValueError, match="the main cache's row format"):
        call(extra=bad, extra_indices=torch.zeros(T, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"out torch.float32 \(14, 4, 40\).*\[14, 4, 48\]"):
        call(value_is_key=True, out=torch.empty(T, 4, 40))
    over = torch.zeros(T, 2, dtype=torch.int32)
    over[5, 1] = 10  # token 5 is request 1's, which has 10 rows: 0 .. 9
    with pytest.raises(RuntimeError, match="out of range"):
        call(causal_range=False, indices=over)
    over2 = torch.zeros(T, 1, dtype=torch.int32)
    over2[0, 0] = 2  # request 0 has 2 second-cache entries
    with pytest.raises(RuntimeError, match="out of range"):
        call(extra=d.extra, extra_indices=over2)
    with pytest.raises(RuntimeError, match="sink"):
        call(sink=torch.tensor([0.0, math.inf, 0.0, 0.0]))


def test_value_is_key_refuses_ds_layout():
    d = _case(dtype=torch.bfloat16, cache_dtype=torch.uint8)
    plan = d.plan(impl="torch")
    with pytest.raises(ValueError, match="value_is_key is not supported on an fp8_ds_mla"):
        mb.keyset_attention(d.q_lat, d.q_pe, d.case.kv_cache, plan, 0.3, value_is_key=True)


def test_native_names_a_bad_window_and_page(isa):
    """The native op's own checks (below the entry point): a window < 1 and a second-cache
    page id outside the cache, named before anything is read (records built by hand, as the
    entry point would not let them through)."""
    d = _case()
    c = d.case
    T = c.batch.num_tokens
    plan = d.plan(impl=native.Kernels(isa=isa))
    layout = CacheLayout.of(c.kv_cache, DIMS.kv_lora_rank, DIMS.qk_rope_head_dim, torch.float32)
    attn = AbsorbedCall(d.q_lat, d.q_pe, c.kv_cache, layout, plan.step, 0.3, None)
    win = KeyWindow((3, 3, 0, 3, 3), torch.tensor([3, 3, 0, 3, 3], dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"window\[2\] = 0 must be >= 1"):
        native_ops.keyset_attention(KeySetCall(attn, win), isa=isa)
    bt2 = d.extra.block_table.clone()
    bt2[0, 0] = 10_000
    extra = KeyCache(d.extra.kv_cache, bt2, d.extra.lens)
    call = KeySetCall(attn, None, extra=extra, extra_indices=torch.zeros(T, 1, dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"second block_table\[0, 0\] = 10000"):
        native_ops.keyset_attention(call, isa=isa)


# ---- the long grid -----------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("page", [1, 16, 64])
@pytest.mark.parametrize("window", [1, 4, 33, 10_000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_long_grid(kernels, page, window, dtype):
    d = _case(page=page, page2=max(1, 64 // page), dtype=dtype, prefix=[300, 0, 17],
              new=[3, 40, 9], lens2=[75, 10, 4])  # fmt: skip
    for k1, k2 in ((0, 0), (5, 0), (0, 16), (3, 8)):
        check_keyset(*_run(d, kernels, window=window, k1=k1, k2=k2, sink=SINKS["mixed"]), dtype)
