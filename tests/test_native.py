"""Native CPU kernels (mla_backend.ops.native), once per ISA level this CPU executes (the
``isa`` fixture, :func:`native.host_isas`; ``MLA_BACKEND_TEST_ISAS=avx2,scalar`` restricts it):
absorbed attention against an independent float64 reference and a plain compute-dtype reference
(for ``fp8_ds_mla`` caches also against an emulation of the kernel's own roundings), cache writes
bit for bit against torch, the e4m3 decode against torch for every byte, argument errors and
fake-tensor (opaque op) behaviour. The loader (levels, flags, selection, a level the CPU lacks
never built, the failure path) is tested in tests/test_native_isa.py."""

from __future__ import annotations

import math

import pytest
import torch

import mla_backend as mb
from mla_backend.cache_layout import CacheLayout
from mla_backend.ops import LatentWrite, native
from mla_backend.ops import torch as torch_ops
from mla_backend.ops.native.engine import ENGINES, attention_engine, engine_code, level_engines
from mla_backend.testing.cases import make_case
from mla_backend.testing.native_checks import ATTENTION_DTYPES
from mla_backend.testing.native_checks import check_absorbed as _check

if not native.host_isas():
    pytest.skip("the native kernels target x86-64 (no ISA level here)", allow_module_level=True)

FP8 = torch.float8_e4m3fn
DS = torch.uint8  # fp8_ds_mla rows
# (r, rope): the conftest DIMS' latents, odd ones (partial fp8_ds_mla tiles, odd r), no rope,
# DeepSeek's.
SHAPES = [(16, 4), (40, 6), (32, 0), (96, 32), (200, 32), (33, 0), (512, 64)]
# (q dtype, cache dtype)
DTYPES = ATTENTION_DTYPES


def _absorbed(
    q_lat, q_pe, kv_cache, block_table, cu, kv_lens, scale, kv_scale=None, splits=0,
    max_page_id=-1, *, isa, engine=None,
):  # fmt: skip
    """The raw op ``native_absorbed_attention`` on the test's own tensors (malformed ones
    included: the seam's wrapper takes a validated record), its engine named."""
    code = engine_code(attention_engine(isa) if engine is None else engine)
    return native.op_namespace(isa).native_absorbed_attention(
        q_lat, q_pe, kv_cache, block_table, cu, kv_lens, scale, kv_scale, splits, max_page_id, code
    )


def _write_latent(*args, isa):
    """The raw op ``native_write_latent`` on the test's own tensors."""
    native.op_namespace(isa).native_write_latent(*args)


def _dims(H: int, r: int, rope: int) -> mb.MLADims:
    return mb.MLADims(H, r, 8, rope, 8)


def _run_case(
    isa,
    H,
    r,
    rope,
    prefix,
    new,
    page,
    qdt,
    cdt,
    seed=0,
    splits=0,
    scale=None,
    garbage_table=False,
    strided=False,
    engine=None,
):
    case = make_case(_dims(H, r, rope), prefix, new, page, dtype=qdt, cache_dtype=cdt, seed=seed)
    g = torch.Generator().manual_seed(seed + 1000)
    T = sum(new)
    q_lat = torch.randn(T, H, r, generator=g).to(qdt)
    q_pe = torch.randn(T, H, rope, generator=g).to(qdt)
    if strided:  # views with padded head / token strides
        big = torch.randn(T, H + 2, r + rope + 5, generator=g).to(qdt)
        big[:, :H, :r] = q_lat
        big[:, :H, r + 5 :] = q_pe
        q_lat, q_pe = big[:, :H, :r], big[:, :H, r + 5 :]
    bt = case.batch.block_table.to(torch.int32).clone()
    if garbage_table:  # columns past each request's pages may hold anything
        for i, (p, n) in enumerate(zip(prefix, new)):
            used = -(-(p + n) // page)
            bt[i, used:] = 10**6 + i
    cu = torch.tensor(case.batch.cu_new, dtype=torch.int32)
    kvl = torch.tensor(case.batch.kv_lens, dtype=torch.int32)
    scale = scale if scale is not None else 1.0 / math.sqrt(r + rope)
    o, lse = _absorbed(
        q_lat,
        q_pe,
        case.kv_cache,
        bt,
        cu,
        kvl,
        scale,
        case.kv_scale,
        splits,
        isa=isa,
        engine=engine,
    )
    return case, q_lat, q_pe, scale, o, lse


MIXED = ([0, 5, 37, 0, 64, 3], [1, 1, 4, 9, 1, 0])  # zero-prefix extends, decodes, n=0 request


@pytest.mark.parametrize("qdt,cdt", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("r,rope", SHAPES, ids=lambda x: str(x))
def test_dims_and_dtypes_mixed_batch(isa, r, rope, qdt, cdt):
    res = _run_case(isa, 16, r, rope, *MIXED, 16, qdt, cdt, seed=r + rope)
    _check(res[0], *res[1:4], *res[4:], qdt)


@pytest.mark.parametrize("page", [1, 16, 64])
@pytest.mark.parametrize("H", [1, 3, 9, 16, 63, 128])
def test_heads_and_pages(isa, H, page):
    prefix, new = [3, 70, 0, 130], [1, 2, 5, 1]
    for qdt, cdt in [
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float32),
        (torch.bfloat16, DS),
        (torch.float32, DS),
    ]:
        res = _run_case(isa, H, 40, 8, prefix, new, page, qdt, cdt, seed=H * 7 + page)
        _check(res[0], *res[1:4], *res[4:], qdt)


# (H, r, rope, prefix, new, page, q dtype, cache dtype, splits): the AMX engine's edges (rows
# per request at and around its 16-row threshold, past its 128-row blocks and not a multiple of
# 16; D = r + rope a multiple of 32 (tiles read in place from 16-row pages) or not (gathered);
# pages of 1, 16, 64; kv lengths around its 128-row tiles; fp8; splits), and layouts it leaves
# to the vector engines (fp8_ds_mla, fp16 / fp32 q)
ENGINE_CASES = [
    (16, 512, 64, [0, 5, 37, 0, 64, 3], [1, 1, 4, 9, 1, 0], 16, torch.bfloat16, torch.bfloat16, 0),
    (128, 512, 64, [127, 1000, 4000], [1, 3, 1], 16, torch.bfloat16, torch.bfloat16, 0),
    (128, 512, 64, [300, 129], [2, 1], 64, torch.bfloat16, FP8, 3),
    (9, 40, 8, [100, 7, 250], [20, 3, 1], 1, torch.bfloat16, torch.bfloat16, 0),
    (15, 96, 32, [200, 50], [1, 17], 16, torch.bfloat16, torch.bfloat16, 2),
    (32, 96, 32, [200, 50], [5, 17], 64, torch.bfloat16, FP8, 0),
    (5, 33, 0, [60, 0, 16], [4, 30, 1], 16, torch.bfloat16, torch.bfloat16, 0),
    (16, 64, 16, [700, 0], [1, 20], 16, torch.bfloat16, DS, 0),
    (16, 64, 16, [700, 0], [1, 20], 16, torch.float16, torch.float16, 0),
]


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("case", ENGINE_CASES, ids=lambda c: f"H{c[0]}-r{c[1]}-{c[7]}")
def test_every_engine_of_the_level(isa, engine, case):
    """Each engine the level runs (whatever the rule picks by default), against float64."""
    if engine not in level_engines(isa):
        with pytest.raises(RuntimeError, match="engine"):
            _run_case(isa, 1, 16, 4, [3], [1], 16, torch.bfloat16, torch.bfloat16, engine=engine)
        return
    H, r, rope, prefix, new, page, qdt, cdt, splits = case
    res = _run_case(
        isa,
        H,
        r,
        rope,
        prefix,
        new,
        page,
        qdt,
        cdt,
        seed=H + r,
        splits=splits,
        garbage_table=True,
        engine=engine,
    )
    _check(res[0], *res[1:4], *res[4:], qdt)


@pytest.mark.parametrize("splits", [0, 1, 2, 3, 7, 100])
@pytest.mark.parametrize(
    "qdt,cdt",
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, FP8),
        (torch.float32, torch.float32),
        (torch.bfloat16, DS),
        (torch.float16, DS),
    ],
    ids=str,
)
def test_kv_splits_and_layouts(isa, splits, qdt, cdt):
    prefix, new = [700, 0, 300, 1000], [1, 20, 6, 3]
    res = _run_case(
        isa,
        9,
        64,
        16,
        prefix,
        new,
        16,
        qdt,
        cdt,
        seed=splits,
        splits=splits,
        garbage_table=True,
        strided=True,
    )
    _check(res[0], *res[1:4], *res[4:], qdt)


def test_sharp_softmax_scale(isa):
    for qdt, cdt in [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32)]:
        res = _run_case(isa, 16, 64, 16, [200, 50], [1, 4], 16, qdt, cdt, scale=0.5)
        _check(res[0], *res[1:4], *res[4:], qdt)


@pytest.mark.parametrize(
    "qdt,cdt",
    [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, FP8), (torch.bfloat16, DS)],
    ids=str,
)
def test_long_context_8k(isa, qdt, cdt):
    res = _run_case(isa, 16, 512, 64, [8191, 3000, 6000], [1, 1, 2], 64, qdt, cdt, seed=3)
    _check(res[0], *res[1:4], *res[4:], qdt)


@pytest.mark.slow
def test_long_context_32k(isa):
    for qdt, cdt in [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, FP8), (torch.bfloat16, DS)]:
        res = _run_case(isa, 16, 512, 64, [32767], [1], 64, qdt, cdt, seed=5)
        _check(res[0], *res[1:4], *res[4:], qdt)


def test_hypothesis_shapes_and_layouts(isa):
    hyp = pytest.importorskip("hypothesis")
    st = hyp.strategies

    @hyp.settings(max_examples=40, deadline=None, derandomize=True)
    @hyp.given(
        H=st.integers(1, 20),
        r=st.one_of(st.integers(1, 80), st.sampled_from([96, 127, 128, 129, 200, 257])),
        rope=st.sampled_from([0, 2, 6, 16, 34]),
        page=st.sampled_from([1, 2, 3, 16, 64]),
        reqs=st.lists(st.tuples(st.integers(0, 150), st.integers(0, 6)), min_size=1, max_size=4),
        dt=st.sampled_from(DTYPES),
        splits=st.sampled_from([0, 1, 2, 5]),
        seed=st.integers(0, 1000),
    )
    def run(H, r, rope, page, reqs, dt, splits, seed):
        # (make_case cannot build an empty request: its slot tensor would be float)
        prefix = [max(p, 1 - n) for p, n in reqs]
        new = [n for _, n in reqs]
        if sum(new) == 0:
            new[0] = 1
        qdt, cdt = dt
        res = _run_case(
            isa,
            H,
            r,
            rope,
            prefix,
            new,
            page,
            qdt,
            cdt,
            seed=seed,
            splits=splits,
            garbage_table=seed % 2 == 0,
            strided=seed % 3 == 0,
        )
        _check(res[0], *res[1:4], *res[4:], qdt)

    run()


# ---- write_latent ------------------------------------------------------------------------
@pytest.mark.parametrize("cdt", [FP8, torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16], ids=str)
def test_write_latent_bitwise(isa, cdt, src):
    g = torch.Generator().manual_seed(0)
    r, rope, ps, pages, T = 40, 6, 16, 8, 50
    c = (torch.randn(T, r, generator=g) * 10).to(src)
    k = (torch.randn(T, rope, generator=g) * 10).to(src)
    # extremes: saturation, subnormal range, signed zero, ties
    c[0, :8] = torch.tensor([1e6, -1e6, 1e-6, -1e-6, 0.0, -0.0, 448 * 0.02, 3.3e-4]).to(src)
    slots = torch.randperm(pages * ps, generator=g)[:T].to(torch.int32)
    slots[::7] = -1
    scale = torch.tensor(0.02) if cdt == FP8 else None
    cache = torch.full((pages, ps, r + rope), 1.0).to(cdt)
    expect = cache.clone()
    _write_latent(cache, c, k, slots, scale, isa=isa)
    row = torch.cat([c, k], -1).float()
    if cdt == FP8:
        row = (row / scale).clamp(-448, 448).to(FP8)
    else:
        row = torch.cat([c, k], -1).to(cdt)
    flat = expect.view(-1, r + rope)
    keep = slots >= 0
    flat[slots[keep].long()] = row[keep]
    assert torch.equal(cache.view(torch.uint8), expect.view(torch.uint8))


def test_write_latent_all_fp8_bytes(isa):
    """Every fp8 code point (decoded x scale) round-trips, and a dense sweep of values matches
    torch's rounding bit for bit."""
    vals = torch.linspace(-500, 500, 200003)
    vals = torch.cat([vals, torch.arange(256, dtype=torch.uint8).view(FP8).float()])
    vals = vals[torch.isfinite(vals)]
    T = vals.numel() // 4
    c = vals[: T * 4].view(T, 4)
    cache = torch.zeros(T, 1, 4, dtype=FP8)
    scale = torch.tensor(1.0)
    _write_latent(
        cache, c, torch.zeros(T, 0), torch.arange(T, dtype=torch.int64), scale, isa=isa
    )
    ref = c.clamp(-448, 448).to(FP8)
    assert torch.equal(cache.view(torch.uint8).view(T, 4), ref.view(torch.uint8))


@pytest.mark.parametrize("r,rope", [(512, 64), (200, 32), (96, 0), (33, 6), (1, 2)], ids=str)
@pytest.mark.parametrize("src", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_write_ds_mla_bitwise(isa, src, r, rope):
    """The native fp8_ds_mla write equals the torch path's writer (itself tested bit for bit
    against vLLM's quantizer) byte for byte: magnitudes over 16 decades, all-zero and partial
    tiles, inf, NaN, subnormal inputs, padding slots; bytes of other rows untouched."""
    g = torch.Generator().manual_seed(r + rope)
    T, ps, pages = 120, 16, 10
    c = torch.randn(T, r, generator=g) * torch.logspace(-8, 8, T)[:, None]
    c[0, :5] = torch.tensor([float("inf"), 0.0, -0.0, 1e-40, 3.0])[: min(5, r)]
    c[1] = 0.0
    c[2, r // 2] = float("nan")
    c[3, -1] = -1e30
    c, k = c.to(src), (torch.randn(T, rope, generator=g) * 10).to(src)
    slots = torch.randperm(pages * ps, generator=g)[:T]
    slots[::5] = -1
    lay = CacheLayout.ds_mla(r, rope, src)
    base = torch.randint(0, 256, (pages, ps, lay.width), generator=g, dtype=torch.uint8)
    mine, ref = base.clone(), base.clone()
    _write_latent(mine, c, k, slots.to(torch.int32), None, isa=isa)
    torch_ops.Kernels().write_latent(LatentWrite(ref, lay, c, k, slots, None))
    assert torch.equal(mine, ref)
    keep = slots >= 0  # and the writer's rows are CacheLayout.pack's
    assert torch.equal(mine.view(-1, lay.width)[slots[keep]], lay.pack(c, k)[keep])


@pytest.mark.parametrize("flush_denormal", [False, True])
def test_fp8_decode_exact_for_every_byte(isa, flush_denormal):
    """The kernels' cheap e4m3 decode (fp16 bit trick + vcvtph2ps, and its bf16 form) equals
    torch's float8_e4m3fn -> float32 for all 256 bytes (NaN bytes read as +-480), subnormals
    included, also with denormals-are-zero set."""
    b = torch.arange(256, dtype=torch.uint8).repeat(3)[5:]  # unaligned lengths and offsets
    ref = b.view(FP8).float()
    nan = ref.isnan()
    ref[nan] = torch.where(b[nan] >= 128, -480.0, 480.0)
    old = (
        torch.is_flush_denormal_enabled() if hasattr(torch, "is_flush_denormal_enabled") else False
    )
    torch.set_flush_denormal(flush_denormal)
    try:
        for bf16 in (False, True):
            got = native.op_namespace(isa).native_fp8_decode(b, bf16)
            assert torch.equal(got.view(torch.int32), ref.view(torch.int32)), bf16
    finally:
        torch.set_flush_denormal(old)


# ---- errors, fakes, loader ---------------------------------------------------------------
def test_bad_inputs_raise_clear_errors(isa):
    case = make_case(_dims(4, 16, 4), [5], [1], 4)
    q, qp = torch.randn(1, 4, 16), torch.randn(1, 4, 4)
    bt = case.batch.block_table.to(torch.int32)
    cu, kvl = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([6], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="q_lat dtype Double is not supported"):
        _absorbed(q.double(), qp.double(), case.kv_cache, bt, cu, kvl, 0.1, isa=isa)
    with pytest.raises(RuntimeError, match="r \\+ rope"):
        _absorbed(q[..., :8], qp, case.kv_cache, bt, cu, kvl, 0.1, isa=isa)
    bad = bt.clone()
    bad[0, 0] = 999
    with pytest.raises(RuntimeError, match="999"):
        _absorbed(q, qp, case.kv_cache, bad, cu, kvl, 0.1, isa=isa)
    with pytest.raises(RuntimeError, match="kv_lens\\[0\\] = 0"):
        _absorbed(
            q, qp, case.kv_cache, bt, cu, torch.zeros(1, dtype=torch.int32), 0.1, isa=isa
        )
    with pytest.raises(RuntimeError, match="num_kv_splits=-1"):
        _absorbed(q, qp, case.kv_cache, bt, cu, kvl, 0.1, None, -1, isa=isa)
    ds = torch.zeros(8, 4, CacheLayout.ds_mla(16, 4, torch.float32).width - 1, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="fp8_ds_mla kv_cache last dim"):
        _absorbed(q, qp, ds, bt, cu, kvl, 0.1, isa=isa)
    with pytest.raises(RuntimeError, match="fp8_ds_mla kv_cache last dim"):
        _write_latent(ds, q[0], qp[0], torch.arange(4), isa=isa)
    # the plan's max_page_id is checked in O(1) against the cache's page count
    n_pages = case.kv_cache.shape[0]
    with pytest.raises(RuntimeError, match=f"page id {n_pages} \\(max_page_id\\)"):
        _absorbed(q, qp, case.kv_cache, bt, cu, kvl, 0.1, None, 0, n_pages, isa=isa)
    o1, _ = _absorbed(q, qp, case.kv_cache, bt, cu, kvl, 0.1, isa=isa)
    used = int(bt[0, : -(-6 // case.kv_cache.shape[1])].max())
    o2, _ = _absorbed(
        q, qp, case.kv_cache, bt, cu, kvl, 0.1, None, 0, used, isa=isa
    )
    assert torch.equal(o1, o2)


def test_fake_tensor_mode_is_opaque(isa):
    from torch._subclasses import FakeTensorMode

    case = make_case(_dims(4, 16, 4), [5, 0], [1, 3], 4, dtype=torch.bfloat16)
    args = (
        torch.randn(4, 4, 16).bfloat16(),
        torch.randn(4, 4, 4).bfloat16(),
        case.kv_cache,
        case.batch.block_table.to(torch.int32),
        torch.tensor([0, 1, 4], dtype=torch.int32),
        torch.tensor([6, 3], dtype=torch.int32),
    )
    with FakeTensorMode() as mode:
        fargs = [mode.from_tensor(a) for a in args]
        o, lse = native.op_namespace(isa).native_absorbed_attention(*fargs, 0.25, None, 0)
        assert o.shape == (4, 4, 16) and o.dtype == torch.bfloat16 and lse.dtype == torch.float32
        native.op_namespace(isa).native_write_latent(
            fargs[2],
            mode.from_tensor(torch.randn(2, 16)),
            mode.from_tensor(torch.randn(2, 4)),
            mode.from_tensor(torch.tensor([1, 2])),
            None,
        )
