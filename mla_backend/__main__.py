"""``python -m mla_backend info``: what runs here and why (the resolved selection of every
device this process sees), the CPU, the native builds present, which implementation's code
serves each seam method in every registered implementation, and the configuration variables.

Resolving the CPU builds the native kernels when none is built yet (about a minute, once).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path
from typing import TextIO

import torch

from . import __version__, config
from .ops.base import SEAM_METHODS
from .ops.registry import IMPLS
from .selection import resolve
from .testing.host import cpu_flags, cpu_model, has_amx, torch_capability

#: the CPU flags that decide what our kernels can run
ISA_FLAGS = (
    "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16",
    "avx512_vnni", "amx_tile", "amx_bf16", "asimd", "asimdhp", "bf16", "sve", "svebf16", "sve2",
)


def native_builds() -> list[str]:
    """The native kernel builds in torch's extensions directory (one per ISA level and source
    version), newest first."""
    from torch.utils.cpp_extension import get_default_build_root

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    if not root.is_dir():
        return []
    dirs = [so.parent for so in root.glob("**/mla_backend_native_*/*.so")]
    return [d.name for d in sorted(dirs, key=lambda d: d.stat().st_mtime, reverse=True)]


def seam_table() -> list[str]:
    """Lines of the table of who serves each seam method (rows) in every registered
    implementation (columns): the implementation whose code runs (``torch``: delegated to the
    torch implementation); an implementation that cannot be imported here says why below."""
    cols, missing = {}, []
    for name in IMPLS.names():
        try:
            cols[name] = IMPLS.entry(name).methods()
        except ImportError as e:
            cols[name] = {}
            missing.append(f"  {name}: cannot be imported here ({e})")
    width = max(len(m) for m in SEAM_METHODS) + 2
    lines = ["  " + "seam method".ljust(width) + "".join(f"{n:<12}" for n in cols)]
    for m in SEAM_METHODS:
        lines.append("  " + m.ljust(width) + "".join(f"{c.get(m, '-'):<12}" for c in cols.values()))
    return [line.rstrip() for line in lines] + missing


def info(out: TextIO = sys.stdout) -> None:
    """Print the report (see the module doc)."""
    p = print
    p(f"mla-backend {__version__}: torch {torch.__version__}, Python "
      f"{platform.python_version()}, {platform.machine()}", file=out)
    flags = cpu_flags()
    p(f"CPU: {cpu_model()}; torch CPU capability {torch_capability()}; AMX tiles usable: "
      f"{'yes' if has_amx() else 'no'}", file=out)
    p("  ISA flags: " + (" ".join(f for f in ISA_FLAGS if f in flags) or "none"), file=out)
    builds = native_builds()
    p("native builds present: " + (", ".join(builds) if builds else "none yet"), file=out)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for dev in devices:
        try:
            p(resolve(dev).report(), file=out)
        except (ValueError, RuntimeError) as e:
            p(f"device {dev}: cannot resolve: {e}", file=out)
    p("seam methods: whose code serves each (torch = delegated to the torch implementation):",
      file=out)
    for line in seam_table():
        p(line, file=out)
    p("configuration (MLA_BACKEND_*; set values marked *):", file=out)
    s = config.current()
    for v in config.VARIABLES:
        mark = "*" if s.is_set(v.name) else " "
        value = s.value(v.name) or "(unset)"
        p(f" {mark} {v.name:<38} {value:<12} {v.meaning}", file=out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mla_backend", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="what runs here and why")
    args = parser.parse_args(argv)
    if args.command == "info":
        info()
    return 0


if __name__ == "__main__":
    sys.exit(main())
