"""The Gluon kernel's side of the absorbed op: when it serves a call (:func:`gluon_serves`)
and its launch (:func:`launch_gluon_attention`: TMA descriptors over the queries and the
cache, then the schedule's arguments shared with the Triton kernel)."""

from __future__ import annotations

import torch

from .launch import launch, recording, target_arch


def gluon_serves(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                 block_q: int, block_h: int) -> bool:
    """The Gluon kernel serves CUDA tensors (or recorded launches) of its shapes on a GPU of
    its archs (:data:`gluon_attention.ARCHS`), on a cache whose pages are one
    [pages * page_size, width] matrix (its TMA descriptor)."""
    if (q_lat.device.type != "cuda" and not recording()) or not kv_cache.is_contiguous():
        return False
    try:
        from ..jit import gluon_attention as ga
    except ImportError:  # a Triton without Gluon (before 3.5): the Triton kernel serves
        return False
    arch = target_arch(q_lat.device)
    if arch not in ga.ARCHS and not (arch is None and recording()):  # ROCm: never
        return False
    return ga.serves(q_lat.shape[1], q_lat.shape[2], q_pe.shape[-1], kv_cache.shape[1],
                     q_lat.dtype, kv_cache.dtype, block_q, block_h)


def launch_gluon_attention(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    schedule_args: tuple[object, ...],
    qk_scale_log2: float,
    stride_args: tuple[int, ...],
    block_q: int,
    block_h: int,
    grid: tuple[int, int],
) -> None:
    """The Gluon kernel (:mod:`..jit.gluon_attention`) on a call it serves: TMA descriptors
    over the queries as [T * H, r] / [T * H, rope] and the cache as [pages * 64, r + rope],
    then the arguments it shares with the Triton kernel (``schedule_args``: the plan part's
    index tensors, the outputs and partials, the head count; ``stride_args``: the block
    table's and the outputs' strides; see :func:`.absorbed.absorbed_attention_op`)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from ..jit import gluon_attention as ga

    T, H, r = q_lat.shape
    dt = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[q_lat.dtype]

    def desc(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
        layout = gl.NVMMASharedLayout.get_default_for(block, dt)
        return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)

    q2 = q_lat.contiguous().view(T * H, r)
    p2 = q_pe.contiguous().view(T * H, q_pe.shape[-1])
    kv2 = kv_cache.view(kv_cache.shape[0] * kv_cache.shape[1], kv_cache.shape[2])
    launch(
        ga.absorbed_attn_gluon_kernel,
        grid,
        desc(q2, [ga.BLOCK_M.value, 256]),
        desc(p2, [ga.BLOCK_M.value, ga.ROPE.value]),
        desc(kv2, [ga.BLOCK_N.value, 256]),
        desc(kv2, [ga.BLOCK_N.value, ga.ROPE.value]),
        *schedule_args,
        kv_cache.shape[1],
        qk_scale_log2,
        *stride_args,
        BLOCK_Q=block_q,
        BLOCK_H=block_h,
        num_warps=ga.NUM_WARPS,
    )
