"""The benchmarks' shared harness: interleaved timing, the roofline measured in the same run
(the ISA's own compute ceiling: the best of a bf16 and an fp32 GEMM; the best streaming read),
markdown tables, results files (``<name>-latest.md`` plus one appended ``<name>-history.md``),
the host line every result names (CPU model, torch capability, our native ISA levels), and
engine server processes (start, wait until ready, stop the whole process group).
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from mla_backend.testing import host
from mla_backend.testing.cpu_imitation import CAPS
from mla_backend.testing.engine_server import Server, free_port

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parents[1]

# host and ISA access (mla_backend.testing.host holds the one line that finds the native API)
host_isas = host.host_isas
selected_isa = host.selected_isa
native_kernels = host.native_kernels
describe_host = host.describe
__all__ = ["Server", "free_port"]  # engine servers (start, wait ready, stop the process group)


# -- timing ----------------------------------------------------------------------------------
def best_time(fn: Callable[[], object], repeat: int = 5, min_time: float = 0.05) -> float:
    """Best-of-``repeat`` seconds per call (each repeat runs ``fn`` enough to last min_time)."""
    return interleaved({"fn": fn}, repeat, min_time)["fn"]


def interleaved(
    fns: dict[str, Callable[[], object]], rounds: int, min_time: float
) -> dict[str, float]:
    """Best seconds per call of each function over ``rounds`` interleaved rounds (every round
    times each once for >= ``min_time``). One whose warm-up call takes over a second is timed
    in the first round only."""
    best = dict.fromkeys(fns, float("inf"))
    slow = set()
    for k, f in fns.items():  # warm-up
        t0 = time.perf_counter()
        f()
        if time.perf_counter() - t0 > 1.0:
            slow.add(k)
    for rnd in range(rounds):
        for k, f in fns.items():
            if k in slow and rnd > 0:
                continue
            n, t0 = 0, time.perf_counter()
            while True:
                f()
                n += 1
                dt = time.perf_counter() - t0
                if dt >= min_time:
                    break
            best[k] = min(best[k], dt / n)
    return best


# -- roofline --------------------------------------------------------------------------------
class Roofline:
    """The probes of this run's roofline, to time among the kernels (same interleaved rounds:
    the machine is shared, each shape is judged against the roofline of its own rounds): an
    n^3 GEMM in bf16 and in fp32 (the compute ceiling is the better: on a CPU without bf16
    dot products torch's bf16 GEMM is far below its fp32 one) and a skinny matmul streaming a
    [rows, 576] bf16 matrix of ``mbytes`` MiB (read bandwidth)."""

    KEYS = ("_gemm_bf16", "_gemm_fp32", "_stream")

    def __init__(self, n: int = 1024, mbytes: int = 256) -> None:
        g = torch.Generator().manual_seed(0)
        self.n = n
        self.a32 = torch.randn(n, n, generator=g)
        self.b32 = torch.randn(n, n, generator=g)
        self.a16, self.b16 = self.a32.bfloat16(), self.b32.bfloat16()
        rows = mbytes * (1 << 20) // (576 * 2)
        self.big = torch.randn(rows, 576, generator=g).bfloat16()
        self.x = torch.randn(16, 576, generator=g).bfloat16()

    def probes(self) -> dict[str, Callable[[], object]]:
        return {
            "_gemm_bf16": lambda: torch.mm(self.a16, self.b16),
            "_gemm_fp32": lambda: torch.mm(self.a32, self.b32),
            "_stream": lambda: torch.mm(self.x, self.big.t()),
        }

    def take(self, times: dict[str, float]) -> tuple[float, float, str]:
        """Remove the probes' times from ``times``; (peak FLOP/s, read bytes/s, which GEMM)."""
        flops = {k: 2 * self.n**3 / times.pop(f"_gemm_{k}") for k in ("bf16", "fp32")}
        which = max(flops, key=lambda k: flops[k])
        return flops[which], self.big.numel() * 2 / times.pop("_stream"), which


_GEMM_PROBE = """
import time, torch
n = 1024
best = 0.0
for dt in (torch.bfloat16, torch.float32):
    a, b = torch.randn(n, n).to(dt), torch.randn(n, n).to(dt)
    torch.mm(a, b)
    for _ in range(3):
        k, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < 0.2:
            torch.mm(a, b)
            k += 1
        best = max(best, 2 * n**3 * k / (time.perf_counter() - t0))
print(best)
"""


def isa_gemm_ceiling(isa: str) -> float:
    """The compute ceiling of one ISA level on this CPU: the better of a bf16 and an fp32
    1024^3 GEMM in a child process whose torch kernels are capped at that level
    (:data:`~mla_backend.testing.cpu_imitation.CAPS`; FLOP/s)."""
    env = dict(os.environ, **CAPS.get(isa, {}))
    out = subprocess.run([sys.executable, "-c", _GEMM_PROBE], env=env, capture_output=True,
                         text=True, timeout=600, check=True)  # fmt: skip
    return float(out.stdout.strip().splitlines()[-1])


def roof_fraction(flops: float, nbytes: float, t: float, peak: float, bw: float) -> float:
    """Achieved share of min(peak, intensity x bandwidth) for a kernel taking ``t`` seconds."""
    return max(flops / peak, nbytes / bw) / t


# -- tables and results ----------------------------------------------------------------------
def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A markdown table, columns right-aligned to their widest cell."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(header)]  # fmt: skip
    line = lambda cells: "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join(
        [line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
        + [line(r) for r in rows]
    )


def utc_stamp() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H%MZ")


def write_result(name: str, title: str, notes: Sequence[str], body: str,
                 out: Path | None = None) -> Path:  # fmt: skip
    """Print a result (title with the UTC time, the host line, notes, body) and keep it as
    ``<name>-latest.md``, appended to ``<name>-history.md`` (newest last)."""
    text = "\n".join(
        [f"# {title} ({utc_stamp()})", "", describe_host() + f"; torch {torch.__version__}, "
         f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f}", ""]
        + [f"- {n}" for n in notes] + ["", body.rstrip(), ""]
    )  # fmt: skip
    print(text)
    out = RESULTS if out is None else out
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}-latest.md").write_text(text)
    hist = out / f"{name}-history.md"
    head = "" if hist.exists() else f"# {name}: every run, oldest first\n\n"
    with hist.open("a") as f:
        f.write(head + "#" + text + "\n")  # one level down: "## title (time)"
    return out / f"{name}-latest.md"
