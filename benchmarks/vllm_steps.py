"""``python -m benchmarks vllm-steps``: where a vLLM decode step's time goes, MLA_ABSORB vs a
peer backend, on the 8 x 128-token workload (tiny model, mostly per-step host work).

Each engine runs the workload in a fresh process with vLLM's torch profiler on one more generate
(``RunSpec.profile_dir``, :mod:`mla_backend_integrations._testing.vllm_runner`); this module reads
the worker's Chrome trace and splits every pure-decode step
(``execute_context_0(0)_generation_N``) into phases, the median over the steps of each:

- host before the model: from the step's start to the compiled graph (vLLM's input preparation,
  the attention metadata builder: ours builds ``MLABatch`` and ``mb.plan`` there);
- per layer, the KV-cache update op and the attention op, each split into the kernels it calls
  (ours: ``native_*``; vLLM's: ``_C::*``) and the rest (Python, dispatch, allocations, copies);
- the rest of the graph (vLLM's linears, norms, RoPE: the same code for every backend) and the
  host after it (sampling).

Writes ``vllm_steps-latest.md`` (and the history).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from mla_backend_integrations._testing.vllm_backends import FORCED_NOTE
from mla_backend_integrations._testing.vllm_runner import RunSpec, Workload, run_backend

from mla_backend.testing.tiny_model import PRESETS, make_tiny_deepseek_v2

from . import harness

STEP = "execute_context_0(0)_generation_"
GRAPH = "## Call CompiledFxGraph"
KV_OP = "vllm::unified_mla_kv_cache_update"
ATTN_OP = "vllm::unified_mla_attention_with_output"
#: op-name prefixes counted as an attention kernel (ours, vLLM's CPU kernels)
KERNELS = ("mla_backend_", "_C::")


def _within(ev: list[dict[str, Any]], outer: dict[str, Any]) -> Iterable[dict[str, Any]]:
    t0, t1 = outer["ts"], outer["ts"] + outer["dur"]
    return (e for e in ev if e is not outer and t0 <= e["ts"] and e["ts"] + e["dur"] <= t1)


def _top(ev: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The outermost events of ``ev`` (each not inside an earlier one), in time order."""
    out, end = [], -1.0
    for e in sorted(ev, key=lambda e: (e["ts"], -e["dur"])):
        if e["ts"] >= end:
            out.append(e)
            end = e["ts"] + e["dur"]
    return out


def step_phases(trace: Path) -> tuple[dict[str, float], int]:
    """Median microseconds per decode step of each phase in ``trace`` (and the step count)."""
    ev = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    steps = [e for e in ev if e["name"].startswith(STEP) and not e["name"].endswith("(0)")]
    per: dict[str, list[float]] = {}
    for s in steps:
        inner = list(_within(ev, s))
        graphs = [e for e in _top(inner) if e["name"].startswith(GRAPH)]
        if not graphs:
            continue
        g = graphs[0]
        ph = {"step": s["dur"], "host before the model": g["ts"] - s["ts"]}
        ph["after the graph (lm head, sampling)"] = s["ts"] + s["dur"] - (g["ts"] + g["dur"])
        in_graph = list(_within(ev, g))
        ops = [e for e in _top(in_graph) if e["name"] in (KV_OP, ATTN_OP)]
        for name, label in ((KV_OP, "KV-cache update"), (ATTN_OP, "attention op")):
            mine = [e for e in ops if e["name"] == name]
            kern = sum(
                k["dur"] for o in mine for k in _top(_within(in_graph, o))
                if k["name"].startswith(KERNELS)
            )  # fmt: skip
            total = sum(e["dur"] for e in mine)
            ph[f"{label}: kernels"] = kern
            ph[f"{label}: the rest"] = total - kern
        ph["rest of the model (vLLM's linears, norms, RoPE)"] = g["dur"] - sum(
            e["dur"] for e in ops
        )
        for k, v in ph.items():
            per.setdefault(k, []).append(v)
    return {k: statistics.median(v) for k, v in per.items()}, len(per.get("step", []))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks vllm-steps",
                                 description=__doc__.split("\n\n")[0])  # fmt: skip
    ap.add_argument("--isa", default=None, help="our native ISA level (default: the selected)")
    ap.add_argument("--peer", default="AMX_MLA", help="the in-tree backend to compare")
    ap.add_argument("--model-dir", default="/tmp/mla_bench_models/lite")
    ap.add_argument("--out-dir", default=None, help="keep the traces here (default: a temp dir)")
    args = ap.parse_args(argv)
    isa = args.isa or harness.selected_isa()
    model = make_tiny_deepseek_v2(args.model_dir, **PRESETS["default"], dtype="bfloat16")
    wl = Workload("b8_in128_out32", 8, 128, 32, iters=3)
    engine = dict(dtype="bfloat16", max_model_len=128 + 32 + 64, skip_tokenizer_init=True)
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="vllm_steps_"))
    runs = [(f"MLA_ABSORB {isa}", "MLA_ABSORB", isa), (args.peer, args.peer, None)]
    cols: list[tuple[str, dict[str, float], int, dict[str, Any]]] = []
    for label, backend, level in runs:
        res = run_backend(RunSpec(str(model), backend, [wl], engine, isa=level,
                                  profile_dir=str(out_dir)))  # fmt: skip
        traces = sorted(out_dir.glob(f"{backend}-{wl.name}_*.trace.json"))
        if not traces:
            raise RuntimeError(f"{backend}: no profiler trace in {out_dir}")
        phases, n = step_phases(traces[-1])
        cols.append((label, phases, n, res))
    keys = list(cols[0][1])
    header = ["phase (median per decode step)"] + [f"{c[0]} us" for c in cols]
    rows = [[k] + [f"{c[1].get(k, 0.0):.0f}" for c in cols] for k in keys]
    notes = [
        f"tiny DeepSeek-V2 (16 heads, 512 + 64, 2 layers, bf16), {wl.num_prompts} prompts x "
        f"{wl.input_len} tokens, {wl.output_len} greedy tokens; one profiled generate per "
        "engine after its timed runs (vLLM's torch profiler on the worker: its own overhead is "
        "in every figure); medians over the pure-decode steps "
        + ", ".join(f"{c[0]} {c[2]}" for c in cols),
        "kernels: the ops an attention / KV-update op calls (ours mla_backend_*::native_*, "
        "vLLM's _C::*); the rest: that op's Python, dispatch, allocations and copies",
        "timed runs (output tok/s, best of 3, no profiler): "
        + ", ".join(f"{c[0]} {c[3]['workloads'][0]['output_tok_s']:.0f}" for c in cols),
        "selected: " + ", ".join(
            str(c[3].get("selected")) + (" (forced)" if c[3].get("amx_forced") else "")
            for c in cols
        ),
    ]
    if any(c[3].get("amx_forced") for c in cols):
        notes.append(FORCED_NOTE)
    harness.write_result("vllm_steps", "vLLM decode step, where the time goes", notes,
                         harness.table(header, rows))  # fmt: skip
    return 0
