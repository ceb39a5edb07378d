"""vLLM engine benchmark: MLA_ABSORB vs the in-tree AMX_MLA and CPU_MLA on the same model and
workloads, interleaved (round r runs every backend once, in rotated order), one engine at a
time (each backend in a fresh process, see compare).

Python equivalent of ``vllm bench latency`` (fixed batch, fixed input/output lengths, greedy,
EOS ignored, best of N timed iterations after a warm-up). Writes a Markdown table and the raw
JSON to ``benchmarks/results/``.

    python benchmarks/vllm_bench.py                 # full: 128-token and 2K / 8K prompts
    python benchmarks/vllm_bench.py --quick         # short prompts only
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from mla_backend.testing.tiny_model import PRESETS, make_tiny_deepseek_v2
from compare import RunSpec, Workload, run_backend
from vllm_amx import FORCED_NOTE

BACKENDS = ("MLA_ABSORB", "AMX_MLA", "CPU_MLA")


def workloads(quick: bool) -> list[Workload]:
    w = [Workload("b8_in128_out32", 8, 128, 32, iters=3)]
    if not quick:
        w += [
            Workload("b4_in2048_out32", 4, 2048, 32, iters=2, seed=1),
            Workload("b2_in8192_out16", 2, 8192, 16, iters=1, seed=2),
        ]
    return w


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model-dir", default="/tmp/mla_bench_models/lite")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--backends", default=",".join(BACKENDS))
    args = ap.parse_args()

    model = make_tiny_deepseek_v2(args.model_dir, **PRESETS["default"], dtype="bfloat16")
    wls = workloads(args.quick)
    max_len = max(w.input_len + w.output_len for w in wls) + 64
    engine = dict(dtype="bfloat16", max_model_len=max_len, skip_tokenizer_init=True)
    backends = args.backends.split(",")
    results: dict[str, list[dict]] = {b: [] for b in backends}
    for r in range(args.rounds):
        order = backends[r % len(backends) :] + backends[: r % len(backends)]
        for b in order:
            t = time.perf_counter()
            res = run_backend(RunSpec(str(model), b, wls, engine))
            print(
                f"round {r} {b}: {time.perf_counter() - t:.0f}s "
                + ", ".join(f"{w['name']}={w['output_tok_s']:.1f} tok/s" for w in res["workloads"]),
                flush=True,
            )
            results[b].append(res)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (out / f"vllm_bench_{stamp}.json").write_text(json.dumps(results, indent=1))
    lines = [
        f"# vLLM CPU backends, tiny DeepSeek-V2 ({model.name}: 16 heads, 512+64, nope 128, "
        "v 128, 2 layers, bf16)",
        "",
        f"{args.rounds} interleaved rounds; per round best of N timed runs; table = median "
        "over rounds of output tokens/s (latency in s).",
        "",
        "| workload | " + " | ".join(backends) + " | MLA_ABSORB / AMX_MLA | MLA_ABSORB / CPU_MLA |",
        "|---|" + "---|" * (len(backends) + 2),
    ]
    for i, w in enumerate(wls):
        tok = {
            b: statistics.median(x["workloads"][i]["output_tok_s"] for x in results[b])
            for b in backends
        }
        lat = {
            b: statistics.median(x["workloads"][i]["latency_s"] for x in results[b])
            for b in backends
        }
        cells = [f"{tok[b]:.1f} ({lat[b]:.2f} s)" for b in backends]
        ratio = [
            f"{tok['MLA_ABSORB'] / tok[o]:.2f}x" if "MLA_ABSORB" in tok and o in tok else "-"
            for o in ("AMX_MLA", "CPU_MLA")
        ]
        lines.append(f"| {w.name} | " + " | ".join(cells + ratio) + " |")
    lines += [
        "",
        "| backend | selected | block size | chunked prefill | prefix caching | KV bytes/token "
        "| attention-weight bytes/layer beyond the checkpoint |",
        "|---|---|---|---|---|---|---|",
    ]
    for b in backends:
        x = results[b][0]
        lines.append(
            f"| {b} | {x['selected']}{' (forced)' if x.get('amx_forced') else ''} | "
            f"{x['block_size']} | {x['chunked_prefill']} | "
            f"{x['prefix_caching']} | {x['kv_bytes_per_token']} | "
            f"{x.get('attn_weight_extra_bytes_per_layer', '-')} |"
        )
    lines += [
        "",
        "selected: the backend the model's layers ran (vLLM's CPU platform serves a request for "
        "AMX_MLA with CPU_MLA on a CPU without AMX).",
        "Attention-weight bytes per layer beyond the checkpoint's kv_b_proj: computed from the "
        "model's dims and each backend's weight handling (benchmarks/compare.py, "
        "attn_weight_extra_bytes, says how for each backend).",
    ]
    if any(x.get("amx_forced") for b in backends for x in results[b]):
        lines += ["", FORCED_NOTE]
    table = "\n".join(lines) + "\n"
    (out / f"vllm_bench_{stamp}.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
