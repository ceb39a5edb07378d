"""DeepSeek Sparse Attention on the Triton path (:mod:`mla_backend.ops.triton.dsa`), under the
interpreter on CPU tensors or compiled on a GPU (``MLA_TEST_DEVICE=cuda``), against the float64
oracle (:mod:`mla_backend.testing.reference`) and the torch path (CPU):

- the index-key write: every byte of the cache equal to the torch writer's (vLLM's fp8 page
  layout, quant blocks 128 / 32 / 8, amax and ue8m0 scales, zeros, NaN, -0.0, padding slots;
  plain bf16 / fp16 / fp32 caches);
- the indexer logits (fp8 index caches with one or several scales per key, plain caches; bf16 /
  fp16 / fp32 / e4m3 queries; pages 1 / 16 / 64 shuffled, NaN in never-written rows; ragged
  batches with an empty request) and the top-k sets (near-tie slack; exact ties to the lower
  position; short rows padded with -1; ``out=``);
- the top-k selection kernel alone on crafted rows (exact ties, +-0, NaN, +-inf, rows longer
  than one block) equal to the torch rule (:func:`mla_backend.ops.torch.indexer.topk_positions`);
- the sparse attention over every latent layout (bf16 / fp16 / fp32, per-tensor fp8,
  ``fp8_ds_mla``), latents of 1 to 4 column chunks, lists in any order with -1 entries, a token
  with no entry (o = 0, lse = -inf), split lists merged by LSE, ``out=`` / ``lse=`` buffers,
  out-of-range indices refused; the e4m3 bit-decoding mode (``fp8_mode="bits"``);
- hypothesis-drawn shapes.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from triton_case import DEVICE, ON_GPU, TritonKernels, load_benchmark, tops  # noqa: F401

import mla_backend as mb
from mla_backend.index_cache import IndexCacheLayout
from mla_backend.ops import IndexKeyWrite
from mla_backend.ops.torch import indexer as torch_indexer
from mla_backend.ops.triton import dsa
from mla_backend.testing.cases import DsaCase, index_fp8_dequantized, make_dsa_case
from mla_backend.testing.dsa_checks import check_logits, check_sparse, check_topk, logit_bound
from mla_backend.testing.native_checks import ATTENTION_DTYPES
from mla_backend.testing.reference import reference_indexer_logits, reference_topk

# the interpreter's numpy casts of NaN (the e4m3 encoder's masked lanes) warn; nothing is lost
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered in cast")
FP8 = torch.float8_e4m3fn
RAGGED = ([0, 9, 70, 3, 130], [5, 1, 6, 0, 2])  # fresh extend, decodes, an empty request
R, ROPE = 40, 8  # odd r: a partial fp8_ds_mla tile


def _case(H=4, Hi=8, Di=64, topk=7, page=16, prefix=RAGGED[0], new=RAGGED[1], r=R, rope=ROPE,
          **kw) -> DsaCase:  # fmt: skip
    dims = mb.MLADims(H, r, 8, rope, 8)
    return make_dsa_case(dims, mb.IndexerDims(Hi, Di, topk), list(prefix), list(new), page,
                         impl="torch", **kw)  # fmt: skip


def _dev(d: DsaCase, kernels: TritonKernels | None = None) -> SimpleNamespace:
    """The case's tensors on DEVICE and a Triton plan of its step."""
    c = d.case
    plan = mb.plan(c.batch, c.dims, mb.Policy("absorb"), device=DEVICE,
                   impl=kernels or TritonKernels(), indexer=d.indexer)  # fmt: skip
    return SimpleNamespace(
        plan=plan, index_cache=d.index_cache.to(DEVICE), kv_cache=c.kv_cache.to(DEVICE),
        kv_scale=None if c.kv_scale is None else c.kv_scale.to(DEVICE),
        q_I=d.q_I.to(DEVICE), weights=d.weights.to(DEVICE),
    )  # fmt: skip


# ---- the index-key write -------------------------------------------------------------------
WRITE_KINDS = [("fp8", 128, 128, None), ("fp8", 128, 128, "ue8m0"), ("fp8", 64, 32, None),
               ("fp8", 64, 32, "ue8m0"), ("fp8", 8, 8, None), ("bfloat16", 48, 0, None),
               ("float16", 48, 0, None), ("float32", 48, 0, None)]  # fmt: skip


def _byte_diff(got: torch.Tensor, want: torch.Tensor, lay: IndexCacheLayout,
               slots: torch.Tensor, k: torch.Tensor) -> str:
    """Where two fp8 index caches differ: per differing token, its values' and scales' bytes
    (a GPU-only difference is then read off the test log)."""
    ps = got.shape[1]
    vals_g, sc_g = lay.page_views(got)
    vals_w, sc_w = lay.page_views(want)
    lines = []
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        p, j = divmod(slot, ps)
        dv = (vals_g[p, j] != vals_w[p, j]).nonzero().flatten().tolist()
        ds = (sc_g[p, j].view(torch.int32) != sc_w[p, j].view(torch.int32)).nonzero()
        ds = ds.flatten().tolist()
        if dv or ds:
            lines.append(
                f"token {t} (slot {slot}): value bytes {dv[:6]} got "
                f"{vals_g[p, j][dv[:6]].tolist()} want {vals_w[p, j][dv[:6]].tolist()} "
                f"(keys {k[t].float()[dv[:6]].tolist()}); scales {ds} got "
                f"{sc_g[p, j].tolist()} want {sc_w[p, j].tolist()}"
            )
    return "\n".join(lines[:8]) or "bytes outside the written rows differ"


@pytest.mark.parametrize("k_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("name,Di,block,fmt", WRITE_KINDS, ids=str)
def test_index_key_write_equals_the_torch_writer(name, Di, block, fmt, k_dtype):
    """Every byte of the cache (written slots, untouched slots, other pages) equals the torch
    writer's, over keys spanning 9 decades, a zero key, -0.0 and NaN values and padding slots;
    the fp8 bytes also read back as vLLM's rule gives them."""
    ps, pages, T = 16, 5, 40
    lay = IndexCacheLayout.named(name, Di, block or 128, fmt)
    g = torch.Generator().manual_seed(Di + block)
    if lay.kind == "fp8":
        before = torch.randint(0, 256, (pages, ps, lay.width), dtype=torch.uint8, generator=g)
    else:
        before = torch.randn(pages, ps, Di, generator=g).to(lay.dtype)
    k = torch.randn(T, Di, generator=g) * torch.logspace(-6, 3, T)[:, None]
    k[0] = 0.0
    k[1, :3] = -0.0
    k[2, 1] = float("nan")
    k = k.to(k_dtype)
    slots = torch.randperm(pages * ps, generator=g)[:T]
    slots[::5] = -1
    want = before.clone()
    torch_indexer.write_index_keys(IndexKeyWrite(want, lay, k, slots))
    got = before.to(DEVICE)
    mb.write_index_keys(got, k.to(DEVICE), slots.to(DEVICE), lay, impl=TritonKernels())
    got = got.cpu()
    if lay.kind == "fp8":
        # a NaN key's e4m3 byte is 0x7F or 0xFF: IEEE leaves a NaN's sign to the hardware (the
        # H200 writes 0x7F where the host writes 0xFF); both read back as NaN
        for cache in (got, want):
            vals = lay.page_views(cache)[0]
            vals[vals == 0xFF] = 0x7F
        assert torch.equal(got, want), _byte_diff(got, want, lay, slots, k)
        vals, scales = lay.page_views(got)
        flat = lay.decode(vals.reshape(-1, Di), scales.reshape(-1, scales.shape[-1]))
        ref = index_fp8_dequantized(k, block, fmt == "ue8m0")
        ok = slots >= 0
        ok[2] = False  # the NaN key: e4m3 NaN in its block, compared bytewise above
        assert torch.equal(flat[slots[ok].long()], ref[ok])
    else:  # NaN payloads may differ (a GPU's canonical NaN); every other value bit-exact
        assert torch.equal(torch.isnan(got), torch.isnan(want))
        fin = ~torch.isnan(want)
        bits = {2: torch.int16, 4: torch.int32}[lay.dtype.itemsize]
        assert torch.equal(got[fin].view(bits), want[fin].view(bits))


# ---- the indexer ------------------------------------------------------------------------------
INDEX_KINDS = [(torch.uint8, torch.bfloat16), (torch.uint8, FP8), (torch.uint8, torch.float32),
               (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
               (torch.float32, torch.float32), (torch.float16, torch.float32),
               (torch.bfloat16, FP8)]  # fmt: skip


def _check_indexer(d: DsaCase, dv: SimpleNamespace, topks=(7, 300)) -> None:
    ref = reference_indexer_logits(d.q_I, d.weights, d.keys, d.case.batch.new_lens)
    tol = logit_bound(d, False)  # every product exact: fp32 sums only
    lg = mb.indexer_logits(dv.q_I, dv.weights, dv.index_cache, dv.plan)
    check_logits(lg.cpu(), ref, tol)
    for topk in topks:
        idx = mb.indexer_topk(dv.q_I, dv.weights, dv.index_cache, dv.plan, topk)
        assert idx.dtype == torch.int32 and idx.device.type == DEVICE.type
        check_topk(idx.cpu(), ref, topk, tol)


#: every kind at page 16; pages 1 and 64 for vLLM's fp8 cache only (interpreter time)
INDEX_CASES = [(*k, 16) for k in INDEX_KINDS] + [(*k, p) for k in INDEX_KINDS[:2] for p in (1, 64)]


@pytest.mark.parametrize("index_dtype,q_dtype,page", INDEX_CASES, ids=str)
def test_indexer_logits_and_topk(index_dtype, q_dtype, page):
    d = _case(page=page, index_dtype=index_dtype, q_dtype=q_dtype, seed=page)
    _check_indexer(d, _dev(d))


@pytest.mark.parametrize("Di,block", [(64, 32), (32, 8)])
def test_indexer_several_scales_per_key(Di, block):
    """An fp8 index cache with Di / block scales per key (one dot per block, each times its
    own scale): the same keys rewritten into such a cache."""
    d = _case(Di=Di, index_dtype=torch.float32, seed=block)
    lay = IndexCacheLayout.named("fp8", Di, block)
    c = d.case
    cache = torch.full((c.kv_cache.shape[0], 16, lay.width), 0xFF, dtype=torch.uint8)
    for i, keys in enumerate(d.keys):
        bt = c.batch.block_table[i]
        slots = torch.tensor([int(bt[t // 16]) * 16 + t % 16 for t in range(keys.shape[0])])
        torch_indexer.write_index_keys(IndexKeyWrite(cache, lay, keys, slots))
    d.index_cache = cache
    d.keys = [index_fp8_dequantized(k, block) for k in d.keys]
    _check_indexer(d, _dev(d), topks=(7,))


@pytest.mark.parametrize("topk", [1, 3, 10, 50])
def test_topk_exact_ties_lower_position_wins(topk):
    """Keys drawn from 3 vectors: logits tie exactly in groups; the cut through a group keeps
    its lowest positions; the set equals the oracle's and the torch path's."""
    d = _case(index_dtype=torch.bfloat16, q_dtype=torch.bfloat16, distinct_keys=3, seed=topk)
    ref = reference_indexer_logits(d.q_I, d.weights, d.keys, d.case.batch.new_lens)
    dv = _dev(d)
    idx = mb.indexer_topk(dv.q_I, dv.weights, dv.index_cache, dv.plan, topk).cpu()
    assert torch.equal(idx.long(), reference_topk(ref, topk))
    want = mb.indexer_topk(d.q_I, d.weights, d.index_cache, d.plan(impl="torch"), topk)
    assert torch.equal(idx, want)


def test_topk_zero_ties_and_out_buffer():
    """Zero weights make every logit +0 or -0: all tie, the lowest positions win; ``out=`` is
    written in place."""
    d = _case(page=1)
    dv = _dev(d)
    w = torch.zeros_like(dv.weights)
    w[::2] = -0.0
    out = torch.empty(dv.plan.num_tokens, 5, dtype=torch.int32, device=DEVICE)
    idx = mb.indexer_topk(dv.q_I, w, dv.index_cache, dv.plan, 5, out=out)
    assert idx.data_ptr() == out.data_ptr()
    pos = dv.plan.sparse.token_pos_t.tolist()
    assert idx.tolist() == [[p if p <= pt else -1 for p in range(5)] for pt in pos]


def _crafted_rows(W: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows = [
        torch.randn(W, generator=g),  # distinct
        torch.randint(-2, 3, (W,), generator=g).float(),  # five values: long runs of ties
        torch.zeros(W),  # all tie
        torch.where(torch.rand(W, generator=g) < 0.5, -0.0, 0.0),  # +0 / -0 tie
        torch.randn(W, generator=g).masked_fill(torch.rand(W, generator=g) < 0.3, float("nan")),
        torch.randn(W, generator=g).masked_fill(torch.rand(W, generator=g) < 0.3, float("-inf")),
        torch.full((W,), float("nan")),
        torch.randn(W, generator=g).masked_fill(torch.rand(W, generator=g) < 0.01, float("inf")),
        torch.randn(W, generator=g) * 1e-38,  # subnormals
        (torch.randn(W, generator=g) * 4).round() / 4 + 1000.0,  # ties in a narrow band
    ]
    return torch.stack(rows)


@pytest.mark.parametrize("W,topk", [(3000, 1), (3000, 100), (3000, 2048), (700, 2048), (40, 7)])
def test_select_kernel_follows_the_rank_rule(W, topk):
    """The selection kernel alone, on crafted rows, equals the torch rule exactly (the same
    positions in the same order, -1 padded), for rows seeing fewer or more than topk
    positions, over several blocks of the kernel."""
    logits = _crafted_rows(W, W + topk)
    n = logits.shape[0]
    g = torch.Generator().manual_seed(topk)
    pos = torch.randint(0, W, (n,), generator=g).to(torch.int32)
    pos[0], pos[1] = W - 1, min(topk, W) - 1  # the whole row; exactly topk visible
    want = torch.empty(n, topk, dtype=torch.int32)
    torch_indexer.topk_positions(logits, pos, topk, want)
    out = torch.full((n, topk), -7, dtype=torch.int32, device=DEVICE)
    dsa.select_topk(logits.to(DEVICE), pos.to(DEVICE), out, 0, n)
    assert torch.equal(out.cpu(), want)


# ---- the sparse attention ---------------------------------------------------------------------
def _indices(d: DsaCase, topk: int, seed: int) -> torch.Tensor:
    """The oracle's top-k, padded with -1, shuffled per row (any order is allowed)."""
    ref = reference_indexer_logits(d.q_I, d.weights, d.keys, d.case.batch.new_lens)
    idx = reference_topk(ref, topk)
    g = torch.Generator().manual_seed(seed)
    for t in range(idx.shape[0]):
        idx[t] = idx[t, torch.randperm(topk, generator=g)]
    return idx.to(torch.int32)


def _check_sparse(d: DsaCase, dv: SimpleNamespace, idx: torch.Tensor, qdt: torch.dtype,
                  scale: float, H: int, r: int, rope: int, seed: int) -> None:  # fmt: skip
    """Triton's sparse attention against the oracle (dense attention masked to the index
    sets) and against the torch path on the same inputs."""
    T = dv.plan.num_tokens
    g = torch.Generator().manual_seed(seed)
    q_lat = torch.randn(T, H, r, generator=g).to(qdt)
    q_pe = torch.randn(T, H, rope, generator=g).to(qdt)
    o, lse = mb.sparse_absorbed_attention(q_lat.to(DEVICE), q_pe.to(DEVICE), dv.kv_cache,
                                          dv.plan, idx.to(DEVICE), scale, dv.kv_scale)  # fmt: skip
    o, lse = o.cpu(), lse.cpu()
    check_sparse(d, o, lse, q_lat, q_pe, idx, scale, qdt)
    ot, lt = mb.sparse_absorbed_attention(q_lat, q_pe, d.case.kv_cache, d.plan(impl="torch"),
                                          idx, scale, d.case.kv_scale)  # fmt: skip
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lt))
    fin = torch.isfinite(lt)
    assert (lse[fin] - lt[fin]).abs().max() <= 1e-3
    tol = 2e-5 if qdt == torch.float32 else 2.0**-6
    assert (o.float() - ot.float()).abs().max() <= tol * max(1.0, ot.float().abs().max().item())


#: every layout at page 16; pages 1 and 64 for the bf16 and fp8_ds_mla caches (interpreter time)
SPARSE_CASES = [(*k, 16) for k in ATTENTION_DTYPES] + [
    (*k, p) for k in ATTENTION_DTYPES if k[1] in (torch.bfloat16, torch.uint8) for p in (1, 64)
]


@pytest.mark.parametrize("qdt,cdt,page", SPARSE_CASES, ids=str)
def test_sparse_attention_every_layout(qdt, cdt, page):
    d = _case(H=5, page=page, dtype=qdt, cache_dtype=cdt, seed=page + 3)
    dv = _dev(d)
    for topk in (6, 64):
        _check_sparse(d, dv, _indices(d, topk, page), qdt, 1 / math.sqrt(48), 5, R, ROPE, page)


@pytest.mark.parametrize("r,rope,cdt,H", [(300, 16, torch.uint8, 3), (300, 16, torch.bfloat16, 3),
                                          (512, 64, torch.uint8, 64), (256, 0, mb.FP8_DTYPE, 3)])
def test_sparse_attention_latent_chunks(r, rope, cdt, H):
    """Latents of 2 to 4 column chunks (a partial last chunk; each fp8_ds_mla chunk one scale
    tile); no rope; 64 heads of a 512-wide latent (32 indices per step, as on a GPU)."""
    d = _case(H=H, r=r, rope=rope, prefix=[0, 75], new=[2, 1], dtype=torch.bfloat16,
              cache_dtype=cdt, seed=r)  # fmt: skip
    _check_sparse(d, _dev(d), _indices(d, 40, r), torch.bfloat16, 0.05, H, r, rope, r)


@pytest.mark.parametrize("splits", [2, 3, 50])
def test_sparse_attention_split_lists(splits):
    """Lists cut into pieces merged by LSE (a piece may hold no valid entry), 16 heads of two
    head blocks of 8 ... as one block of 16."""
    d = _case(H=16, prefix=[200, 130], new=[1, 2], dtype=torch.float32, seed=splits)
    dv = _dev(d, TritonKernels(sparse_splits=splits))
    idx = _indices(d, 150, splits)
    idx[1, :100] = -1  # a token whose first pieces are empty
    _check_sparse(d, dv, idx, torch.float32, 0.2, 16, R, ROPE, splits)


@pytest.mark.parametrize("splits", [None, 2])
def test_sparse_attention_empty_lists_and_out_buffers(splits):
    d = _case(dtype=torch.bfloat16, cache_dtype=torch.bfloat16)
    dv = _dev(d, TritonKernels(sparse_splits=splits))
    T, H = dv.plan.num_tokens, 4
    q_lat = torch.randn(T, H, R).bfloat16()
    q_pe = torch.randn(T, H, ROPE).bfloat16()
    idx = torch.full((T, 140), -1, dtype=torch.int32)
    idx[0, 2] = 0  # one token attends to position 0 only, the others to nothing
    out = torch.empty(T, H, R, dtype=torch.bfloat16, device=DEVICE)
    lse = torch.empty(T, H, device=DEVICE)
    o, lo = mb.sparse_absorbed_attention(q_lat.to(DEVICE), q_pe.to(DEVICE), dv.kv_cache, dv.plan,
                                         idx.to(DEVICE), 0.1, out=out, lse=lse)  # fmt: skip
    assert o.data_ptr() == out.data_ptr() and lo.data_ptr() == lse.data_ptr()
    check_sparse(d, o.cpu(), lo.cpu(), q_lat, q_pe, idx, 0.1, torch.bfloat16)


@pytest.mark.parametrize("bad", [130, 10**6, -2])
def test_out_of_range_index_refused(bad):
    """Request 1 has 10 tokens: index 130 is past it (though inside request 2's range)."""
    if ON_GPU:
        pytest.skip("on a GPU the refusal is a device-side assert, which ends the CUDA context")
    d = _case()
    dv = _dev(d)
    T = dv.plan.num_tokens
    idx = torch.zeros(T, 3, dtype=torch.int32)
    idx[5, 1] = bad  # token 5 is request 1's only token
    with pytest.raises(RuntimeError, match="out of range"):
        mb.sparse_absorbed_attention(torch.randn(T, 4, R), torch.randn(T, 4, ROPE), dv.kv_cache,
                                     dv.plan, idx, 0.1)  # fmt: skip


def test_fp8_bits_mode():
    """The integer e4m3 decoding (GPUs without a native conversion): e4m3 queries on an fp8
    index cache, and the sparse attention on per-tensor fp8 and fp8_ds_mla caches."""
    kern = TritonKernels(fp8_mode="bits")
    d = _case(index_dtype=torch.uint8, q_dtype=FP8, dtype=torch.bfloat16, cache_dtype=FP8)
    dv = _dev(d, kern)
    _check_indexer(d, dv, topks=(7,))
    _check_sparse(d, dv, _indices(d, 20, 1), torch.bfloat16, 0.1, 4, R, ROPE, 1)
    d = _case(dtype=torch.bfloat16, cache_dtype=torch.uint8, seed=5)
    _check_sparse(d, _dev(d, kern), _indices(d, 20, 2), torch.bfloat16, 0.1, 4, R, ROPE, 2)


def test_unsupported_shapes_run_the_torch_versions():
    """A latent wider than 4 chunks of 128 goes to the torch implementation's (torch_default)."""
    assert not dsa.sparse_supported(520) and dsa.sparse_supported(512)
    assert not dsa.indexer_supported(17) and dsa.indexer_supported(16)


# ---- shapes drawn by hypothesis -----------------------------------------------------------------
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    H=st.integers(1, 20),
    Hi=st.integers(1, 70),
    Di=st.sampled_from([16, 48, 128]),
    page=st.sampled_from([1, 3, 16, 64]),
    reqs=st.lists(st.tuples(st.integers(0, 90), st.integers(0, 4)), min_size=1, max_size=3),
    topk=st.integers(1, 40),
    fp8=st.booleans(),
    seed=st.integers(0, 999),
)
def test_hypothesis_shapes(H, Hi, Di, page, reqs, topk, fp8, seed):
    prefix = [max(p, 1 - n) for p, n in reqs]
    new = [n for _, n in reqs]
    new[0] = new[0] or 1
    d = _case(H=H, Hi=Hi, Di=Di, topk=topk, page=page, prefix=prefix, new=new,
              index_dtype=torch.uint8 if fp8 else torch.bfloat16, q_dtype=torch.bfloat16,
              dtype=torch.bfloat16, cache_dtype=torch.uint8 if fp8 else torch.bfloat16,
              seed=seed)  # fmt: skip
    dv = _dev(d)
    ref = reference_indexer_logits(d.q_I, d.weights, d.keys, d.case.batch.new_lens)
    idx = mb.indexer_topk(dv.q_I, dv.weights, dv.index_cache, dv.plan, topk)
    check_topk(idx.cpu(), ref, topk, logit_bound(d, False))
    _check_sparse(d, dv, idx.cpu(), torch.bfloat16, 0.15, H, R, ROPE, seed)


def test_gpu_sparse_benchmark_dry_run(tmp_path):
    """``python -m benchmarks gpu-sparse --smoke``: the GPU sweep's code on tiny CPU shapes
    (fake timer; its own checks against the torch path must pass) writing its table."""
    if ON_GPU:
        pytest.skip("the GPU run executes the benchmark itself")
    bench = load_benchmark("gpu_sparse")
    assert bench.main(["--smoke", "--caches", "fp8_ds_mla", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "gpu_sparse-latest.md").read_text()
    rows = [x for x in text.splitlines() if x.replace(" ", "").startswith("|2|150|16|")]
    assert len(rows) == 1 and "fp8_ds_mla" in rows[0]


@pytest.mark.parametrize("ratio", [2, 4, 7])
def test_indexer_over_compressed_keys(ratio):
    """DeepSeek-V4's CSA indexer (``IndexerDims(compress_ratio=m)``): the token at p sees keys
    0 .. (p + 1) // m - 1 of a cache whose pages hold page_size / m keys: logits -inf exactly
    past them and close to the torch path's, the top-k equal to the torch path's (fp32 keys and
    queries), a token with no key yet selecting nothing."""
    g = torch.Generator().manual_seed(ratio)
    prefix, new, ps, Hi, Di, topk = [0, 9, 30], [13, 1, 6], 2, 4, 32, 4
    lens = [a + b for a, b in zip(prefix, new, strict=True)]
    pages = -(-max(lens) // (ps * ratio))
    bt = torch.randperm(3 * pages, generator=g).view(3, pages).int()
    keys = torch.randn(3 * pages, ps, Di, generator=g)
    batch = mb.MLABatch.build(prefix, new, bt, ps * ratio)
    dims, ix = mb.MLADims(4, R, 8, ROPE, 8), mb.IndexerDims(Hi, Di, topk, compress_ratio=ratio)
    T = batch.num_tokens
    q = torch.randn(T, Hi, Di, generator=g)
    w = torch.rand(T, Hi, generator=g)
    plan_t = mb.plan(batch, dims, mb.Policy("absorb"), impl="torch", indexer=ix)
    plan = mb.plan(batch, dims, mb.Policy("absorb"), device=DEVICE, impl=TritonKernels(),
                   indexer=ix)  # fmt: skip
    dq, dw, dk = q.to(DEVICE), w.to(DEVICE), keys.to(DEVICE)
    lg = mb.indexer_logits(dq, dw, dk, plan).cpu()
    want = mb.indexer_logits(q, w, keys, plan_t)
    assert torch.equal(torch.isinf(lg), torch.isinf(want))
    torch.testing.assert_close(lg, want, rtol=1e-4, atol=1e-4)
    sel = mb.indexer_topk(dq, dw, dk, plan, topk).cpu()
    assert torch.equal(sel, mb.indexer_topk(q, w, keys, plan_t, topk))
    first = batch.positions() < ratio - 1  # no key complete yet
    assert first.any() and (sel[first] == -1).all()
