"""DeepSeek-V4's KV compressor, engine-neutral: the per-token state it keeps across steps and the
compressed entries it emits (torch; runs on any device torch runs on).

What it computes (DeepSeek-V4, transformers' ``DeepseekV4{CSA,HCA}Compressor``): with
``C = kv_proj(x)`` and ``Z = gate_proj(x)`` per token (width ``coff * d``; ``coff`` = 2 with
``overlap``, else 1) and a learned position bias ``B`` [ratio, coff * d], entry ``w`` of a request
pools the tokens of its window per channel::

    HCA (no overlap):  slots  = positions w*m .. w*m + m - 1           (C, Z + B)
    CSA (overlap):     slots  = positions (w-1)*m .. w*m - 1, first d channels  (Ca, Za + Ba)
                              + positions w*m .. w*m + m - 1, last d channels  (Cb, Zb + Bb)
                       (w = 0: the first half is empty: weight 0)
    entry_w = RoPE_{w*m}( RMSNorm( sum_slots softmax_slots(Z + B) * C ) )   (fp32, per channel)

with ``m`` = ratio, RMSNorm weighted (``norm_weight``, ``eps``), and interleaved (GPT-J) RoPE on the
last ``rope_dim`` channels at position ``w * m``. Entry ``w`` exists once the token at position
``w*m + m - 1`` has been seen; the token at position p sees entries ``w < (p + 1) // m``.

The state is what vLLM keeps (its ``CompressorStateCache``): per token, ``[C ; Z + B[p % m]]``
in fp32, ``2 * coff * d`` wide, in a paged cache addressed by position through the request's
block table, so the rows of the last ``coff * m`` positions before a step must still be there
(an engine with a sliding-window allocator keeps just those). A step then

1. :func:`save_states`: writes every new token's row at its slot (``-1`` = skip), and
2. :func:`compress`: for each entry a token of the step completes (:func:`schedule`, once per
   step, from the batch's host lengths), gathers its window's rows, pools, normalizes, rotates.

The caller writes the entries into the compressed cache (``write_latent``, or the index-key
writer for the indexer's 128-wide compressor).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .batch import MLABatch
from .rope import rope_interleaved

__all__ = [
    "CompressSchedule",
    "CompressorSpec",
    "compress",
    "compress_slots",
    "save_states",
    "schedule",
]

#: rows gathered per chunk of entries in :func:`compress` (bounds its scratch memory)
_GATHER_ROWS = 1 << 16


@dataclass(frozen=True)
class CompressorSpec:
    """One compressor's shape.

    Attributes:
        ratio: tokens per entry ``m`` (V4: 4 for CSA layers, 128 for HCA layers).
        head_dim: ``d``, the entry width (512 for attention rows, 128 for the indexer's keys).
        overlap: two series over overlapping windows of ``2 * m`` (V4: CSA) or one (HCA).
        rope_dim: RoPE'd trailing channels of an entry (V4: 64), even, <= ``head_dim``.
        eps: the RMSNorm epsilon.
    """

    ratio: int
    head_dim: int
    overlap: bool
    rope_dim: int = 64
    eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in ("ratio", "head_dim"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"compressor {name}={v!r} is not supported: an int >= 1")
        r = self.rope_dim
        if isinstance(r, bool) or not isinstance(r, int) or r < 0 or r % 2 or r > self.head_dim:
            raise ValueError(
                f"compressor rope_dim={r!r} is not supported: an even int in 0..head_dim "
                f"({self.head_dim})"
            )
        if not self.eps > 0:
            raise ValueError(f"compressor eps={self.eps!r} is not supported: > 0")

    @property
    def coff(self) -> int:
        """Series per token: 2 with overlap, else 1."""
        return 2 if self.overlap else 1

    @property
    def state_width(self) -> int:
        """A state row's width: ``[C ; Z + B]``, ``2 * coff * d`` fp32 values."""
        return 2 * self.coff * self.head_dim

    @property
    def window(self) -> int:
        """Positions an entry pools: ``coff * ratio``."""
        return self.coff * self.ratio


@dataclass(frozen=True, eq=False)
class CompressSchedule:
    """The entries a step's tokens complete, for one ratio (made by :func:`schedule`).

    Attributes:
        ratio: the compressor's ``m``.
        tokens: [E] int64 query rows (of the step's ``[T, ...]`` tensors) completing an entry.
        reqs: [E] int64 their requests (rows of the block tables).
        entries: [E] int64 entry numbers ``w`` (per request; the token is at ``w*m + m - 1``).
        num_entries: per request, entries that exist after the step (``kv_len // m``; host).
        num_entries_t: [B] int32, the same on the device.
    """

    ratio: int
    tokens: torch.Tensor
    reqs: torch.Tensor
    entries: torch.Tensor
    num_entries: tuple[int, ...]
    num_entries_t: torch.Tensor

    @property
    def num_emitted(self) -> int:
        return int(self.tokens.shape[0])


def schedule(
    batch: MLABatch, ratio: int, device: torch.device | str | None = None
) -> CompressSchedule:
    """The entries ``batch``'s tokens complete at compression ratio ``ratio`` (host lengths only;
    once per step and ratio), on ``device`` (default: the block table's)."""
    if isinstance(ratio, bool) or not isinstance(ratio, int) or ratio < 1:
        raise ValueError(f"compression ratio={ratio!r} is not supported: an int >= 1")
    dev = batch.block_table.device if device is None else torch.device(device)
    tokens: list[int] = []
    reqs: list[int] = []
    entries: list[int] = []
    for i, (p0, n) in enumerate(zip(batch.prefix_lens, batch.new_lens, strict=True)):
        # positions p0 .. p0 + n - 1 complete entries w with w*m + m - 1 in that range
        first, last = -(-(p0 + 1) // ratio) - 1, (p0 + n) // ratio - 1
        for w in range(max(first, 0), last + 1):
            tokens.append(batch.cu_new[i] + w * ratio + ratio - 1 - p0)
            reqs.append(i)
            entries.append(w)
    num = tuple((p + n) // ratio for p, n in zip(batch.prefix_lens, batch.new_lens, strict=True))

    def t(v: list[int] | tuple[int, ...], dtype: torch.dtype = torch.long) -> torch.Tensor:
        return torch.tensor(v, dtype=dtype, device=dev)

    return CompressSchedule(ratio, t(tokens), t(reqs), t(entries), num, t(num, torch.int32))


def _check_state_cache(state_cache: torch.Tensor, spec: CompressorSpec) -> None:
    if (
        state_cache.dtype != torch.float32
        or state_cache.dim() != 3
        or state_cache.shape[2] != spec.state_width
        or state_cache.stride(2) != 1
        or state_cache.stride(1) != spec.state_width
        or state_cache.stride(0) < state_cache.shape[1] * spec.state_width
    ):
        raise ValueError(
            f"compressor state cache {state_cache.dtype} {tuple(state_cache.shape)} strides "
            f"{state_cache.stride()} is not supported: [pages, page_size, {spec.state_width}] "
            "float32 with contiguous rows of a page (2 x coff x head_dim: [C ; Z + B]), pages "
            "apart by at least their rows"
        )


def save_states(
    kv: torch.Tensor,
    score: torch.Tensor,
    ape: torch.Tensor,
    positions: torch.Tensor,
    state_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    spec: CompressorSpec,
) -> None:
    """Write each token's state row ``[C ; Z + B[p % m]]`` (fp32) at its slot.

    Args:
        kv / score: [T, coff * d] ``C`` / ``Z`` (any float dtype).
        ape: [ratio, coff * d] the position bias ``B`` (float).
        positions: [T] int32 / int64 token positions.
        state_cache: [pages, page_size, 2 * coff * d] float32.
        slot_mapping: [T] int32 / int64 ``page * page_size + offset`` per token, -1 = skip.
    """
    _check_state_cache(state_cache, spec)
    cw = spec.coff * spec.head_dim
    T = kv.shape[0] if kv.dim() == 2 else -1
    for name, x in (("kv", kv), ("score", score)):
        if x.dim() != 2 or tuple(x.shape) != (T, cw) or not x.dtype.is_floating_point:
            raise ValueError(
                f"compressor {name} {x.dtype} {tuple(x.shape)} is not supported: [T, {cw}] "
                "float (coff x head_dim)"
            )
    if tuple(ape.shape) != (spec.ratio, cw) or not ape.dtype.is_floating_point:
        raise ValueError(
            f"compressor ape {ape.dtype} {tuple(ape.shape)} is not supported: "
            f"[ratio={spec.ratio}, {cw}] float"
        )
    for name, x in (("positions", positions), ("slot_mapping", slot_mapping)):
        if x.dim() != 1 or x.shape[0] != T or x.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"compressor {name} {x.dtype} {tuple(x.shape)} is not supported: [T={T}] "
                "int32 / int64"
            )
    ps = state_cache.shape[1]
    n_slots = state_cache.shape[0] * ps
    slots = slot_mapping.long()
    keep = slots >= 0
    torch._assert_async(
        (slots < n_slots).all(), "compressor slot_mapping: a slot past the state cache's rows"
    )
    new = torch.cat([kv.float(), score.float() + ape.float()[positions.long() % spec.ratio]], 1)
    at = slots.clamp(0, max(n_slots - 1, 0))[keep]  # (page, offset) pairs: any page stride
    state_cache.index_put_((at // ps, at % ps), new[keep])


def compress(
    state_cache: torch.Tensor,
    block_table: torch.Tensor,
    sched: CompressSchedule,
    spec: CompressorSpec,
    norm_weight: torch.Tensor,
    cos_sin: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The entries the step completes (after :func:`save_states` of the step's tokens).

    Args:
        state_cache: [pages, page_size, 2 * coff * d] float32 (holding the rows of every
            position of each entry's window).
        block_table: [B, max_pages] int32 / int64 pages of each request's state rows, by
            position (the plan's request order).
        sched: the step's :class:`CompressSchedule` at ``spec.ratio``.
        norm_weight: [d] the RMSNorm weight.
        cos_sin: [P, rope_dim] float, RoPE table by position (cos of each pair, then sin; the
            layout of vLLM's ``cos_sin_cache``), P > every entry's position ``w * m``.
        out: optional [E, d] float32 buffer.
    Returns:
        [E, d] float32: row e is entry ``sched.entries[e]`` of request ``sched.reqs[e]``.
    """
    _check_state_cache(state_cache, spec)
    d, m, win = spec.head_dim, spec.ratio, spec.window
    if sched.ratio != m:
        raise ValueError(f"schedule of ratio {sched.ratio} for a compressor of ratio {m}")
    _check_pool_args(spec, norm_weight, cos_sin)
    if block_table.dim() != 2 or block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"compressor block_table {block_table.dtype} {tuple(block_table.shape)} is not "
            "supported: [B, pages] int32 / int64"
        )
    E = sched.num_emitted
    dev = state_cache.device
    if out is None:
        out = torch.empty((E, d), dtype=torch.float32, device=dev)
    elif out.dtype != torch.float32 or tuple(out.shape) != (E, d):
        raise ValueError(f"out {out.dtype} {tuple(out.shape)}: expected [{E}, {d}] float32")
    if E == 0:
        return out
    ps = state_cache.shape[1]
    bt = block_table.long()
    torch._assert_async(
        (sched.entries.max() * m + m <= bt.shape[1] * ps),
        "compressor: an entry's window lies past the block table's pages",
    )
    offs = torch.arange(win, device=dev) - (spec.coff - 1) * m  # window offsets from w * m
    pos = sched.entries.unsqueeze(1) * m + offs  # [E, win]
    p = pos.clamp(min=0)
    slots = bt[sched.reqs.unsqueeze(1), p // ps] * ps + p % ps
    torch._assert_async(
        ((slots >= 0) | (pos < 0)).all(), "compressor: a negative page in the block table"
    )
    slots = torch.where(pos >= 0, slots, -1)
    return _pool(state_cache, slots, sched.entries * m, spec, norm_weight, cos_sin, out)


def compress_slots(
    state_cache: torch.Tensor,
    window_slots: torch.Tensor,
    entry_pos: torch.Tensor,
    spec: CompressorSpec,
    norm_weight: torch.Tensor,
    cos_sin: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Entries from their windows' state rows named by flat slots (an engine that resolves the
    slots itself, e.g. vLLM's ``gather_slots``; :func:`compress` resolves them from a block
    table).

    Args:
        state_cache: [pages, page_size, 2 * coff * d] float32.
        window_slots: [E, coff * m] int32 / int64 flat state slots of each entry's window in
            position order (``w*m - (coff-1)*m .. w*m + m - 1``), -1 where the position is
            before the sequence (weight 0).
        entry_pos: [E] int32 / int64 the entries' positions ``w * m`` (where RoPE rotates them).
        norm_weight / cos_sin / out: as :func:`compress`.
    Returns:
        [E, d] float32.
    """
    _check_state_cache(state_cache, spec)
    E, win = window_slots.shape[0], spec.window
    if (
        window_slots.dim() != 2
        or window_slots.shape[1] != win
        or window_slots.dtype not in (torch.int32, torch.int64)
    ):
        raise ValueError(
            f"compressor window_slots {window_slots.dtype} {tuple(window_slots.shape)} is not "
            f"supported: [E, coff x ratio = {win}] int32 / int64"
        )
    if entry_pos.dim() != 1 or entry_pos.shape[0] != E:
        raise ValueError(f"compressor entry_pos {tuple(entry_pos.shape)}: expected [{E}]")
    _check_pool_args(spec, norm_weight, cos_sin)
    d = spec.head_dim
    if out is None:
        out = torch.empty((E, d), dtype=torch.float32, device=state_cache.device)
    elif out.dtype != torch.float32 or tuple(out.shape) != (E, d):
        raise ValueError(f"out {out.dtype} {tuple(out.shape)}: expected [{E}, {d}] float32")
    if E == 0:
        return out
    return _pool(state_cache, window_slots.long(), entry_pos.long(), spec, norm_weight, cos_sin,
                 out)  # fmt: skip


def _check_pool_args(
    spec: CompressorSpec, norm_weight: torch.Tensor, cos_sin: torch.Tensor
) -> None:
    d = spec.head_dim
    if tuple(norm_weight.shape) != (d,):
        raise ValueError(f"compressor norm_weight {tuple(norm_weight.shape)}: expected [{d}]")
    if cos_sin.dim() != 2 or cos_sin.shape[1] != spec.rope_dim:
        raise ValueError(
            f"compressor cos_sin {tuple(cos_sin.shape)} is not supported: [positions, "
            f"rope_dim={spec.rope_dim}]"
        )


def _pool(
    state_cache: torch.Tensor,
    slots: torch.Tensor,
    entry_pos: torch.Tensor,
    spec: CompressorSpec,
    norm_weight: torch.Tensor,
    cos_sin: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """Pool, normalize and rotate E entries whose windows' rows sit at ``slots`` [E, win]
    (int64, -1: none) into ``out`` [E, d]."""
    d, m, win = spec.head_dim, spec.ratio, spec.window
    ps = state_cache.shape[1]
    n_slots = state_cache.shape[0] * ps
    E = slots.shape[0]
    step = max(1, _GATHER_ROWS // win)
    for e0 in range(0, E, step):
        slot = slots[e0 : e0 + step]
        valid = slot >= 0
        torch._assert_async(
            (slot < n_slots).all(), "compressor: a window slot past the state cache"
        )
        at = slot.clamp(0, n_slots - 1)
        g = state_cache[at // ps, at % ps]  # [e, win, 2 * coff * d]; any page stride
        cw = spec.coff * d
        if spec.overlap:  # first m slots: the first series (Ca); last m: the second (Cb)
            c = torch.cat([g[:, :m, :d], g[:, m:, d:cw]], 1)
            z = torch.cat([g[:, :m, cw : cw + d], g[:, m:, cw + d :]], 1)
        else:
            c, z = g[:, :, :d], g[:, :, cw:]
        z = z.masked_fill(~valid.unsqueeze(-1), float("-inf"))
        c = c.masked_fill(~valid.unsqueeze(-1), 0.0)  # a row never written may hold NaN
        pooled = (c * torch.softmax(z, dim=1)).sum(1)  # [e, d]
        normed = pooled * torch.rsqrt(pooled.square().mean(-1, keepdim=True) + spec.eps)
        normed = normed * norm_weight.float()
        out[e0 : e0 + step] = rope_interleaved(normed, cos_sin, entry_pos[e0 : e0 + step])
    return out
