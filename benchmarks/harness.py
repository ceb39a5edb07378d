"""The benchmarks' shared harness: interleaved timing (with a per-round hook: the roofline's
samples, ``benchmarks/roofline.py``), markdown tables, results files (``<name>-latest.md``
plus one appended ``<name>-history.md``), the host line every result names (CPU model, torch
capability, our native ISA levels). Engine server processes are
``mla_backend_integrations._testing.engine_server``'s (imported by the engine benchmarks only,
so the kernel benchmarks run where the integrations are not installed, e.g. a bare GPU box).
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from mla_backend.testing import host

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parents[1]

# host and ISA access (mla_backend.testing.host holds the one line that finds the native API)
host_isas = host.host_isas
selected_isa = host.selected_isa
native_kernels = host.native_kernels
describe_host = host.describe


# -- timing ----------------------------------------------------------------------------------
def best_time(fn: Callable[[], object], repeat: int = 5, min_time: float = 0.05) -> float:
    """Best-of-``repeat`` seconds per call (each repeat runs ``fn`` enough to last min_time)."""
    return interleaved({"fn": fn}, repeat, min_time)["fn"]


def interleaved(
    fns: dict[str, Callable[[], object]], rounds: int, min_time: float,
    each_round: Callable[[int], None] | None = None,
) -> dict[str, float]:
    """Best seconds per call of each function over ``rounds`` interleaved rounds (every round
    times each once for >= ``min_time``, then calls ``each_round(round)``). One whose warm-up
    call takes over a second is timed in the first round only."""
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
        if each_round is not None:
            each_round(rnd)
    return best


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
