"""The DSA indexer's key cache: its layouts (:class:`IndexCacheLayout`), what one page holds and
how a key is stored, for the lightning indexer of DeepSeek-V3.2 / GLM-5 (one key ``k_I`` of
``index_head_dim`` values per token, shared by every index head).

Kinds:

- ``fp8``: vLLM's ``DeepseekV32IndexerCache`` byte for byte. The cache is uint8
  ``[num_pages, page_size, W]`` with ``W = index_head_dim + 4 * index_head_dim /
  quant_block_size`` (132 at Di 128, block 128); the row view is only a shape: a page is one
  block of ``page_size * W`` bytes holding first every token's e4m3 values (token ``j`` of the
  page at bytes ``[j * Di, (j + 1) * Di)``), then every token's float32 scales (token ``j``'s
  ``Di / quant_block_size`` scales at byte ``page_size * Di + 4 * j * Di / quant_block_size``),
  as vLLM's ``indexer_k_quant_and_cache`` kernel writes it. Writer rule (that kernel's): per
  block of ``quant_block_size`` values ``scale = max(amax, 1e-4) / 448`` in fp32 (NaN values do
  not enter the amax), rounded up to a power of two when ``scale_fmt == "ue8m0"``
  (``2^ceil(log2(scale))``), ``stored = e4m3(x / scale)`` saturated to +-448, nearest even.
  The value read back is ``stored * scale``. A block holding +-inf gets scale inf and its
  values ``x / inf``: NaN for the infinite ones, +-0 for the others (read back NaN: ``0 * inf``).
- ``plain``: ``[num_pages, page_size, Di]`` keys in bfloat16 / float16 / float32 as given.

The layout is resolved once per call at the public entry points (:meth:`IndexCacheLayout.of`
from the cache tensor; engine adapters name theirs with :meth:`IndexCacheLayout.named`) and
handed to the kernel implementation. :meth:`encode` / :meth:`decode` / :meth:`page_views` are
the torch reference path's writer and reader.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .fp8 import FP8_DTYPE, FP8_MAX

#: vLLM's floor on a block's amax before the scale is taken
AMAX_FLOOR = 1e-4
#: the scale formats of the fp8 writer (None: amax / 448 as is)
SCALE_FMTS = (None, "ue8m0")
PLAIN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: engine names of index caches -> kind (``fp4`` and others are refused, naming these)
NAMES = {"fp8": "fp8", "fp8_e4m3": "fp8", "bfloat16": "plain", "float16": "plain",
         "float32": "plain"}  # fmt: skip
_NAME_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class IndexerDims:
    """The lightning indexer's dims of a DSA model (DeepSeek-V3.2 / GLM-5: 64 heads of 128,
    top 2048).

    Attributes:
        n_heads: index heads Hi (``index_n_heads``).
        head_dim: Di (``index_head_dim``), one key of Di values per token.
        topk: tokens each query token attends to (``index_topk``).
        compress_ratio: tokens per key: 1 for DSA (a key per token); DeepSeek-V4's CSA
            indexer scores compressed keys, one per 4 tokens (the token at position p sees keys
            ``0 .. (p + 1) // ratio - 1``; a page of its cache holds ``page_size / ratio``
            keys of the plan's ``page_size`` tokens).
    """

    n_heads: int
    head_dim: int
    topk: int
    compress_ratio: int = 1

    def __post_init__(self) -> None:
        for name in ("n_heads", "head_dim", "topk", "compress_ratio"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"indexer {name}={v!r} is not supported: it must be an int >= 1")

    @classmethod
    def from_config(cls, hf_config: object) -> IndexerDims | None:
        """The indexer's dims of a model config (a HF ``DeepseekV32Config`` / GLM-5 config or
        an engine's view of it: ``index_topk``, ``index_n_heads``, ``index_head_dim``); None for
        a dense MLA model (no ``index_topk``). Values it cannot serve raise ``ValueError``."""
        topk = getattr(hf_config, "index_topk", None)
        if topk is None:
            return None
        return cls(
            n_heads=getattr(hf_config, "index_n_heads", None),
            head_dim=getattr(hf_config, "index_head_dim", None),
            topk=topk,
        )


@dataclass(frozen=True)
class IndexCacheLayout:
    """One page of the indexer's key cache.

    Attributes:
        kind: ``"fp8"`` (vLLM's packed e4m3 + float32 scales, uint8 pages) or ``"plain"``.
        index_head_dim: Di, values per key.
        quant_block_size: values per float32 scale (``fp8``; 0 for ``plain``).
        dtype: the cache tensor's dtype (uint8 for ``fp8``).
        scale_fmt: ``None`` or ``"ue8m0"`` (``fp8``: power-of-two scales; the reader takes
            any stored scale).
    """

    kind: str
    index_head_dim: int
    quant_block_size: int
    dtype: torch.dtype
    scale_fmt: str | None = None

    def __post_init__(self) -> None:
        Di, qb = self.index_head_dim, self.quant_block_size
        if isinstance(Di, bool) or not isinstance(Di, int) or Di < 1:
            raise ValueError(f"index_head_dim={Di!r} is not supported: it must be an int >= 1")
        if self.kind == "fp8":
            if self.dtype != torch.uint8:
                raise ValueError(f"an fp8 index cache is uint8 pages, not {self.dtype}")
            if isinstance(qb, bool) or not isinstance(qb, int) or qb < 1 or Di % qb:
                raise ValueError(
                    f"index_head_dim {Di} is not a multiple of quant_block_size {qb!r}: the fp8 "
                    "index cache stores one float32 scale per whole block of a key"
                )
            if Di % 4:
                raise ValueError(
                    f"index_head_dim {Di} is not supported by the fp8 index cache: a page's "
                    "float32 scales start at page_size x Di bytes, which must be 4-aligned "
                    "(Di a multiple of 4)"
                )
            if self.scale_fmt not in SCALE_FMTS:
                raise ValueError(
                    f"scale_fmt={self.scale_fmt!r} is not supported; supported: {SCALE_FMTS}"
                )
        elif self.kind == "plain":
            if self.dtype not in PLAIN_DTYPES:
                raise ValueError(
                    f"a plain index cache holds bfloat16 / float16 / float32 keys, not "
                    f"{self.dtype}"
                )
        else:
            raise ValueError(f"index cache kind {self.kind!r} is not supported; use fp8 or plain")

    # ---- constructors --------------------------------------------------------------------
    @classmethod
    def of(
        cls, index_cache: torch.Tensor, index_head_dim: int, scale_fmt: str | None = None
    ) -> IndexCacheLayout:
        """The layout of a cache tensor [num_pages, page_size, W]: uint8 is ``fp8`` (its
        quant block read off the width, ``W = Di + 4 Di / quant_block_size``), bfloat16 /
        float16 / float32 ``plain``; anything else (an fp4 cache, fp8 keys without their
        scales, ...) is refused naming what is supported."""
        dt = index_cache.dtype
        if dt in PLAIN_DTYPES:
            return cls("plain", index_head_dim, 0, dt)
        if dt != torch.uint8:
            raise ValueError(
                f"index cache dtype {dt} is not supported; supported: uint8 (vLLM's fp8 index "
                "cache: e4m3 keys + float32 scales per page), bfloat16, float16, float32"
            )
        extra = index_cache.shape[-1] - index_head_dim if index_cache.dim() else -1
        nb = extra // 4
        if extra <= 0 or extra % 4 or index_head_dim % nb:
            raise ValueError(
                f"uint8 index cache of shape {tuple(index_cache.shape)} is not an fp8 index "
                f"cache of index_head_dim {index_head_dim}: its width must be Di + 4 x "
                "(scales per key), scales per key dividing Di (132 at Di 128, block 128)"
            )
        return cls("fp8", index_head_dim, index_head_dim // nb, dt, scale_fmt)

    @classmethod
    def named(
        cls,
        name: str,
        index_head_dim: int,
        quant_block_size: int = 128,
        scale_fmt: str | None = None,
    ) -> IndexCacheLayout:
        """The layout an engine names: ``fp8`` / ``fp8_e4m3`` (vLLM's packed cache), or
        ``bfloat16`` / ``float16`` / ``float32`` (plain keys). ``fp4`` (DeepSeek-V4's indexer
        cache) and other names are refused."""
        kind = NAMES.get(name)
        if kind is None:
            raise ValueError(
                f"index cache dtype {name!r} is not supported; supported: {', '.join(NAMES)}"
            )
        if kind == "fp8":
            return cls("fp8", index_head_dim, quant_block_size, torch.uint8, scale_fmt)
        return cls("plain", index_head_dim, 0, _NAME_DTYPES[name])

    # ---- sizes ---------------------------------------------------------------------------
    @property
    def scales_per_key(self) -> int:
        """float32 scales per key (``fp8``; 0 for ``plain``)."""
        return self.index_head_dim // self.quant_block_size if self.kind == "fp8" else 0

    @property
    def width(self) -> int:
        """The cache tensor's last dimension (elements of ``dtype``)."""
        return self.index_head_dim + 4 * self.scales_per_key

    @property
    def bytes_per_token(self) -> int:
        return self.width * self.dtype.itemsize

    # ---- the reference writer and reader ------------------------------------------------
    def quantize(self, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``fp8``: keys k [T, Di] (any float dtype) -> (e4m3 values as uint8 [T, Di], float32
        scales [T, Di / quant_block_size]) by vLLM's writer rule (module docstring)."""
        T, Di = k.shape
        qb = self.quant_block_size
        x = k.float().view(T, Di // qb, qb)
        ax = x.abs()
        amax = torch.where(torch.isnan(ax), 0.0, ax).amax(-1)  # fmaxf ignores NaN; inf stays
        scale = amax.clamp(min=AMAX_FLOOR) / FP8_MAX
        if self.scale_fmt == "ue8m0":
            scale = torch.exp2(torch.ceil(torch.log2(scale)))
        q = (x / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        return q.view(T, Di).view(torch.uint8), scale

    def encode(self, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Keys k [T, Di] as stored: ``fp8`` (values uint8 [T, Di], scales float32 [T, nb]);
        ``plain`` (k in ``dtype``, None)."""
        if self.kind == "fp8":
            return self.quantize(k)
        return k.to(self.dtype), None

    def decode(self, values: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
        """Stored keys back: values [L, Di] (uint8 e4m3 or the plain dtype), scales float32
        [L, nb] or None -> float32 [L, Di] (each block times its scale)."""
        if self.kind != "fp8":
            return values.float()
        L, Di = values.shape
        v = values.contiguous().view(FP8_DTYPE).float().view(L, -1, self.quant_block_size)
        return (v * scales.float()[..., None]).view(L, Di)

    def page_views(self, index_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Views of a cache [num_pages, page_size, W] (each page contiguous, any page stride):
        (values [num_pages, page_size, Di], scales float32 [num_pages, page_size, nb] or None).
        ``fp8``: the value block and the scale block of each page (module docstring)."""
        if self.kind != "fp8":
            return index_cache, None
        P, ps, W = index_cache.shape
        Di, nb = self.index_head_dim, self.scales_per_key
        s0, off = index_cache.stride(0), index_cache.storage_offset()
        values = index_cache.as_strided((P, ps, Di), (s0, Di, 1), off)
        f32 = index_cache.view(torch.float32)  # [P, ps, W / 4]
        scales = f32.as_strided((P, ps, nb), (s0 // 4, nb, 1), f32.storage_offset() + ps * Di // 4)
        return values, scales
