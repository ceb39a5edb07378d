"""Roofline plot (PNG) of the native CPU kernel benchmarks: x = arithmetic intensity (FLOP/byte),
y = achieved GFLOP/s, the measured roof (min(peak, bandwidth x intensity)) and one point per
kernel and shape, decode (circles) and extend (triangles).

How to run (after the benchmarks have written their tables; matplotlib required:
``pip install matplotlib``):

    python benchmarks/roofline_plot.py [--decode benchmarks/results/native_decode-latest.md]
        [--extend benchmarks/results/native_extend-latest.md] [--out PATH.png]

It writes ``benchmarks/results/roofline-<UTC stamp>.png`` and ``roofline-latest.png`` (or
``--out``). Inputs are the markdown tables of ``native_decode_bench.py`` and
``native_extend_bench.py``; columns are found by header name: the shape columns (``H``,
``batch`` and ``kv`` for decode; ``H``, ``batch``, ``prefix``, ``new`` for extend), the
measured ``peak TF/s`` and ``bw GB/s`` of each row, and every ``<kernel> <cache dtype> ms``
column (``native bf16 ms``, ``vLLM bf16 ms``, ``native fp8_ds_mla ms``, ...): columns that are
absent are skipped, ``nan`` cells too. FLOPs and bytes are recomputed from the shape (decode:
2 H kv (2r + rope) per request over the cache rows; extend: ``native_extend_bench``'s causal
count over cache rows plus bf16 q and o). Each table's roof is drawn from the median peak and
bandwidth its own run measured (decode solid, extend dashed: the machine is shared, so the two
runs may have seen different loads), and, dotted, from the best of both (its quietest moment).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS

R, ROPE = 512, 64
#: bytes of one cached token row per cache dtype (fp8_ds_mla: 512 e4m3 + 4 fp32 scales + 64 bf16)
ROW_BYTES = {"bf16": 1152, "fp16": 1152, "fp32": 2304, "fp8": 576, "fp8_ds_mla": 656}
COLORS = {"native": "tab:blue", "vLLM": "tab:red", "torch": "tab:gray", "triton": "tab:green"}
MARKERS = {"decode": "o", "extend": "^"}


def read_table(path: Path) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the first markdown table in ``path``."""
    header, rows = None, []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line.startswith("|"):
            if header is not None:
                break
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if header is None:
            header = cells
        elif set(line) <= set("|-: "):
            continue
        else:
            rows.append(cells)
    if header is None:
        raise ValueError(f"{path}: no markdown table found")
    return header, rows


def decode_work(row: dict[str, str], row_bytes: int) -> tuple[float, float]:
    H, B, L = int(row["H"]), int(row["batch"]), int(row["kv"])
    return 2.0 * H * L * (2 * R + ROPE) * B, float(B * L * row_bytes)


def extend_work(row: dict[str, str], row_bytes: int) -> tuple[float, float]:
    from native_extend_bench import extend_bytes, extend_flops

    shape = int(row["H"]), int(row["batch"]), int(row["prefix"]), int(row["new"])
    return extend_flops(*shape), extend_bytes(*shape, row_bytes)


def points(path: Path, kind: str):
    """(kernel label, intensity FLOP/B, GFLOP/s) per kernel column and row, and the rows'
    measured (peak FLOP/s, bandwidth B/s)."""
    header, rows = read_table(path)
    work = decode_work if kind == "decode" else extend_work
    kernels = []
    for i, h in enumerate(header):
        parts = h.split()
        if len(parts) == 3 and parts[2] == "ms" and parts[1] in ROW_BYTES:
            kernels.append((i, parts[0], parts[1]))
    out, roofs = [], []
    for cells in rows:
        row = dict(zip(header, cells))  # duplicate names (roof): shape columns are unique
        try:
            roofs.append((float(row["peak TF/s"]) * 1e12, float(row["bw GB/s"]) * 1e9))
        except (KeyError, ValueError):
            pass
        for i, name, dtype in kernels:
            try:
                ms = float(cells[i])
            except (IndexError, ValueError):
                continue
            if ms != ms or ms <= 0:  # nan: skipped in the run
                continue
            flops, nbytes = work(row, ROW_BYTES[dtype])
            out.append((f"{name} {dtype}", flops / nbytes, flops / (ms * 1e-3) / 1e9))
    return out, roofs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--decode", type=Path, default=RESULTS / "native_decode-latest.md")
    ap.add_argument("--extend", type=Path, default=RESULTS / "native_extend-latest.md")
    ap.add_argument("--out", type=Path, default=None, help="PNG path (default: results/)")
    args = ap.parse_args()
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("roofline_plot.py needs matplotlib: pip install matplotlib")

    series, roofs = {}, {}
    for kind, path in (("decode", args.decode), ("extend", args.extend)):
        if not path.exists():
            print(f"{path} not found: no {kind} points")
            continue
        pts, rf = points(path, kind)
        if rf:
            roofs[kind] = rf
        for label, x, y in pts:
            series.setdefault((kind, label), []).append((x, y))
    if not series:
        sys.exit("no benchmark tables to plot")

    fig, ax = plt.subplots(figsize=(10, 6.5))
    xs = [x for v in series.values() for x, _ in v]
    lo, hi = min(xs) / 2, max(xs) * 2
    n = 200
    grid = [lo * (hi / lo) ** (i / (n - 1)) for i in range(n)]
    lines = [
        (kind, statistics.median(p for p, _ in rf), statistics.median(b for _, b in rf))
        for kind, rf in roofs.items()
    ]
    if roofs:
        every = [r for rf in roofs.values() for r in rf]
        lines.append(("best", max(p for p, _ in every), max(b for _, b in every)))
    style = {"decode": "-", "extend": "--", "best": ":"}
    for tag, peak, bw in lines:
        ax.plot(
            grid,
            [min(peak, bw * x) / 1e9 for x in grid],
            style[tag],
            color="black",
            lw=1.0 if tag == "best" else 1.5,
            label=f"roof, {tag if tag == 'best' else tag + ' run median'}: "
            f"{peak / 1e12:.2f} TFLOP/s, {bw / 1e9:.1f} GB/s",
        )
    for (kind, label), pts in sorted(series.items()):
        name, dtype = label.split()
        face = COLORS.get(name, "tab:purple")
        ax.scatter(
            [x for x, _ in pts],
            [y for _, y in pts],
            marker=MARKERS[kind],
            s=36,
            color=face if dtype == "bf16" else "none",
            edgecolors=face,
            linewidths=1.2,
            alpha=0.85 if dtype != "fp8_ds_mla" else 0.6,
            label=f"{kind} {label}",
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("achieved GFLOP/s")
    ax.set_title("MLA absorbed attention on CPU: decode and extend vs the measured roofline")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right", ncol=2)
    fig.tight_layout()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H%M%SZ")
    outs = [args.out] if args.out else [RESULTS / f"roofline-{stamp}.png"]
    if not args.out:
        outs.append(RESULTS / "roofline-latest.png")
    for out in outs:
        fig.savefig(out, dpi=120)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
