"""Roofline plots (PNG, matplotlib when installed): one per native ISA level, our kernels at that
level and the peer kernels measured in the same run, against that run's measured roof
(min(peak, bandwidth x intensity)).

``python -m benchmarks plot`` redraws them from ``decode-latest.md`` (every section of it: a
run at the host's levels and, e.g., a run with an AVX2-only CPU imitated), one
``roofline-<isa>-latest.png`` per level, titled with that section's CPU, torch capability and
load. matplotlib is an optional dependency of the benchmarks only (``pip install matplotlib``),
never of the package.
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from mla_backend.testing import host

from . import harness
from .problems import flops_bytes

COLORS = {"ours": "tab:blue", "CPU_MLA": "tab:orange", "AMX_MLA": "tab:red", "torch": "tab:gray"}
Points = dict[str, list[tuple[float, float]]]


def roofline_per_isa(name: str, points: Points, peak: float, bw: float,
                     ceilings: dict[str, float], out: Path | None = None,
                     subtitle: str | None = None) -> list[Path]:  # fmt: skip
    """Write ``roofline-<isa>-latest.png`` per level of ``ceilings`` (ISA level -> its own
    compute ceiling) from ``points`` (kernel label -> [(FLOP/byte, FLOP/s)]; labels "ours <isa>
    <cache>" or "<peer> <cache>"), the run's roof (``peak``, ``bw``) and the level's own.
    ``subtitle`` names the CPU and setting (default: this process's CPU and torch capability)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no roofline plot: matplotlib is not installed (pip install matplotlib)")
        return []
    if subtitle is None:
        subtitle = f"{host.cpu_model()}, torch CPU capability {host.torch_capability()}"
    xs = [x for pts in points.values() for x, _ in pts]
    lo, hi = min(xs) / 2, max(xs) * 2
    grid = [lo * (hi / lo) ** (i / 199) for i in range(200)]
    written = []
    for isa, ceiling in ceilings.items():
        fig, ax = plt.subplots(figsize=(9, 6))
        roof = f"roof (run's best probes): {peak / 1e12:.2f} TFLOP/s, {bw / 1e9:.1f} GB/s"
        ax.plot(grid, [min(peak, bw * x) / 1e9 for x in grid], "-", color="black", label=roof)
        own = ceiling
        ax.plot(grid, [min(own, bw * x) / 1e9 for x in grid], "--", color="tab:blue",
                label=f"{isa} ceiling: {own / 1e12:.3f} TFLOP/s")  # fmt: skip
        for label, pts in sorted(points.items()):
            parts = label.split()
            if parts[0] == "ours" and parts[1] != isa:
                continue
            ax.scatter([x for x, _ in pts], [y / 1e9 for _, y in pts], s=36,
                       color=COLORS.get(parts[0], "tab:purple"),
                       marker="o" if parts[-1] == "bf16" else "^", label=label)  # fmt: skip
        shown = [(x, y) for lab, pts in points.items() for x, y in pts
                 if lab.split()[0] != "ours" or lab.split()[1] == isa]  # fmt: skip
        above = sum(y > min(peak, bw * x) * 1.02 for x, y in shown)
        if above:
            ax.text(0.01, 0.99, f"{above} of {len(shown)} points above the in-run roof: the "
                    "probes ran on a loaded, shared machine", transform=ax.transAxes,
                    fontsize=7, va="top")  # fmt: skip
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("arithmetic intensity (FLOP / byte)")
        ax.set_ylabel("achieved GFLOP/s")
        ax.set_title(f"MLA {name}, our kernels at {isa}\n{subtitle}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
        fig.tight_layout()
        path = (harness.RESULTS if out is None else out) / f"roofline-{isa}-latest.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        print(f"wrote {path}")
        written.append(path)
    return written


# -- redrawing from decode-latest.md ----------------------------------------------------------
@dataclass
class DecodeRun:
    """One section of ``decode-latest.md``: its title line's time, host line, whether an
    AVX2-only CPU was imitated, each level's compute ceiling (FLOP/s), the table's points and
    the run's roof: its best probes (``peak``, ``bw``) where the section states them (robust
    roofline), else the medians of the per-shape probe columns (older sections)."""

    stamp: str
    host_line: str
    imitated: bool
    ceilings: dict[str, float] = field(default_factory=dict)
    peak: float | None = None
    bw: float | None = None
    points: Points = field(default_factory=dict)
    peaks: list[float] = field(default_factory=list)
    bws: list[float] = field(default_factory=list)

    def subtitle(self) -> str:
        def grab(pattern: str) -> str:
            m = re.search(pattern, self.host_line)
            return m.group(1) if m else "?"

        setting = "an AVX2-only CPU imitated on " if self.imitated else ""
        cpu, cap = grab(r"CPU: (.*?) \("), grab(r"capability (\w+)")
        load = grab(r"load average ([\d.]+)")
        return (
            f"{setting}{cpu}, torch CPU capability {cap}\n"
            f"run {self.stamp}, load average {load} (shared machine)"
        )


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def parse_decode(text: str) -> list[DecodeRun]:
    """Every run (section) of a ``decode-latest.md`` with a table; raises ValueError naming
    what is missing when a section's table lacks the H / batch / kv / peak / bw columns."""
    runs: list[DecodeRun] = []
    preamble: list[str] = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"#+ Absorbed MLA decode.*\((\S+)\)\s*$", line)
        if m:
            host_line = next((x for x in lines[i + 1 :] if x.startswith("CPU:")), "")
            imitated = "imitated" in " ".join(preamble[-3:]) or (
                "capability AVX2" in host_line and "avx512" in host_line
            )
            runs.append(DecodeRun(m.group(1), host_line, imitated))
            preamble = []
            continue
        preamble.append(line)
        if runs and line.startswith("- ") and "measured once before the shapes" in line:
            tail = line.split("measured once before the shapes):", 1)[1]
            for isa, tf in re.findall(r"(\w+) ([\d.]+)", tail.replace("TFLOP/s", "")):
                runs[-1].ceilings[isa] = float(tf) * 1e12
        if runs and line.startswith("- compute ceiling for ours <isa>:"):
            own, _, rest = line.partition("; for the peers: ")
            for isa, tf in re.findall(r"(\w+) ([\d.]+) TFLOP/s \(", own):
                runs[-1].ceilings[isa] = float(tf) * 1e12
            peak, bw = re.match(r"([\d.]+) TFLOP/s", rest), re.search(r"; bw ([\d.]+) GB/s", rest)
            if peak and bw:
                runs[-1].peak, runs[-1].bw = float(peak[1]) * 1e12, float(bw[1]) * 1e9
        if runs and line.startswith("|") and not line.startswith("|-"):
            cells = _cells(line)
            if cells[0] == "H":
                header = cells
                need = (["H", "batch", "kv", "peak TF/s", "bw GB/s"],
                        ["H", "batch", "kv", "shape's GEMM TF/s", "shape's bw GB/s"])
                if header[:5] not in need:
                    raise ValueError(f"decode table header {header[:5]}: expected one of {need}")
                continue
            H, B, L = (int(c) for c in cells[:3])
            runs[-1].peaks.append(float(cells[3].split()[0]) * 1e12)
            runs[-1].bws.append(float(cells[4]) * 1e9)
            for col, cell in zip(header[5:], cells[5:]):
                if not col.endswith(" ms (roof)") or cell == "-":
                    continue
                label = col.removesuffix(" ms (roof)")
                f, nb = flops_bytes(H, B, L, label.rsplit(" ", 1)[1])
                t = float(cell.split()[0]) / 1e3
                runs[-1].points.setdefault(label, []).append((f / nb, f / t))
    return [r for r in runs if r.points]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks plot",
                                 description=__doc__.split("\n\n")[1])  # fmt: skip
    ap.add_argument("--results", type=Path, default=harness.RESULTS / "decode-latest.md")
    ap.add_argument("--out", type=Path, default=None, help="folder (default: the results')")
    args = ap.parse_args(argv)
    runs = parse_decode(args.results.read_text())
    if not runs:
        print(f"no decode table in {args.results}")
        return 1
    drawn: dict[str, str] = {}
    for run in runs:
        levels = sorted({k.split()[1] for k in run.points if k.startswith("ours ")})
        ceilings = {isa: run.ceilings.get(isa, math.inf) for isa in levels}
        for isa in levels:
            if isa in drawn:
                print(f"level {isa}: run {run.stamp} replaces run {drawn[isa]}")
            drawn[isa] = run.stamp
        peak = run.peak if run.peak is not None else statistics.median(run.peaks)
        bw = run.bw if run.bw is not None else statistics.median(run.bws)
        roofline_per_isa("decode", run.points, peak, bw, ceilings, out=args.out,
                         subtitle=run.subtitle())  # fmt: skip
    return 0
