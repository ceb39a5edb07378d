"""float8 e4m3 helpers: quantization, and the fp8 absorption bmm (``q_nope·W_UK``, ``o_lat·W_UV``).

Convention everywhere in this package: ``stored = value / scale``, ``value = stored * scale``,
with scales in float32. The bmm uses ``torch._scaled_mm`` where the device supports it and an
exact dequantize-then-matmul fallback elsewhere; both are selectable for tests.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0


def quantize_fp8(x: torch.Tensor, per_token: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize to float8_e4m3fn with a float32 scale (amax / 448).

    Args:
        x: [..., K] any float dtype.
        per_token: one scale per row ([..., 1]) instead of one per tensor ([]).
    Returns:
        (x_fp8 [..., K] float8_e4m3fn, scale float32 [] or [..., 1]).
    """
    xf = x.float()
    if per_token:
        amax = xf.abs().amax(dim=-1, keepdim=True)
    else:
        amax = xf.abs().amax()
    scale = (amax / FP8_MAX).clamp(min=1e-12)
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def quantize_fp8_groups(
    x: torch.Tensor, group_size: int, eps: float = 1e-10, pow2_scale: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each group of ``group_size`` consecutive values of the last dim to
    float8_e4m3fn with its own float32 scale (per-token-group quantization, as DSA indexers
    round their queries).

    Per group: ``scale = max(amax, eps) * (1 / 448)``, with ``pow2_scale`` rounded up to a
    power of two (``2^ceil(log2(scale))``, UE8M0 scales); ``stored = e4m3(x / scale)``
    saturated to +-448.

    Args:
        x: [..., K] bf16 / fp16 / fp32, K a multiple of ``group_size``.
        group_size: values per scale (>= 1).
    Returns:
        (x_fp8 [..., K] float8_e4m3fn, scale float32 [..., K / group_size]).
    """
    K = x.shape[-1]
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size={group_size!r} must be an int >= 1")
    if K % group_size:
        raise ValueError(f"last dim {K} is not a multiple of group_size {group_size}")
    xf = x.float().reshape(*x.shape[:-1], K // group_size, group_size)
    scale = xf.abs().amax(dim=-1).clamp(min=eps) * (1.0 / FP8_MAX)
    if pow2_scale:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(x.shape), scale


def dequantize_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [..., K] float8 times scale (broadcastable float32) -> dtype."""
    return (x.float() * scale).to(dtype)


def scaled_mm_supported(device: torch.device, k: int, n: int) -> bool:
    """Whether ``torch._scaled_mm`` serves an fp8 [M, K] x [K, N] product on ``device``:
    CPU, or a CUDA GPU with native fp8 (compute capability >= 8.9) and K, N multiples of 16
    (its alignment rule). ROCm and older GPUs take the exact dequantize fallback."""
    if not hasattr(torch, "_scaled_mm"):
        return False
    if device.type == "cpu":
        return True
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9) and k % 16 == 0 and n % 16 == 0


def fp8_bmm(
    a: torch.Tensor,
    b_fp8: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    per_token: bool = True,
    use_scaled_mm: bool | None = None,
) -> torch.Tensor:
    """Batched ``a @ (b_fp8 * b_scale)`` with ``a`` quantized to fp8 on the fly.

    Args:
        a: [H, M, K] bf16/fp16/fp32 activation (e.g. ``q_nope`` as [H, T, nope]).
        b_fp8: [H, K, N] float8_e4m3fn weight (e.g. ``W_UK`` as [H, nope, r]).
        b_scale: float32 [] (per tensor) or [H, 1, 1] (per head) weight scale.
        out_dtype: output dtype (bf16 by default).
        per_token: quantize ``a`` with one scale per row (else per tensor).
        use_scaled_mm: force (True) or forbid (False) ``torch._scaled_mm``; None = auto.
    Returns:
        [H, M, N] out_dtype.
    """
    if b_fp8.dtype != FP8_DTYPE:
        raise ValueError(f"fp8_bmm weight dtype {b_fp8.dtype} is not supported; need {FP8_DTYPE}")
    a_q, a_scale = quantize_fp8(a, per_token=per_token)  # a_scale [H, M, 1] or []
    H, M, K = a.shape
    N = b_fp8.shape[-1]
    if use_scaled_mm is None:
        use_scaled_mm = scaled_mm_supported(a.device, K, N)
    if not use_scaled_mm:
        return torch.bmm(a_q.float() * a_scale, b_fp8.float() * b_scale).to(out_dtype)
    out = torch.empty(H, M, N, dtype=out_dtype, device=a.device)
    bs = b_scale.float().reshape(-1)
    one = torch.ones((), dtype=torch.float32, device=a.device)
    for h in range(H):
        # _scaled_mm wants a row-major A and a column-major B; scales as [] tensors.
        sa = a_scale[h] if per_token else a_scale
        sb = bs[h] if bs.numel() > 1 else bs[0]
        y = torch._scaled_mm(
            a_q[h].contiguous(),
            b_fp8[h].t().contiguous().t(),
            scale_a=one,
            scale_b=one,
            out_dtype=torch.float32,
        )
        out[h] = (y * sa * sb).to(out_dtype)
    return out
