"""The roofline a benchmark judges its kernels against, measured in the same run and robust to
a shared machine: every ceiling is the best of many samples taken between the kernels' timing
rounds (load only ever lowers a sample, so the best of the run is the least flattering roof).

Compute ceilings (FLOP/s, all threads): torch's 1024^3 GEMM in bf16 and fp32 in this process;
per native ISA level the better of torch's GEMM with its kernels capped at that level (a child
process: ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS) and the FMA peak of
our own loop at that level (``benchmarks/micro/dot_throughput.cpp --peak``: 12 independent
vfmadd231ps chains per thread, ymm at avx2, zmm at avx512, and vdpbf16ps where better). Read
bandwidth: the better of torch's fp32 sum over 256 MiB and the micro benchmark's 32-byte-load
stream over 256 MiB. A kernel's roof is min(ceiling, intensity x bandwidth); a share above 100%
means a probe was beaten, and the table flags it (:func:`roof_cell`).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from mla_backend_integrations._testing.cpu_imitation import CAPS

MICRO_SRC = Path(__file__).resolve().parent / "micro" / "dot_throughput.cpp"

# FLOP/s of an fp32 and (argv[1] == "bf16") a bf16 n^3 GEMM, one line each; a dtype whose first
# call takes over 0.5 s (bf16 without bf16 dot products) is judged by that call alone
_GEMM_PROBE = """
import sys, time, torch
n = 1024
for dt in (torch.float32, torch.bfloat16)[: 2 if sys.argv[1] == "bf16" else 1]:
    best = 0.0
    a, b = torch.randn(n, n).to(dt), torch.randn(n, n).to(dt)
    t0 = time.perf_counter()
    torch.mm(a, b)
    first = time.perf_counter() - t0
    best = max(best, 2 * n**3 / first)
    for _ in range(3 if first < 0.5 else 0):
        k, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < 0.2:
            torch.mm(a, b)
            k += 1
        best = max(best, 2 * n**3 * k / (time.perf_counter() - t0))
    print(best)
"""


def isa_gemm_ceiling(isa: str, bf16: bool = True) -> dict[str, float]:
    """torch's best 1024^3 GEMM in fp32 (and bf16) in a child process whose torch kernels are
    capped at ``isa``: {"fp32": FLOP/s, "bf16": FLOP/s}."""
    env = dict(os.environ, **CAPS[isa])
    out = subprocess.run([sys.executable, "-c", _GEMM_PROBE, "bf16" if bf16 else "fp32"],
                         env=env, capture_output=True, text=True, timeout=600,
                         check=True)  # fmt: skip
    return dict(zip(("fp32", "bf16"), map(float, out.stdout.split())))


def micro_binary() -> Path | None:
    """``dot_throughput.cpp`` built once per source version (g++ or $CXX, -O2, no -m flags: each
    loop carries its own target); None where no compiler is found or the build fails."""
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        return None
    digest = hashlib.sha256(MICRO_SRC.read_bytes()).hexdigest()[:12]
    exe = Path(tempfile.gettempdir()) / f"mla_backend_micro_{os.getuid()}" / f"dot-{digest}"
    if not exe.exists():
        exe.parent.mkdir(parents=True, exist_ok=True)
        tmp = exe.with_suffix(f".{os.getpid()}")
        build = subprocess.run([cxx, "-O2", "-pthread", str(MICRO_SRC), "-o", str(tmp)],
                               capture_output=True, text=True)  # fmt: skip
        if build.returncode != 0:
            print(f"micro benchmark not built: {build.stderr[-500:]}", file=sys.stderr)
            return None
        tmp.replace(exe)
    return exe


def roof_fraction(flops: float, nbytes: float, t: float, peak: float, bw: float) -> float:
    """Achieved share of min(peak, intensity x bandwidth) for a kernel taking ``t`` seconds."""
    return max(flops / peak, nbytes / bw) / t


def roof_cell(share: float) -> str:
    """A roof share for a table: above 100% is flagged with '!' (a probe was beaten)."""
    return f"{share:.0%}" + ("!" if share > 1.0 else "")


ROOF_FLAG_NOTE = (
    "a roof share marked '!' is above 100%: the kernel beat a ceiling measured in this run "
    "(data resident in cache beating the streaming read, or every sample of a probe disturbed); "
    "it is not a measurement of the kernel"
)


@dataclass
class ShapeProbes:
    """One shape's own probe results (its interleaved rounds): shown next to it, to show load."""

    peak: float
    bw: float
    which: str


class Roofline:
    """This run's roofline. ``probes()`` go among the kernels (timed in the same interleaved
    rounds), ``sample(round)`` is the rounds' hook (the micro benchmark at ``isas`` every round,
    torch's capped GEMM per level in round 0), ``take(times)`` takes the probes' times out of a
    shape's results; the ceilings (``peak``, ``ceiling``, ``bw``) are the best over the run."""

    def __init__(self, isas: Sequence[str] = (), n: int = 1024, mbytes: int = 256,
                 capped: bool = True) -> None:  # fmt: skip
        g = torch.Generator().manual_seed(0)
        self.isas, self.n, self.mbytes, self.capped = list(isas), n, mbytes, capped
        self.a32 = torch.randn(n, n, generator=g)
        self.b32 = torch.randn(n, n, generator=g)
        self.a16, self.b16 = self.a32.bfloat16(), self.b32.bfloat16()
        self.stream32 = torch.randn(mbytes * (1 << 20) // 4, generator=g)
        self.micro = micro_binary()
        self.best: dict[str, float] = {}  # probe -> best value over the run
        self.count: dict[str, int] = {}  # probe -> samples taken

    def _record(self, key: str, value: float) -> None:
        self.best[key] = max(self.best.get(key, 0.0), value)
        self.count[key] = self.count.get(key, 0) + 1

    def _slow_bf16(self, prefix: str) -> bool:
        """bf16 GEMM measured below a tenth of fp32's (no bf16 dot products): not worth timing
        again (one call takes seconds), its best stays recorded."""
        bf16, fp32 = self.best.get(f"{prefix} bf16"), self.best.get(f"{prefix} fp32")
        return bf16 is not None and fp32 is not None and bf16 < 0.1 * fp32

    def probes(self) -> dict[str, Callable[[], object]]:
        fns: dict[str, Callable[[], object]] = {
            "_gemm_fp32": lambda: torch.mm(self.a32, self.b32),
            "_stream": lambda: self.stream32.sum(),
        }
        if not self._slow_bf16("torch gemm"):
            fns["_gemm_bf16"] = lambda: torch.mm(self.a16, self.b16)
        return fns

    def sample(self, rnd: int) -> None:
        """One round's samples: the micro benchmark's FMA peaks and stream; in round 0 also
        torch's GEMM capped at each level."""
        threads = str(torch.get_num_threads())
        if self.micro is not None:
            args = [str(self.micro), "--threads", threads, "--stream", str(self.mbytes)]
            if self.isas:
                args += ["--peak", ",".join(self.isas)]
            out = subprocess.run(args, capture_output=True, text=True, timeout=120).stdout
            for line in out.splitlines():
                parts = line.split()
                if parts and parts[0] == "peak" and float(parts[2]) > 0:
                    self._record(f"fma {parts[1]}", float(parts[2]))
                elif parts and parts[0] == "stream":
                    self._record("stream ours", float(parts[1]))
        if rnd == 0 and self.capped:
            for isa in self.isas:
                got = isa_gemm_ceiling(isa, bf16=not self._slow_bf16(f"gemm {isa}"))
                for dt, v in got.items():
                    self._record(f"gemm {isa} {dt}", v)

    def take(self, times: dict[str, float]) -> ShapeProbes:
        """Remove the probes' times from ``times`` (recording them); this shape's own values."""
        gemm = {k: 2 * self.n**3 / times.pop(f"_gemm_{k}")
                for k in ("bf16", "fp32") if f"_gemm_{k}" in times}  # fmt: skip
        bw = self.stream32.numel() * 4 / times.pop("_stream")
        for k, v in gemm.items():
            self._record(f"torch gemm {k}", v)
        self._record("torch stream", bw)
        which = max(gemm, key=lambda k: gemm[k])
        return ShapeProbes(gemm[which], bw, which)

    def _best_of(self, keys: Sequence[str]) -> tuple[float, str]:
        found = [(self.best[k], k) for k in keys if k in self.best]
        return max(found) if found else (float("nan"), "none")

    def peak(self) -> tuple[float, str]:
        """The best compute ceiling measured in this process (torch's GEMMs, our FMA loops)."""
        return self._best_of(["torch gemm bf16", "torch gemm fp32"]
                             + [f"fma {i}" for i in self.isas])  # fmt: skip

    def ceiling(self, isa: str) -> tuple[float, str]:
        """One level's own compute ceiling: torch's GEMM capped at it, our FMA loop at it."""
        return self._best_of([f"gemm {isa} bf16", f"gemm {isa} fp32", f"fma {isa}"])

    def bw(self) -> tuple[float, str]:
        """The best streaming read of the run (bytes/s)."""
        return self._best_of(["torch stream", "stream ours"])

    def summary(self) -> str:
        """Every probe's best over the run and its number of samples, for the notes."""

        def fmt(k: str) -> str:
            v = self.best[k]
            unit = f"{v / 1e9:.1f} GB/s" if "stream" in k else f"{v / 1e12:.3f} TFLOP/s"
            return f"{k} {unit} (best of {self.count[k]})"

        return "; ".join(fmt(k) for k in sorted(self.best))
