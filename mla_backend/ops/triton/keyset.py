"""Triton path of the attention over key sets (the semantics:
:mod:`mla_backend.ops.torch.keyset_attention`): the launch of :mod:`.jit.keyset_attention` (one
program per query token and block of heads, no kv splits), its per-token data (request,
position, range start) made on the device from the plan, the torch implementation's index /
sink check (``torch._assert_async``, no host read) and its one-count-per-position rule (repeats
and main-cache indices inside the causal range set to -1 before the launch,
``distinct_indices``). value = key runs as a latent
of the whole row with no rope part (q = ``[q_lat ; q_pe]``)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import triton

from ..torch import keyset_attention as torch_keyset
from . import dsa
from .jit import heuristics as hx
from .jit.keyset_attention import keyset_attn_kernel
from .ops.checks import TL_DTYPE, check_runnable, skip_launch
from .ops.fp8_decode import resolve_fp8_mode
from .ops.launch import interpreting, launch

if TYPE_CHECKING:
    from ..base import KeySetCall

_LOG2E = 1.0 / math.log(2.0)


def keyset_supported(call: KeySetCall) -> bool:
    """Whether :func:`keyset_attention` takes the call (latent within the sparse attention's
    column chunks, the whole row when ``value_is_key``)."""
    return dsa.sparse_supported(call.value_width)


def _token_data(call: KeySetCall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """([T] request, [T] position, [T] range start), int32 on the queries' device."""
    a, part = call.attn, call.attn.part
    T, dev = a.q_lat.shape[0], a.q_lat.device
    req = torch.repeat_interleave(
        torch.arange(part.num_reqs, device=dev), part.new_lens_t.long(), output_size=T
    )
    pos = part.prefix_lens_t.long()[req] + torch.arange(T, device=dev) - part.cu_new_t.long()[req]
    if call.window is not None:
        start = (pos - call.window.sizes_t.long()[req] + 1).clamp(min=0)
    else:
        start = torch.zeros_like(pos)
    return req.int(), pos.int(), start.int()


def keyset_attention(call: KeySetCall, *, fp8_mode: str | None = None) -> tuple[torch.Tensor,
                                                                               torch.Tensor]:
    """(o [T, H, dv] in q's dtype, lse [T, H] float32, the sink included) of the call (checked
    at the entry point; :func:`keyset_supported`), in ``call.attn.out`` / ``.lse`` when given."""
    a, part = call.attn, call.attn.part
    q_lat, q_pe = a.q_lat, a.q_pe
    if call.value_is_key:
        q_lat, q_pe = torch.cat([q_lat, q_pe], -1), q_lat.new_empty(*q_lat.shape[:2], 0)
    q_lat = q_lat if q_lat.stride(-1) == 1 else q_lat.contiguous()
    q_pe = q_pe if q_pe.stride(-1) == 1 or q_pe.shape[-1] <= 1 else q_pe.contiguous()
    T, H, r = q_lat.shape
    rope = q_pe.shape[-1]
    dev, cd = q_lat.device, q_lat.dtype
    o = torch.empty(T, H, r, dtype=cd, device=dev)
    lse = torch.empty(T, H, dtype=torch.float32, device=dev)
    if T == 0 or H == 0 or skip_launch(q_lat):
        return a.deliver(o, lse)
    if a.kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache must be contiguous in its last dimension")
    torch_keyset.check_keyset_indices(part, call.indices, call.extra, call.extra_indices,
                                      call.sink)  # fmt: skip
    check_runnable(dev, keyset_attn_kernel)
    lay = a.layout
    ds = lay.kind == "fp8_ds_mla"
    bits = lay.kind != "plain" and resolve_fp8_mode(fp8_mode, dev) == "bits"
    chunk, n_chunks, block_h, block_n = dsa.sparse_tiles(r, H, cd == torch.float32,
                                                         lay.kind != "plain")  # fmt: skip
    round_bf16 = interpreting() and cd == torch.bfloat16
    dot = torch.float32 if round_bf16 else cd
    has_scale = a.kv_scale is not None and not ds

    def view(cache: torch.Tensor) -> torch.Tensor:
        if ds:
            return cache if bits else cache.view(dsa.FP8)
        return cache.view(torch.uint8) if bits else cache

    req, pos, start = _token_data(call)
    ex = call.extra
    own = (start, pos) if call.causal_range else (None, None)  # the range holds those
    idx = (torch_keyset.distinct_indices(call.indices, *own).int().contiguous()
           if call.indices is not None else req[:, None])  # fmt: skip
    idx2 = (torch_keyset.distinct_indices(call.extra_indices).int().contiguous()
            if call.extra_indices is not None else req[:, None])  # fmt: skip
    kv2 = view(ex.kv_cache) if ex is not None else view(a.kv_cache)
    bt2 = ex.block_table.int() if ex is not None else part.block_table
    lens2 = ex.lens.int() if ex is not None else part.kv_lens_t
    sink = call.sink.float().contiguous() if call.sink is not None else lse
    kv_scale = a.kv_scale.float().reshape(()) if has_scale else lse
    launch(keyset_attn_kernel, (T, triton.cdiv(H, block_h)),
        q_lat, q_pe if rope else q_lat, view(a.kv_cache), kv2, part.block_table, bt2,
        part.kv_lens_t, lens2, req, pos, start, idx, idx2, sink, kv_scale, o, lse,
        H, r, rope, a.kv_cache.shape[1], kv2.shape[1],
        call.indices.shape[1] if call.indices is not None else 0,
        call.extra_indices.shape[1] if call.extra_indices is not None else 0,
        lay.scale_offset if ds else 0, lay.rope_offset if ds else 0,
        float(a.softmax_scale) * _LOG2E,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), a.kv_cache.stride(0),
        a.kv_cache.stride(1), kv2.stride(0), kv2.stride(1), part.block_table.stride(0),
        bt2.stride(0), idx.stride(0), idx2.stride(0), o.stride(0), o.stride(1), lse.stride(0),
        lse.stride(1),
        BLOCK_H=block_h, BLOCK_N=block_n, CHUNK=chunk, NUM_CHUNKS=n_chunks,
        BLOCK_ROPE=hx.dim_block(rope), HAS_ROPE=rope > 0, HAS_SCALE=has_scale, FP8_BITS=bits,
        DOT_DTYPE=TL_DTYPE[dot], P_DTYPE=TL_DTYPE[cd], IEEE=dot == torch.float32,
        ROUND_BF16=round_bf16, ROUND_OUT=round_bf16, DS=ds, ROPE_DTYPE=TL_DTYPE[cd],
        RANGE=call.causal_range, HAS_IDX=call.indices is not None,
        HAS_IDX2=call.extra_indices is not None, HAS_SINK=call.sink is not None,
        num_warps=dsa.SPARSE_WARPS if r >= 256 else 4, num_stages=dsa.SPARSE_STAGES,
    )  # fmt: skip
    return a.deliver(o, lse)
