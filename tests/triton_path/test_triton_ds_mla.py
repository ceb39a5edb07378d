"""Triton kernels on the ``fp8_ds_mla`` cache (uint8 rows: e4m3 tiles of 128 with one float32
scale each, k_pe in the compute dtype; :mod:`mla_backend.cache_layout`).

- ``write_latent``: bit for bit equal to :meth:`CacheLayout.pack` (partial last tile, an
  all-zero tile, padding slots untouched, any r / rope incl. 0).
- ``absorbed_attention``: against the float64 reference on the dequantized values the cache
  holds and against the torch path on the same (NaN-poisoned) cache: decode (one and several
  splits), extend, mixed; page sizes 1 / 16 / 64; (r, rope) = (512, 64), (96, 32), (200, 0);
  native and integer fp8 decode. Unwritten rows are 0xFF bytes (NaN values and scales): any
  read of them makes the output non-finite.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from triton_case import DEVICE, TCase, dense_reference, tops  # noqa: E402

import mla_backend as mb  # noqa: E402
from mla_backend.cache_layout import CacheLayout  # noqa: E402

DIMS = [(512, 64), (96, 32), (200, 0)]
TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (3e-2, 3e-2)}


@pytest.mark.parametrize("r,rope", DIMS + [(64, 16), (130, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_write_bit_identical_to_pack(r, rope, dtype) -> None:
    layout = CacheLayout.ds_mla(r, rope, dtype)
    page_size, pages, T = 4, 5, 9
    g = torch.Generator().manual_seed(r + rope)
    c = (torch.randn(T, r, generator=g) * torch.logspace(-3, 3, T)[:, None]).to(dtype)
    c[2, : min(r, 128)] = 0.0  # an all-zero tile
    c[3, 0] = -0.0
    c[4, -1] = 1e-30  # a tiny value next to large ones in the (partial) last tile
    c[4, :-1] *= 1e3
    k = torch.randn(T, rope, generator=g).to(dtype)
    slots = torch.tensor([7, -1, 0, 19, 3, 12, -1, 5, 8, 13, 1][:T], dtype=torch.int64)
    cache = torch.full((pages, page_size, layout.width), 0xAB, dtype=torch.uint8)
    expect = cache.clone().view(-1, layout.width)
    ok = slots >= 0
    expect[slots[ok]] = layout.pack(c[ok], k[ok])
    cache = cache.to(DEVICE)
    tops.write_latent(cache, c.to(DEVICE), k.to(DEVICE), slots.to(DEVICE))
    got = cache.cpu().view(-1, layout.width)
    assert torch.equal(got, expect), (got != expect).nonzero()[:10]


def test_write_bits_and_native_mode_agree() -> None:
    layout = CacheLayout.ds_mla(512, 64, torch.bfloat16)
    c = torch.randn(3, 512).to(torch.bfloat16)
    k = torch.randn(3, 64).to(torch.bfloat16)
    slots = torch.tensor([0, 2, 1])
    for mode in ("native", "bits"):
        cache = torch.zeros(1, 4, layout.width, dtype=torch.uint8, device=DEVICE)
        tops.write_latent(cache, c.to(DEVICE), k.to(DEVICE), slots.to(DEVICE), fp8_mode=mode)
        assert torch.equal(cache.cpu()[0, :3], layout.pack(c, k)[[0, 2, 1]])


def test_wrong_width_is_refused() -> None:
    c = torch.randn(2, 96)
    k = torch.randn(2, 32)
    bad = torch.zeros(1, 4, 96 + 32, dtype=torch.uint8, device=DEVICE)  # not the ds row
    with pytest.raises(ValueError):
        tops.write_latent(bad, c.to(DEVICE), k.to(DEVICE), torch.tensor([0, 1], device=DEVICE))


def _ds_case(prefix, new, r, rope, page_size, dtype, phase, H=4, seed=0) -> TCase:
    return TCase(prefix, new, H=H, r=r, rope=rope, page_size=page_size,
                 cache_dtype=torch.uint8, q_dtype=dtype, seed=seed, phase=phase)


def _check(case: TCase, out) -> None:
    o, lse = out
    T, H, r = case.q_lat.shape
    assert o.shape == (T, H, r) and o.dtype == case.q_lat.dtype and lse.shape == (T, H)
    o, lse = o.cpu(), lse.cpu()
    assert torch.isfinite(o.float()).all() and torch.isfinite(lse).all()
    atol, rtol = TOL[case.q_lat.dtype]
    # the reference sees the values the cache holds, in the compute dtype (as read)
    seqs = [s.to(case.q_lat.dtype).double() for s in case.seqs]
    o_ref, lse_ref = dense_reference(case.q_lat, case.q_pe, seqs, case.prefix, case.new,
                                     case.scale)
    torch.testing.assert_close(o.double(), o_ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(lse.double(), lse_ref, atol=atol, rtol=rtol)
    o_t, lse_t = case.torch_path(poisoned=True)
    torch.testing.assert_close(o.float(), o_t.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(lse, lse_t.float(), atol=atol, rtol=rtol)


SHAPES = {
    "decode": ([5, 130, 0, 63], [1, 1, 1, 1], mb.Phase.DECODE),
    "extend": ([0, 40, 17], [9, 5, 20], mb.Phase.EXTEND),
    "mixed": ([70, 0, 33, 12], [1, 12, 1, 6], mb.Phase.MIXED),
}


@pytest.mark.parametrize("r,rope", DIMS, ids=lambda x: str(x))
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("shape", ["decode", "extend", "mixed"])
def test_absorbed_ds_vs_reference(shape, page_size, r, rope) -> None:
    prefix, new, phase = SHAPES[shape]
    dtype = torch.bfloat16 if (r + page_size) % 2 == 0 else torch.float32
    case = _ds_case(prefix, new, r, rope, page_size, dtype, phase, seed=page_size + r)
    splits = [1, 3] if shape == "decode" else [1 + page_size // 16 % 2]
    for s in splits:
        _check(case, case.triton(num_kv_splits=s))


@pytest.mark.parametrize("mode", ["native", "bits"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_absorbed_ds_fp8_modes(mode, dtype) -> None:
    case = _ds_case([300, 7], [1, 1], 512, 64, 16, dtype, mb.Phase.DECODE, H=16, seed=3)
    _check(case, case.triton(num_kv_splits=4, fp8_mode=mode))


def test_write_then_attend_roundtrip() -> None:
    """The Triton writer's cache read by the Triton kernel equals the torch-written case."""
    case = _ds_case([20, 3], [2, 1], 96, 32, 16, torch.float32, mb.Phase.MIXED, seed=5)
    layout = CacheLayout.ds_mla(96, 32, torch.float32)
    flat = case.kv_cache.cpu().view(-1, layout.width)
    written = (flat[:, layout.scale_offset:layout.scale_offset + 4] != 0xFF).all(-1)
    rows = written.nonzero()[:, 0]
    fresh = torch.full_like(case.kv_cache, 0xFF)
    deq = layout.unpack(flat[rows], torch.float32)
    # re-quantizing the dequantized rows reproduces them exactly (scales and codes)
    tops.write_latent(fresh, deq[:, :96].to(DEVICE), deq[:, 96:].to(DEVICE), rows.to(DEVICE))
    assert torch.equal(fresh.cpu().view(-1, layout.width)[rows], flat[rows])
