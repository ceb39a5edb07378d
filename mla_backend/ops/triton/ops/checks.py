"""The Triton ops' shared argument checks: the dtypes the kernels take, the cache's row width,
and whether a call may run here (GPU tensors, or CPU tensors under the interpreter) or is a
``FakeTensor`` call that only allocates its outputs."""

from __future__ import annotations

import torch
import triton.language as tl
from torch._subclasses.fake_tensor import FakeTensor

from .... import fp8 as _fp8
from ....cache_layout import CacheLayout
from ..jit import heuristics as hx
from .launch import recording

#: torch float dtype -> the kernels' dtype
TL_DTYPE = {
    torch.float32: tl.float32,
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
}
#: the latent cache dtypes the kernels read and write (uint8: ``fp8_ds_mla`` rows)
CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, _fp8.FP8_DTYPE, torch.uint8)


def check_cache(kv_cache: torch.Tensor, r: int, rope: int, compute_dtype: torch.dtype) -> None:
    """Raise ValueError unless ``kv_cache`` is a [num_pages, page_size, width] cache the kernels
    take: a dtype of :data:`CACHE_DTYPES`, rows of ``r + rope`` elements (a uint8 cache: the
    ``fp8_ds_mla`` row's bytes, rope part in ``compute_dtype``), contiguous last dimension."""
    if kv_cache.dtype not in CACHE_DTYPES:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} is not supported; use one of "
                         f"{CACHE_DTYPES}")
    width = CacheLayout.of(kv_cache, r, rope, compute_dtype).width
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != width:
        raise ValueError(
            f"kv_cache shape {tuple(kv_cache.shape)} does not hold rows of r + rope = {r} + "
            f"{rope} ({width} elements of {kv_cache.dtype})"
        )
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache must be contiguous in its last dimension")


def check_runnable(device: torch.device, kernel: object) -> None:
    """Triton kernels run on GPU tensors, or on CPU tensors only under the interpreter."""
    if device.type == "cuda" or recording():
        return
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(kernel, InterpretedFunction):
        raise RuntimeError(
            f"the Triton kernels got {device.type} tensors but were compiled for a GPU: set "
            "TRITON_INTERPRET=1 before mla_backend.ops.triton is imported to run them on "
            "CPU (slow; for tests), or use the torch path (MLA_BACKEND_IMPL=torch)"
        )


def skip_launch(x: torch.Tensor) -> bool:
    """True when ``x`` is a FakeTensor and the kernels are interpreted: the op's fake
    implementation (this same code under ``FakeTensorMode``) then only allocates outputs.
    On a GPU the launch goes through ``wrap_triton``, which records it instead of running it.
    Tracing for ``torch.compile`` (functional tensors) cannot use the interpreter."""
    if not hx.interpreting():
        return False
    if isinstance(x, FakeTensor):
        return True
    if torch._subclasses.fake_tensor.is_fake(x):
        raise RuntimeError(
            "torch.compile of the Triton MLA ops needs a GPU: the Triton interpreter "
            "(TRITON_INTERPRET=1) runs kernels on real data and cannot be traced"
        )
    return False


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x``, copied only when its last dimension is strided."""
    return x if x.stride(-1) == 1 or x.shape[-1] <= 1 else x.contiguous()
