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

The layout is resolved once per call, at the public entry points (:meth:`CacheLayout.of`, from
the cache tensor; the engine adapters name theirs with :meth:`CacheLayout.named`), and handed to
the kernel implementation, which never looks at dtypes or names again: its decisions read the
layout's properties (``tile_scaled``, ``per_tensor_scale``) and the torch reference path its
:meth:`~CacheLayout.encode` / :meth:`~CacheLayout.decode`.

A new layout: a ``kind`` here (its row's width, :meth:`of` / :meth:`named`, ``encode`` /
``decode``), then its reader and writer in each implementation that reads it in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .fp8 import FP8_DTYPE, FP8_MAX

#: c_kv values per float32 scale in ``fp8_ds_mla``.
FP8_TILE = 128
_FLT_MIN = float(torch.finfo(torch.float32).tiny)
PLAIN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: kinds, by the cache tensor's dtype (anything else plain)
_KIND_OF_DTYPE = {torch.uint8: "fp8_ds_mla", FP8_DTYPE: "fp8"}
#: every cache tensor dtype a layout reads, and how errors name them
CACHE_DTYPES = PLAIN_DTYPES + tuple(_KIND_OF_DTYPE)
CACHE_DTYPES_TEXT = (
    "bfloat16, float16, float32, float8_e4m3fn (per-tensor scale), uint8 (fp8_ds_mla)"
)
#: engine names of cache dtypes (vLLM's ``--kv-cache-dtype``) -> kind; "auto" and the plain
#: dtype names are plain in the model's dtype
ENGINE_NAMES = {
    "auto": "plain",
    "bfloat16": "plain",
    "float16": "plain",
    "fp8": "fp8",
    "fp8_e4m3": "fp8",
    "fp8_ds_mla": "fp8_ds_mla",
}
_PLAIN_NAME_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


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
        """The layout of a cache tensor [pages, page_size, width] for these dims (``fp8_ds_mla``
        keeps k_pe in ``compute_dtype``)."""
        return cls.for_dtype(kv_cache.dtype, r, rope, compute_dtype)

    @classmethod
    def for_dtype(
        cls, dtype: torch.dtype, r: int, rope: int, compute_dtype: torch.dtype
    ) -> CacheLayout:
        """The layout of a cache of ``dtype`` (uint8: ``fp8_ds_mla``, k_pe in
        ``compute_dtype``)."""
        kind = _KIND_OF_DTYPE.get(dtype, "plain")
        if kind == "fp8_ds_mla":
            return cls.ds_mla(r, rope, compute_dtype)
        return cls(kind, r, rope, dtype, dtype)

    @classmethod
    def named(cls, name: str, r: int, rope: int, model_dtype: torch.dtype) -> CacheLayout:
        """The layout an engine names (vLLM's ``--kv-cache-dtype``: :data:`ENGINE_NAMES`) for
        these dims and model dtype."""
        kind = ENGINE_NAMES.get(name)
        if kind is None:
            raise ValueError(
                f"kv cache dtype {name!r} is not supported; supported: {', '.join(ENGINE_NAMES)}"
            )
        if kind == "fp8_ds_mla":
            return cls.ds_mla(r, rope, model_dtype)
        dtype = FP8_DTYPE if kind == "fp8" else _PLAIN_NAME_DTYPES.get(name, model_dtype)
        return cls(kind, r, rope, dtype, dtype)

    @classmethod
    def ds_mla(cls, r: int, rope: int, compute_dtype: torch.dtype) -> CacheLayout:
        return cls("fp8_ds_mla", r, rope, torch.uint8, compute_dtype)

    @staticmethod
    def name_is_tile_scaled(name: str) -> bool:
        """Whether an engine's cache dtype name (:data:`ENGINE_NAMES`) is a tile-scaled layout
        (its rows' size then depends on the dims and model dtype: :attr:`bytes_per_token`)."""
        return ENGINE_NAMES.get(name) == "fp8_ds_mla"

    @property
    def tile_scaled(self) -> bool:
        """Rows carry their own per-tile scales (``fp8_ds_mla``): no ``kv_scale``."""
        return self.kind == "fp8_ds_mla"

    @property
    def per_tensor_scale(self) -> bool:
        """Stored values times one per-tensor ``kv_scale`` (``fp8``)."""
        return self.kind == "fp8"

    def check_query_dtype(self, query_dtype: torch.dtype) -> None:
        """Attention reads a plain cache in the queries' dtype (fp8 caches are widened to any):
        ``ValueError`` naming both where a plain cache holds another dtype. Engines call it at
        start-up with the model's dtype; every attention entry point with its queries'."""
        if self.kind == "plain" and self.dtype != query_dtype:
            raise ValueError(
                f"a {self.dtype} latent cache with {query_dtype} queries is not supported: a "
                "plain cache holds the model's dtype (kv cache dtype 'auto'); fp8 caches "
                "(fp8, fp8_ds_mla) serve any model dtype"
            )

    @property
    def storage_dtype(self) -> torch.dtype:
        """The dtype rows are copied as (1-byte kinds as raw bytes)."""
        return torch.uint8 if self.dtype.itemsize == 1 else self.dtype

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

    def encode(
        self, c_kv: torch.Tensor, k_pe: torch.Tensor, kv_scale: torch.Tensor | None
    ) -> torch.Tensor:
        """Rows of T tokens as stored, viewed as :attr:`storage_dtype`: c_kv [T, r], k_pe
        [T, rope] -> [T, width] (the torch reference writer; fp8 stores ``value / kv_scale``
        saturated to +-448)."""
        if self.tile_scaled:
            return self.pack(c_kv, k_pe)
        row = torch.cat([c_kv, k_pe], dim=-1) if k_pe.shape[-1] else c_kv
        if not self.per_tensor_scale:
            return row.to(self.dtype)
        if kv_scale is not None:
            row = row.float() / kv_scale.float()
        return row.float().clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(torch.uint8)

    def decode(
        self, rows: torch.Tensor, dtype: torch.dtype, kv_scale: torch.Tensor | None
    ) -> torch.Tensor:
        """Rows as stored [L, width] -> [L, r + rope] in ``dtype``: tiles times their own
        scales (``fp8_ds_mla``), values times ``kv_scale`` (a tensor: never read on the host)."""
        if self.tile_scaled:
            return self.unpack(rows, dtype)
        if kv_scale is None:
            return rows if rows.dtype == dtype else rows.to(dtype)
        return (rows.float() * kv_scale.float()).to(dtype)

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
