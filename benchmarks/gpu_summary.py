"""The GPU run's summary (:mod:`benchmarks.gpu_run`): reads the tables the run wrote (whatever
part of them a stage finished), checks the issue's targets and applies the decisions that
``benchmarks/results/gpu-plan.md`` fixed before the run. Pure text processing (no GPU, no
torch), so it is tested on the CPU with tables in the benchmark's format."""

from __future__ import annotations

import math
import re
from pathlib import Path

#: the targets (issue 28), fixed before the run
COPY_PCT_16 = 75.0  # bf16 decode at 16 heads: % of the measured copy bandwidth
GEMM_PCT_128 = 40.0  # bf16 decode at 128 heads: % of the measured bf16 GEMM throughput
VS_FLASHINFER = 1.0  # FlashInfer's ms / ours, at every shape it serves
FP8_SPEEDUP_16 = 1.3  # bf16 ms / fp8 ms at 16 heads
VERIFY_RATIO = 1.3  # 2-token verify ms / 1-token decode ms
#: the decisions' thresholds
FI_DEFAULT = 1.5  # FlashInfer this much faster than our best at 128 heads: CUDA default
KNOB_GAIN = 1.05  # a sweep setting this much faster than the default (same output): default
SAME_OUTPUT = 5e-2  # max |o - o_default| for "same output" (bf16 outputs of magnitude ~1)


def parse_table(text: str, first: str) -> list[dict[str, str]]:
    """Rows of every whitespace table in ``text`` whose header starts with ``first`` (one dict
    per row, keyed by the header's names); rows end at the first line that does not fit."""
    rows, header = [], None
    for line in text.splitlines():
        tokens = line.split()
        if tokens[:1] == [first]:
            header = tokens
            continue
        if header and tokens and re.fullmatch(r"-?\d+", tokens[0]):
            if len(tokens) == len(header):
                rows.append(dict(zip(header, tokens)))
            continue
        if header and tokens and not tokens[0].startswith("("):
            header = None
    return rows


def _f(row: dict[str, str], key: str) -> float:
    try:
        return float(row.get(key, "nan"))
    except ValueError:
        return math.nan


def sections(text: str) -> dict[str, str]:
    """The benchmark's output split by the cache named in each ``device: ...`` line."""
    parts: dict[str, str] = {}
    cache = "bf16"
    for line in text.splitlines():
        m = re.search(r"cache (\w+)", line) if line.startswith("device:") else None
        if m:
            cache = m.group(1)
        parts[cache] = parts.get(cache, "") + line + "\n"
    return parts


def _key(r: dict[str, str]) -> tuple[int, int, int]:
    return int(r["mean_kv"]), int(r["heads"]), int(r["q_len"])


def _fmt(x: float, spec: str = ".2f", unit: str = "") -> str:
    return "n/a" if math.isnan(x) else format(x, spec) + unit


def summarize(out: Path, stages: list[tuple[str, str, float]]) -> str:
    """The summary (markdown) of the run in ``out``; ``stages``: (name, status, seconds)."""
    read = lambda n: (out / n).read_text() if (out / n).exists() else ""  # noqa: E731
    env, bf16_text, fp8_text = read("env.txt"), read("bench_bf16.txt"), read("bench_fp8.txt")
    lines = ["# GPU run summary", "", "```", env.strip()[:900], "```", "",
             "| stage | status | s |", "|---|---|---|"]
    lines += [f"| {n} | {s} | {t:.0f} |" for n, s, t in stages]
    tests = read("pytest.log")
    m = re.findall(r"^.*\b(?:passed|failed|error)\b.*$", tests, re.M)
    lines += ["", f"GPU tests: {m[-1].strip() if m else 'no result line'}"]
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", tests, re.M)
    lines += [f"- FAILED {x}" for x in failed[:20]]
    fi = read("flashinfer.log")
    lines += [f"FlashInfer: {x}" for x in re.findall(r"^(?:flashinfer \S+|fa3 MLA .*|.*"
                                                      r"(?:passed|failed).*)$", fi, re.M)[-3:]]

    # bench_bf16.txt: the main table (Triton, FlashInfer, ceilings), then the Gluon stage's
    # (Triton and Gluon timed side by side in one process)
    bf16: dict[tuple[int, int, int], dict[str, str]] = {}
    glu: dict[tuple[int, int, int], dict[str, str]] = {}
    for r in parse_table(bf16_text, "batch"):
        (glu if "gluon_ms" in r else bf16)[_key(r)] = r
    m = re.search(r"measured: bf16 GEMM (\d+) TFLOP/s, copy (\d+) GB/s", bf16_text)
    gemm, copy = (float(m.group(1)), float(m.group(2))) if m else (math.nan, math.nan)
    lines += ["", f"Measured ceilings: bf16 GEMM {_fmt(gemm, '.0f')} TFLOP/s, copy "
              f"{_fmt(copy, '.0f')} GB/s", "", "## Targets", "",
              "| target | shape (kv, heads, q_len) | ours (Triton) | Gluon | met (best) |",
              "|---|---|---|---|---|"]
    decisions: list[str] = []

    def gluon(key: tuple[int, int, int]) -> tuple[float, float]:
        """(Gluon's ms, its speed-up over Triton timed beside it) at ``key``, or nans."""
        g = glu.get(key, {})
        return _f(g, "gluon_ms"), _f(g, "ms") / _f(g, "gluon_ms")

    def row(target: str, key: object, ours: str, theirs: str, ok: bool) -> None:
        lines.append(f"| {target} | {key} | {ours} | {theirs} | {'yes' if ok else 'NO'} |")

    nan0 = lambda x: 0.0 if math.isnan(x) else x  # noqa: E731
    for key, r in sorted(bf16.items()):
        kv, heads, q = key
        ms = _f(r, "ms")
        gl_ms, gl_up = gluon(key)
        best = ms / max(1.0, nan0(gl_up))
        if q == 1 and heads == 16:
            pct = _f(r, "GB/s") / copy * 100
            gl_pct = _f(glu.get(key, {}), "GB/s") * gl_up / copy * 100
            row(f">= {COPY_PCT_16:.0f}% of copy", key, _fmt(pct, ".1f", "%"),
                _fmt(gl_pct, ".1f", "%"), max(pct, nan0(gl_pct)) >= COPY_PCT_16)
        if q == 1 and heads == 128:
            pct = _f(r, "TFLOP/s") / gemm * 100
            gl_pct = _f(glu.get(key, {}), "TFLOP/s") * gl_up / gemm * 100
            row(f">= {GEMM_PCT_128:.0f}% of GEMM", key, _fmt(pct, ".1f", "%"),
                _fmt(gl_pct, ".1f", "%"), max(pct, nan0(gl_pct)) >= GEMM_PCT_128)
        fi_ms = _f(r, "flashinfer_ms")
        if not math.isnan(fi_ms):
            ratio, gl_ratio = fi_ms / ms, fi_ms / gl_ms
            row(f">= {VS_FLASHINFER:.1f}x FlashInfer", key, _fmt(ratio, unit="x"),
                _fmt(gl_ratio, unit="x"), max(ratio, nan0(gl_ratio)) >= VS_FLASHINFER)
            if heads == 128 and fi_ms * FI_DEFAULT < best:
                decisions.append(f"FlashInfer {best / fi_ms:.2f}x our best at {key}: "
                                 "FlashInfer becomes the CUDA default for the shapes it serves")
        if q == 2 and (kv, heads, 1) in bf16:
            ratio = ms / _f(bf16[(kv, heads, 1)], "ms")
            gl_ratio = gl_ms / gluon((kv, heads, 1))[0]
            ok = min(ratio, gl_ratio if not math.isnan(gl_ratio) else math.inf) <= VERIFY_RATIO
            row(f"verify <= {VERIFY_RATIO}x decode", key, _fmt(ratio, unit="x"),
                _fmt(gl_ratio, unit="x"), ok)
        if gl_up > 1.0:
            decisions.append(f"Gluon {gl_up:.2f}x Triton at {key} (max|o-gluon| "
                             f"{glu[key].get('max|o-gluon|')}): Gluon becomes that shape's "
                             "default")
    for cache, text in sections(fp8_text).items():
        for r in parse_table(text, "batch"):
            kv, heads, q = _key(r)
            base = bf16.get((kv, heads, q))
            if base is None or q != 1:
                continue
            speed = _f(base, "ms") / _f(r, "ms")
            target = f">= {FP8_SPEEDUP_16}x bf16" if heads == 16 else "(no target)"
            ok = "yes" if speed >= FP8_SPEEDUP_16 else ("NO" if heads == 16 else "-")
            lines.append(f"| {cache} {target} | {(kv, heads, q)} | {_fmt(speed, unit='x')} | - "
                         f"| {ok} |")

    sparse = [ln for ln in read("sweep.txt").splitlines() if " | " in ln]
    lines += ["", "## DSA: indexer top-k + sparse attention vs dense absorbed decode", ""]
    if sparse:
        lines += [f"| {sparse[0]} |", "|" + "---|" * (sparse[0].count(" | ") + 1)]
        lines += [f"| {ln} |" for ln in sparse[1:]]
    else:
        lines.append("(no table: see sweep.txt)")

    sweep = parse_table(read("sweep.txt"), "heads")
    lines += ["", "## Tile sweep: settings faster than the default (same output)", ""]
    groups: dict[tuple[str, str, str], list[dict[str, str]]] = {}
    for r in sweep:
        groups.setdefault((r["heads"], r["cache"], r["q_len"]), []).append(r)
    for g, rows in groups.items():
        good = [r for r in rows if r["knobs"] != "default"
                and _f(r, "max|o-default|") <= SAME_OUTPUT
                and float(r["vs_default"].rstrip("x")) >= KNOB_GAIN]
        if good:
            best = max(good, key=lambda r: float(r["vs_default"].rstrip("x")))
            lines.append(f"- heads {g[0]} {g[1]} q_len {g[2]}: {best['knobs']} "
                         f"{best['vs_default']} ({best['ms']} ms)")
            decisions.append(f"heads {g[0]} {g[1]} q_len {g[2]}: {best['knobs']} becomes the "
                             f"default ({best['vs_default']} the current default)")
        else:
            lines.append(f"- heads {g[0]} {g[1]} q_len {g[2]}: the default stays "
                         f"({len(rows) - 1} settings tried)")
    lines += ["", "## Decisions (per benchmarks/results/gpu-plan.md)", ""]
    lines += [f"- {d}" for d in decisions] or ["- none: the defaults stay"]
    if failed:
        lines.append("- GPU test failures: no path with a failing test becomes a default")
    return "\n".join(lines) + "\n"
