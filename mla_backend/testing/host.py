"""The host a demo or benchmark runs on: CPU model, torch's CPU capability, and our native
kernels' ISA levels (which ones this CPU executes, which one a process uses, the kernels at a
given level). Shared by ``examples/`` and ``benchmarks/``; every result they print names these.

The levels come from :mod:`mla_backend.ops.native` (``ISA_LEVELS``, ``host_isas()``,
``selected_isa()``, ``Kernels(isa)``).
"""

from __future__ import annotations

import functools
import os
import platform
import subprocess
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..ops import KernelImpl

#: An engine or benchmark process runs our native kernels at this level when set.
ISA_ENV = "MLA_BACKEND_NATIVE_ISA"


def isa_levels() -> tuple[str, ...]:
    """Every level our native kernels know, lowest first."""
    from ..ops import native

    return tuple(native.ISA_LEVELS)


def host_isas() -> tuple[str, ...]:
    """The native levels this CPU can execute, lowest first (empty: no native kernels)."""
    from ..ops import native

    return tuple(native.host_isas())


def selected_isa() -> str:
    """The level this process's native kernels run at (``MLA_BACKEND_NATIVE_ISA`` or the best
    host level); 'unavailable' when the native kernels cannot load here."""
    from ..ops import native

    if not native.available():
        return "unavailable"
    return str(native.selected_isa())


def native_kernels(isa: str | None = None) -> KernelImpl:
    """The native seam implementation (``KernelImpl``) at ``isa`` (None: the selected level)."""
    from ..ops import native

    return native.Kernels(isa)


@functools.cache
def cpu_model() -> str:
    """The CPU's model name (lscpu's "Model name", else /proc/cpuinfo, else platform)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.strip().startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    from ..ops.native.isa import cpuinfo_field

    return cpuinfo_field("model name") or platform.processor() or platform.machine()


def cpu_flags() -> frozenset[str]:
    """The CPU feature flags Linux reports (empty elsewhere)."""
    from ..ops.native.isa import cpuinfo_field

    return frozenset((cpuinfo_field("flags", "Features") or "").split())


def torch_capability() -> str:
    """torch's CPU kernel level (``torch.backends.cpu.get_cpu_capability()``)."""
    import torch

    return str(torch.backends.cpu.get_cpu_capability())


def has_amx() -> bool:
    """AMX tiles usable here (torch's check, which also asks the OS for permission)."""
    import torch

    return bool(torch.cpu._is_amx_tile_supported())


def describe() -> str:
    """One line naming the CPU and ISA levels, for every table and demo output."""
    isas = host_isas()
    from ..config import current

    env = current().native_isa
    return (
        f"CPU: {cpu_model()} ({os.cpu_count()} cores, {platform.machine()}); torch CPU "
        f"capability {torch_capability()}, AMX tiles {'yes' if has_amx() else 'no'}; "
        f"our native kernels: {selected_isa()}"
        + (f" (forced by {ISA_ENV}={env})" if env else "")
        + f", levels this CPU runs: {', '.join(isas) if isas else 'none'}"
    )
