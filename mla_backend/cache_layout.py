"""The latent cache's layouts: what one token's row ``[c_kv ; k_pe]`` looks like in memory.

- ``plain``: ``[c_kv ; k_pe]`` in bf16/fp16/fp32, ``r + rope`` elements of the cache dtype.
- ``fp8``: the same in float8_e4m3fn with one per-tensor float32 scale (``kv_scale``).
- ``fp8_ds_mla``: DeepSeek's tile-scaled layout (FlashMLA; vLLM's ``--kv-cache-dtype
  fp8_ds_mla``), a uint8 row per token: ``c_kv`` as e4m3 in tiles of :data:`FP8_TILE` values,
  then one float32 scale per tile (the tile's own max / 448, per token), then ``k_pe``
  unquantized in the compute dtype. At DeepSeek dims (r 512, rope 64, bf16):
  512 + 4*4 + 64*2 = 656 bytes per token (bf16: 1152; per-tensor fp8: 576).

  Bytes of a row, for any r and rope: ``[0, r)`` e4m3 values; ``[s0, s0 + 4 * tiles)`` the
  float32 scales, with ``s0 = r`` rounded up to 4 (aligned floats; equal to r when r % 4 == 0,
  as at every DeepSeek dim); then ``rope`` values of the compute dtype. The last tile may be
  partial (``tiles = ceil(r / 128)``).

  Writer, bit for bit as vLLM's ``concat_and_cache_ds_mla`` kernel: ``scale = max(amax /
  448, FLT_MIN)`` stored as is (FlashMLA's reference quantizer rounds it up to a power of
  two: both are read correctly, since the scale is stored), ``stored = e4m3(clamp(value /
  scale, -448, 448))`` rounded to nearest even, ``k_pe`` copied verbatim.

A uint8 cache is read as ``fp8_ds_mla``; the compute dtype (queries at read, ``k_pe`` at write)
gives the rope part's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .fp8 import FP8_DTYPE, FP8_MAX

#: c_kv values per float32 scale in ``fp8_ds_mla``.
FP8_TILE = 128
_FLT_MIN = float(torch.finfo(torch.float32).tiny)
PLAIN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class CacheLayout:
    """One token's row of the latent cache.

    Attributes:
        kind: ``"plain"``, ``"fp8"`` or ``"fp8_ds_mla"``.
        kv_lora_rank: r; rope: qk_rope_head_dim.
        dtype: the cache tensor's dtype (uint8 for ``fp8_ds_mla``).
        rope_dtype: dtype of the stored k_pe (``fp8_ds_mla``: the compute dtype).
    """

    kind: str
    kv_lora_rank: int
    rope: int
    dtype: torch.dtype
    rope_dtype: torch.dtype

    @classmethod
    def of(
        cls, kv_cache: torch.Tensor, r: int, rope: int, compute_dtype: torch.dtype
    ) -> CacheLayout:
        """The layout of a cache tensor [pages, page_size, width] for these dims."""
        if kv_cache.dtype == torch.uint8:
            return cls("fp8_ds_mla", r, rope, torch.uint8, compute_dtype)
        kind = "fp8" if kv_cache.dtype == FP8_DTYPE else "plain"
        return cls(kind, r, rope, kv_cache.dtype, kv_cache.dtype)

    @classmethod
    def ds_mla(cls, r: int, rope: int, compute_dtype: torch.dtype) -> CacheLayout:
        return cls("fp8_ds_mla", r, rope, torch.uint8, compute_dtype)

    @property
    def tiles(self) -> int:
        return -(-self.kv_lora_rank // FP8_TILE)

    @property
    def scale_offset(self) -> int:
        """Byte offset of the float32 tile scales (``fp8_ds_mla``)."""
        return -(-self.kv_lora_rank // 4) * 4

    @property
    def rope_offset(self) -> int:
        """Byte offset of k_pe (``fp8_ds_mla``)."""
        return self.scale_offset + 4 * self.tiles

    @property
    def width(self) -> int:
        """The cache tensor's last dimension (elements of ``dtype``)."""
        if self.kind == "fp8_ds_mla":
            return self.rope_offset + self.rope * self.rope_dtype.itemsize
        return self.kv_lora_rank + self.rope

    @property
    def bytes_per_token(self) -> int:
        return self.width * self.dtype.itemsize

    def pack(self, c_kv: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
        """``fp8_ds_mla`` rows of T tokens: c_kv [T, r], k_pe [T, rope] -> uint8 [T, width]."""
        T, r = c_kv.shape
        tiles = self.tiles
        x = c_kv.float()
        padded = torch.nn.functional.pad(x, (0, tiles * FP8_TILE - r)).view(T, tiles, FP8_TILE)
        scale = (padded.abs().amax(-1) / FP8_MAX).clamp(min=_FLT_MIN)  # [T, tiles] float32
        q = (padded / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        out = torch.zeros(T, self.width, dtype=torch.uint8, device=c_kv.device)
        out[:, :r] = q.view(T, -1)[:, :r].view(torch.uint8)
        out[:, self.scale_offset : self.rope_offset] = scale.view(torch.uint8).view(T, 4 * tiles)
        if self.rope:
            rope_bytes = k_pe.to(self.rope_dtype).contiguous().view(torch.uint8)
            out[:, self.rope_offset :] = rope_bytes.view(T, -1)
        return out

    def unpack(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``fp8_ds_mla`` rows uint8 [L, width] -> [L, r + rope] in ``dtype`` (each tile times
        its own scale; k_pe as stored)."""
        L = rows.shape[0]
        r = self.kv_lora_rank
        vals = rows[:, :r].contiguous().view(FP8_DTYPE).float()
        scales = rows[:, self.scale_offset : self.rope_offset].contiguous().view(torch.float32)
        scale_per_col = scales.repeat_interleave(FP8_TILE, dim=1)[:, :r]
        out = torch.empty(L, r + self.rope, dtype=dtype, device=rows.device)
        out[:, :r] = vals * scale_per_col
        if self.rope:
            rope = rows[:, self.rope_offset :].contiguous().view(self.rope_dtype)
            out[:, r:] = rope
        return out
