"""Launching the Triton ops' kernels, or recording the launches instead: a Triton kernel goes
through ``torch.library.wrap_triton`` (so ``torch.compile`` traces it), a Gluon kernel is
launched directly; within :func:`record_launches` every launch is recorded (kernel, grid,
arguments, constexprs) for the compute capability the recording names, and nothing runs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.library import wrap_triton

from ..jit import heuristics as hx


@dataclass(frozen=True)
class Launch:
    """One recorded kernel launch (see :func:`record_launches`): the kernel, its grid, its
    positional arguments and its keyword arguments (constexprs and launch options)."""

    kernel: object
    grid: tuple[int, ...]
    args: tuple[object, ...]
    kwargs: dict[str, object]


#: the launches recorded instead of run, while :func:`record_launches` is active
_RECORDING: list[list[Launch]] = []
#: the compute capability each active :func:`record_launches` records for (None: any)
_RECORDING_ARCH: list[int | None] = []


@contextlib.contextmanager
def record_launches(arch: int | None = None) -> Iterator[list[Launch]]:
    """Within this block the ops record their kernel launches (with the constexprs a GPU
    compile gets, also under the interpreter) instead of running them, on any device's
    tensors: what the ahead-of-time resource check (``python -m benchmarks gpu-resources``)
    compiles is exactly what a call launches. ``arch``: the compute capability (90: sm_90,
    100: sm_100) the calls are recorded for, which decides the kernels that serve them (the
    Gluon kernel serves Hopper only); None: any."""
    launches: list[Launch] = []
    _RECORDING.append(launches)
    _RECORDING_ARCH.append(arch)
    try:
        yield launches
    finally:
        _RECORDING.pop()
        _RECORDING_ARCH.pop()


def recording() -> bool:
    """True within :func:`record_launches`."""
    return bool(_RECORDING)


def target_arch(device: torch.device) -> int | None:
    """The compute capability a call on ``device`` launches for (major * 10 + minor): the
    recorded one while :func:`record_launches` is active, the CUDA device's otherwise; None
    when unknown (recording for any arch, a CPU device, ROCm)."""
    if _RECORDING:
        return _RECORDING_ARCH[-1]
    if device.type != "cuda" or torch.version.hip is not None:
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def interpreting() -> bool:
    """Run on the Triton interpreter (and not recording launches for a GPU compile)."""
    return hx.interpreting() and not _RECORDING


def launch(kernel: object, grid: tuple[int, ...], *args: object, **kwargs: object) -> None:
    """Launch ``kernel`` on ``grid`` (or record the launch, see :func:`record_launches`)."""
    if _RECORDING:
        _RECORDING[-1].append(Launch(kernel, grid, args, kwargs))
        return
    if type(kernel).__name__.startswith("Gluon"):
        # launched directly: torch's wrap_triton analyses Triton (not Gluon) kernels' IR, so
        # the Gluon path runs eagerly (and is not traced by torch.compile)
        kernel[grid](*args, **kwargs)
        return
    wrap_triton(kernel)[grid](*args, **kwargs)
