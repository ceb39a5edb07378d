"""DeepSeek-V4's fp8 page layout (:mod:`mla_backend.v4_cache`): against vLLM's own Triton writer
and reader, bit for bit, and its properties (round-trip bound, untouched bytes, refusals).

The oracle (:mod:`v4_vllm_oracle`) runs vLLM 0.32's ``quantize_and_insert_k_cache`` and
``dequantize_and_gather_k_cache`` (launchers and kernels, compiled from vLLM's installed source)
under Triton's interpreter, in a process of its own (``TRITON_INTERPRET=1`` must precede Triton's
import and must not leak into this session), once for all cases: the module's fixture builds
every case's inputs here, deterministically, and hands them over in a file. Its one correction:
the interpreter's float32 -> e4m3 conversion (wrong in Triton 3.9) is replaced by the GPU's
rounding, nearest even with saturation, from a numpy table (:func:`e4m3_rne`, checked here
against torch's cast on every midpoint). Readers are compared on bf16 (vLLM's output dtype),
on caches without e4m3fn's NaN codes (the interpreter decodes them as +-480) and with scale
bytes in [10, 254] (below 10 a value can be a bf16 subnormal, which the interpreter's float32 ->
bf16 conversion gets wrong; the writer stores exponent bytes in [105, 247] for finite bf16
rows). The oracle is skipped, with the reason, where vllm or triton is missing.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from v4_vllm_oracle import E4M3_VALUES, e4m3_rne

from mla_backend import v4_cache as v4
from mla_backend.v4_cache import (
    V4_DATA_BYTES,
    V4_HEAD_DIM,
    V4_NOPE,
    V4_SCALE_BYTES,
    V4_TILE,
    V4_TOKEN_BYTES,
    check_v4_cache,
    encode_v4_rows,
    read_v4_rows,
    refuse_unsupported_v4_layout,
    v4_page_bytes,
    write_v4_rows,
)

ORACLE = Path(__file__).resolve().parent / "v4_vllm_oracle.py"


def test_e4m3_rne_matches_torch_on_every_midpoint():
    """The oracle's rounding agrees with torch's cast on every e4m3 value, every midpoint
    between neighbours (ties to even) and points just off them."""
    v = E4M3_VALUES
    mids = (v[1:] + v[:-1]) / 2
    pts = np.concatenate(
        [
            v,
            mids,
            np.nextafter(mids.astype(np.float32), 0),
            np.nextafter(mids.astype(np.float32), 1e9),
            [500.0, 1e30, 2.0**-11],
        ]
    )
    pts = np.concatenate([pts, -pts]).astype(np.float32)
    want = torch.from_numpy(pts).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    assert np.array_equal(e4m3_rne(pts), want.numpy())


# ---- inputs ---------------------------------------------------------------------------------
def _tie_row() -> torch.Tensor:
    """A row whose tiles hold e4m3 midpoints (ties: to even), subnormal ties, -0.0 and the
    tile maximum 448 * 2^k exactly (scale 2^k, nothing clamped)."""
    row = torch.zeros(V4_HEAD_DIM, dtype=torch.float64)
    mids = (E4M3_VALUES[1:] + E4M3_VALUES[:-1]) / 2  # 126 midpoints, all bf16-exact
    for t in range(V4_NOPE // V4_TILE):
        k = 2 * t - 8
        vals = torch.from_numpy(mids[(np.arange(V4_TILE) * 7 + t * 11) % len(mids)])
        vals[0] = 448.0
        vals[1::4] *= -1
        row[t * V4_TILE : (t + 1) * V4_TILE] = vals * 2.0**k
    row[5] = -0.0
    row[V4_NOPE:] = torch.linspace(-3, 3, V4_HEAD_DIM - V4_NOPE)
    return row


def make_rows(n: int, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """[n, 512] rows: per-tile magnitudes over a wide range (fp16: its range), a zero row, a
    row of tiles below the 1e-4 amax floor (one all zero), near-max values (not fp16), the tie
    row; fp32 rows not bf16-exact."""
    lo, hi = (-10, 10) if dtype == torch.float16 else (-40, 40)
    mag = torch.exp2(torch.randint(lo, hi, (n, 8), generator=gen).double())
    x = torch.randn(n, V4_HEAD_DIM, generator=gen, dtype=torch.float64)
    x = x * mag.repeat_interleave(V4_TILE, 1)
    tiny = torch.randn(V4_HEAD_DIM, generator=gen, dtype=torch.float64) * 1e-6
    specials = [torch.zeros(V4_HEAD_DIM, dtype=torch.float64), tiny, _tie_row()]
    specials[1][V4_TILE : 2 * V4_TILE] = 0
    if dtype != torch.float16:
        big = torch.randn(V4_HEAD_DIM, generator=gen, dtype=torch.float64) * 1e37
        specials.append(big.clamp(-3e38, 3e38))
    for i, row in enumerate(specials[:n]):
        x[i] = row
    return x.to(dtype)


def make_slots(
    n: int, n_skip: int, n_slots: int, gen: torch.Generator, dtype: torch.dtype, head: int = 0
) -> torch.Tensor:
    """n distinct slots of [0, n_slots) and n_skip -1s, shuffled, but the first ``head`` (rows
    that must be written: :func:`make_rows`'s special rows) never -1."""
    used = torch.randperm(n_slots, generator=gen)[:n]
    tail = torch.cat([used[head:], torch.full((n_skip,), -1)])
    tail = tail[torch.randperm(len(tail), generator=gen)]
    return torch.cat([used[:head], tail]).to(dtype)


def sentinel(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)


# ---- 1. against vLLM ------------------------------------------------------------------------
# (page_size, input dtype, how the cache is handed over)
WRITE_CASES = [
    (1, torch.float32, "2d"),
    (4, torch.bfloat16, "3d"),
    (16, torch.float16, "strided"),
    (64, torch.bfloat16, "strided"),
    (64, torch.float32, "2d"),
]
READ_PAGE_SIZES = [1, 4, 16, 64]


def write_case(page_size: int, dtype: torch.dtype, view: str) -> dict:
    """A writer case: a sentinel cache (40 bytes past each page but for "2d"), rows of ``dtype``
    and shuffled distinct slots with three -1s (int32 for page size 4)."""
    gen = torch.Generator().manual_seed(page_size * 31 + len(view))
    pages, n, n_skip = 3, min(14, 3 * page_size), 3
    pb = v4_page_bytes(page_size)
    extra = 0 if view == "2d" else 40
    slot_dtype = torch.int32 if page_size == 4 else torch.int64
    return {
        "kind": "write",
        "page_size": page_size,
        "page_bytes": pb,
        "cache": sentinel((pages, pb + extra), gen),
        "rows": make_rows(n + n_skip, gen, dtype),
        "slots": make_slots(n, n_skip, pages * page_size, gen, slot_dtype, head=min(4, n)),
    }


def _reader_cache(pages: int, page_size: int, gen: torch.Generator) -> torch.Tensor:
    """Random bytes without e4m3fn's NaN codes, scale bytes in [10, 254], no NaN rope values
    (copied as bits by both, but NaN != NaN)."""
    cache = sentinel((pages, v4_page_bytes(page_size)), gen)
    cache[cache == 0x7F] = 0x7E
    cache[cache == 0xFF] = 0xFE
    scales = cache[:, page_size * V4_DATA_BYTES : page_size * V4_TOKEN_BYTES]
    scales.copy_(torch.randint(10, 255, scales.shape, generator=gen, dtype=torch.uint8))
    data = cache[:, : page_size * V4_DATA_BYTES].view(pages, page_size, V4_DATA_BYTES)
    rope = data[:, :, V4_NOPE:].contiguous().view(torch.bfloat16)
    rope[rope.isnan()] = 1.0
    data[:, :, V4_NOPE:] = rope.view(torch.uint8)
    return cache


def read_case(page_size: int) -> dict:
    """A reader case: two requests over a shuffled block table, the last tokens of each
    gathered (crossing a page boundary for page sizes > 4) at output offset 2."""
    gen = torch.Generator().manual_seed(100 + page_size)
    pages = max(4, 16 // page_size)
    per_req = pages // 2
    seq_lens = torch.tensor([per_req * page_size - 1, per_req * page_size // 2 + 1])
    return {
        "kind": "gather",
        "page_size": page_size,
        "offset": 2,
        "cache": _reader_cache(pages, page_size, gen),
        "block_table": torch.randperm(pages, generator=gen).view(2, per_req).int(),
        "seq_lens": seq_lens.int(),
        "gather_lens": torch.minimum(seq_lens, torch.tensor([9, 6])).int(),
        "out_shape": (2, 2 + 9, V4_HEAD_DIM),
    }


@pytest.fixture(scope="module")
def vllm_results(tmp_path_factory) -> dict:
    """vLLM's result of every writer and reader case, by case key, from one oracle process."""
    cases = {("write", *c): write_case(*c) for c in WRITE_CASES}
    cases.update({("read", p): read_case(p) for p in READ_PAGE_SIZES})
    handed = []
    for case in cases.values():
        c = dict(case)
        if c["kind"] == "write":  # vLLM's writer takes bf16 rows and int64 slots
            c["k"], c["slots"] = c.pop("rows").bfloat16(), c["slots"].long()
        handed.append(c)
    d = tmp_path_factory.mktemp("v4_oracle")
    torch.save(handed, d / "cases.pt")
    proc = subprocess.run(
        [sys.executable, str(ORACLE), str(d / "cases.pt"), str(d / "out.pt")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"the oracle process failed:\n{proc.stderr[-4000:]}"
    got = torch.load(d / "out.pt")
    if "skip" in got:
        pytest.skip(f"no vLLM oracle: {got['skip']}")
    return dict(zip(cases, got["results"]))


@pytest.mark.parametrize(
    ("page_size", "dtype", "view"),
    WRITE_CASES,
    ids=[f"ps{c[0]}-{str(c[1])[6:]}-{c[2]}" for c in WRITE_CASES],
)
def test_writer_matches_vllm(vllm_results, page_size, dtype, view):
    """write_v4_rows leaves every byte of the cache as vLLM's Triton writer given
    ``rows.bfloat16()`` does: data, scales, pad, rope, skipped -1 slots, page padding and bytes
    past the page (sentinel bytes), for caches handed over as vLLM's [pages, page_bytes]
    tensor, a row-strided view, and the [pages, page_size, 584] view."""
    case = write_case(page_size, dtype, view)
    theirs = vllm_results[("write", page_size, dtype, view)]
    ours, pb = case["cache"].clone(), case["page_bytes"]
    if view == "3d":
        cache = ours[:, : page_size * V4_TOKEN_BYTES].view(-1, page_size, V4_TOKEN_BYTES)
    else:
        cache = ours[:, :pb]
    write_v4_rows(cache, page_size, case["slots"], case["rows"])
    assert not torch.equal(theirs, case["cache"])
    diff = (theirs != ours).nonzero()
    assert diff.numel() == 0, f"{len(diff)} bytes differ, first at (page, byte) {diff[0].tolist()}"


@pytest.mark.parametrize("page_size", READ_PAGE_SIZES)
def test_reader_matches_vllm(vllm_results, page_size):
    """read_v4_rows (bf16) gives vLLM's gather reader's rows bit for bit: two requests, pages in
    a shuffled block table, the last tokens of each (crossing a page boundary) gathered at an
    output offset; slots of no row (-1) read as zeros, where vLLM's output keeps its zeros."""
    case = read_case(page_size)
    out = vllm_results[("read", page_size)]
    bt, seq_lens, gather = case["block_table"], case["seq_lens"], case["gather_lens"]
    slots = torch.full((2, 9), -1, dtype=torch.int64)
    for b in range(2):
        for i in range(int(gather[b])):
            pos = int(seq_lens[b] - gather[b]) + i
            slots[b, i] = int(bt[b, pos // page_size]) * page_size + pos % page_size
    ours = read_v4_rows(case["cache"], page_size, slots)
    assert ours.shape == (2, 9, V4_HEAD_DIM) and ours.dtype == torch.bfloat16
    theirs = out[:, case["offset"] :]
    assert torch.equal(ours.view(torch.int16), theirs.view(torch.int16))
    assert not ours[slots < 0].any() and ours[slots >= 0].abs().sum() > 0


# ---- 2. properties --------------------------------------------------------------------------
def _half_ulp_bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Half an e4m3 ulp of ``x / scale``, times scale: ``2^(max(E, -6) - 4) * scale`` for
    ``|x / scale|`` in [2^E, 2^(E+1)) (3 mantissa bits; subnormals: spacing 2^-9)."""
    v = (x / scale).abs()
    _, f = torch.frexp(v)  # v = m * 2^f, m in [0.5, 1): E = f - 1
    return torch.exp2((f - 1).clamp(min=-6).double() - 4) * scale


@settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    seed=st.integers(0, 2**31 - 1),
    page_size=st.sampled_from([1, 3, 16, 64]),
    n=st.integers(1, 12),
    lo=st.integers(-60, 40),
    span=st.integers(0, 30),
    dtype=st.sampled_from([torch.bfloat16, torch.float32, torch.float16]),
)
def test_round_trip_within_half_an_e4m3_ulp(seed, page_size, n, lo, span, dtype):
    """read(write(x)): each nope value within half an e4m3 ulp of its bf16 value at its tile's
    scale (zeros exact), the scale the least power of two with ``amax / scale <= 448``
    (``amax`` floored at 1e-4), rope bit-exact; bf16 / fp16 reads are the fp32 read rounded."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.float16:
        lo, span = max(min(lo, 6), -14), min(span, 6)
    mag = torch.exp2(torch.randint(lo, lo + span + 1, (n, 8), generator=gen).double())
    x = (
        torch.randn(n, V4_HEAD_DIM, generator=gen, dtype=torch.float64)
        * mag.repeat_interleave(V4_TILE, 1)
    ).to(dtype)
    x[torch.rand(x.shape, generator=gen) < 0.05] = 0
    pages = -(-n // page_size) + 1
    cache = sentinel((pages, v4_page_bytes(page_size)), gen)
    slots = make_slots(n, 0, pages * page_size, gen, torch.int64)
    write_v4_rows(cache, page_size, slots, x)
    got = read_v4_rows(cache, page_size, slots, torch.float32).double()
    xb = x.bfloat16().double()

    nope, got_nope = xb[:, :V4_NOPE], got[:, :V4_NOPE]
    tiles = nope.unflatten(1, (-1, V4_TILE))
    amax = tiles.abs().amax(-1).clamp(min=1e-4)
    page, off = slots // page_size, slots % page_size
    exp_bytes = torch.stack(
        [
            cache[p, page_size * V4_DATA_BYTES + o * V4_SCALE_BYTES :][:7]
            for p, o in zip(page.tolist(), off.tolist())
        ]
    )
    scale = torch.exp2(exp_bytes.double() - 127)
    assert (amax / scale <= 448).all() and (amax / scale > 224).all()
    scale_el = scale.repeat_interleave(V4_TILE, 1)
    err = (got_nope - nope).abs()
    assert (err <= _half_ulp_bound(nope, scale_el)).all()
    assert (got_nope[nope == 0] == 0).all()
    assert torch.equal(
        got[:, V4_NOPE:].float().bfloat16().view(torch.int16),
        x[:, V4_NOPE:].bfloat16().view(torch.int16),
    )
    for d in (torch.bfloat16, torch.float16):
        assert torch.equal(read_v4_rows(cache, page_size, slots, d), got.float().to(d))


def test_decode_every_byte():
    """Every e4m3 code under every scale byte reads (fp32) as numpy's float32 ``value *
    2^(byte - 127)``: 2^-127 (byte 0) a subnormal, 2^128 (byte 255) inf, NaN codes NaN; the
    pad byte is ignored."""
    b = torch.arange(256)
    tok = torch.zeros(256, V4_TOKEN_BYTES, dtype=torch.uint8)
    codes = torch.arange(V4_NOPE) % 256
    tok[:, :V4_NOPE] = (codes[None] + 3 * b[:, None]) % 256
    tiles = (b[:, None] + 37 * torch.arange(7)) % 256  # [256, 7] each byte in every tile
    tok[:, V4_DATA_BYTES : V4_DATA_BYTES + 7] = tiles
    tok[:, -1] = 0xAB
    got = v4.decode_v4_rows(tok, torch.float32)[:, :V4_NOPE].numpy()
    code = tok[:, :V4_NOPE].numpy().astype(np.int64)
    mag = np.where((code & 0x7F) == 0x7F, np.nan, E4M3_VALUES[np.minimum(code & 0x7F, 126)])
    value = np.where(code & 0x80, -mag, mag).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        scale = np.ldexp(1.0, tiles.numpy().astype(np.int64) - 127).astype(np.float32)
        want = value * np.repeat(scale, V4_TILE, axis=1)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("page_size", [1, 5, 64])
def test_write_touches_only_its_rows(page_size):
    """Writing rows changes exactly those tokens' 576 data bytes and 8 scale bytes (addressed
    here by a loop over the documented offsets); every other byte (other tokens, page padding,
    bytes past the page in a strided cache) keeps its sentinel value. A call whose slots are
    all -1, and an empty call, change nothing."""
    gen = torch.Generator().manual_seed(7 + page_size)
    pages, pb = 3, v4_page_bytes(page_size)
    base = sentinel((pages, pb + 24), gen)
    n = min(6, pages * page_size)
    rows = make_rows(n + 2, gen, torch.float32)
    slots = make_slots(n, 2, pages * page_size, gen, torch.int32)
    after = base.clone()
    write_v4_rows(after[:, :pb], page_size, slots, rows)
    want = base.clone()
    enc = encode_v4_rows(rows)
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        p, o = divmod(s, page_size)
        want[p, o * V4_DATA_BYTES : (o + 1) * V4_DATA_BYTES] = enc[i, :V4_DATA_BYTES]
        sc = page_size * V4_DATA_BYTES + o * V4_SCALE_BYTES
        want[p, sc : sc + V4_SCALE_BYTES] = enc[i, V4_DATA_BYTES:]
        assert enc[i, -1] == 0  # the pad byte
    assert torch.equal(after, want)

    before = after.clone()
    write_v4_rows(after[:, :pb], page_size, torch.full((3,), -1), rows[:3])
    write_v4_rows(after[:, :pb], page_size, torch.empty(0, dtype=torch.int64), rows[:0])
    assert torch.equal(after, before)


def test_read_shapes_dtypes_and_no_row():
    """Slots of any shape give [..., 512] in the asked dtype; a negative slot reads zeros; each
    row is the flat read's row."""
    gen = torch.Generator().manual_seed(3)
    cache = sentinel((4, v4_page_bytes(4)), gen)
    write_v4_rows(cache, 4, torch.arange(16), make_rows(16, gen, torch.bfloat16))
    slots = torch.randint(-1, 16, (2, 3, 4), generator=gen)
    flat = read_v4_rows(cache, 4, slots.flatten().clamp(min=0), torch.float32)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        got = read_v4_rows(cache, 4, slots.int(), dtype)
        assert got.shape == (2, 3, 4, V4_HEAD_DIM) and got.dtype == dtype
        want = flat.to(dtype).masked_fill((slots.flatten() < 0)[:, None], 0).view(got.shape)
        assert torch.equal(got, want)
    assert read_v4_rows(cache, 4, torch.empty(0, 5, dtype=torch.int64)).shape == (0, 5, 512)
    empty = torch.empty(0, v4_page_bytes(4), dtype=torch.uint8)
    assert not read_v4_rows(empty, 4, torch.full((3,), -1)).any()
    write_v4_rows(empty, 4, torch.full((3,), -1), torch.ones(3, V4_HEAD_DIM))  # nothing to do


def test_page_bytes():
    """vLLM's page: page_size * 584 rounded up to a multiple of 576 (its decode TMA stride)."""
    assert [v4_page_bytes(p) for p in (1, 4, 64, 256)] == [1152, 2880, 37440, 149760]
    for p in range(1, 200):
        b = v4_page_bytes(p)
        assert b % 576 == 0 and p * 584 <= b < p * 584 + 576


class _HostReads(TorchDispatchMode):
    """Counts what reads a tensor's data on the host (a device-to-host sync on a GPU)."""

    OPS = ("aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten.unique")

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func.overloadpacket) in self.OPS:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def test_no_host_reads():
    """write and read never read tensor data on the host (skipped slots included)."""
    gen = torch.Generator().manual_seed(5)
    cache = sentinel((3, v4_page_bytes(16)), gen)
    rows = make_rows(8, gen, torch.float32)
    slots = make_slots(6, 2, 48, gen, torch.int64)
    with _HostReads() as mode:
        write_v4_rows(cache, 16, slots, rows)
        read_v4_rows(cache, 16, slots.view(2, 4))
    assert mode.seen == []


# ---- 3. refusals ----------------------------------------------------------------------------
def _u8(*shape: int) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.uint8)


BAD_CACHES = {
    "dtype": (lambda: torch.zeros(2, 2880, dtype=torch.bfloat16), 4, r"dtype torch\.bfloat16"),
    "dims": (lambda: _u8(2880), 4, r"1 dims \(2880,\)"),
    "dims4": (lambda: _u8(2, 1, 4, 584), 4, r"4 dims"),
    "byte stride": (lambda: _u8(2, 5760)[:, ::2], 4, r"byte stride 2"),
    "row width": (lambda: _u8(2, 2000), 4, r"row of 2000 bytes .* 2336"),
    "page stride": (lambda: _u8(2, 64 * 584), 64, r"page stride 37376 .* 37440"),
    "page stride 3d": (lambda: _u8(2, 64, 584), 64, r"page stride 37376 .* 37440"),
    "page_size 0": (lambda: _u8(2, 1152), 0, r"page_size=0"),
    "page_size 3d": (lambda: _u8(2, 8, 584), 4, r"page_size=4"),
    "token stride 3d": (lambda: _u8(2, 4, 1168)[:, :, ::2], 4, r"strides"),
    "V4.1 3d": (lambda: _u8(2, 64, 528), 64, r"DeepSeek-V4\.1's 528-byte fp8 row \(MXFP8"),
    "V4.1 2d": (lambda: _u8(2, 64 * 528), 64, r"DeepSeek-V4\.1's 528-byte"),
    "V3.2 3d": (lambda: _u8(2, 64, 656), 64, r"DeepSeek-V3\.2's 656-byte fp8_ds_mla"),
}


@pytest.mark.parametrize("case", list(BAD_CACHES))
def test_bad_cache_refused(case):
    """Each malformed cache is refused by check, write and read with a ValueError naming it."""
    make, ps, match = BAD_CACHES[case]
    cache = make()
    with pytest.raises(ValueError, match=match):
        check_v4_cache(cache, ps)
    with pytest.raises(ValueError, match=match):
        write_v4_rows(cache, ps, torch.zeros(1, dtype=torch.int64), torch.zeros(1, 512))
    with pytest.raises(ValueError, match=match):
        read_v4_rows(cache, ps, torch.zeros(1, dtype=torch.int64))


def test_good_caches_accepted():
    check_v4_cache(_u8(3, v4_page_bytes(64)), 64)
    check_v4_cache(_u8(3, v4_page_bytes(64) + 100)[:, : 64 * 584], 64)  # vLLM's 2-D view
    check_v4_cache(_u8(3, v4_page_bytes(64))[:, : 64 * 584].view(3, 64, 584), 64)
    check_v4_cache(_u8(1, 584), 1)  # one page: no stride to check
    refuse_unsupported_v4_layout(584)


@pytest.mark.parametrize(
    ("nbytes", "match"),
    [
        (528, r"DeepSeek-V4\.1's 528-byte fp8 row \(MXFP8.*supported: DeepSeek-V4's 584-byte row"),
        (656, r"V3\.2's 656-byte fp8_ds_mla row .*cache_layout"),
        (352, r"nvfp4_ds_mla"),
        (132, r"indexer's 132-byte fp8 key row"),
        (68, r"indexer's 68-byte MXFP4"),
        (600, r"a 600-byte row is not supported; supported: DeepSeek-V4's 584-byte row"),
    ],
)
def test_other_layouts_refused_by_name(nbytes, match):
    with pytest.raises(ValueError, match=match):
        refuse_unsupported_v4_layout(nbytes)


def test_bad_rows_and_slots_refused():
    cache = _u8(2, v4_page_bytes(4))
    s = torch.zeros(2, dtype=torch.int64)
    bad = [
        (lambda: write_v4_rows(cache, 4, s, torch.zeros(2, 576)), r"rows .* \(2, 576\)"),
        (
            lambda: write_v4_rows(cache, 4, s, torch.zeros(2, 512, dtype=torch.int32)),
            r"rows torch\.int32",
        ),
        (lambda: write_v4_rows(cache, 4, s, torch.zeros(2, 1, 512)), r"rows .* \[N, 512\]"),
        (
            lambda: write_v4_rows(cache, 4, s.float(), torch.zeros(2, 512)),
            r"slots dtype torch\.float32",
        ),
        (lambda: write_v4_rows(cache, 4, s[:1], torch.zeros(2, 512)), r"slots \(1,\) .*N=2"),
        (lambda: read_v4_rows(cache, 4, s, torch.int8), r"dtype torch\.int8"),
        (lambda: read_v4_rows(cache, 4, s.double()), r"slots dtype torch\.float64"),
    ]
    for call, match in bad:
        with pytest.raises(ValueError, match=match):
            call()


def test_slot_past_the_cache_refused():
    """A slot >= num_pages * page_size: ``torch._assert_async`` (a RuntimeError on the CPU);
    the cache is left as it was."""
    cache = _u8(2, v4_page_bytes(4))
    with pytest.raises(RuntimeError, match="slot past the V4 cache"):
        write_v4_rows(cache, 4, torch.tensor([3, 8]), torch.ones(2, 512))
    assert not cache.any()
    with pytest.raises(RuntimeError, match="slot past the V4 cache"):
        read_v4_rows(cache, 4, torch.tensor([[8]], dtype=torch.int32))


def test_module_constants():
    assert (v4.V4_HEAD_DIM, v4.V4_NOPE, v4.V4_ROPE, v4.V4_TILE) == (512, 448, 64, 64)
    assert (V4_DATA_BYTES, V4_SCALE_BYTES, V4_TOKEN_BYTES) == (576, 8, 584)
