"""Public entry point of the attention over key sets: :func:`keyset_attention`, the one absorbed
attention primitive dense MLA, DSA and DeepSeek-V4 are cases of (the semantics:
:mod:`mla_backend.ops.torch.keyset_attention`).

- dense MLA: ``causal_range=True``, no window, no index list (``absorbed_attention``);
- DSA: ``causal_range=False``, ``indices`` = the indexer's top-k (``sparse_absorbed_attention``);
- V4 sliding-window layers: ``mb.plan(..., window=128)``, ``causal_range=True``, ``sink``,
  ``value_is_key=True``; CSA / HCA layers: the same plus ``extra`` (the compressed rows'
  :class:`~mla_backend.ops.KeyCache`) and ``extra_indices`` (selected / every visible entry).

Inputs are validated here, once, naming the bad value and what is supported; the kernels come
from the plan's implementation (the device seam); no call reads tensor data on the host.
"""

from __future__ import annotations

import torch

from .checks import check_step
from .ops import AbsorbedCall, KeyCache, KeySetCall
from .plan import MLAPlan

__all__ = ["KeyCache", "keyset_attention"]

INDEX_DTYPES = (torch.int32, torch.int64)


def _check_index(name: str, t: torch.Tensor | None, T: int, dev: torch.device) -> None:
    if t is None:
        return
    if t.dim() != 2 or t.shape[0] != T or t.dtype not in INDEX_DTYPES:
        raise ValueError(
            f"{name} {t.dtype} {tuple(t.shape)} is not supported: [T={T}, k] int32 / int64"
        )
    if t.device.type != dev.type:
        raise ValueError(f"{name} is on {t.device}, but the plan was made for {dev}")


def _check_extra(extra: KeyCache, main: torch.Tensor, plan: MLAPlan) -> None:
    if not isinstance(extra, KeyCache):
        raise ValueError(f"extra={type(extra).__name__} is not supported: a KeyCache")
    c, B = extra.kv_cache, plan.num_reqs
    if c.dtype != main.dtype or c.dim() != 3 or c.shape[2] != main.shape[2]:
        raise ValueError(
            f"extra cache {c.dtype} {tuple(c.shape)} is not supported: [pages, page_size, "
            f"{main.shape[2]}] {main.dtype} (the main cache's row format)"
        )
    if c.stride(2) != 1:
        raise ValueError(f"extra cache strides {c.stride()}: its rows must be contiguous")
    bt, lens = extra.block_table, extra.lens
    if bt.dim() != 2 or bt.shape[0] != B or bt.dtype not in INDEX_DTYPES:
        raise ValueError(
            f"extra block_table {bt.dtype} {tuple(bt.shape)} is not supported: [B={B}, pages] "
            "int32 / int64"
        )
    if lens.dim() != 1 or lens.shape[0] != B or lens.dtype not in INDEX_DTYPES:
        raise ValueError(
            f"extra lens {lens.dtype} {tuple(lens.shape)} is not supported: [B={B}] int32 / int64"
        )
    for name, t in (("extra cache", c), ("extra block_table", bt), ("extra lens", lens)):
        if t.device.type != plan.device.type:
            raise ValueError(f"{name} is on {t.device}, but the plan was made for {plan.device}")


def keyset_attention(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    plan: MLAPlan,
    softmax_scale: float,
    kv_scale: torch.Tensor | None = None,
    *,
    causal_range: bool = True,
    indices: torch.Tensor | None = None,
    extra: KeyCache | None = None,
    extra_indices: torch.Tensor | None = None,
    sink: torch.Tensor | None = None,
    value_is_key: bool = False,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed attention (MQA of every head) over each query token's key set.

    Args:
        q_lat: [T, H, r]; q_pe: [T, H, rope]; bf16 / fp16 / fp32, T == plan.num_tokens (V4:
            r = 448 and rope = 64 of the 512-wide row, or r = 512 and rope = 0).
        kv_cache: the main latent cache, every layout the dense path reads (bf16 / fp16 /
            fp32, per-tensor fp8 with ``kv_scale``, uint8 ``fp8_ds_mla`` unless
            ``value_is_key``).
        plan: the step's plan; its ``window`` (``mb.plan(..., window=...)``) starts the causal
            ranges.
        softmax_scale: scale of ``q·k``.
        causal_range: whether the key set holds the causal range ``start .. p`` of the main
            cache (start 0, or the plan's window).
        indices: [T, k] int32 / int64 positions of the main cache per token, -1 = none. The
            key set is a set per cache: a position listed twice, or one the causal range
            already holds, counts once (as in :func:`mla_backend.sparse_absorbed_attention`).
        extra: a second cache in the main cache's row format, with its own block table and
            entry counts (:class:`~mla_backend.ops.KeyCache`); needs ``extra_indices`` [T, k2]
            (its entries per token, -1 = none; a repeated entry counts once).
        sink: [H] float32 per-head sink logits (a finite value, or -inf for none).
        value_is_key: the value is the whole row (o [T, H, r + rope]); else its first r
            columns (o [T, H, r]).
        out / lse: optional [T, H, dv] (q's dtype) / [T, H] float32 buffers.
    Returns:
        (o [T, H, dv] in q's dtype, lse [T, H] float32, natural log, the sink included: a
        token with no key gets o = 0 and lse = sink, -inf without one). Indices past their
        request's rows are refused: the native kernels raise naming them before reading; the
        torch / Triton paths through ``torch._assert_async`` (no host read).
    """
    layout = check_step(q_lat, q_pe, kv_cache, plan, q_lat.shape[-1] + q_pe.shape[-1], kv_scale)
    if q_lat.shape[-1] != plan.dims.kv_lora_rank:
        raise ValueError(f"q_lat width {q_lat.shape[-1]} != kv_lora_rank {plan.dims.kv_lora_rank}")
    T, H, r = q_lat.shape
    dev = q_lat.device
    if not causal_range and indices is None and extra is None:
        raise ValueError(
            "an empty key set: give causal_range=True, indices, or extra with extra_indices"
        )
    _check_index("indices", indices, T, dev)
    _check_index("extra_indices", extra_indices, T, dev)
    if (extra is None) != (extra_indices is None):
        raise ValueError("extra and extra_indices go together: give both or neither")
    if extra is not None:
        _check_extra(extra, kv_cache, plan)
    if sink is not None and (
        sink.dtype != torch.float32 or tuple(sink.shape) != (H,) or sink.device.type != dev.type
    ):
        raise ValueError(
            f"sink {sink.dtype} {tuple(sink.shape)} on {sink.device} is not supported: [H={H}] "
            f"float32 on {dev}"
        )
    if value_is_key and layout.tile_scaled:
        raise ValueError(
            "value_is_key is not supported on an fp8_ds_mla cache (its rope part is kept "
            "apart from the c_kv tiles); use a bf16 / fp16 / fp32 or per-tensor fp8 cache"
        )
    dv = r + q_pe.shape[-1] if value_is_key else r
    if out is not None and (
        out.dtype != q_lat.dtype or tuple(out.shape) != (T, H, dv) or out.device != dev
    ):
        raise ValueError(
            f"out {out.dtype} {tuple(out.shape)} on {out.device}: expected [{T}, {H}, {dv}] "
            f"{q_lat.dtype} on {dev}"
        )
    if lse is not None and (
        lse.dtype != torch.float32 or tuple(lse.shape) != (T, H) or lse.device != dev
    ):
        raise ValueError(
            f"lse {lse.dtype} {tuple(lse.shape)} on {lse.device}: expected [{T}, {H}] float32 "
            f"on {dev}"
        )
    attn = AbsorbedCall(q_lat, q_pe, kv_cache, layout, plan.step, softmax_scale, kv_scale, out,
                        lse)  # fmt: skip
    call = KeySetCall(attn, plan.window, bool(causal_range), indices, extra, extra_indices, sink,
                      bool(value_is_key))  # fmt: skip
    with torch.no_grad():
        return plan.impl.keyset_attention(call)
