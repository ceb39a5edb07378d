"""The split of ``kv_b_proj`` into ``W_UK`` and ``W_UV``, and the two absorption bmms.

``kv_b_proj.weight`` is [H*(nope+v), r]; viewed as [H, nope+v, r], ``W_UK = w[:, :nope]``
([H, nope, r]) and ``W_UV = w[:, nope:]``. We keep ``W_UV`` transposed as [H, r, v] so that
``o = bmm(o_lat, W_UV)`` needs no transpose at run time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .dims import MLADims
from .fp8 import FP8_DTYPE, fp8_bmm

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass
class AbsorbWeights:
    """Per-layer absorption weights.

    Attributes:
        W_UK: [H, nope, r] (compute dtype, or float8_e4m3fn when ``fp8``).
        W_UV: [H, r, v] (compute dtype, or float8_e4m3fn when ``fp8``).
        W_UK_scale / W_UV_scale: float32 [] or [H, 1, 1] weight scales (fp8 only).
        W_UK_packed / W_UV_packed: the same weights in a kernel implementation's own layout
            (made once per layer by its ``prepare_weights``; the native CPU kernels' VNNI
            blocks for bf16 weights), None where the implementation uses ``W_UK`` / ``W_UV``.

    The normal path decompresses ``c_kv`` with ``W_UK`` / ``W_UV`` as well: no other copy of
    ``kv_b_proj`` is kept.
    """

    W_UK: torch.Tensor
    W_UV: torch.Tensor
    W_UK_scale: torch.Tensor | None = None
    W_UV_scale: torch.Tensor | None = None
    W_UK_packed: torch.Tensor | None = None
    W_UV_packed: torch.Tensor | None = None

    @property
    def fp8(self) -> bool:
        return self.W_UK.dtype == FP8_DTYPE


def _expand_block_scale(
    scale: torch.Tensor,
    shape: tuple[int, int],
    weight_name: str,
    block: tuple[int, int] | None = None,
) -> torch.Tensor:
    """A weight scale ([] / [1] per tensor, [rows] / [rows, 1] per channel, or a 2-D grid of
    ``block``-sized blocks, DeepSeek-V3's 128 x 128 by default) expanded to ``shape``
    [rows, cols] float32."""
    rows, cols = shape
    s = scale.float()
    if s.numel() == 1:
        return s.reshape(1, 1).expand(rows, cols)
    if s.dim() == 1 and s.numel() == rows or s.dim() == 2 and s.shape == (rows, 1):
        return s.reshape(rows, 1).expand(rows, cols)
    if s.dim() == 2:
        br, bc = block or (128, 128)
        if (-(-rows // br), -(-cols // bc)) == tuple(s.shape):
            return s.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    raise ValueError(
        f"{weight_name} scale of shape {tuple(scale.shape)} is not supported for a weight of "
        f"shape {shape} with blocks {block or (128, 128)}: use a per-tensor or "
        "per-output-channel scale, or a 2-D block scale with its weight_block_size"
    )


def split_kv_b_proj(
    weight: torch.Tensor,
    dims: MLADims,
    weight_scale: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
    keep_fp8: bool = False,
    weight_block_size: tuple[int, int] | None = None,
) -> AbsorbWeights:
    """Split ``kv_b_proj.weight`` into ``W_UK`` [H, nope, r] and ``W_UV`` [H, r, v].

    Args:
        weight: [H*(nope+v), r], bf16/fp16/fp32, or float8_e4m3fn with ``weight_scale``.
        dims: the layer's dims (H = heads on this rank).
        weight_scale: fp8 only: per-tensor, per-row or 2-D block scale (value = stored * scale).
        dtype: compute dtype of the result; defaults to the weight's (bf16 for fp8 weights).
        keep_fp8: keep ``W_UK``/``W_UV`` in float8_e4m3fn with per-head scales for the fp8
            bmm branch (the weight must then be fp8, or it is quantized per head here).
        weight_block_size: (rows, cols) of a 2-D block scale (the checkpoint's
            ``quantization_config.weight_block_size``); default 128 x 128.
    """
    H, nope, v, r = dims.num_heads, dims.qk_nope_head_dim, dims.v_head_dim, dims.kv_lora_rank
    expected = (H * (nope + v), r)
    if tuple(weight.shape) != expected:
        raise ValueError(
            f"kv_b_proj weight shape {tuple(weight.shape)} does not match dims: expected "
            f"[H*(nope+v), r] = {list(expected)} for H={H}, nope={nope}, v={v}, r={r}"
        )
    if weight.dtype == FP8_DTYPE:
        if weight_scale is None:
            raise ValueError("kv_b_proj weight is float8_e4m3fn but no weight_scale was given")
        full = weight.float() * _expand_block_scale(
            weight_scale, expected, "kv_b_proj", weight_block_size
        )
        out_dtype = dtype or torch.bfloat16
    elif weight.dtype in _FLOAT_DTYPES:
        if weight_scale is not None:
            raise ValueError(f"weight_scale given for a {weight.dtype} kv_b_proj weight")
        full = weight.float()
        out_dtype = dtype or weight.dtype
    else:
        raise ValueError(
            f"kv_b_proj weight dtype {weight.dtype} is not supported; supported: "
            "bfloat16, float16, float32, float8_e4m3fn (with a scale)"
        )
    if out_dtype not in _FLOAT_DTYPES:
        raise ValueError(f"compute dtype {out_dtype} is not supported; use bf16, fp16 or fp32")
    w = full.view(H, nope + v, r)
    w_uk = w[:, :nope, :]  # [H, nope, r]
    w_uv = w[:, nope:, :].transpose(1, 2)  # [H, r, v]
    if not keep_fp8:
        return AbsorbWeights(
            W_UK=w_uk.to(out_dtype).contiguous(), W_UV=w_uv.to(out_dtype).contiguous()
        )
    from .fp8 import FP8_MAX

    def per_head(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = (x.abs().amax(dim=(1, 2), keepdim=True) / FP8_MAX).clamp(min=1e-12)
        return (x / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).contiguous(), s

    uk, uk_s = per_head(w_uk)
    uv, uv_s = per_head(w_uv)
    return AbsorbWeights(W_UK=uk, W_UV=uv, W_UK_scale=uk_s, W_UV_scale=uv_s)


def _head_bmm(
    x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, fp8: bool,
    out: torch.Tensor | None,
) -> torch.Tensor:
    """``y[t, h] = x[t, h] · w[h]``: x [T, H, K], w [H, K, N] -> [T, H, N] in x's dtype (into
    ``out`` [T, H, N] when given)."""
    xh = x.transpose(0, 1)  # [H, T, K]
    if fp8:
        y = fp8_bmm(xh, w, scale, out_dtype=x.dtype).transpose(0, 1)
    elif out is not None:
        return torch.bmm(xh, w.to(x.dtype), out=out.transpose(0, 1)).transpose(0, 1)
    else:
        y = torch.bmm(xh, w.to(x.dtype)).transpose(0, 1)
    if out is None:
        return y
    return out.copy_(y)


def absorb_q(
    q_nope: torch.Tensor, weights: AbsorbWeights, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``q_lat = q_nope · W_UK`` per head.

    Args:
        q_nope: [T, H, nope] bf16/fp16/fp32.
        out: optional [T, H, r] buffer in q_nope's dtype (any strides) to write into.
    Returns:
        q_lat: [T, H, r], dtype of q_nope (``out`` when given).
    """
    return _head_bmm(q_nope, weights.W_UK, weights.W_UK_scale, weights.fp8, out)


def apply_W_UV(
    o_lat: torch.Tensor, weights: AbsorbWeights, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``o = o_lat · W_UV`` per head.

    Args:
        o_lat: [T, H, r].
        out: optional [T, H, v] buffer in o_lat's dtype (any strides) to write into.
    Returns:
        o: [T, H, v], dtype of o_lat (``out`` when given).
    """
    return _head_bmm(o_lat, weights.W_UV, weights.W_UV_scale, weights.fp8, out)


#: Where an engine's ``kv_b_proj`` keeps its fp8 weight scale, in lookup order: block-scaled
#: checkpoints (DeepSeek-V3) store the inverse scale ``weight_scale_inv``; per-tensor and
#: per-channel fp8 layers (vLLM ``Fp8LinearMethod``, compressed-tensors) store ``weight_scale``.
#: Both mean value = stored * scale.
FP8_SCALE_ATTRS = ("weight_scale_inv", "weight_scale")


def _block_size_of(module: object) -> tuple[int, int] | None:
    """``weight_block_size`` of a block-quantized linear: on the layer (vLLM sets it there),
    else on its quantization config (SGLang's ``quant_method.quant_config``)."""
    block = getattr(module, "weight_block_size", None)
    if block is None:
        qcfg = getattr(getattr(module, "quant_method", None), "quant_config", None)
        block = getattr(qcfg, "weight_block_size", None)
    if block is None:
        return None
    if len(block) != 2 or any(isinstance(b, bool) or int(b) < 1 for b in block):
        raise ValueError(f"weight_block_size={block!r} must be two positive ints")
    return int(block[0]), int(block[1])


def weights_from_kv_b_proj(
    kv_b_proj: torch.nn.Module | torch.Tensor,
    dims: MLADims,
    dtype: torch.dtype | None = None,
    keep_fp8: bool = False,
) -> AbsorbWeights:
    """``AbsorbWeights`` from an engine's ``kv_b_proj`` (a linear module, or its weight).

    The weight is [H*(nope+v), r] (a weight stored transposed, [r, H*(nope+v)], as some fp8
    GEMM kernels keep it, is accepted too). An fp8 (e4m3) weight is dequantized with the scale
    the module carries, looked up in one order (:data:`FP8_SCALE_ATTRS`: ``weight_scale_inv``,
    then ``weight_scale``), per tensor, per output channel, or per block of the module's
    ``weight_block_size`` (on the module or its ``quant_method.quant_config``). Scales on a
    bf16/fp16/fp32 weight are ignored (nothing to dequantize).

    Args:
        kv_b_proj: the module (``.weight`` plus optional scale attributes) or a weight tensor.
        dims: the layer's dims (heads on this rank).
        dtype: the model's compute dtype (bf16/fp16/fp32); required for an fp8 weight,
            default the weight's dtype otherwise.
        keep_fp8: keep ``W_UK``/``W_UV`` in fp8 with per-head scales (see
            :func:`split_kv_b_proj`).
    Returns:
        ``W_UK`` [H, nope, r] and ``W_UV`` [H, r, v]: the only copy the core keeps.
    Raises:
        ValueError: naming the shape, dtype or scale that does not fit.
    """
    if isinstance(kv_b_proj, torch.Tensor):
        weight, module = kv_b_proj, None
    else:
        weight, module = getattr(kv_b_proj, "weight", None), kv_b_proj
        if not isinstance(weight, torch.Tensor):
            raise ValueError(
                f"kv_b_proj {type(kv_b_proj).__name__} has no weight tensor (got {weight!r})"
            )
    weight = weight.detach()
    H, nope, v, r = dims.num_heads, dims.qk_nope_head_dim, dims.v_head_dim, dims.kv_lora_rank
    rows = H * (nope + v)
    if tuple(weight.shape) == (r, rows) and rows != r:
        weight = weight.t()  # stored [K, N] (column-major fp8 GEMM layout)
    scale, block = None, None
    if weight.dtype == FP8_DTYPE:
        if dtype is None:
            raise ValueError(
                "kv_b_proj weight is float8_e4m3fn: pass dtype= (the model's bf16/fp16/fp32)"
            )
        if module is not None:
            for name in FP8_SCALE_ATTRS:
                scale = getattr(module, name, None)
                if scale is not None:
                    break
            block = _block_size_of(module)
        if scale is not None and not isinstance(scale, torch.Tensor):
            scale = torch.tensor(float(scale), dtype=torch.float32)
        if scale is not None:
            scale = scale.detach().to(weight.device)
    return split_kv_b_proj(
        weight, dims, weight_scale=scale, dtype=dtype, keep_fp8=keep_fp8,
        weight_block_size=block,
    )


def weights_from_w_kc_w_vc(
    w_kc: torch.Tensor,
    w_vc: torch.Tensor,
    dims: MLADims,
    w_scale: torch.Tensor | float | None = None,
    dtype: torch.dtype | None = None,
) -> AbsorbWeights:
    """``AbsorbWeights`` from SGLang's split absorption weights (``DeepseekV2AttentionMLA``'s
    ``w_kc`` [H, nope, r] and ``w_vc`` [H, r, v], already the core's layout).

    Tensors already in ``dtype`` and contiguous are used as they are (no copy); fp8 (e4m3)
    ones are dequantized with ``w_scale`` (SGLang's ``w_scale``: per tensor, or per head [H]).

    Args:
        w_kc, w_vc: the model's tensors.
        dims: the layer's dims (heads on this rank).
        w_scale: the fp8 scale (value = stored * scale); for bf16/fp16/fp32 weights only
            None or 1.0 (SGLang's default) are accepted.
        dtype: the model's compute dtype; required for fp8 weights, default the weights'.
    Raises:
        ValueError: naming the shape, dtype or scale that does not fit.
    """
    H, nope, v, r = dims.num_heads, dims.qk_nope_head_dim, dims.v_head_dim, dims.kv_lora_rank
    for name, t, shape in (("w_kc", w_kc, (H, nope, r)), ("w_vc", w_vc, (H, r, v))):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else repr(t)
            raise ValueError(
                f"{name} shape {got} does not match dims: expected {list(shape)} for H={H}, "
                f"nope={nope}, r={r}, v={v}"
            )
    if w_kc.dtype != w_vc.dtype:
        raise ValueError(f"w_kc dtype {w_kc.dtype} != w_vc dtype {w_vc.dtype}")
    if w_kc.dtype == FP8_DTYPE:
        if w_scale is None:
            raise ValueError("w_kc/w_vc are float8_e4m3fn but no w_scale was given")
        if dtype is None:
            raise ValueError("w_kc/w_vc are float8_e4m3fn: pass dtype= (the model's dtype)")
        s = torch.as_tensor(w_scale, dtype=torch.float32, device=w_kc.device)
        if s.numel() == H and H > 1:
            s = s.reshape(H, 1, 1)
        elif s.numel() == 1:
            s = s.reshape(())
        else:
            raise ValueError(
                f"w_scale of shape {tuple(s.shape)} is not supported: use a per-tensor or "
                f"per-head [{H}] scale"
            )
        uk, uv = w_kc.float() * s, w_vc.float() * s
    elif w_kc.dtype in _FLOAT_DTYPES:
        if w_scale is not None and not (
            torch.as_tensor(w_scale).numel() == 1 and float(w_scale) == 1.0
        ):
            raise ValueError(f"w_scale={w_scale!r} given for {w_kc.dtype} w_kc/w_vc")
        uk, uv = w_kc.detach(), w_vc.detach()
    else:
        raise ValueError(
            f"w_kc dtype {w_kc.dtype} is not supported; supported: bfloat16, float16, "
            "float32, float8_e4m3fn (with w_scale)"
        )
    out_dtype = dtype or w_kc.dtype
    if out_dtype not in _FLOAT_DTYPES:
        raise ValueError(f"compute dtype {out_dtype} is not supported; use bf16, fp16 or fp32")
    return AbsorbWeights(W_UK=uk.to(out_dtype).contiguous(), W_UV=uv.to(out_dtype).contiguous())


def extra_weight_bytes(weights: AbsorbWeights) -> int:
    """Bytes the core holds for one layer's ``W_UK`` + ``W_UV`` (and their fp8 scales)."""
    ts = (weights.W_UK, weights.W_UV, weights.W_UK_scale, weights.W_UV_scale)
    return sum(t.numel() * t.element_size() for t in ts if t is not None)
