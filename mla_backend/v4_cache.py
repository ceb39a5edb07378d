"""DeepSeek-V4's fp8 KV-cache page layout (vLLM's ``fp8_ds_mla`` cache for DeepSeek-V4): its
geometry, its validation, and the torch writer and reader of its rows.

This module owns the bytes of a V4 page and nothing above them: which token goes to which slot
(the engine's slot mapping and block table) and the attention that reads the rows are elsewhere.
DeepSeek-V3.2's 656-byte ``fp8_ds_mla`` row is :mod:`mla_backend.cache_layout`'s.

A token's row is :data:`V4_HEAD_DIM` = 512 values: :data:`V4_NOPE` = 448 "nope" values, then
:data:`V4_ROPE` = 64 "rope" values. Stored, a token takes :data:`V4_TOKEN_BYTES` = 584 bytes, in
two parts that a page keeps apart (vLLM's ``quantize_and_insert_k_cache`` Triton writer, its
fused C++ insert, and its ``dequantize_and_gather_k_cache`` reader; the docstring of
``vllm/v1/attention/backends/mla/flashmla_sparse.py``):

- a data row of :data:`V4_DATA_BYTES` = 576 bytes: the 448 nope values as float8_e4m3fn, then
  the 64 rope values as bfloat16 (128 bytes, little-endian);
- a scale row of :data:`V4_SCALE_BYTES` = 8 bytes: 7 UE8M0 exponent bytes, one per
  :data:`V4_TILE` = 64 nope values (the tile's scale is ``2^(byte - 127)``), then a pad byte 0.

A page of ``page_size`` tokens holds every token's data row first (token ``s`` at byte
``s * 576``), then every token's scale row (token ``s`` at byte ``page_size * 576 + s * 8``),
and is :func:`v4_page_bytes` long: ``page_size * 584`` rounded up to a multiple of 576 (the
decode kernel's TMA stride); the bytes past the scale rows are padding, never touched here.

The cache tensor (:func:`check_v4_cache`): uint8, a page per row, ``[num_pages, row_bytes]``
with contiguous bytes within a row and pages ``cache.stride(0)`` bytes apart (vLLM's 2-D view,
``kv_cache.view(num_pages, -1)``: rows of ``page_size * 584`` bytes, a stride of
:func:`v4_page_bytes`), or ``[num_pages, page_size, 584]`` (vLLM's bound SWA cache, ``[B, 1,
N, C]`` squeezed) with contiguous token rows, read as the former. Pages are always addressed
through ``cache.stride(0)``, which may exceed the page's bytes. A token's flat slot is ``page *
page_size + offset``.

Writer (:func:`write_v4_rows`), bit for bit vLLM's Triton writer on bf16 rows: per tile,
``amax = max(max |x|, 1e-4)``, ``exponent = ceil(log2(amax / 448))`` (exactly: from the
float32 quotient's exponent bits, no ``log2``), ``stored = e4m3(clamp(x / 2^exponent, -448,
448))`` rounded to nearest even, scale byte ``clamp(exponent + 127, 0, 255)``; rope copied as
bf16. Rows in fp32 or fp16 are rounded to bf16 first (round to nearest even), as vLLM's writer
only takes bf16 and its CPU insert (``fused_qnorm_rope_kv_insert_cpu``) round-trips through
bf16: the bytes are those of vLLM's writer given ``rows.bfloat16()``. Rows are assumed finite
(a NaN or inf gives unspecified bytes, as in vLLM).

Reader (:func:`read_v4_rows`): nope = ``float32(e4m3) * 2^(byte - 127)``, rope the stored bf16,
both then cast to the requested dtype (bf16: vLLM's gather reader, bit for bit).
"""

from __future__ import annotations

import torch

#: values in a token's row: nope then rope
V4_HEAD_DIM = 512
#: the e4m3 part (tile-scaled)
V4_NOPE = 448
#: the bf16 part (stored as is)
V4_ROPE = 64
#: nope values per UE8M0 scale byte
V4_TILE = 64
#: bytes of a token's data row: 448 e4m3 + 64 bf16
V4_DATA_BYTES = V4_NOPE + 2 * V4_ROPE
#: bytes of a token's scale row: 7 exponent bytes + 1 pad byte (0)
V4_SCALE_BYTES = 8
#: bytes a token takes in its page (data row + scale row)
V4_TOKEN_BYTES = V4_DATA_BYTES + V4_SCALE_BYTES
#: a page's length is a multiple of this (the decode kernel's TMA stride)
V4_PAGE_ALIGN = V4_DATA_BYTES
#: UE8M0 scale bytes holding a tile's exponent (the 8th byte of a scale row is the pad)
V4_TILES = V4_NOPE // V4_TILE
#: the dtypes of rows written and read
V4_ROW_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

_E4M3 = torch.float8_e4m3fn
_E4M3_MAX = 448.0
_AMAX_FLOOR = 1e-4  # vLLM: fmaxf(amax, 1e-4)
_SLOT_DTYPES = (torch.int32, torch.int64)
_SUPPORTED = (
    f"DeepSeek-V4's {V4_TOKEN_BYTES}-byte row ({V4_NOPE} e4m3 + {V4_ROPE} bf16 rope + "
    f"{V4_SCALE_BYTES} UE8M0 scale bytes)"
)
#: rows of other layouts a caller may hand over, by bytes per token -> what they are
_KNOWN_OTHER_ROWS = {
    528: "DeepSeek-V4.1's 528-byte fp8 row (MXFP8: all 512 values as e4m3, rope included, one "
    "UE8M0 scale per 32 values, pages rounded up to 512 bytes)",
    656: "DeepSeek-V3.2's 656-byte fp8_ds_mla row (512 e4m3, 4 float32 tile scales, 64 bf16 "
    "rope; mla_backend.cache_layout reads it)",
    352: "the 352-byte nvfp4_ds_mla row (DeepSeek-V3.2 dims, e2m1 values)",
    132: "the sparse indexer's 132-byte fp8 key row (128 e4m3 + a float32 scale), not an "
    "attention KV cache",
    68: "the sparse indexer's 68-byte MXFP4 key row (vLLM indexer_kv_dtype='mxfp4': 128 e2m1 + "
    "4 UE8M0 scales), not an attention KV cache",
}


def v4_page_bytes(page_size: int) -> int:
    """Bytes of a V4 page of ``page_size`` tokens: ``page_size * 584`` rounded up to a
    multiple of 576 (vLLM's page; the last bytes are padding)."""
    _check_page_size(page_size)
    used = page_size * V4_TOKEN_BYTES
    return -(-used // V4_PAGE_ALIGN) * V4_PAGE_ALIGN


def refuse_unsupported_v4_layout(bytes_per_token: int) -> None:
    """Refuse a cache row of ``bytes_per_token`` bytes that is not V4's 584-byte row, naming
    the layout when it is a known one (DeepSeek-V4.1's 528-byte MXFP8 row, V3.2's 656-byte
    ``fp8_ds_mla`` row, ``nvfp4_ds_mla``, the sparse indexer's fp8 / MXFP4 key rows).

    Raises:
        ValueError: unless ``bytes_per_token == 584``.
    """
    if bytes_per_token == V4_TOKEN_BYTES:
        return
    what = _KNOWN_OTHER_ROWS.get(bytes_per_token, f"a {bytes_per_token}-byte row")
    raise ValueError(f"{what} is not supported; supported: {_SUPPORTED}")


def check_v4_cache(cache: torch.Tensor, page_size: int) -> None:
    """Validate a V4 cache tensor for pages of ``page_size`` tokens (shapes, dtype and strides
    only; no data is read).

    Supported: uint8 ``[num_pages, row_bytes]`` with ``stride(1) == 1``, ``row_bytes >=
    page_size * 584`` (the data and scale rows) and, with more than one page, ``stride(0) >=
    v4_page_bytes(page_size)``; or uint8 ``[num_pages, page_size, 584]`` with contiguous token
    rows (``stride(2) == 1``, ``stride(1) == 584``) and the same page stride.

    Raises:
        ValueError: naming the value and what is supported (dtype, dims, strides, a row or page
            stride too small, ``page_size < 1``, another layout's row:
            :func:`refuse_unsupported_v4_layout`).
    """
    _page_rows(cache, page_size)


def encode_v4_rows(rows: torch.Tensor) -> torch.Tensor:
    """The stored bytes of tokens' rows, each as its data row then its scale row (contiguous
    here; a page keeps the two parts apart).

    Args:
        rows: [..., 512] bf16 / fp16 / fp32 (fp16 / fp32 rounded to bf16 first).
    Returns:
        [..., 584] uint8: bytes ``[0, 448)`` e4m3 nope, ``[448, 576)`` bf16 rope, ``[576,
        583)`` UE8M0 tile exponents, ``583`` the pad byte 0.
    """
    _check_rows(rows)
    x = rows.to(torch.bfloat16)
    nope = x[..., :V4_NOPE].float().unflatten(-1, (V4_TILES, V4_TILE))
    amax = nope.abs().amax(-1).clamp_min(_AMAX_FLOOR)
    mant, exp = torch.frexp(amax / _E4M3_MAX)  # quotient = mant * 2^exp, mant in [0.5, 1)
    exponent = exp - (mant == 0.5).to(exp.dtype)  # ceil(log2(quotient)), exactly
    scale = _pow2(exponent.clamp(-126, 127))
    q = (nope / scale.unsqueeze(-1)).clamp(-_E4M3_MAX, _E4M3_MAX).to(_E4M3)
    scale_bytes = (exponent + 127).clamp(0, 255).to(torch.uint8)
    pad = torch.zeros_like(scale_bytes[..., :1])
    rope = x[..., V4_NOPE:].contiguous().view(torch.uint8)
    return torch.cat([q.view(torch.uint8).flatten(-2), rope, scale_bytes, pad], -1)


def decode_v4_rows(token_bytes: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Tokens' rows from their stored bytes (:func:`encode_v4_rows`'s order).

    Args:
        token_bytes: [..., 584] uint8.
        dtype: bf16 / fp16 / fp32 of the result.
    Returns:
        [..., 512] ``dtype``: nope ``float32(e4m3) * 2^(byte - 127)`` per tile, rope the stored
        bf16, cast to ``dtype`` (bf16 / fp16: round to nearest even).
    """
    if token_bytes.dtype != torch.uint8 or token_bytes.shape[-1:] != (V4_TOKEN_BYTES,):
        raise ValueError(
            f"token bytes {token_bytes.dtype} {tuple(token_bytes.shape)} are not supported: "
            f"[..., {V4_TOKEN_BYTES}] uint8"
        )
    _check_dtype(dtype)
    nope = token_bytes[..., :V4_NOPE].contiguous().view(_E4M3).float()
    nope = nope.unflatten(-1, (V4_TILES, V4_TILE))
    exp_bytes = token_bytes[..., V4_DATA_BYTES : V4_DATA_BYTES + V4_TILES].int()
    nope = (nope * _pow2(exp_bytes - 127).unsqueeze(-1)).flatten(-2).to(dtype)
    rope = token_bytes[..., V4_NOPE:V4_DATA_BYTES].contiguous().view(torch.bfloat16).to(dtype)
    return torch.cat([nope, rope], -1)


def write_v4_rows(
    cache: torch.Tensor, page_size: int, slots: torch.Tensor, rows: torch.Tensor
) -> None:
    """Write tokens' rows into their slots of a V4 cache, in place (vLLM's writer, bit for bit;
    no host read of any tensor's data).

    Args:
        cache: the V4 cache (:func:`check_v4_cache`), uint8.
        page_size: tokens per page.
        slots: [N] int32 / int64 flat slots ``page * page_size + offset``; a negative slot is
            skipped (vLLM's -1). A slot past the cache is refused with ``torch._assert_async``
            (a RuntimeError on the CPU, a device-side assert on a GPU). Two rows with the same
            slot leave unspecified bytes there (as vLLM's writer does).
        rows: [N, 512] bf16 / fp16 / fp32 (fp16 / fp32 rounded to bf16 first).

    Only the written tokens' data and scale rows change; every other byte of the cache (other
    tokens, page padding, bytes past the page) is left as it was.
    """
    pages = _page_rows(cache, page_size)
    _check_rows(rows)
    if rows.dim() != 2:
        raise ValueError(
            f"rows {rows.dtype} {tuple(rows.shape)} is not supported: [N, {V4_HEAD_DIM}]"
        )
    n = rows.shape[0]
    _check_slots(slots, cache, "write_v4_rows")
    if slots.dim() != 1 or slots.shape[0] != n:
        raise ValueError(f"slots {tuple(slots.shape)} is not supported: [N={n}] (one slot per row)")
    if rows.device != cache.device:
        raise ValueError(f"rows are on {rows.device}, but the cache is on {cache.device}")
    if n == 0:
        return
    n_slots = pages.shape[0] * page_size
    s = slots.long()
    torch._assert_async((s < n_slots).all(), "write_v4_rows: a slot past the V4 cache's pages")
    if n_slots == 0:  # no pages: every slot is negative (else refused above)
        return
    keep = s >= 0
    # A skipped row stands in for the first kept row (its slot, its bytes): each target is
    # written with one value whatever the order, and no host read drops the skipped rows. When
    # no row is kept, each writes its target's current bytes back.
    first = torch.argmax(keep.to(torch.uint8))
    src = torch.where(keep, torch.arange(n, device=s.device), first)
    page, cols = _columns(s[src].clamp(0, max(n_slots - 1, 0)), page_size)
    page = page.expand_as(cols)
    vals = encode_v4_rows(rows)[src]
    vals = torch.where(keep.any(), vals, pages[page, cols])
    pages.index_put_((page, cols), vals)


def read_v4_rows(
    cache: torch.Tensor,
    page_size: int,
    slots: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Read tokens' rows from their slots of a V4 cache (no host read of any tensor's data).

    Args:
        cache: the V4 cache (:func:`check_v4_cache`), uint8.
        page_size: tokens per page.
        slots: [...] int32 / int64 flat slots ``page * page_size + offset``; a negative slot has
            no row: its output row is zeros. A slot past the cache is refused with
            ``torch._assert_async`` (a RuntimeError on the CPU, a device-side assert on a GPU).
        dtype: bf16 / fp16 / fp32 of the result.
    Returns:
        [..., 512] ``dtype`` (:func:`decode_v4_rows` of each slot's bytes).
    """
    pages = _page_rows(cache, page_size)
    _check_dtype(dtype)
    _check_slots(slots, cache, "read_v4_rows")
    s = slots.reshape(-1).long()
    n_slots = pages.shape[0] * page_size
    out_shape = (*slots.shape, V4_HEAD_DIM)
    if s.numel() == 0:
        return torch.zeros(out_shape, dtype=dtype, device=cache.device)
    torch._assert_async((s < n_slots).all(), "read_v4_rows: a slot past the V4 cache's pages")
    if n_slots == 0:  # no pages: every slot is negative (else refused above)
        return torch.zeros(out_shape, dtype=dtype, device=cache.device)
    page, cols = _columns(s.clamp(0, n_slots - 1), page_size)
    rows = decode_v4_rows(pages[page.expand_as(cols), cols], dtype)
    return rows.masked_fill((s < 0).unsqueeze(-1), 0).view(out_shape)


def _columns(slots: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Page [N, 1] and byte columns [N, 584] of the tokens at ``slots`` [N] (>= 0): the data
    row's 576 bytes, then the scale row's 8."""
    page, off = slots // page_size, slots % page_size
    dev = slots.device
    data = off.unsqueeze(1) * V4_DATA_BYTES + torch.arange(V4_DATA_BYTES, device=dev)
    scale = (
        page_size * V4_DATA_BYTES
        + off.unsqueeze(1) * V4_SCALE_BYTES
        + torch.arange(V4_SCALE_BYTES, device=dev)
    )
    return page.unsqueeze(1), torch.cat([data, scale], 1)


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """``2^exponent`` as float32, exactly, for int exponents in [-127, 128] (from the bits:
    ``2^-127`` is float32's subnormal ``1 << 22``, ``2^128`` is inf)."""
    e = exponent.int()
    bits = torch.where(e > -127, (e + 127) << 23, 1 << 22)
    return bits.view(torch.float32)


def _page_rows(cache: torch.Tensor, page_size: int) -> torch.Tensor:
    """The cache as ``[num_pages, row_bytes]`` (a view, pages ``stride(0)`` apart), validated
    (:func:`check_v4_cache`)."""
    _check_page_size(page_size)
    if not isinstance(cache, torch.Tensor):
        raise ValueError(f"cache {type(cache).__name__} is not supported: a uint8 tensor")
    if cache.dtype != torch.uint8:
        raise ValueError(
            f"V4 cache dtype {cache.dtype} is not supported: torch.uint8 (pages of {_SUPPORTED})"
        )
    if cache.dim() == 3:
        if cache.shape[2] != V4_TOKEN_BYTES:
            refuse_unsupported_v4_layout(cache.shape[2])
        if cache.shape[1] != page_size:
            raise ValueError(
                f"V4 cache [num_pages, page_size, {V4_TOKEN_BYTES}] of shape "
                f"{tuple(cache.shape)} does not hold page_size={page_size} tokens per page"
            )
        if cache.stride(2) != 1 or (page_size > 1 and cache.stride(1) != V4_TOKEN_BYTES):
            raise ValueError(
                f"V4 cache {tuple(cache.shape)} with strides {cache.stride()} is not supported: "
                f"each page's bytes contiguous (strides (page_stride, {V4_TOKEN_BYTES}, 1))"
            )
        pages = cache.view(cache.shape[0], page_size * V4_TOKEN_BYTES)
    elif cache.dim() == 2:
        pages = cache
    else:
        raise ValueError(
            f"V4 cache of {cache.dim()} dims {tuple(cache.shape)} is not supported: "
            f"[num_pages, page_bytes] uint8 (or [num_pages, page_size, {V4_TOKEN_BYTES}])"
        )
    if pages.stride(1) != 1 and pages.shape[1] > 1:
        raise ValueError(
            f"V4 cache with byte stride {pages.stride(1)} is not supported: contiguous bytes "
            "within a page (stride(1) == 1)"
        )
    used = page_size * V4_TOKEN_BYTES
    if pages.shape[1] < used:
        if pages.shape[1] in (page_size * 528, -(-page_size * 528 // 512) * 512):
            refuse_unsupported_v4_layout(528)
        raise ValueError(
            f"V4 cache row of {pages.shape[1]} bytes is too small for a page of "
            f"page_size={page_size} tokens: its data and scale rows take page_size * "
            f"{V4_TOKEN_BYTES} = {used} bytes (a page: v4_page_bytes = "
            f"{v4_page_bytes(page_size)})"
        )
    if pages.shape[0] > 1 and pages.stride(0) < v4_page_bytes(page_size):
        raise ValueError(
            f"V4 cache page stride {pages.stride(0)} bytes is smaller than a page of "
            f"page_size={page_size} tokens: v4_page_bytes = {v4_page_bytes(page_size)} "
            f"(page_size * {V4_TOKEN_BYTES} rounded up to a multiple of {V4_PAGE_ALIGN})"
        )
    return pages


def _check_page_size(page_size: int) -> None:
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size={page_size!r} is not supported: an int >= 1 (tokens a page)")


def _check_rows(rows: torch.Tensor) -> None:
    if rows.dtype not in V4_ROW_DTYPES or rows.dim() < 1 or rows.shape[-1] != V4_HEAD_DIM:
        raise ValueError(
            f"rows {rows.dtype} {tuple(rows.shape)} is not supported: [..., {V4_HEAD_DIM}] "
            f"bfloat16 / float16 / float32 ({V4_NOPE} nope + {V4_ROPE} rope)"
        )


def _check_slots(slots: torch.Tensor, cache: torch.Tensor, what: str) -> None:
    if slots.dtype not in _SLOT_DTYPES:
        raise ValueError(f"{what}: slots dtype {slots.dtype} is not supported: int32 / int64")
    if slots.device != cache.device:
        raise ValueError(f"{what}: slots are on {slots.device}, but the cache is on {cache.device}")


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in V4_ROW_DTYPES:
        raise ValueError(f"dtype {dtype} is not supported: bfloat16 / float16 / float32")
