"""Regression tests of issue 37: the bad inputs the fuzzer found the public entry points
accepting, corrupting or crashing on, one test per defect class, each run on the torch
implementation and the native kernels at every ISA level this CPU runs (the ``kernels``
fixture). Every case either raises an error naming the value or gives the oracle's answer
(:mod:`mla_backend.testing.reference`), the same for every implementation; cache rows a call
does not address stay bit-identical."""

from __future__ import annotations

import math

import pytest
import torch

import mla_backend as mb
from mla_backend.cache_layout import CacheLayout
from mla_backend.index_cache import IndexCacheLayout
from mla_backend.ops.native import build
from mla_backend.testing.cases import make_case, make_dsa_case
from mla_backend.testing.reference import (
    plain_attention,
    reference_indexer_logits,
    reference_sparse_attention,
    reference_topk,
)

DIMS = mb.MLADims(2, 8, 4, 4, 4)  # H, r, nope, rope, v
INDEXER = mb.IndexerDims(2, 16, 4)  # Hi, Di, topk
SCALE = DIMS.default_softmax_scale


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# ---- 1. write_latent: an out-of-range slot never wraps ---------------------------------------
@pytest.mark.parametrize("slot", [8, 9, 10**9])
def test_write_latent_refuses_a_slot_outside_the_cache(kernels: object, slot: int) -> None:
    cache = torch.zeros(2, 4, 8, dtype=torch.bfloat16)
    before = cache.clone()
    with pytest.raises(ValueError, match=rf"slot_mapping\[1\] = {slot} is outside the cache"):
        mb.write_latent(cache, torch.ones(2, 8, dtype=torch.bfloat16),
                        torch.zeros(2, 0, dtype=torch.bfloat16), torch.tensor([0, slot]),
                        impl=kernels)  # fmt: skip
    assert _same_bytes(cache, before)  # nothing written, not even the valid slot 0


# ---- 2. write_index_keys: an out-of-range slot never wraps -----------------------------------
@pytest.mark.parametrize("kind", ["plain", "fp8"])
def test_write_index_keys_refuses_a_slot_outside_the_cache(kernels: object, kind: str) -> None:
    if kind == "plain":
        cache = torch.zeros(2, 4, 16, dtype=torch.bfloat16)
    else:
        cache = torch.zeros(2, 4, IndexCacheLayout.named("fp8", 16, 16).width, dtype=torch.uint8)
    before = cache.clone()
    with pytest.raises(ValueError, match=r"slot_mapping\[0\] = 11 is outside the index cache"):
        mb.write_index_keys(cache, torch.ones(1, 16), torch.tensor([11]), impl=kernels)
    assert _same_bytes(cache, before)


# ---- 1b. a slot named by several tokens of one write holds the last one's row, whole --------
@pytest.mark.parametrize("layout", ["bf16", "fp8", "fp8_ds_mla"])
def test_a_slot_written_twice_holds_the_last_tokens_row(kernels: object, layout: str) -> None:
    # 300 tokens (more than one thread's share) over 7 slots, every slot many times, the
    # writers of a slot far apart; padding in between
    r, rope, T = 256, 16, 300
    g = torch.Generator().manual_seed(7)
    slots = torch.randint(0, 7, (T,), generator=g)
    slots[::11] = -1
    c_kv = torch.randn(T, r, generator=g).bfloat16()
    k_pe = torch.randn(T, rope, generator=g).bfloat16()
    if layout == "fp8_ds_mla":
        lay = CacheLayout.ds_mla(r, rope, torch.bfloat16)
        cache, scale = torch.zeros(2, 4, lay.width, dtype=torch.uint8), None
    elif layout == "fp8":
        cache, scale = torch.zeros(2, 4, r + rope, dtype=torch.float8_e4m3fn), torch.tensor(0.5)
    else:
        cache, scale = torch.zeros(2, 4, r + rope, dtype=torch.bfloat16), None
    mb.write_latent(cache, c_kv, k_pe, slots, scale, impl=kernels)
    # the oracle: each slot written alone by its last token, on the torch implementation
    want = torch.zeros_like(cache)
    for s in range(8):
        named = (slots == s).nonzero().flatten()
        if len(named):
            t = named[-1 :]
            mb.write_latent(want, c_kv[t], k_pe[t], torch.tensor([s]), scale, impl="torch")
    assert _same_bytes(cache, want)


# ---- 3. the block table the kernels read is the one the plan checks --------------------------
def test_a_host_copy_that_differs_from_a_cpu_block_table_is_refused() -> None:
    bt = torch.tensor([[10**8]], dtype=torch.int32)
    host = torch.tensor([[0]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"differs .* at \[0, 0\]: 0 != 100000000"):
        mb.MLABatch.build([3], [1], bt, 4, block_table_host=host)
    ok = mb.MLABatch.build([3], [1], bt, 4, block_table_host=bt.clone())  # an equal copy is fine
    assert ok.host_block_table() is bt


def test_a_page_beyond_the_cache_in_a_cpu_block_table_is_refused(kernels: object) -> None:
    case = make_case(DIMS, [3], [1], 4, seed=1, impl="torch")
    bt = torch.tensor([[10**8]], dtype=torch.int32)
    batch = mb.MLABatch.build([3], [1], bt, 4, block_table_host=bt.clone())
    plan = mb.plan(batch, DIMS, mb.Policy("absorb"), impl=kernels)
    q_lat = torch.randn(1, DIMS.num_heads, DIMS.kv_lora_rank)
    with pytest.raises(ValueError, match="page id 100000000"):
        mb.absorbed_attention(q_lat, case.q_pe, case.kv_cache, plan, SCALE)


# ---- 4, 6: sparse attention with k = 0 and with repeated entries -----------------------------
def _sparse(kernels: object, indices: list[list[int]]) -> tuple:
    d = make_dsa_case(DIMS, INDEXER, [5], [1], 4, seed=2, impl="torch")
    c = d.case
    plan = d.plan(impl=kernels)
    q_lat = torch.randn(1, DIMS.num_heads, DIMS.kv_lora_rank,
                        generator=torch.Generator().manual_seed(9))  # fmt: skip
    idx = torch.tensor(indices, dtype=torch.int32).view(1, -1)
    o, lse = mb.sparse_absorbed_attention(q_lat, c.q_pe, c.kv_cache, plan, idx, SCALE)
    ref_o, ref_lse = reference_sparse_attention(q_lat, c.q_pe, c.c_kv, c.k_pe, [1], idx, SCALE)
    return o, lse, ref_o, ref_lse


def test_sparse_attention_with_no_index_column(kernels: object) -> None:
    o, lse, _, _ = _sparse(kernels, [[]])
    assert o.shape == (1, DIMS.num_heads, DIMS.kv_lora_rank) and torch.all(o == 0)
    assert torch.all(torch.isneginf(lse))


@pytest.mark.parametrize("indices", [[0, 0, 1], [1, 0, 1, 0], [3, -1, 3, 3], [2, 2]])
def test_a_repeated_sparse_index_counts_once(kernels: object, indices: list[int]) -> None:
    o, lse, ref_o, ref_lse = _sparse(kernels, [indices])  # the oracle takes the set
    torch.testing.assert_close(o.double(), ref_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    distinct = sorted(set(i for i in indices if i >= 0))
    o1, lse1, _, _ = _sparse(kernels, [distinct])
    torch.testing.assert_close(o, o1, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, lse1, atol=1e-6, rtol=1e-6)


# ---- 5. write_latent's tensors on another device than the cache ------------------------------
@pytest.mark.parametrize("where", ["c_kv", "k_pe", "slot_mapping"])
def test_write_latent_refuses_a_tensor_on_another_device(kernels: object, where: str) -> None:
    cache = torch.zeros(2, 4, 12)
    args = {"c_kv": torch.ones(1, 8), "k_pe": torch.ones(1, 4), "slot_mapping": torch.tensor([1])}
    args[where] = args[where].to("meta")
    with pytest.raises(ValueError, match=rf"{where} is on meta, but the cache is on cpu"):
        mb.write_latent(cache, args["c_kv"], args["k_pe"], args["slot_mapping"], impl=kernels)
    assert torch.all(cache == 0)


# ---- 7. NaN in the indexer: a NaN logit ranks below every number -----------------------------
@pytest.mark.parametrize("kind", ["plain", "fp8"])
def test_a_nan_key_gives_a_nan_logit_that_ranks_last(kernels: object, kind: str) -> None:
    Di = INDEXER.head_dim
    layout = (IndexCacheLayout.named("fp8", Di, Di) if kind == "fp8"
              else IndexCacheLayout("plain", Di, 0, torch.float32))  # fmt: skip
    cache = torch.zeros(2, 4, layout.width, dtype=layout.dtype)
    keys = torch.rand(5, Di) + 0.5
    mb.write_index_keys(cache, keys, torch.arange(5), layout, impl="torch")
    values, scales = layout.page_views(cache)  # [2, 4, Di] views (rows 2 and 4: [0, 2], [1, 0])
    if kind == "fp8":
        values[0, 2, 3] = 0x7F  # e4m3fn NaN (the decode used to read 480)
        values[1, 0, 0] = 0xFF
    else:
        values[0, 2, 3] = float("nan")
    batch = mb.MLABatch.build([4], [1], torch.tensor([[0, 1]], dtype=torch.int32), 4)
    plan = mb.plan(batch, DIMS, mb.Policy("absorb"), impl=kernels, indexer=INDEXER)
    q_I = torch.rand(1, INDEXER.n_heads, Di) + 0.5
    w = torch.rand(1, INDEXER.n_heads) + 0.5
    lg = mb.indexer_logits(q_I, w, cache, plan, layout)
    nan_rows = [2, 4] if kind == "fp8" else [2]
    stored = layout.decode(values.reshape(-1, Di)[:5],
                           None if scales is None else scales.reshape(-1, 1)[:5])  # fmt: skip
    ref = reference_indexer_logits(q_I, w, [stored], [1])
    assert torch.isnan(lg[0, nan_rows]).all() and torch.isnan(ref[0, nan_rows]).all()
    finite = [p for p in range(5) if p not in nan_rows]
    torch.testing.assert_close(lg[0, finite].double(), ref[0, finite], rtol=2e-2, atol=1e-3)
    for topk in (1, 3, 5):
        idx = mb.indexer_topk(q_I, w, cache, plan, topk, layout)
        want = reference_topk(torch.nan_to_num(ref, nan=-1e300), topk)  # NaN below numbers
        assert idx.tolist() == want.tolist(), (topk, lg)


# ---- 8. write_latent's dtypes -----------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.float8_e4m3fn])
@pytest.mark.parametrize("which", ["c_kv", "k_pe"])
def test_write_latent_refuses_an_unsupported_dtype(kernels: object, dtype, which: str) -> None:
    cache = torch.zeros(2, 4, 12)
    t = {"c_kv": torch.ones(1, 8), "k_pe": torch.ones(1, 4)}
    t[which] = t[which].to(dtype)
    with pytest.raises(ValueError, match=rf"{which} dtype {dtype} is not supported"):
        mb.write_latent(cache, t["c_kv"], t["k_pe"], torch.tensor([1]), impl=kernels)
    assert torch.all(cache == 0)


# ---- 9. write_index_keys on infinite keys: vLLM's writer (scale inf, value NaN) --------------
@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_an_infinite_key_is_written_as_vllm_writes_it(kernels: object, scale_fmt) -> None:
    layout = IndexCacheLayout.named("fp8", 16, 8, scale_fmt=scale_fmt)
    cache = torch.zeros(1, 4, layout.width, dtype=torch.uint8)
    k = torch.ones(2, 16)
    k[0, 1], k[1, 9] = float("inf"), float("-inf")
    mb.write_index_keys(cache, k, torch.tensor([0, 2]), layout, impl=kernels)
    values, scales = layout.page_views(cache)
    # the block with the inf: scale = max(inf, 1e-4) / 448 = inf; x / inf = NaN for +-inf, 0 else
    finite = torch.tensor(1.0) / 448 if scale_fmt is None else torch.tensor(2.0**-8)  # fp32
    assert scales[0, 0].tolist() == [math.inf, finite.item()]
    assert scales[0, 2].tolist() == [scales[0, 0, 1].item(), math.inf]
    for slot, blk, pos in ((0, 0, 1), (2, 1, 9)):
        e = values[0, slot].view(torch.float8_e4m3fn).float()
        block = e[blk * 8 : (blk + 1) * 8]
        assert torch.isnan(block[pos % 8]) and (block.abs().nansum() == 0)
    for slot in (1, 3):  # other slots untouched
        assert torch.all(values[0, slot] == 0) and torch.all(scales[0, slot] == 0)


# ---- 10. indexer weights contiguous by torch's definition ------------------------------------
def test_indexer_takes_weights_torch_calls_contiguous(kernels: object) -> None:
    ix = mb.IndexerDims(1, 16, 3)
    d = make_dsa_case(DIMS, ix, [4, 2], [3, 2], 4, seed=5, impl="torch")
    plan = d.plan(impl=kernels)
    T = d.q_I.shape[0]
    w = torch.randn(1, T).t()  # [T, 1], stride (1, T)
    assert w.is_contiguous() and w.stride(1) != 1
    lg = mb.indexer_logits(d.q_I, w, d.index_cache, plan)
    ref = reference_indexer_logits(d.q_I, w, d.keys, d.case.batch.new_lens)
    torch.testing.assert_close(lg.double(), ref, rtol=2e-2, atol=1e-2)
    idx = mb.indexer_topk(d.q_I, w, d.index_cache, plan, 3)
    assert idx.tolist() == mb.indexer_topk(d.q_I, w.contiguous().clone(), d.index_cache, plan,
                                           3).tolist()  # fmt: skip
    # an empty step: [0, 1] weights
    empty = mb.MLABatch.build([4], [0], torch.tensor([[1, 2]], dtype=torch.int32), 4)
    p0 = mb.plan(empty, DIMS, mb.Policy("absorb"), impl=kernels, indexer=ix)
    q0 = torch.zeros(0, 1, 16)
    assert mb.indexer_topk(q0, torch.zeros(0, 1), d.index_cache, p0, 3).shape == (0, 3)
    assert mb.indexer_logits(q0, torch.zeros(0, 1), d.index_cache, p0).shape == (0, 4)


# ---- 11. softmax_scale must be a finite float > 0 --------------------------------------------
@pytest.mark.parametrize(
    ("scale", "error"),
    [(None, TypeError), ("0.1", TypeError), (True, TypeError), (0.0, ValueError),
     (-0.5, ValueError), (math.nan, ValueError), (math.inf, ValueError)],
)  # fmt: skip
def test_softmax_scale_is_checked(kernels: object, scale, error: type) -> None:
    d = make_dsa_case(DIMS, INDEXER, [3], [2], 4, seed=3, impl="torch")
    c = d.case
    plan = d.plan(impl=kernels)
    q_lat = torch.randn(2, DIMS.num_heads, DIMS.kv_lora_rank)
    with pytest.raises(error, match="softmax_scale"):
        mb.absorbed_attention(q_lat, c.q_pe, c.kv_cache, plan, scale)
    with pytest.raises(error, match="softmax_scale"):
        mb.sparse_absorbed_attention(q_lat, c.q_pe, c.kv_cache, plan,
                                     torch.zeros(2, 1, dtype=torch.int32), scale)  # fmt: skip
    with pytest.raises(error, match="softmax_scale"):
        mb.normal_attention(c.q_nope, c.q_pe, c.kv_cache, plan, c.weights, scale)
    if scale is not None:  # None is MLAAttention's default (1 / sqrt(nope + rope))
        with pytest.raises(error, match="softmax_scale"):
            mb.MLAAttention(DIMS, c.weights, scale)


@pytest.mark.parametrize(
    ("cache_dtype", "q_dtype"),
    [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16),
     (torch.float16, torch.bfloat16)],
)  # fmt: skip
def test_a_plain_cache_of_another_dtype_than_the_queries_is_refused(
    kernels: object, cache_dtype: torch.dtype, q_dtype: torch.dtype
) -> None:
    """Every implementation refuses it at the entry point naming both dtypes (the native
    kernels refused it, the torch path computed in the queries' dtype): engines check the
    same rule at start-up."""
    d = make_dsa_case(DIMS, INDEXER, [3], [2], 4, seed=3, impl="torch")
    c = d.case
    plan = d.plan(impl=kernels)
    cache = c.kv_cache.to(cache_dtype)
    q_lat = torch.randn(2, DIMS.num_heads, DIMS.kv_lora_rank).to(q_dtype)
    q_pe, q_nope = c.q_pe.to(q_dtype), c.q_nope.to(q_dtype)
    named = f"{cache_dtype} latent cache with {q_dtype} queries"
    with pytest.raises(ValueError, match=named):
        mb.absorbed_attention(q_lat, q_pe, cache, plan, SCALE)
    with pytest.raises(ValueError, match=named):
        mb.sparse_absorbed_attention(q_lat, q_pe, cache, plan,
                                     torch.zeros(2, 1, dtype=torch.int32), SCALE)  # fmt: skip
    with pytest.raises(ValueError, match=named):
        mb.normal_attention(q_nope, q_pe, cache, plan, c.weights, SCALE)


# ---- found by the fuzzer: a per-tensor fp8 scale that is not finite and > 0 ------------------
@pytest.mark.parametrize("value", [0.0, -1.0, math.nan, math.inf])
def test_a_bad_kv_scale_is_refused(kernels: object, value: float) -> None:
    cache = torch.zeros(2, 4, 12, dtype=mb.FP8_DTYPE)
    before = cache.clone()
    with pytest.raises(ValueError, match=rf"kv_scale = {value} must be finite and > 0"):
        mb.write_latent(cache, torch.ones(1, 8), torch.ones(1, 4), torch.tensor([1]),
                        torch.tensor(value), impl=kernels)  # fmt: skip
    assert _same_bytes(cache, before)
    batch = mb.MLABatch.build([1], [1], torch.tensor([[0]], dtype=torch.int32), 4)
    dims = mb.MLADims(1, 8, 4, 4, 4)
    plan = mb.plan(batch, dims, mb.Policy("absorb"), impl=kernels)
    with pytest.raises(ValueError, match="must be finite and > 0"):
        mb.absorbed_attention(torch.ones(1, 1, 8), torch.ones(1, 1, 4), cache, plan, 0.5,
                              torch.tensor(value))  # fmt: skip


# ---- found by the fuzzer: a query whose last dim is strided (torch's flash kernel's LSE) -------
@pytest.mark.parametrize("rope", [0, 4])
def test_a_strided_query_gives_the_oracle_lse(kernels: object, rope: int) -> None:
    dims = mb.MLADims(2, 8, 4, rope, 4)
    cache = torch.randn(2, 4, 8 + rope)
    batch = mb.MLABatch.build([0, 5], [1, 1], torch.tensor([[1, 0], [0, 1]], dtype=torch.int32),
                              4)  # fmt: skip
    plan = mb.plan(batch, dims, mb.Policy("absorb"), impl=kernels)
    wide = torch.randn(2, 2, 16)
    q_lat, q_pe = wide[..., ::2], torch.randn(2, 2, rope)  # q_lat's last dim has stride 2
    o, lse = mb.absorbed_attention(q_lat, q_pe, cache, plan, 0.3)
    rows = cache.view(8, -1).double()
    for t, (prefix, table) in enumerate(((0, [1]), (5, [0, 1]))):
        kv = torch.cat([rows[p * 4 : p * 4 + 4] for p in table])[: prefix + 1]
        q = torch.cat([q_lat[t : t + 1], q_pe[t : t + 1]], -1)
        ref_o, ref_lse = plain_attention(q, kv[:, None], kv[:, None, :8], prefix, 0.3, None)
        torch.testing.assert_close(o[t].double(), ref_o[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(lse[t].double(), ref_lse[0], rtol=1e-4, atol=1e-5)


# ---- the native build's name covers what the binary depends on -------------------------------
@pytest.mark.parametrize(
    "change",
    ["torch_version", "torch_git", "cxx11_abi", "compiler", "python"],
)
def test_native_build_name_covers_the_binary_dependencies(
    monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    before = build.extension_name("avx2")
    if change == "torch_version":
        monkeypatch.setattr(torch, "__version__", torch.__version__ + "+other")
    elif change == "torch_git":
        monkeypatch.setattr(torch.version, "git_version", "0" * 40)
    elif change == "cxx11_abi":
        abi = torch.compiled_with_cxx11_abi()
        monkeypatch.setattr(torch, "compiled_with_cxx11_abi", lambda: not abi)
    elif change == "compiler":
        monkeypatch.setenv("CXX", "/nonexistent/g++-99")
    else:
        monkeypatch.setattr(build.sys.implementation, "cache_tag", "cpython-299")
    after = build.extension_name("avx2")
    assert after != before and after.startswith("mla_backend_native_avx2_")
    assert build.extension_name("avx2", openmp=False) == after + "_serial"


def test_native_build_name_shared_by_environments(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same torch release installed elsewhere (another virtual environment) names the same
    build, which the loader then reuses (tests/test_native_build_lock.py)."""
    before = build.extension_name("avx2")
    monkeypatch.setattr(torch, "__file__", "/elsewhere/site-packages/torch/__init__.py")
    assert build.extension_name("avx2") == before
