"""How the Triton kernels decode fp8 e4m3 cache bytes on a device: Triton's native
float8e4nv conversion, or an integer decode of the bytes (``"bits"``)."""

from __future__ import annotations

import torch


def fp8_mode(device: torch.device) -> str:
    """How the kernels convert fp8 e4m3 cache values on ``device``: ``"native"`` or ``"bits"``.

    Triton converts float8e4nv natively on NVIDIA sm_89+ (Ada, Hopper, Blackwell) and in the
    interpreter; on older NVIDIA GPUs and on ROCm the bytes are decoded with integer ops.
    """
    if device.type != "cuda":
        return "native"
    if torch.version.hip is not None:
        return "bits"
    return "native" if torch.cuda.get_device_capability(device) >= (8, 9) else "bits"


def resolve_fp8_mode(mode: str | None, device: torch.device) -> str:
    """``mode`` checked (``"native"`` or ``"bits"``), or the device's default when None."""
    mode = mode or fp8_mode(device)
    if mode not in ("native", "bits"):
        raise ValueError(f"fp8_mode={mode!r} is not supported; use 'native' or 'bits'")
    return mode
