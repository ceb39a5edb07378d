"""Roofline plots (PNG, matplotlib when installed): one per native ISA level, our kernels at that
level and the peer kernels measured in the same run, against that run's measured roof
(min(peak, bandwidth x intensity))."""

from __future__ import annotations

from pathlib import Path

from mla_backend.testing import host

from . import harness

COLORS = {"ours": "tab:blue", "CPU_MLA": "tab:orange", "AMX_MLA": "tab:red", "torch": "tab:gray"}


def roofline_per_isa(name: str, points: dict[str, list[tuple[float, float]]], peak: float,
                     bw: float, ceilings: dict[str, float],
                     out: Path | None = None) -> list[Path]:  # fmt: skip
    """Write ``roofline-<isa>-latest.png`` per level of ``ceilings`` (ISA level -> its own
    compute ceiling) from ``points`` (kernel label -> [(FLOP/byte, FLOP/s)]; labels "ours <isa>
    <cache>" or "<peer> <cache>"), the run's roof (``peak``, ``bw``) and the level's own."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no roofline plot: matplotlib is not installed")
        return []
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
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("arithmetic intensity (FLOP / byte)")
        ax.set_ylabel("achieved GFLOP/s")
        ax.set_title(f"MLA {name}, our kernels at {isa}\n{host.cpu_model()}, torch CPU "
                     f"capability {host.torch_capability()}", fontsize=9)  # fmt: skip
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
        fig.tight_layout()
        path = (harness.RESULTS if out is None else out) / f"roofline-{isa}-latest.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        print(f"wrote {path}")
        written.append(path)
    return written
