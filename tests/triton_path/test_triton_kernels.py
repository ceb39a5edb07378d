"""Triton kernels (mla_backend.ops.triton.ops) through the plan API, on CPU under the Triton
interpreter (or on a GPU with ``MLA_TEST_DEVICE=cuda``).

Cases come from the shared builder (:func:`mla_backend.testing.cases.make_case`, wrapped in
:class:`triton_case.TCase`); every kernel variant is compared with an independent float64
dense absorbed reference (o_lat and LSE: gather each request's rows, two dots, causal mask,
softmax) and with the core torch path; the full layer is compared with the shared oracle.
Unused cache pages and the tails of partially used pages hold NaN, so any read outside a
request's kv range shows up as NaN in the output. Shapes are small: the interpreter runs
every program in Python.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

import triton.language as tl  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from triton_case import (  # noqa: E402
    DEVICE,
    ON_GPU,
    TCase,
    TritonKernels,
    assert_matches,
    dense_reference,
    load_benchmark,
    tops,
)

import mla_backend as mb  # noqa: E402
from mla_backend.fp8 import FP8_DTYPE  # noqa: E402
from mla_backend.ops.triton.jit import heuristics as hx  # noqa: E402
from mla_backend.ops.triton.jit.attention import _e4m3_bits_to_f32  # noqa: E402
from mla_backend.ops.triton.jit.cache_write import _e4m3_grid_to_bits  # noqa: E402

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
    mb.write_latent(want, c_kv, k_pe, slots, scale, impl="torch")
    got = base.clone().to(DEVICE)
    mb.write_latent(
        got,
        c_kv.to(DEVICE),
        k_pe.to(DEVICE),
        slots.to(torch.int32).to(DEVICE),
        None if scale is None else scale.to(DEVICE),
        impl=TritonKernels(fp8_mode=mode),
    )
    got = got.cpu()
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
    kv = torch.randn(2, 4, 12, device=DEVICE)
    before = kv.clone()
    z = torch.zeros(0, dtype=torch.long, device=DEVICE)
    tops.write_latent(kv, torch.zeros(0, 8, device=DEVICE), torch.zeros(0, 4, device=DEVICE), z)
    assert torch.equal(kv, before)


def test_write_latent_padded_slot_mapping() -> None:
    """vLLM pads slot_mapping beyond the real tokens: only the first T entries are used."""
    kv = torch.zeros(2, 4, 12, device=DEVICE)
    c_kv, k_pe = torch.randn(3, 8, device=DEVICE), torch.randn(3, 4, device=DEVICE)
    slots = torch.tensor([5, -1, 0, 7, 6, 1], device=DEVICE)  # entries 3.. belong to no token
    mb.write_latent(kv, c_kv, k_pe, slots, impl=TritonKernels())
    flat = kv.view(-1, 12)
    assert torch.equal(flat[5], torch.cat([c_kv[0], k_pe[0]]))
    assert torch.equal(flat[0], torch.cat([c_kv[2], k_pe[2]]))
    untouched = [i for i in range(8) if i not in (0, 5)]
    assert torch.equal(flat[untouched], torch.zeros(6, 12, device=DEVICE))


# ----------------------------------------------------------------------------------------
# Attention: decode, extend, splits, pages, dims, dtypes
# ----------------------------------------------------------------------------------------

DECODE_PREFIX = [0, 5, 37, 70]


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("splits", [1, 3, 16])
def test_decode_pages_and_splits(page_size: int, splits: int) -> None:
    # 16 splits of 16-token chunks over kv lengths 1..71: most splits of every request are
    # empty (LSE -inf), and the shortest request has a single kv row.
    case = TCase(DECODE_PREFIX, [1] * 4, H=4, r=32, rope=16, page_size=page_size, seed=splits,
                 phase=mb.Phase.DECODE)
    plan = case.plan(num_kv_splits=splits, block_n=16)
    assert plan.step.work.num_kv_splits == splits and plan.step.work.block_q == 1
    assert_matches(case, case.triton(num_kv_splits=splits, block_n=16))


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("splits", [1, 3])
def test_extend_ragged_causal(page_size: int, splits: int) -> None:
    # Requests: fresh prefill, decode-like, zero new tokens, long extend onto a prefix.
    case = TCase([0, 9, 4, 33], [5, 1, 0, 9], H=3, r=32, rope=16, page_size=page_size, seed=7)
    assert_matches(case, case.triton(num_kv_splits=splits))


def test_extend_many_tokens_few_heads_uses_token_blocks() -> None:
    # H=2 -> BLOCK_H=2, BLOCK_Q=16: rows of 16 tokens share a program; causal bound per row.
    assert hx.attention_tiles(2, 13) == (16, 2)
    case = TCase([3, 0], [13, 6], H=2, r=16, rope=16, page_size=16, seed=3)
    assert case.plan(num_kv_splits=2).step.work.block_q == 16
    assert_matches(case, case.triton(num_kv_splits=2))


@pytest.mark.parametrize(
    "r,rope,H",
    [(96, 32, 3), (24, 0, 5), (40, 8, 20), (512, 64, 2)],
)
def test_odd_dims(r: int, rope: int, H: int) -> None:
    case = TCase([6, 21], [1, 3], H=H, r=r, rope=rope, page_size=16, seed=r + rope)
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
    case = TCase([12, 40], [2, 1], H=4, r=32, rope=16, page_size=16, cache_dtype=cache_dtype,
                 q_dtype=q_dtype, seed=11)
    assert (case.kv_scale is not None) == (cache_dtype == FP8_DTYPE)
    assert_matches(case, case.triton(num_kv_splits=3))


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
def test_fp8_cache_decoded_from_bytes(q_dtype: torch.dtype) -> None:
    """The integer e4m3 decode (GPUs without native fp8 in Triton) gives the same result."""
    case = TCase([30, 3], [1, 2], H=3, r=24, rope=8, page_size=16, cache_dtype=FP8_DTYPE,
                 q_dtype=q_dtype, seed=13)
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
    out = torch.empty(256, device=DEVICE)
    back = torch.empty(256, dtype=torch.uint8, device=DEVICE)
    _decode_bytes_kernel[(1,)](codes.to(DEVICE), out, back, 256)
    out, back = out.cpu(), back.cpu()
    want = codes.view(FP8_DTYPE).float()
    finite = torch.isfinite(want)  # 0x7F / 0xFF are NaN codes
    assert int((~finite).sum()) == 2
    assert torch.equal(out[finite], want[finite])
    assert torch.equal(torch.signbit(out[finite]), torch.signbit(want[finite]))  # -0.0 kept
    assert torch.equal(back[finite], codes[finite])  # encoder inverts the decoder


def test_fp8_scale_is_applied() -> None:
    """Doubling kv_scale doubles every value: o doubles; the same scores need q halved."""
    case = TCase([20], [2], H=2, r=16, rope=16, page_size=16, cache_dtype=FP8_DTYPE, seed=5)
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
    case = TCase(DECODE_PREFIX, [1] * 4, H=H, r=32, rope=16, page_size=page_size, seed=1,
                 phase=mb.Phase.DECODE)
    o, lse = case.torch_path(poisoned=True)
    assert torch.isfinite(o).all() and torch.isfinite(lse).all(), (
        "the torch path's absorbed attention returned NaN: it reads cache rows outside a "
        "request's kv range (padding of a batched gather?)"
    )


def test_default_heuristic_path_and_many_splits_agree() -> None:
    case = TCase([300, 2], [1, 1], H=2, r=16, rope=16, page_size=64, seed=9)
    base = case.triton()  # heuristic (CPU: fallback SM count)
    assert_matches(case, base)
    many = case.triton(num_kv_splits=19, block_n=16)
    torch.testing.assert_close(many[0], base[0], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(many[1], base[1], atol=2e-5, rtol=2e-5)


def test_strided_query_views() -> None:
    """SGLang splits q into q_lat / q_pe views of one [T, H, r + rope] tensor."""
    case = TCase([8, 3], [1, 2], H=3, r=32, rope=16, page_size=16, seed=4)
    q = torch.cat([case.q_lat, case.q_pe], dim=-1)
    q_lat, q_pe = q[..., :32], q[..., 32:]
    assert not q_lat.is_contiguous()
    got = mb.absorbed_attention(q_lat, q_pe, case.kv_cache, case.plan(), case.scale)
    assert_matches(case, got)
    # the module function on the plan part, as the seam calls it
    got = tops.absorbed_attention(q_lat, q_pe, case.kv_cache, case.plan().step, case.scale)
    assert_matches(case, got)


def test_idle_batch_and_requests_without_tokens() -> None:
    kv = torch.zeros(2, 16, 48, device=DEVICE)
    bt = torch.zeros(2, 2, dtype=torch.int32)
    batch = mb.MLABatch.build([3, 0], [0, 0], bt.to(DEVICE), 16, mb.Phase.IDLE,
                              block_table_host=bt)
    dims = mb.MLADims(2, 32, 8, 16, 8)
    plan = mb.plan(batch, dims, mb.Policy("absorb"), device=DEVICE, impl=TritonKernels())
    o, lse = mb.absorbed_attention(
        torch.zeros(0, 2, 32, device=DEVICE), torch.zeros(0, 2, 16, device=DEVICE), kv, plan, 0.1
    )
    assert o.shape == (0, 2, 32) and lse.shape == (0, 2)


def test_int64_block_table() -> None:
    case = TCase([17], [2], H=2, r=16, rope=16, page_size=16, seed=12)
    case.set_block_table(case.batch.host_block_table().long())
    assert case.batch.block_table.dtype == torch.int64
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
    case = TCase(prefix, new, H=H, r=r, rope=rope, page_size=page_size, seed=sum(prefix))
    assert_matches(case, case.triton(num_kv_splits=splits, block_n=block_n))


# ----------------------------------------------------------------------------------------
# Seam, heuristics, benchmark plumbing
# ----------------------------------------------------------------------------------------


def test_seam_routes_to_triton_and_matches_shared_oracle(monkeypatch) -> None:
    """Full layer through MLAAttention on a Triton plan vs the shared oracle (the paper's
    decompressed MHA)."""
    case = TCase([10, 0], [1, 4], H=3, r=32, rope=16, page_size=16, seed=21, nope=8, v=12)
    base = case.base
    called = []
    real = tops.absorbed_attention

    def spy(*a, **k):
        called.append(True)
        return real(*a, **k)

    monkeypatch.setattr(tops, "absorbed_attention", spy)
    w = mb.AbsorbWeights(base.weights.W_UK.to(DEVICE), base.weights.W_UV.to(DEVICE))
    attn = mb.MLAAttention(case.dims, w, case.scale)
    out = attn(base.q_nope.to(DEVICE), case.q_pe, case.kv_cache, case.plan())
    assert called, "a Triton plan did not reach mla_backend.ops.triton.ops"
    assert out.shape == (5, 3, 12) and out.device.type == case.device.type
    torch.testing.assert_close(out.cpu(), base.oracle(case.scale), atol=1e-4, rtol=1e-4)


def test_env_override_routes_to_triton(monkeypatch) -> None:
    """MLA_BACKEND_IMPL=triton sends the tensors (CPU ones too) through the seam to the Triton
    kernels when no impl is named."""
    case = TCase([9, 2], [1, 3], H=2, r=16, rope=16, page_size=16, seed=8)
    calls = []
    for name in ("absorbed_attention", "write_latent"):
        real = getattr(tops, name)

        def spy(*a, _real=real, _name=name, **k):
            calls.append(_name)
            return _real(*a, **k)

        monkeypatch.setattr(tops, name, spy)
    monkeypatch.setenv("MLA_BACKEND_IMPL", "triton")
    kv = case.kv_cache.clone()
    c_kv, k_pe = torch.randn(1, 16, device=DEVICE), torch.randn(1, 16, device=DEVICE)
    mb.write_latent(kv, c_kv, k_pe, torch.tensor([-1], device=DEVICE))
    assert torch.equal(kv.nan_to_num(7.0), case.kv_cache.nan_to_num(7.0))  # -1: nothing written
    plan = mb.plan(case.batch, case.dims, mb.Policy("absorb"), device=DEVICE)
    assert plan.impl.name == "triton"
    got = mb.absorbed_attention(case.q_lat, case.q_pe, case.kv_cache, plan, case.scale)
    assert calls == ["write_latent", "absorbed_attention"]
    assert_matches(case, got)


def test_cpu_tensors_without_interpreter_get_a_clear_error(monkeypatch) -> None:
    from mla_backend.ops.triton.jit import attention

    compiled = triton.JITFunction(attention.absorbed_attn_kernel.fn)  # as on a GPU machine
    monkeypatch.setattr(tops.absorbed, "absorbed_attn_kernel", compiled)
    case = TCase([4], [1], H=2, r=16, rope=16, page_size=16, device=torch.device("cpu"))
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        case.triton()


def test_kernels_are_torch_library_ops() -> None:
    """The kernels are registered custom ops (torch.library.triton_op)."""
    for name in ("triton_absorbed_attention", "triton_write_latent"):
        op = getattr(torch.ops.mla_backend, name).default
        assert isinstance(op, torch._ops.OpOverload)
    def written(name: str) -> list[str]:
        schema = getattr(torch.ops.mla_backend, name).default._schema
        return [a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write]

    assert written("triton_write_latent") == ["kv_cache"]  # declares its one mutation
    assert written("triton_absorbed_attention") == []


def test_num_parts_heuristic() -> None:
    sms = 132
    assert hx.num_parts(1, sms) == hx.PROGRAMS_PER_SM * sms  # 16 heads: one head block
    assert hx.num_parts(2, sms) == hx.PROGRAMS_PER_SM * sms // 2  # 128 heads: two blocks of 64
    assert hx.num_parts(10**6, sms) == 1
    assert hx.sm_count(torch.device("cpu")) == hx.CPU_FALLBACK_SM_COUNT


@pytest.mark.parametrize(
    "H,new,rows",
    [(16, [4, 3, 1], 64), (128, [1, 1, 1], 64), (64, [2, 1], 64), (5, [7, 1], 64)],
)
def test_full_64_row_query_blocks(H: int, new: list[int], rows: int) -> None:
    """FlashMLA's M = 64 rows per program (heads x tokens), several head blocks, tokens of one
    request sharing a program, with the schedule splitting the long request."""
    case = TCase([40, 90, 3][: len(new)], new, H=H, r=32, rope=16, page_size=16, seed=H)
    plan = case.plan(num_kv_splits=5, block_n=16)
    bq = plan.step.work.block_q
    assert bq * hx.attention_tiles(H, bq)[1] == rows
    assert_matches(case, case.triton(num_kv_splits=5, block_n=16))


@pytest.mark.parametrize("rows", [16, 32])
def test_rows_per_program_knob(rows: int) -> None:
    """Smaller query blocks than FlashMLA's 64 rows (a GPU tuning knob) give the same result."""
    case = TCase([9, 33], [5, 2], H=8, r=32, rope=16, page_size=16, seed=rows)
    plan = case.plan(num_kv_splits=3, rows_per_program=rows)
    bq = plan.step.work.block_q
    assert bq * hx.attention_tiles(8, bq, rows)[1] == rows
    assert_matches(case, case.triton(num_kv_splits=3, rows_per_program=rows))
    with pytest.raises(ValueError, match="rows_per_program=24"):
        TritonKernels(rows_per_program=24)


def test_refresh_rewrites_the_schedule() -> None:
    """A refreshed plan (new lengths, same query counts: CUDA-graph replay) gets the new
    lengths' schedule in place, and the kernel serves the new step."""
    case = TCase([5, 70, 12], [1, 1, 1], H=4, r=32, rope=16, page_size=16, seed=21,
                 phase=mb.Phase.DECODE)
    impl = TritonKernels(num_kv_splits=4, block_n=16)
    plan = case.plan(impl)
    meta, base = plan.step.work.state.part_meta, plan.step.work.state.split_base
    addrs = (meta.data_ptr(), base.data_ptr())
    grown = TCase([40, 71, 13], [1, 1, 1], H=4, r=32, rope=16, page_size=16, seed=21,
                  phase=mb.Phase.DECODE)
    plan.refresh_(grown.batch)
    assert (meta.data_ptr(), base.data_ptr()) == addrs
    fresh = grown.plan(impl).step.work.state
    assert torch.equal(meta, fresh.part_meta) and torch.equal(base, fresh.split_base)
    out = mb.absorbed_attention(grown.q_lat, grown.q_pe, grown.kv_cache, plan, grown.scale)
    assert_matches(grown, out)


@pytest.mark.parametrize("H", [1, 2, 3, 16, 128])
@pytest.mark.parametrize("max_new", [1, 2, 7, 64])
def test_attention_tiles_are_valid(H: int, max_new: int) -> None:
    bq, bh = hx.attention_tiles(H, max_new)
    for b in (bq, bh):
        assert b & (b - 1) == 0
    assert bq * bh >= hx.MIN_DOT_DIM  # tl.dot needs M >= 16 on GPUs
    assert bh >= min(H, hx.ROWS_PER_PROGRAM)
    assert bq <= hx.next_pow2(max_new)
    assert bq * bh <= max(hx.ROWS_PER_PROGRAM, hx.MIN_DOT_DIM)
    assert hx.dim_block(0) == 16 and hx.dim_block(96) == 128 and hx.dim_block(512) == 512


def test_gpu_benchmark_plumbing_on_cpu(capsys) -> None:
    bench = load_benchmark()
    # FlashMLA's accounting: 1 ms, b=1, q_len=1, 1 head, 1000 kv tokens, bf16.
    tflops, gbs = bench._flashmla_throughput(1.0, 1, 1, 1, 1000, 2)
    assert tflops == pytest.approx(2 * 1000 * 1088 / 1e9)
    assert gbs == pytest.approx((1000 * 576 + 576 + 512) * 2 / 1e6)
    _, gbs8 = bench._flashmla_throughput(1.0, 1, 1, 1, 1000, 1)  # fp8 cache, bf16 q / o
    assert gbs8 == pytest.approx((1000 * 576 + (576 + 512) * 2) / 1e6)
    if ON_GPU:
        return  # the GPU run executes the benchmark itself
    if not torch.cuda.is_available():
        assert bench.main([]) == 0
        assert "needs a CUDA or ROCm GPU" in capsys.readouterr().out
    # The GPU sweep's code on tiny CPU shapes (fake timer), compared with the torch path.
    assert bench.main(["--smoke"]) == 0
    assert (
        bench.main(["--smoke", "--cache", "fp8", "--peak-tflops", "989", "--peak-gbs", "3350"]) == 0
    )
    out = capsys.readouterr().out
    assert out.count("\n    2      80    16") == 8 and "%roofline" in out


# ----------------------------------------------------------------------------------------
# Tile knobs of the chunked kernel (issue 28): latent chunks, padded rows, fp16 latent dots
# for e4m3 caches, launch options, the occupancy-aware split count
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("r,chunk", [(32, 16), (96, 32), (512, 128), (200, 64), (64, 512)])
def test_latent_chunks_match_reference(r: int, chunk: int) -> None:
    case = TCase([37, 4], [1, 2], H=3, r=r, rope=16, page_size=16, seed=r + chunk,
                 q_dtype=torch.bfloat16, cache_dtype=torch.bfloat16)
    block_r = hx.dim_block(r)
    assert hx.latent_chunks(block_r, chunk) == min(block_r // min(chunk, block_r), 4)
    assert_matches(case, case.triton(num_kv_splits=2, chunk=chunk))


@pytest.mark.parametrize("cache", [FP8_DTYPE, torch.uint8], ids=["fp8", "fp8_ds_mla"])
@pytest.mark.parametrize("chunk", [64, 128])
def test_fp8_fp16_latent_dots(cache: torch.dtype, chunk: int) -> None:
    """e4m3 caches with the latent dots in fp16 (exact widening): same accuracy bar as bf16."""
    case = TCase([70, 9], [1, 3], H=4, r=256, rope=32, page_size=16, cache_dtype=cache,
                 q_dtype=torch.bfloat16, seed=chunk)
    out = case.triton(num_kv_splits=3, chunk=chunk, fp8_f16=True)
    if cache == torch.uint8:  # the ds reference reads the dequantized rows (see ds tests)
        seqs = [s.to(torch.bfloat16).double() for s in case.seqs]
        o_ref, lse_ref = dense_reference(case.q_lat, case.q_pe, seqs, case.prefix, case.new,
                                         case.scale)
        torch.testing.assert_close(out[0].cpu().double(), o_ref, atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(out[1].cpu().double(), lse_ref, atol=3e-2, rtol=3e-2)
    else:
        assert_matches(case, out)


@pytest.mark.parametrize("H,q_len,rows", [(4, 1, 16), (16, 1, 64), (3, 2, 64)])
def test_pad_rows_to_a_full_block(H: int, q_len: int, rows: int) -> None:
    bq, bh = hx.attention_tiles(H, q_len, rows, pad=True)
    assert bq * bh == rows and bh >= H
    case = TCase([21, 50], [q_len] * 2, H=H, r=32, rope=16, page_size=16, seed=H + rows)
    assert_matches(case, case.triton(num_kv_splits=2, rows_per_program=rows, pad_rows=True))


def test_launch_knobs_are_checked() -> None:
    for kw, name in [({"num_warps": 3}, "num_warps=3"), ({"num_stages": 0}, "num_stages=0"),
                     ({"chunk": 48}, "chunk=48"), ({"block_n": 24}, "block_n=24")]:
        with pytest.raises(ValueError, match=name):
            TritonKernels(**kw)
    with pytest.raises(ValueError, match="fp8_ds_mla latent of 1024"):
        hx.latent_chunks(1024, 128, 128)
    assert hx.latent_chunks(1024, 128) == 4  # plain caches: wider chunks
    # knobs the interpreter ignores still reach the launch
    case = TCase([9], [1], H=2, r=32, rope=16, page_size=16, seed=2)
    assert_matches(case, case.triton(num_warps=8, num_stages=2))


def test_split_count_follows_residency() -> None:
    """One wave of resident programs: 2 per SM at 4 warps, 1 at 8 (64 rows, FlashMLA's)."""
    assert hx.ctas_per_sm(16, 64, 4) == 2 and hx.ctas_per_sm(64, 32, 8) == 1
    assert hx.num_parts(1, 132, hx.ctas_per_sm(16, 64, 4)) == 264
    assert hx.num_parts(2, 132, hx.ctas_per_sm(64, 32, 8)) == 66
    from mla_backend.parts import StepShape

    dims = mb.MLADims(128, 512, 128, 64, 512)
    step = StepShape(dims, [1] * 4, [100] * 4, torch.device("cpu"),
                     torch.zeros(4, 2, dtype=torch.int32), 64)
    bq, parts = TritonKernels().work_shape(step)
    assert (bq, parts) == (1, hx.CPU_FALLBACK_SM_COUNT // 2)  # 2 head blocks of 64, 8 warps


# ----------------------------------------------------------------------------------------
# The Gluon kernel's host side (the kernel itself runs only on a GPU: test_triton_gpu_only)
# ----------------------------------------------------------------------------------------


def test_gluon_serves_rule() -> None:
    from mla_backend.ops.triton.jit import gluon_attention as ga

    bf = torch.bfloat16
    assert ga.serves(16, 512, 64, 64, bf, bf, 1, 16)
    assert ga.serves(128, 512, 64, 64, bf, bf, 1, 64)
    assert ga.serves(32, 512, 64, 64, torch.float16, torch.float16, 2, 32)
    assert not ga.serves(16, 512, 64, 16, bf, bf, 1, 16)  # page 16
    assert not ga.serves(16, 256, 64, 64, bf, bf, 1, 16)  # r 256
    assert not ga.serves(24, 512, 64, 64, bf, bf, 1, 32)  # heads not a divisor of 64
    assert not ga.serves(16, 512, 64, 64, bf, FP8_DTYPE, 1, 16)  # fp8 cache
    assert not ga.serves(16, 512, 64, 64, bf, bf, 8, 16)  # 128 rows


def test_gluon_knob_plans_whole_pages_and_falls_back_off_gpu() -> None:
    """Kernels(gluon=True) cuts its schedule at 64-row pages; where Gluon does not serve
    (CPU tensors: Gluon has no interpreter) the Triton kernel runs, checked against the
    reference."""
    with pytest.raises(ValueError, match="block_n=32"):
        TritonKernels(gluon=True, block_n=32)
    case = TCase([130, 7], [1, 2], H=16, r=512, rope=64, page_size=64, seed=3,
                 q_dtype=torch.bfloat16, cache_dtype=torch.bfloat16)
    kernels = TritonKernels(gluon=True, num_kv_splits=3)
    plan = case.plan(kernels)
    meta = plan.step.work.state.part_meta.cpu()
    assert (meta[:, 1] % 64 == 0).all() and (meta[:, 3] % 64 == 0).all()
    if not ON_GPU:
        assert_matches(case, mb.absorbed_attention(case.q_lat, case.q_pe, case.kv_cache, plan,
                                                   case.scale))


@pytest.mark.parametrize("arch,gluon", [(90, True), (100, False), (80, False), (None, True)])
def test_gluon_serves_hopper_only(arch: int | None, gluon: bool) -> None:
    """A call recorded for compute capability ``arch`` launches the Gluon kernel on Hopper
    (sm_90; None: any arch) and the Triton kernel elsewhere (Blackwell has no wgmma)."""
    case = TCase([130, 7], [1, 1], H=128, r=512, rope=64, page_size=64, seed=4,
                 q_dtype=torch.bfloat16, cache_dtype=torch.bfloat16)
    plan = case.plan(TritonKernels(gluon=True))
    with tops.record_launches(arch) as launches:
        mb.absorbed_attention(case.q_lat, case.q_pe, case.kv_cache, plan, case.scale)
    names = {getattr(x.kernel, "fn", x.kernel).__name__ for x in launches}
    assert ("absorbed_attn_gluon_kernel" in names) == gluon
    assert ("absorbed_attn_kernel" in names) == (not gluon)
