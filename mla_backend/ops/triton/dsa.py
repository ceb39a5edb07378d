"""Triton DSA ops (the GPU path of :mod:`mla_backend.sparse`): the index-key cache write, the
lightning indexer's logits and causal top-k, and the sparse absorbed attention, as
``torch.library`` custom ops over the kernels of :mod:`.jit.indexer` and
:mod:`.jit.sparse_attention`:

- ``mla_backend::triton_write_index_keys`` (mutates the index cache): one program per key;
  the same bytes as the torch writer (:meth:`IndexCacheLayout.encode`), except that a
  ``ue8m0`` scale is ``2^ceil(log2(s))`` from the exponent bits where torch's fp32 ``log2``
  can round a scale a few ulps above a power of two down to it.
- ``mla_backend::triton_indexer_logits``: float32 [T, width], -inf where a token does not see
  the position.
- ``mla_backend::triton_indexer_topk``: [T, topk] int32. The logits of a chunk of tokens go
  to a float32 scratch [chunk, max_kv_len] (at most :data:`LOGITS_BUDGET` elements), then one
  program per token selects its top-k from it (radix select, no sort).
- ``mla_backend::triton_sparse_attention``: (o [T, H, r], lse [T, H]); long lists split into
  pieces merged by LSE when the batch is too small to fill the GPU.

Indexer dot operands: the queries' and keys' common exact type (e4m3 / bf16 -> bf16, e4m3 x e4m3
included; e4m3 / fp16 -> fp16; anything with fp32 -> fp32 IEEE), accumulated in fp32. Hopper's
fp8 tensor-core dots accumulate with reduced precision unless promoted to fp32 after every
instruction, and Triton 3.6 compiles the promoted form to ``mma.sync`` instead of ``wgmma``;
at decode the indexer is bound by reading its keys (132 bytes per 16K FLOPs), so e4m3 operands
go to exact bf16 dots. Under the interpreter bf16 operands are widened to fp32 (see :mod:`.ops`).
Nothing here reads tensor data on the host: sizes come from shapes and the plan's host ints.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

import torch
import triton
from torch.library import triton_op

from ... import fp8 as _fp8
from ...cache_layout import FP8_TILE
from ...index_cache import AMAX_FLOOR
from ..torch import sparse_attention as torch_sparse
from .jit import heuristics as hx
from .jit.indexer import indexer_logits_kernel, topk_select_kernel, write_index_keys_kernel
from .jit.sparse_attention import sparse_attn_kernel, sparse_merge_kernel
from .ops.checks import TL_DTYPE, check_runnable, skip_launch
from .ops.fp8_decode import resolve_fp8_mode
from .ops.launch import interpreting, launch

if TYPE_CHECKING:
    from ..base import IndexerCall, IndexKeyWrite, SparseCall

FP8 = _fp8.FP8_DTYPE
#: float32 elements of the top-k's logits scratch (chunks of tokens x max_kv_len)
LOGITS_BUDGET = 1 << 25
#: keys per step of the indexer
INDEX_BLOCK_N = 64
#: ``num_stages`` and ``num_warps`` (latents >= 256 wide) of the sparse attention: the sm_90a
#: compile (``python -m benchmarks gpu-resources --ops sparse``) spills at 64 heads with 3
#: stages and at 16 heads of ``fp8_ds_mla`` with 4 warps; these do not
SPARSE_STAGES = 2
SPARSE_WARPS = 8
#: positions per step of the top-k selection; histogram digit width
SELECT_BLOCK = 1024
RADIX_BITS = 8
#: latent column chunks of the sparse attention: at most this many of at most FP8_TILE values
MAX_CHUNKS = 4
#: a split of the sparse attention takes at least this many blocks of indices
MIN_BLOCKS_PER_SPLIT = 4
_LOG2E = 1.0 / math.log(2.0)


def sparse_supported(r: int) -> bool:
    """Whether :func:`sparse_attention` takes latent width ``r`` (MAX_CHUNKS chunks)."""
    return -(-r // min(FP8_TILE, hx.dim_block(r))) <= MAX_CHUNKS


def indexer_supported(num_blocks: int) -> bool:
    """Whether the indexer kernels take ``num_blocks`` scales per key (one dot each)."""
    return num_blocks <= 16


def _dot_dtype(q: torch.dtype, k: torch.dtype) -> torch.dtype:
    """The dot operands' dtype for queries ``q`` and keys ``k`` (e4m3 = FP8): exact for both."""
    if q in (torch.bfloat16, FP8) and k in (torch.bfloat16, FP8):
        return torch.float32 if interpreting() else torch.bfloat16
    if q in (torch.float16, FP8) and k in (torch.float16, FP8):
        return torch.float16
    return torch.float32


# ----------------------------------------------------------------------------------------
# Index-key write
# ----------------------------------------------------------------------------------------


def _write_index_keys_op(
    index_cache: torch.Tensor, k_I: torch.Tensor, slots: torch.Tensor, quant_block: int,
    ue8m0: bool,
) -> None:  # fmt: skip
    """``mla_backend::triton_write_index_keys``: k_I [T, Di] (last dim contiguous), slots [T]
    contiguous, T >= 1; uint8 cache: fp8 (``quant_block`` values per scale)."""
    T, Di = k_I.shape
    if skip_launch(index_cache):
        return
    check_runnable(index_cache.device, write_index_keys_kernel)
    fp8 = index_cache.dtype == torch.uint8
    nb = Di // quant_block if fp8 else 1
    round_bf16 = (
        interpreting() and index_cache.dtype == torch.bfloat16 and k_I.dtype != torch.bfloat16
    )
    launch(write_index_keys_kernel, (T,),
        index_cache, k_I, slots, Di, index_cache.shape[1], quant_block, nb,
        index_cache.stride(0), k_I.stride(0),
        FP8=fp8, UE8M0=ue8m0, BLOCK_NB=hx.next_pow2(nb),
        BLOCK_QB=hx.next_pow2(quant_block if fp8 else Di), ROUND_BF16=round_bf16,
        AMAX_FLOOR=AMAX_FLOOR, FP8_MAX=_fp8.FP8_MAX,
    )  # fmt: skip


def write_index_keys(w: IndexKeyWrite) -> None:
    """Write keys k_I [T, Di] to their slots of the index cache (< 0 skipped), in place, through
    ``mla_backend::triton_write_index_keys`` (arguments validated at the entry point)."""
    T = w.k_I.shape[0]
    if T == 0:
        return
    lay = w.layout
    torch.ops.mla_backend.triton_write_index_keys(
        w.index_cache,
        w.k_I if w.k_I.stride(-1) == 1 else w.k_I.contiguous(),
        w.slot_mapping[:T].contiguous(),
        lay.quant_block_size if lay.kind == "fp8" else 0,
        lay.scale_fmt == "ue8m0",
    )


# ----------------------------------------------------------------------------------------
# Indexer: logits and top-k
# ----------------------------------------------------------------------------------------


def _launch_logits(
    q_I: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor,
    block_table: torch.Tensor, token_req: torch.Tensor, token_pos: torch.Tensor,
    out: torch.Tensor, t0: int, tc: int, quant_block: int, width: int, fill: bool, bits: bool,
) -> None:  # fmt: skip
    """Logits of tokens ``t0 .. t0 + tc`` into rows ``0 .. tc`` of ``out``."""
    T, Hi, Di = q_I.shape
    fp8_cache = index_cache.dtype == torch.uint8
    qb = quant_block if fp8_cache else Di
    nb = Di // qb
    q_dt = q_I.dtype
    k_dt = FP8 if fp8_cache else index_cache.dtype
    dot = _dot_dtype(q_dt, k_dt)
    q_bits = bits and q_dt == FP8
    q_arg = q_I.view(torch.uint8) if q_bits else q_I
    if fp8_cache:
        cache_arg = index_cache if bits else index_cache.view(FP8)
    else:
        cache_arg = index_cache
    blocks = triton.cdiv(max(width, 1), INDEX_BLOCK_N)
    splits = max(1, min(blocks, triton.cdiv(hx.PROGRAMS_PER_SM * hx.sm_count(q_I.device), tc)))
    launch(indexer_logits_kernel, (tc, splits),
        q_arg, weights, cache_arg, block_table, token_req, token_pos, out, t0,
        Hi, Di, index_cache.shape[1], qb, nb, width, splits,
        q_I.stride(0), q_I.stride(1), weights.stride(0), index_cache.stride(0),
        block_table.stride(0), out.stride(0),
        BLOCK_H=hx.dim_block(Hi), BLOCK_N=INDEX_BLOCK_N, BLOCK_QB=hx.dim_block(qb), NUM_QB=nb,
        FP8_CACHE=fp8_cache, Q_BITS=q_bits, K_BITS=bits and fp8_cache,
        DOT_DTYPE=TL_DTYPE[dot], IEEE=dot == torch.float32, FILL=fill, num_warps=4,
    )  # fmt: skip


def _indexer_logits_op(
    q_I: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor,
    block_table: torch.Tensor, token_req: torch.Tensor, token_pos: torch.Tensor,
    quant_block: int, width: int, fp8_bits: bool,
) -> torch.Tensor:  # fmt: skip
    """``mla_backend::triton_indexer_logits`` -> float32 [T, width]."""
    T = q_I.shape[0]
    out = torch.empty(T, width, dtype=torch.float32, device=q_I.device)
    if T == 0 or width == 0 or skip_launch(q_I):
        return out
    check_runnable(q_I.device, indexer_logits_kernel)
    _launch_logits(q_I, weights, index_cache, block_table, token_req, token_pos, out, 0, T,
                   quant_block, width, True, fp8_bits)  # fmt: skip
    return out


def _indexer_topk_op(
    q_I: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor,
    block_table: torch.Tensor, token_req: torch.Tensor, token_pos: torch.Tensor,
    quant_block: int, width: int, topk: int, fp8_bits: bool,
) -> torch.Tensor:  # fmt: skip
    """``mla_backend::triton_indexer_topk`` -> int32 [T, topk] (``width``: the step's longest
    kv length, the scratch's row length)."""
    T = q_I.shape[0]
    dev = q_I.device
    out = torch.empty(T, topk, dtype=torch.int32, device=dev)
    if T == 0:
        return out
    chunk = max(1, min(T, LOGITS_BUDGET // max(width, 1)))
    scratch = torch.empty(chunk, max(width, 1), dtype=torch.float32, device=dev)
    if skip_launch(q_I):
        return out
    check_runnable(dev, topk_select_kernel)
    for t0 in range(0, T, chunk):
        tc = min(chunk, T - t0)
        _launch_logits(q_I, weights, index_cache, block_table, token_req, token_pos, scratch,
                       t0, tc, quant_block, width, False, fp8_bits)  # fmt: skip
        select_topk(scratch, token_pos, out, t0, tc)
    return out


def select_topk(
    logits: torch.Tensor, token_pos: torch.Tensor, out: torch.Tensor, t0: int, tc: int
) -> None:
    """The top-k rule over rows ``0 .. tc`` of ``logits`` (float32 [>= tc, W], row i = token
    ``t0 + i``, which sees positions ``0 .. token_pos[t0 + i]``) into rows ``t0 .. t0 + tc`` of
    ``out`` (int32 [T, topk]): one program per row (:func:`.jit.indexer.topk_select_kernel`)."""
    launch(topk_select_kernel, (tc,),
        logits, token_pos, out, t0, out.shape[1], logits.stride(0), out.stride(0),
        BLOCK=SELECT_BLOCK, RADIX_BITS=RADIX_BITS, num_warps=8,
    )  # fmt: skip


def _indexer_args(call: IndexerCall, fp8_mode: str | None) -> tuple:
    q_I = call.q_I
    bits = resolve_fp8_mode(fp8_mode, q_I.device) == "bits" and (
        q_I.dtype == FP8 or call.layout.kind == "fp8"
    )
    qb = call.layout.quant_block_size if call.layout.kind == "fp8" else 0
    w = call.weights if call.weights.stride(-1) == 1 else call.weights.contiguous()
    # the kernels see keys 0 .. token_pos[t]: the token's last visible key (its position, or with
    # V4's compressed keys (p + 1) // m - 1)
    sp = call.sparse
    return (q_I, w, call.index_cache, call.part.block_table, sp.token_req_t, sp.token_last_t,
            qb), bits  # fmt: skip


def indexer_logits(call: IndexerCall, *, fp8_mode: str | None = None) -> torch.Tensor:
    """float32 [T, call.sparse.max_kv_len] logits (into ``call.out`` when given) through
    ``mla_backend::triton_indexer_logits``."""
    args, bits = _indexer_args(call, fp8_mode)
    res = torch.ops.mla_backend.triton_indexer_logits(*args, call.sparse.max_kv_len, bits)
    return res if call.out is None else call.out.copy_(res)


def indexer_topk(call: IndexerCall, *, fp8_mode: str | None = None) -> torch.Tensor:
    """[T, call.topk] int32 (into ``call.out`` when given) through
    ``mla_backend::triton_indexer_topk``: the rule of :mod:`mla_backend.ops.torch.indexer`,
    exactly."""
    args, bits = _indexer_args(call, fp8_mode)
    res = torch.ops.mla_backend.triton_indexer_topk(*args, call.sparse.max_kv_len, call.topk,
                                                    bits)  # fmt: skip
    return res if call.out is None else call.out.copy_(res)


# ----------------------------------------------------------------------------------------
# Sparse attention
# ----------------------------------------------------------------------------------------


def sparse_tiles(r: int, num_heads: int, fp32: bool = False,
                 e4m3: bool = False) -> tuple[int, int, int, int]:  # fmt: skip
    """(CHUNK, NUM_CHUNKS, BLOCK_H, BLOCK_N) of the sparse attention for latent width r and H
    heads (``fp32`` queries; an ``e4m3`` cache: per-tensor fp8 or ``fp8_ds_mla``): chunks of at
    most one fp8 tile (128), heads up to 64 per program (the MMA's M; 16 for fp32 queries,
    whose operands would need more than 227 KB of shared memory at 64), indices per step 64
    (FlashMLA's block), 32 for a latent >= 256 wide except 16 heads of a 16-bit cache (64
    spills there on sm_90a with Triton 3.6: ``python -m benchmarks gpu-resources --ops
    sparse``; fp32 queries over an fp8 cache still spill: a reference dtype, not a serving
    one)."""
    chunk = min(FP8_TILE, hx.dim_block(r))
    block_h = min(hx.MIN_DOT_DIM if fp32 else hx.ROWS_PER_PROGRAM, hx.dim_block(num_heads))
    block_n = 32 if r >= 256 and (block_h >= 32 or fp32 or e4m3) else 64
    return chunk, -(-r // chunk), block_h, block_n


def sparse_splits(num_tokens: int, head_blocks: int, num_idx: int, block_n: int,
                  device: torch.device, forced: int | None = None) -> tuple[int, int]:  # fmt: skip
    """(splits, index blocks per split) of a sparse attention call: enough programs for
    :data:`heuristics.PROGRAMS_PER_SM` per SM, each split at least
    :data:`MIN_BLOCKS_PER_SPLIT` blocks of ``block_n`` (``forced``: that many splits)."""
    blocks = triton.cdiv(num_idx, block_n)
    if blocks == 0:
        return 1, 0
    if forced is not None:
        want = forced
    else:
        fill = triton.cdiv(hx.PROGRAMS_PER_SM * hx.sm_count(device), num_tokens * head_blocks)
        want = min(triton.cdiv(blocks, MIN_BLOCKS_PER_SPLIT), fill)
    per = triton.cdiv(blocks, max(1, min(want, blocks)))
    return triton.cdiv(blocks, per), per


def _sparse_attention_op(
    q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
    kv_lens: torch.Tensor, token_req: torch.Tensor, indices: torch.Tensor,
    kv_scale: Optional[torch.Tensor],  # noqa: UP045 (torch's schema inference reads it)
    softmax_scale: float, scale_offset: int, rope_offset: int, num_splits: int,
    blocks_per_split: int, fp8_bits: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``mla_backend::triton_sparse_attention``: checked by :func:`sparse_attention` (q last
    dim contiguous, indices [T, K] contiguous, kv_scale a float32 scalar or None; uint8 cache:
    ``fp8_ds_mla`` at the given byte offsets)."""
    T, H, r = q_lat.shape
    rope = q_pe.shape[-1]
    dev, cd = q_lat.device, q_lat.dtype
    o = torch.empty(T, H, r, dtype=cd, device=dev)
    lse = torch.empty(T, H, dtype=torch.float32, device=dev)
    if T == 0 or H == 0:
        return o, lse
    split = num_splits > 1
    part_o = torch.empty(num_splits if split else 0, T, H, r, dtype=torch.float32, device=dev)
    part_lse = torch.empty(num_splits if split else 0, T, H, dtype=torch.float32, device=dev)
    if skip_launch(q_lat):
        return o, lse
    check_runnable(dev, sparse_attn_kernel)
    e4m3 = kv_cache.dtype in (FP8, torch.uint8)
    chunk, n_chunks, block_h, block_n = sparse_tiles(r, H, cd == torch.float32, e4m3)
    round_bf16 = interpreting() and cd == torch.bfloat16
    dot = torch.float32 if round_bf16 else cd
    ds = kv_cache.dtype == torch.uint8
    has_scale = kv_scale is not None and not ds
    if ds:
        kv_arg = kv_cache if fp8_bits else kv_cache.view(FP8)
    else:
        kv_arg = kv_cache.view(torch.uint8) if fp8_bits else kv_cache
    grid = (T, triton.cdiv(H, block_h), num_splits)
    launch(sparse_attn_kernel, grid,
        q_lat, q_pe if rope else q_lat, kv_arg, block_table, kv_lens, token_req, indices,
        kv_scale if has_scale else lse, o, lse, part_o if split else lse,
        part_lse if split else lse,
        T, H, r, rope, kv_cache.shape[1], indices.shape[1], blocks_per_split, scale_offset,
        rope_offset, softmax_scale * _LOG2E,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), kv_cache.stride(0),
        kv_cache.stride(1), block_table.stride(0), indices.stride(0), o.stride(0), o.stride(1),
        lse.stride(0), lse.stride(1),
        BLOCK_H=block_h, BLOCK_N=block_n, CHUNK=chunk, NUM_CHUNKS=n_chunks,
        BLOCK_ROPE=hx.dim_block(rope), HAS_ROPE=rope > 0, HAS_SCALE=has_scale,
        FP8_BITS=fp8_bits, DOT_DTYPE=TL_DTYPE[dot], P_DTYPE=TL_DTYPE[cd],
        IEEE=dot == torch.float32, ROUND_BF16=round_bf16, ROUND_OUT=round_bf16 and not split,
        DS=ds, ROPE_DTYPE=TL_DTYPE[cd], SPLIT=split,
        num_warps=SPARSE_WARPS if r >= 256 else 4, num_stages=SPARSE_STAGES,
    )  # fmt: skip
    if split:
        mb_h = min(hx.next_pow2(H), 16)
        launch(sparse_merge_kernel, (T, triton.cdiv(H, mb_h)),
            part_o, part_lse, o, lse, num_splits, T, H, r, o.stride(0), o.stride(1),
            lse.stride(0), lse.stride(1),
            BLOCK_H=mb_h, BLOCK_R=hx.dim_block(r), ROUND_BF16=round_bf16, num_warps=4,
        )  # fmt: skip
    return o, lse


def sparse_attention(
    call: SparseCall, *, fp8_mode: str | None = None, num_splits: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse absorbed attention through ``mla_backend::triton_sparse_attention`` (arguments
    validated at the entry point; r within :func:`sparse_supported`). Indices out of range
    (>= the request's kv length, or < -1) are refused with ``torch._assert_async`` and repeats
    dropped (the shared :func:`mla_backend.ops.torch.sparse_attention.checked_indices`; on a GPU
    a device-side assert) and masked in the kernel, which never reads them. Returns
    (o_lat [T, H, r], lse [T, H]) in ``call.attn.out`` / ``call.attn.lse`` when given."""
    a, part = call.attn, call.attn.part
    T, H, r = a.q_lat.shape
    dev = a.q_lat.device
    if a.kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache must be contiguous in its last dimension")
    indices = call.indices
    if T:  # range refusal, repeats dropped (the shared rule of ops.torch.sparse_attention)
        indices = torch_sparse.checked_indices(indices, part, call.sparse).to(indices.dtype)
    _, _, block_h, block_n = sparse_tiles(r, H, a.q_lat.dtype == torch.float32,
                                          a.layout.kind != "plain")
    splits, per = sparse_splits(max(T, 1), triton.cdiv(max(H, 1), block_h), call.indices.shape[1],
                                block_n, dev, num_splits)  # fmt: skip
    lay = a.layout
    ds = lay.kind == "fp8_ds_mla"
    bits = lay.kind != "plain" and resolve_fp8_mode(fp8_mode, dev) == "bits"
    q_pe = a.q_pe.to(a.q_lat.dtype)
    o, lse = torch.ops.mla_backend.triton_sparse_attention(
        a.q_lat if a.q_lat.stride(-1) == 1 else a.q_lat.contiguous(),
        q_pe if q_pe.stride(-1) == 1 or q_pe.shape[-1] <= 1 else q_pe.contiguous(),
        a.kv_cache, part.block_table, part.kv_lens_t, call.sparse.token_req_t,
        indices.contiguous(),
        a.kv_scale.float().reshape(()) if a.kv_scale is not None else None,
        float(a.softmax_scale), lay.scale_offset if ds else 0, lay.rope_offset if ds else 0,
        splits, per, bits,
    )  # fmt: skip
    return a.deliver(o, lse)


def _register_ops() -> None:
    """Register the custom ops once per process (a reload keeps the first registration: the ops
    look their kernels up in this module's globals, which a reload updates in place)."""
    ns = torch.ops.mla_backend
    if not hasattr(ns, "triton_write_index_keys"):
        triton_op("mla_backend::triton_write_index_keys", mutates_args={"index_cache"})(
            _write_index_keys_op
        )
    if not hasattr(ns, "triton_indexer_logits"):
        triton_op("mla_backend::triton_indexer_logits", mutates_args=())(_indexer_logits_op)
    if not hasattr(ns, "triton_indexer_topk"):
        triton_op("mla_backend::triton_indexer_topk", mutates_args=())(_indexer_topk_op)
    if not hasattr(ns, "triton_sparse_attention"):
        triton_op("mla_backend::triton_sparse_attention", mutates_args=())(_sparse_attention_op)


_register_ops()
