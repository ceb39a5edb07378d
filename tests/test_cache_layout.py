"""The fp8_ds_mla cache layout (DeepSeek's tile-scaled e4m3, vLLM's ``fp8_ds_mla``): bytes,
write/read round trip bit for bit against a quantizer written out here, and every path's
attention against the oracle over the dequantized cache."""

from __future__ import annotations

import struct

import pytest
import torch

import mla_backend as mb
from mla_backend.cache_layout import FP8_TILE, CacheLayout
from mla_backend.testing.cases import assert_close_to_oracle, make_case


def test_deepseek_dims_take_656_bytes() -> None:
    lay = CacheLayout.ds_mla(512, 64, torch.bfloat16)
    assert (lay.width, lay.bytes_per_token, lay.tiles) == (656, 656, 4)
    assert (lay.scale_offset, lay.rope_offset) == (512, 528)
    assert CacheLayout.ds_mla(512, 64, torch.float32).bytes_per_token == 784
    assert CacheLayout.ds_mla(200, 0, torch.bfloat16).width == 200 + 2 * 4
    assert CacheLayout.ds_mla(202, 32, torch.bfloat16).scale_offset == 204  # aligned floats


def _quantize_token(x: list[float], rope: list[float], r: int) -> bytes:
    """One token's row written out with struct and torch scalars only (bit for bit)."""
    tiny = struct.unpack("<f", struct.pack("<I", 0x00800000))[0]  # FLT_MIN
    vals, scales = b"", b""
    for j0 in range(0, r, FP8_TILE):
        tile = x[j0 : j0 + FP8_TILE]
        amax = max(abs(v) for v in tile)
        scale = struct.unpack("<f", struct.pack("<f", amax / 448.0))[0]  # fp32 division
        scale = max(scale, tiny)
        for v in tile:
            q = torch.tensor(v / scale, dtype=torch.float32).clamp(-448, 448)
            vals += bytes([q.to(torch.float8_e4m3fn).view(torch.uint8).item()])
        scales += struct.pack("<f", scale)
    pad = b"\0" * ((-r) % 4)
    rope_b = torch.tensor(rope, dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
    return vals + pad + scales + rope_b


@pytest.mark.parametrize("r,rope", [(512, 64), (96, 32), (200, 0), (130, 16)])
@pytest.mark.parametrize("impl", ["torch", "auto"])
def test_write_matches_independent_quantizer_bit_for_bit(r: int, rope: int, impl: str) -> None:
    g = torch.Generator().manual_seed(r + rope)
    T = 5
    # magnitudes spanning 1e-3..1e2 across tiles, one all-zero tile, exact-halfway values
    c_kv = (torch.randn(T, r, generator=g) * torch.logspace(-3, 2, r)).to(torch.bfloat16)
    c_kv[1, :FP8_TILE] = 0
    k_pe = torch.randn(T, rope, generator=g).to(torch.bfloat16)
    lay = CacheLayout.ds_mla(r, rope, torch.bfloat16)
    cache = torch.full((3, 4, lay.width), 0xAB, dtype=torch.uint8)
    slots = torch.tensor([5, -1, 0, 11, 7])
    mb.write_latent(cache, c_kv, k_pe, slots, impl=None if impl == "auto" else impl)
    flat = cache.view(-1, lay.width)
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        want = _quantize_token(c_kv[t].float().tolist(), k_pe[t].float().tolist(), r)
        got = flat[slot].numpy().tobytes()
        if (-r) % 4:  # padding bytes between values and scales are not part of the format
            got = got[:r] + b"\0" * ((-r) % 4) + got[lay.scale_offset :]
        assert got == want, f"token {t} slot {slot} differs"
    untouched = [i for i in range(12) if i not in (5, 0, 11, 7)]
    assert (flat[untouched] == 0xAB).all()
    # read back: every tile times its own scale, k_pe verbatim
    back = lay.unpack(flat[[5, 0, 11, 7]], torch.float32)
    from mla_backend.testing.cases import ds_mla_dequantized

    rows = [0, 2, 3, 4]
    torch.testing.assert_close(back[:, :r], ds_mla_dequantized(c_kv[rows]), rtol=0, atol=0)
    torch.testing.assert_close(back[:, r:], k_pe[rows].float(), rtol=0, atol=0)


def test_tile_scales_keep_small_tiles_accurate() -> None:
    """A per-tensor scale flushes a small-magnitude tile; per-tile scales keep it."""
    g = torch.Generator().manual_seed(0)
    c = torch.cat(
        [torch.randn(1, 128, generator=g) * 1e-3, torch.randn(1, 128, generator=g) * 100.0], -1
    )
    lay = CacheLayout.ds_mla(256, 0, torch.float32)
    back = lay.unpack(lay.pack(c, torch.zeros(1, 0)), torch.float32)
    rel = ((back - c).abs() / c.abs().clamp(min=1e-6))[0, :128].median()
    assert rel < 0.07
    per_tensor = (c / (c.abs().max() / 448)).clamp(-448, 448).to(mb.FP8_DTYPE).float()
    per_tensor = per_tensor * (c.abs().max() / 448)
    assert ((per_tensor - c).abs() / c.abs())[0, :128].median() > 0.3


BATCHES = {
    "decode": ([40, 7, 300], [1, 1, 1]),
    "extend": ([17, 0, 64], [5, 12, 9]),
    "mixed": ([0, 50, 12], [23, 1, 4]),
}


@pytest.mark.parametrize(
    "dims",
    [(3, 512, 16, 64, 16), (2, 96, 8, 32, 8), (4, 200, 8, 0, 8)],
    ids=["r512", "r96", "r200_norope"],
)
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("path", ["absorb", "normal"])
def test_paths_over_ds_mla_cache_match_oracle(dims, page_size, batch, path) -> None:
    prefix, new = BATCHES[batch]
    d = mb.MLADims(*dims)
    case = make_case(d, prefix, new, page_size, dtype=torch.bfloat16, cache_dtype=torch.uint8)
    assert case.kv_cache.dtype == torch.uint8
    out = mb.MLAAttention(d, case.weights)(case.q_nope, case.q_pe, case.kv_cache, case.plan(path))
    assert_close_to_oracle(out, case.oracle(), torch.bfloat16)


def test_ds_mla_rejects_a_scale_and_a_wrong_width() -> None:
    case = make_case(
        mb.MLADims(2, 128, 8, 16, 8), [3], [1], 4, dtype=torch.bfloat16, cache_dtype=torch.uint8
    )
    q_lat = torch.zeros(1, 2, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="kv_scale is only meaningful .* not fp8_ds_mla"):
        mb.absorbed_attention(q_lat, case.q_pe, case.kv_cache, case.plan(), 1.0, torch.ones(()))
    with pytest.raises(ValueError, match=r"164 bytes \(fp8_ds_mla rows"):
        mb.absorbed_attention(q_lat, case.q_pe, case.kv_cache[..., :100], case.plan(), 1.0)
