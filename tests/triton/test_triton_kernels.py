"""Triton kernels (mla_backend.ops.triton_ops) on CPU under the Triton interpreter.

Every kernel variant is compared with an independent float64 dense reference written here
(gather each request's rows, two dots, causal mask, softmax) and with the core torch path
(``mla_backend.ops.torch_ops``). Unused cache pages and the tails of partially used pages are
filled with NaN, so any read outside a request's kv range shows up as NaN in the output.
Shapes are small: the interpreter runs every program in Python.
"""

from __future__ import annotations

import importlib
import math
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # must precede the kernels' @triton.jit decoration

import pytest
import torch

triton = pytest.importorskip("triton")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import mla_backend as mb  # noqa: E402
from mla_backend.fp8 import FP8_DTYPE  # noqa: E402
from mla_backend.ops import torch_ops  # noqa: E402


def _load_triton_ops():
    """Import the Triton path; re-decorate its kernels if they were imported before the
    interpreter was switched on (another test module may have imported them)."""
    from triton.runtime.interpreter import InterpretedFunction

    from mla_backend.ops import triton_ops
    from mla_backend.ops.triton_kernels import attention, cache_write

    if not isinstance(attention.absorbed_attn_kernel, InterpretedFunction):
        importlib.reload(attention)
        importlib.reload(cache_write)
        triton_ops = importlib.reload(sys.modules["mla_backend.ops.triton_ops"])
    return triton_ops


tops = _load_triton_ops()
import triton.language as tl  # noqa: E402

from mla_backend.ops.triton_kernels import heuristics as hx  # noqa: E402
from mla_backend.ops.triton_kernels.attention import _e4m3_bits_to_f32  # noqa: E402
from mla_backend.ops.triton_kernels.cache_write import _e4m3_grid_to_bits  # noqa: E402

# ----------------------------------------------------------------------------------------
# Case construction and the independent reference
# ----------------------------------------------------------------------------------------


class Case:
    """A filled paged cache plus a batch and queries.

    Attributes: kv_cache [P, page, r+rope]; batch; q_lat [T,H,r]; q_pe [T,H,rope];
    seqs: per request float64 [L_i, r+rope] of the values the cache holds (dequantized).
    """

    def __init__(
        self,
        prefix: list[int],
        new: list[int],
        H: int,
        r: int,
        rope: int,
        page_size: int,
        cache_dtype: torch.dtype = torch.float32,
        q_dtype: torch.dtype = torch.float32,
        seed: int = 0,
        fp8_scale: float | None = None,
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        B = len(prefix)
        D = r + rope
        lens = [p + n for p, n in zip(prefix, new, strict=True)]
        pages_per = [-(-L // page_size) for L in lens]
        max_pages = max(pages_per + [1]) + 1
        num_pages = sum(pages_per) + 3
        perm = torch.randperm(num_pages, generator=g)
        # Unused block-table entries point at a NaN page (the last one in perm).
        nan_page = int(perm[-1])
        block_table = torch.full((B, max_pages), nan_page, dtype=torch.int32)
        k = 0
        for i, n_p in enumerate(pages_per):
            block_table[i, :n_p] = perm[k : k + n_p].to(torch.int32)
            k += n_p
        kv = torch.full((num_pages, page_size, D), float("nan"), dtype=torch.float32)
        self.kv_cache = kv.to(cache_dtype)
        self.kv_scale = None
        if cache_dtype == FP8_DTYPE:
            self.kv_scale = torch.tensor(fp8_scale if fp8_scale is not None else 0.05)
        self.seqs: list[torch.Tensor] = []
        for i, L in enumerate(lens):
            if L == 0:
                self.seqs.append(torch.zeros(0, D, dtype=torch.float64))
                continue
            c = torch.randn(L, r, generator=g)
            kpe = torch.randn(L, rope, generator=g)
            pos = torch.arange(L)
            slots = block_table[i, pos // page_size].long() * page_size + pos % page_size
            torch_ops.write_latent(self.kv_cache, c, kpe, slots, self.kv_scale)
            stored = self.kv_cache.view(-1, D)[slots].double()
            if self.kv_scale is not None:
                stored = stored * float(self.kv_scale)
            self.seqs.append(stored)
        self.batch = mb.MLABatch.build(prefix, new, block_table, page_size)
        T = sum(new)
        self.q_lat = torch.randn(T, H, r, generator=g).to(q_dtype)
        self.q_pe = torch.randn(T, H, rope, generator=g).to(q_dtype)
        self.scale = 1.0 / math.sqrt(r + rope + 1)

    def triton(self, **kw) -> tuple[torch.Tensor, torch.Tensor]:
        return tops.absorbed_attention(
            self.q_lat, self.q_pe, self.kv_cache, self.batch, self.scale, self.kv_scale, **kw
        )

    def finite_cache(self) -> torch.Tensor:
        """The cache with its NaN rows (outside every kv range) replaced by a finite 7.0."""
        v = self.kv_cache.float()
        return torch.where(torch.isnan(v), 7.0, v).to(self.kv_cache.dtype)

    def torch_path(self, poisoned: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        cache = self.kv_cache if poisoned else self.finite_cache()
        return torch_ops.absorbed_attention(
            self.q_lat, self.q_pe, cache, self.batch, self.scale, self.kv_scale
        )

    def reference(self) -> tuple[torch.Tensor, torch.Tensor]:
        return dense_reference(
            self.q_lat,
            self.q_pe,
            self.seqs,
            self.batch.prefix_lens,
            self.batch.new_lens,
            self.scale,
        )


def dense_reference(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    seqs: list[torch.Tensor],
    prefix: list[int],
    new: list[int],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 absorbed attention from the formulas: o [T,H,r], lse [T,H]."""
    T, H, r = q_lat.shape
    o = torch.zeros(T, H, r, dtype=torch.float64)
    lse = torch.zeros(T, H, dtype=torch.float64)
    row = 0
    for seq, p, n in zip(seqs, prefix, new, strict=True):
        c, kpe = seq[:, :r], seq[:, r:]
        for j in range(n):
            L = p + j + 1
            s = q_lat[row].double() @ c[:L].T + q_pe[row].double() @ kpe[:L].T  # [H, L]
            s = s * scale
            lse[row] = torch.logsumexp(s, dim=-1)
            o[row] = torch.softmax(s, dim=-1) @ c[:L]
            row += 1
    return o, lse


TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2)}


def assert_matches(case: Case, out: tuple[torch.Tensor, torch.Tensor]) -> None:
    o, lse = out
    T, H, r = case.q_lat.shape
    assert o.shape == (T, H, r) and o.dtype == case.q_lat.dtype
    assert lse.shape == (T, H) and lse.dtype == torch.float32
    assert torch.isfinite(o.float()).all() and torch.isfinite(lse).all()
    atol, rtol = TOL[case.q_lat.dtype]
    o_ref, lse_ref = case.reference()
    torch.testing.assert_close(o.double(), o_ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(lse.double(), lse_ref, atol=atol, rtol=rtol)
    o_t, lse_t = case.torch_path()  # cross-check on the same values, NaN rows made finite
    torch.testing.assert_close(o.float(), o_t.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(lse, lse_t, atol=atol, rtol=rtol)


# ----------------------------------------------------------------------------------------
# Cache write
# ----------------------------------------------------------------------------------------


def _codes(x: torch.Tensor) -> torch.Tensor:
    """Bit patterns as int32 (adjacent codes of one sign are adjacent values)."""
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()]
    return x.view(width).to(torch.int32)


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize(
    "dtype,in_dtype,rope",
    [
        (torch.float32, torch.float32, 16),
        (torch.bfloat16, torch.bfloat16, 8),
        (torch.float16, torch.float16, 0),
        (torch.bfloat16, torch.float32, 16),
        (FP8_DTYPE, torch.float32, 16),
        (FP8_DTYPE, torch.bfloat16, 0),
        ("fp8-bits", torch.float32, 16),
    ],
)
def test_write_latent_matches_torch_path(
    page_size: int, dtype: torch.dtype | str, in_dtype: torch.dtype, rope: int
) -> None:
    mode = None
    if dtype == "fp8-bits":  # the integer e4m3 encoder (GPUs without native fp8 in Triton)
        dtype, mode = FP8_DTYPE, "bits"
    g = torch.Generator().manual_seed(page_size + rope)
    r, T, num_pages = 24, 11, 16
    D = r + rope
    base = (torch.randn(num_pages, page_size, D, generator=g) * 0.1).to(dtype)
    c_kv = (torch.randn(T, r, generator=g) * 3).to(in_dtype)
    k_pe = (torch.randn(T, rope, generator=g) * 3).to(in_dtype)
    slots = torch.randperm(num_pages * page_size, generator=g)[:T]
    slots[1] = -1
    slots[T - 2] = -1
    scale = torch.tensor(0.02) if dtype == FP8_DTYPE else None  # 3-sigma values saturate
    want = base.clone()
    torch_ops.write_latent(want, c_kv, k_pe, slots, scale)
    got = base.clone()
    tops.write_latent(got, c_kv, k_pe, slots.to(torch.int32), scale, fp8_mode=mode)
    if dtype == in_dtype or dtype == FP8_DTYPE:  # copy, or our own fp8 rounding: bit-exact
        assert torch.equal(_codes(got), _codes(want))
    else:
        # fp32 -> bf16: GPUs round to nearest even like torch; the interpreter truncates,
        # so allow one code apart.
        diff = (_codes(got) - _codes(want)).abs()
        assert int(diff.max()) <= 1
        assert float((diff > 0).float().mean()) < 0.7
    # Skipped tokens wrote nothing: every row not in the slot list is unchanged.
    written = slots[slots >= 0].long()
    untouched = torch.ones(num_pages * page_size, dtype=torch.bool)
    untouched[written] = False
    assert torch.equal(_codes(got).view(-1, D)[untouched], _codes(base).view(-1, D)[untouched])
    assert not torch.equal(_codes(got).view(-1, D)[written], _codes(base).view(-1, D)[written])


def test_write_latent_no_tokens_is_a_no_op() -> None:
    kv = torch.randn(2, 4, 12)
    before = kv.clone()
    tops.write_latent(kv, torch.zeros(0, 8), torch.zeros(0, 4), torch.zeros(0, dtype=torch.long))
    assert torch.equal(kv, before)


# ----------------------------------------------------------------------------------------
# Attention: decode, extend, splits, pages, dims, dtypes
# ----------------------------------------------------------------------------------------

DECODE_PREFIX = [0, 5, 37, 70]


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("splits", [1, 3, 16])
def test_decode_pages_and_splits(page_size: int, splits: int) -> None:
    # 16 splits of 16-token chunks over kv lengths 1..71: most splits of every request are
    # empty (LSE -inf), and the shortest request has a single kv row.
    case = Case(DECODE_PREFIX, [1] * 4, H=4, r=32, rope=16, page_size=page_size, seed=splits)
    assert_matches(case, case.triton(num_kv_splits=splits, block_n=16))


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("splits", [1, 3])
def test_extend_ragged_causal(page_size: int, splits: int) -> None:
    # Requests: fresh prefill, decode-like, zero new tokens, long extend onto a prefix.
    case = Case([0, 9, 4, 33], [5, 1, 0, 9], H=3, r=32, rope=16, page_size=page_size, seed=7)
    assert_matches(case, case.triton(num_kv_splits=splits))


def test_extend_many_tokens_few_heads_uses_token_blocks() -> None:
    # H=2 -> BLOCK_H=2, BLOCK_Q=8: rows of 8 tokens share a program; causal bound per row.
    assert hx.attention_tiles(2, 13) == (8, 2)
    case = Case([3, 0], [13, 6], H=2, r=16, rope=16, page_size=16, seed=3)
    assert_matches(case, case.triton(num_kv_splits=2))


@pytest.mark.parametrize(
    "r,rope,H",
    [(96, 32, 3), (24, 0, 5), (40, 8, 20), (512, 64, 2)],
)
def test_odd_dims(r: int, rope: int, H: int) -> None:
    case = Case([6, 21], [1, 3], H=H, r=r, rope=rope, page_size=16, seed=r + rope)
    assert_matches(case, case.triton(num_kv_splits=2))


@pytest.mark.parametrize(
    "q_dtype,cache_dtype",
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16),
        (torch.bfloat16, FP8_DTYPE),
        (torch.float32, FP8_DTYPE),
    ],
)
def test_dtypes_and_fp8_cache(q_dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    case = Case(
        [12, 40],
        [2, 1],
        H=4,
        r=32,
        rope=16,
        page_size=16,
        cache_dtype=cache_dtype,
        q_dtype=q_dtype,
        seed=11,
    )
    assert_matches(case, case.triton(num_kv_splits=3))


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
def test_fp8_cache_decoded_from_bytes(q_dtype: torch.dtype) -> None:
    """The integer e4m3 decode (GPUs without native fp8 in Triton) gives the same result."""
    case = Case(
        [30, 3],
        [1, 2],
        H=3,
        r=24,
        rope=8,
        page_size=16,
        cache_dtype=FP8_DTYPE,
        q_dtype=q_dtype,
        seed=13,
    )
    bits = case.triton(num_kv_splits=2, fp8_mode="bits")
    assert_matches(case, bits)
    native = case.triton(num_kv_splits=2, fp8_mode="native")
    assert torch.equal(bits[0], native[0]) and torch.equal(bits[1], native[1])


@triton.jit
def _decode_bytes_kernel(src, dst, back, N: tl.constexpr):
    """The attention kernel's e4m3 byte decoder, and the cache writer's encoder on its output."""
    offs = tl.arange(0, N)
    values = _e4m3_bits_to_f32(tl.load(src + offs))
    tl.store(dst + offs, values)
    tl.store(back + offs, _e4m3_grid_to_bits(values))


def test_e4m3_byte_decode_all_codes() -> None:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    out = torch.empty(256)
    back = torch.empty(256, dtype=torch.uint8)
    _decode_bytes_kernel[(1,)](codes, out, back, 256)
    want = codes.view(FP8_DTYPE).float()
    finite = torch.isfinite(want)  # 0x7F / 0xFF are NaN codes
    assert int((~finite).sum()) == 2
    assert torch.equal(out[finite], want[finite])
    assert torch.equal(torch.signbit(out[finite]), torch.signbit(want[finite]))  # -0.0 kept
    assert torch.equal(back[finite], codes[finite])  # encoder inverts the decoder


def test_fp8_scale_is_applied() -> None:
    """Doubling kv_scale doubles every value: o doubles; the same scores need q halved."""
    case = Case([20], [2], H=2, r=16, rope=16, page_size=16, cache_dtype=FP8_DTYPE, seed=5)
    o1, lse1 = case.triton()
    case.kv_scale = case.kv_scale * 2
    case.q_lat = case.q_lat / 2
    case.q_pe = case.q_pe / 2
    o2, lse2 = case.triton()
    torch.testing.assert_close(o2, 2 * o1, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse2, lse1, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("H", [4, 72])  # the torch path has separate few-head / many-head decode
def test_torch_path_ignores_rows_outside_kv_range(page_size: int, H: int) -> None:
    """Cross-check of the core torch path on the NaN-poisoned caches the Triton tests use
    (FlashMLA's test poisons unused cache rows with NaN the same way): rows outside a
    request's kv range (page tails, unassigned pages) must not reach the output, since
    0 * NaN = NaN in P @ V. Not a Triton test, but it guards the reference these tests use."""
    case = Case(DECODE_PREFIX, [1] * 4, H=H, r=32, rope=16, page_size=page_size, seed=1)
    o, lse = case.torch_path(poisoned=True)
    assert torch.isfinite(o).all() and torch.isfinite(lse).all(), (
        "mla_backend.ops.torch_ops.absorbed_attention returned NaN: it reads cache rows "
        "outside a request's kv range (padding of a batched gather?)"
    )


def test_default_heuristic_path_and_many_splits_agree() -> None:
    case = Case([300, 2], [1, 1], H=2, r=16, rope=16, page_size=64, seed=9)
    base = case.triton()  # heuristic on CPU: fallback SM count
    assert_matches(case, base)
    many = case.triton(num_kv_splits=19, block_n=16)
    torch.testing.assert_close(many[0], base[0], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(many[1], base[1], atol=2e-5, rtol=2e-5)


def test_strided_query_views() -> None:
    """SGLang splits q into q_lat / q_pe views of one [T, H, r + rope] tensor."""
    case = Case([8, 3], [1, 2], H=3, r=32, rope=16, page_size=16, seed=4)
    q = torch.cat([case.q_lat, case.q_pe], dim=-1)
    q_lat, q_pe = q[..., :32], q[..., 32:]
    assert not q_lat.is_contiguous()
    got = tops.absorbed_attention(q_lat, q_pe, case.kv_cache, case.batch, case.scale)
    assert_matches(case, got)


def test_idle_batch_and_requests_without_tokens() -> None:
    kv = torch.zeros(2, 16, 48)
    bt = torch.zeros(2, 2, dtype=torch.int32)
    batch = mb.MLABatch.build([3, 0], [0, 0], bt, 16, mb.Phase.IDLE)
    o, lse = tops.absorbed_attention(torch.zeros(0, 2, 32), torch.zeros(0, 2, 16), kv, batch, 0.1)
    assert o.shape == (0, 2, 32) and lse.shape == (0, 2)


def test_int64_block_table_and_slots() -> None:
    case = Case([17], [2], H=2, r=16, rope=16, page_size=16, seed=12)
    case.batch = mb.MLABatch.build(
        case.batch.prefix_lens, case.batch.new_lens, case.batch.block_table.long(), 16
    )
    assert_matches(case, case.triton(num_kv_splits=2))


@settings(
    max_examples=15,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    data=st.data(),
    page_size=st.sampled_from([1, 4, 16, 64]),
    dims=st.sampled_from([(16, 16), (24, 8), (48, 0), (32, 16), (40, 24)]),
    H=st.sampled_from([1, 2, 3, 5, 17]),
    splits=st.integers(1, 6),
    block_n=st.sampled_from([16, 32, 64]),
)
def test_random_batches(
    data, page_size: int, dims: tuple[int, int], H: int, splits: int, block_n: int
) -> None:
    B = data.draw(st.integers(1, 4))
    prefix = data.draw(st.lists(st.integers(0, 70), min_size=B, max_size=B))
    new = data.draw(st.lists(st.integers(0, 6), min_size=B, max_size=B))
    if sum(new) == 0:
        new[0] = 1
    r, rope = dims
    case = Case(prefix, new, H=H, r=r, rope=rope, page_size=page_size, seed=sum(prefix))
    assert_matches(case, case.triton(num_kv_splits=splits, block_n=block_n))


def test_write_latent_padded_slot_mapping() -> None:
    """vLLM pads slot_mapping beyond the real tokens: only the first T entries are used."""
    kv = torch.zeros(2, 4, 12)
    c_kv, k_pe = torch.randn(3, 8), torch.randn(3, 4)
    slots = torch.tensor([5, -1, 0, 7, 6, 1])  # entries 3.. belong to no token
    tops.write_latent(kv, c_kv, k_pe, slots)
    flat = kv.view(-1, 12)
    assert torch.equal(flat[5], torch.cat([c_kv[0], k_pe[0]]))
    assert torch.equal(flat[0], torch.cat([c_kv[2], k_pe[2]]))
    untouched = [i for i in range(8) if i not in (0, 5)]
    assert torch.equal(flat[untouched], torch.zeros(6, 12))


# ----------------------------------------------------------------------------------------
# Seam, heuristics, fp8 bmm
# ----------------------------------------------------------------------------------------


def test_seam_routes_to_triton_and_matches_paper_oracle() -> None:
    """Full layer through MLAAttention(impl='triton') vs the paper's decompressed MHA."""
    dims = mb.MLADims(
        num_heads=3, kv_lora_rank=32, qk_nope_head_dim=8, qk_rope_head_dim=16, v_head_dim=8
    )
    g = torch.Generator().manual_seed(21)
    w = torch.randn(3 * (8 + 8), 32, generator=g) * 0.2
    weights = mb.split_kv_b_proj(w, dims)
    case = Case([10, 0], [1, 4], H=3, r=32, rope=16, page_size=16, seed=21)
    q_nope = torch.randn(5, 3, 8, generator=g)
    attn = mb.MLAAttention(
        dims, weights, case.scale, policy=mb.Policy(mode="absorb"), impl="triton"
    )
    called = []
    orig = tops.absorbed_attention

    def spy(*a, **k):
        called.append(True)
        return orig(*a, **k)

    tops.absorbed_attention = spy
    try:
        out = attn(q_nope, case.q_pe, case.kv_cache, case.batch)
    finally:
        tops.absorbed_attention = orig
    assert called, "impl='triton' did not reach mla_backend.ops.triton_ops"
    r = 32
    seqs = [s.float() for s in case.seqs]
    ref = mb.testing.reference.reference_mla_attention(
        q_nope,
        case.q_pe,
        [s[:, :r] for s in seqs],
        [s[:, r:] for s in seqs],
        w,
        8,
        8,
        case.batch.new_lens,
        case.scale,
    )
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_env_override_routes_cpu_tensors_to_triton(monkeypatch) -> None:
    """MLA_BACKEND_IMPL=triton sends CPU tensors through the seam to the Triton kernels."""
    case = Case([9, 2], [1, 3], H=2, r=16, rope=16, page_size=16, seed=8)
    calls = []
    for name in ("absorbed_attention", "write_latent"):
        real = getattr(tops, name)

        def spy(*a, _real=real, _name=name, **k):
            calls.append(_name)
            return _real(*a, **k)

        monkeypatch.setattr(tops, name, spy)
    monkeypatch.setenv("MLA_BACKEND_IMPL", "triton")
    kv = case.kv_cache.clone()
    mb.write_latent(kv, torch.randn(1, 16), torch.randn(1, 16), torch.tensor([-1]))
    assert torch.equal(kv.nan_to_num(7.0), case.kv_cache.nan_to_num(7.0))  # -1: nothing written
    got = mb.absorbed_attention(case.q_lat, case.q_pe, case.kv_cache, case.batch, case.scale)
    assert calls == ["write_latent", "absorbed_attention"]
    assert_matches(case, got)


def test_cpu_tensors_without_interpreter_get_a_clear_error(monkeypatch) -> None:
    from mla_backend.ops.triton_kernels import attention

    compiled = triton.JITFunction(attention.absorbed_attn_kernel.fn)  # as on a GPU machine
    monkeypatch.setattr(tops, "absorbed_attn_kernel", compiled)
    case = Case([4], [1], H=2, r=16, rope=16, page_size=16)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        case.triton()


def test_split_heuristic() -> None:
    sms = 132
    assert hx.choose_num_splits(1, 4096, sms) == 16  # one request: split by length
    assert hx.choose_num_splits(128 * 8, 4096, sms) == 1  # big batch fills the GPU
    assert hx.choose_num_splits(1, 100, sms) == 1  # short context: no split
    assert hx.choose_num_splits(1, 10**6, sms) == hx.MAX_SPLITS
    assert hx.choose_num_splits(16, 8192, sms) == 17
    assert hx.sm_count(torch.device("cpu")) == hx.CPU_FALLBACK_SM_COUNT


@pytest.mark.parametrize("H", [1, 2, 3, 16, 128])
@pytest.mark.parametrize("max_new", [1, 2, 7, 64])
def test_attention_tiles_are_valid(H: int, max_new: int) -> None:
    bq, bh = hx.attention_tiles(H, max_new)
    for b in (bq, bh):
        assert b & (b - 1) == 0
    assert bq * bh >= hx.MIN_DOT_DIM  # tl.dot needs M >= 16 on GPUs
    assert bh >= min(H, hx.ROWS_PER_PROGRAM)
    assert bq <= hx.next_pow2(max_new)
    assert hx.dim_block(0) == 16 and hx.dim_block(96) == 128 and hx.dim_block(512) == 512


def _load_benchmark():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "triton_gpu_bench.py"
    spec = importlib.util.spec_from_file_location("triton_gpu_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_benchmark_plumbing_on_cpu(capsys) -> None:
    bench = _load_benchmark()
    # FlashMLA's accounting: 1 ms, b=1, q_len=1, 1 head, 1000 kv tokens, bf16.
    tflops, gbs = bench._flashmla_throughput(1.0, 1, 1, 1, 1000, 2)
    assert tflops == pytest.approx(2 * 1000 * 1088 / 1e9)
    assert gbs == pytest.approx((1000 * 576 + 576 + 512) * 2 / 1e6)
    if not torch.cuda.is_available():
        assert bench.main([]) == 0
        assert "needs a CUDA or ROCm GPU" in capsys.readouterr().out
    _, gbs8 = bench._flashmla_throughput(1.0, 1, 1, 1, 1000, 1)  # fp8 cache, bf16 q / o
    assert gbs8 == pytest.approx((1000 * 576 + (576 + 512) * 2) / 1e6)
    # The GPU sweep's code on tiny CPU shapes (fake timer), compared with the torch path.
    assert bench.main(["--smoke"]) == 0
    assert (
        bench.main(["--smoke", "--cache", "fp8", "--peak-tflops", "989", "--peak-gbs", "3350"]) == 0
    )
    out = capsys.readouterr().out
    assert out.count("\n    2      80    16") == 8 and "%roofline" in out
