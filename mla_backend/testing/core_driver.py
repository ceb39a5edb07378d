"""The torch-free core driver (``tests/native_core/driver.cpp``): its targets, their builds and
runs, and its case / output files.

A :class:`Target` is one build of the driver: an x86-64 ISA level compiled for this host (plain,
or with ``-fsanitize=address,undefined -fno-sanitize-recover=all``), or an aarch64 level
cross-compiled static (``aarch64-linux-gnu-g++``) and run under ``qemu-aarch64 -cpu max`` at an
SVE vector length. The levels and their flags come from ``mla_backend.ops.native.isa``
(:func:`~mla_backend.ops.native.isa.arch_levels`, ``level_flags``); the sources are the
kernels' ``csrc/`` with no torch include path, so an ATen include fails the build.

Case files are records (u32 name length, name, u64 byte count, bytes; little endian): ints are
one int64, floats one float64, strings their bytes, tensors their raw bytes. The driver writes
``<case>.out`` in the same format (``error`` holds a refusal's message).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..ops.native import build, isa

DRIVER = Path(__file__).resolve().parents[2] / "tests" / "native_core" / "driver.cpp"
SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]
# zero reports: UBSan stops at its first report, ASan's leak check on
SANITIZER_ENV = {
    "ASAN_OPTIONS": "detect_leaks=1:abort_on_error=0:exitcode=86",
    "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1:exitcode=87",
}
CROSS_CXX = "aarch64-linux-gnu-g++"
QEMU = "qemu-aarch64"
SVE_VL_BITS = (128, 256, 512)


@dataclass(frozen=True)
class Target:
    """One build of the driver and how to run it."""

    arch: str  # "x86_64" or "aarch64"
    level: str
    sanitize: bool = False
    vl_bits: int | None = None  # aarch64: the SVE vector length qemu gives the process

    @property
    def name(self) -> str:
        tail = "-asan-ubsan" if self.sanitize else ""
        vl = f"-vl{self.vl_bits}" if self.vl_bits else ""
        return f"{self.arch}-{self.level}{tail}{vl}"

    @property
    def emulated(self) -> bool:
        return self.arch != "x86_64"

    def compiler(self) -> str | None:
        if self.emulated:
            return shutil.which(CROSS_CXX)
        return shutil.which("c++") or shutil.which("g++")

    def flags(self) -> list[str]:
        vl = {"vector_bits": self.vl_bits} if self.vl_bits else {}  # SVE: built per length
        flags = isa.level_flags(self.level, **vl) + ["-pthread", f"-I{build._CSRC}"]
        if self.sanitize:
            flags += ["-O1", "-g", *SANITIZE]  # the later -O1 wins over the level's -O3
        if self.emulated:
            flags.append("-static")
        return flags

    def command(self, exe: Path, *args: str) -> list[str]:
        if not self.emulated:
            return [str(exe), *args]
        cpu = "max"
        if self.vl_bits:
            vq = self.vl_bits // 128
            cpu += f",sve-max-vq={vq},sve-default-vector-length={self.vl_bits // 8}"
        return [QEMU, "-cpu", cpu, str(exe), *args]

    def env(self) -> dict[str, str]:
        return {**os.environ, **(SANITIZER_ENV if self.sanitize else {})}

    def missing_tools(self) -> list[str]:
        need = [CROSS_CXX, QEMU] if self.emulated else ["c++"]
        have = {CROSS_CXX: shutil.which(CROSS_CXX), QEMU: shutil.which(QEMU)}
        have["c++"] = self.compiler()
        return [t for t in need if not have[t]]


def uses_sve(level: str) -> bool:
    """Whether a level's code depends on the SVE vector length: its flags enable SVE, or
    ``isa.level_flags`` wants the vector length it is built for (``vector_bits``)."""
    try:
        flags = isa.level_flags(level)
    except ValueError:  # no default vector length on this host: a per-length build
        return True
    return any("sve" in f for f in flags)


def targets(host_levels: Sequence[str]) -> list[Target]:
    """Every target: each of ``host_levels`` (x86-64) plain and sanitized, each aarch64 level
    (at every SVE vector length of :data:`SVE_VL_BITS` where it uses SVE)."""
    out = [Target("x86_64", lvl) for lvl in host_levels]
    out += [Target("x86_64", lvl, sanitize=True) for lvl in host_levels]
    for lvl in isa.arch_levels("aarch64"):
        vls = SVE_VL_BITS if uses_sve(lvl) else (None,)
        out += [Target("aarch64", lvl, vl_bits=vl) for vl in vls]
    return out


def compile_driver(target: Target, out_dir: Path) -> Path:
    """The driver built for ``target`` under ``out_dir`` (reused while sources and flags are
    the same); RuntimeError with the compiler's output if the build fails."""
    cxx = target.compiler()
    if cxx is None:
        raise RuntimeError(f"{target.name}: no compiler ({', '.join(target.missing_tools())})")
    h = hashlib.sha1(" ".join([cxx, *target.flags()]).encode())
    for src in [DRIVER, *sorted(build._CSRC.iterdir())]:
        h.update(src.read_bytes())
    key = h.hexdigest()[:12]
    exe = out_dir / f"driver-{target.arch}-{target.level}{'-san' if target.sanitize else ''}-{key}"
    if not exe.exists():
        tmp = exe.with_suffix(".tmp")
        res = subprocess.run(
            [cxx, *target.flags(), str(DRIVER), "-o", str(tmp)], capture_output=True, text=True
        )
        if res.returncode != 0:
            raise RuntimeError(f"{target.name}: build failed\n{res.stderr[-6000:]}")
        tmp.rename(exe)
    return exe


def run_driver(
    target: Target, exe: Path, args: Sequence[str], timeout: float
) -> subprocess.CompletedProcess[str]:
    """One driver process of ``target`` over ``args`` (case files, or ``--info``)."""
    return subprocess.run(
        target.command(exe, *args), capture_output=True, text=True, timeout=timeout,
        env=target.env(),
    )  # fmt: skip


# ---- case and output files ------------------------------------------------------------------
Field = int | float | str | bytes | torch.Tensor


def encode(value: Field) -> bytes:
    """The bytes of one field (tensors: their values, contiguous)."""
    if isinstance(value, bool | int):
        return struct.pack("<q", int(value))
    if isinstance(value, float):
        return struct.pack("<d", value)
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bytes):
        return value
    t = value.detach().contiguous()
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def write_case(path: Path, **fields: Field) -> None:
    """A case file of ``fields`` (see the module docstring)."""
    parts = []
    for name, value in fields.items():
        data = encode(value)
        parts += [struct.pack("<I", len(name)), name.encode(), struct.pack("<Q", len(data)), data]
    path.write_bytes(b"".join(parts))


def read_output(path: Path) -> dict[str, bytes]:
    """The records of a driver output file."""
    data, out, pos = path.read_bytes(), {}, 0
    while pos < len(data):
        (nl,) = struct.unpack_from("<I", data, pos)
        name = data[pos + 4 : pos + 4 + nl].decode()
        (nb,) = struct.unpack_from("<Q", data, pos + 4 + nl)
        start = pos + 12 + nl
        out[name] = data[start : start + nb]
        pos = start + nb
    return out


def tensor(data: bytes, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """A driver output's bytes as a tensor of ``dtype`` and ``shape``."""
    if not data:
        return torch.empty(tuple(shape), dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype).view(tuple(shape))
