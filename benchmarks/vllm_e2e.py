"""``python -m benchmarks vllm``: vLLM end to end, MLA_ABSORB (our kernels at every native ISA
level this CPU runs, or ``--isas``) vs the in-tree CPU_MLA (every CPU) and AMX_MLA (where its
kernels run) on the same model and workloads, interleaved (round r runs every engine once, in
rotated order), one engine at a time, each in a fresh process
(``mla_backend_integrations._testing.vllm_runner``). ``--imitate avx2`` runs every engine on an
imitated AVX2-only CPU (``mla_backend_integrations._testing.cpu_imitation``: torch capped, vLLM's
CPU checks answering as there, our kernels at avx2 unless ``--isas`` names lower levels).

Python equivalent of ``vllm bench latency`` (fixed batch, fixed input/output lengths, greedy,
EOS ignored, best of N timed iterations after a warm-up). A backend that cannot run on this CPU
or whose engine fails is a row "not available on this CPU: <reason>".

    python -m benchmarks vllm [--quick] [--rounds 2] [--isas avx2,avx512_bf16] [--imitate avx2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from mla_backend_integrations._testing import cpu_imitation
from mla_backend_integrations._testing.vllm_backends import FORCED_NOTE, unavailable_reason
from mla_backend_integrations._testing.vllm_runner import (
    EngineFailed,
    RunSpec,
    Workload,
    run_backend,
)

from mla_backend.testing.tiny_model import PRESETS, make_tiny_deepseek_v2

from . import harness

PEERS = ("CPU_MLA", "AMX_MLA")


def workloads(quick: bool) -> list[Workload]:
    w = [Workload("b8_in128_out32", 8, 128, 32, iters=3)]
    if not quick:
        w += [
            Workload("b4_in2048_out32", 4, 2048, 32, iters=2, seed=1),
            Workload("b2_in8192_out16", 2, 8192, 16, iters=1, seed=2),
        ]
    return w


def engines(isas: list[str], peers: list[str]) -> list[tuple[str, str, str | None]]:
    """(label, vLLM backend, our ISA level) per engine to run."""
    ours = [(f"MLA_ABSORB {isa}", "MLA_ABSORB", isa) for isa in isas]
    return ours + [(p, p, None) for p in peers]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks vllm",
                                 description=__doc__.split("\n\n")[0])  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="the 128-token workload only")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model-dir", default="/tmp/mla_bench_models/lite")
    ap.add_argument("--isas", default=None, help="our ISA levels (default: all this CPU runs)")
    ap.add_argument("--peers", default=",".join(PEERS), help="in-tree backends to compare")
    ap.add_argument("--imitate", default=None, choices=cpu_imitation.IMITABLE,
                    help="run every engine on an imitated CPU of this level")  # fmt: skip
    ap.add_argument("--workloads", default=None,
                    help="comma-separated workload names (default: all)")  # fmt: skip
    args = ap.parse_args(argv)

    imitate = args.imitate
    if args.isas:
        isas = args.isas.split(",")
    elif imitate:
        isas = [imitate]
    else:
        isas = list(harness.host_isas())
    model = make_tiny_deepseek_v2(args.model_dir, **PRESETS["default"], dtype="bfloat16")
    wls = workloads(args.quick)
    if args.workloads:
        wanted = args.workloads.split(",")
        unknown = sorted(set(wanted) - {w.name for w in wls})
        if unknown:
            ap.error(f"unknown workloads {unknown}; known: {[w.name for w in wls]}")
        wls = [w for w in wls if w.name in wanted]
    max_len = max(w.input_len + w.output_len for w in wls) + 64
    engine = dict(dtype="bfloat16", max_model_len=max_len, skip_tokenizer_init=True)
    todo = engines(isas, args.peers.split(","))
    missing: dict[str, str] = {}
    for label, backend, _ in todo:
        why = unavailable_reason(backend, imitate)
        if why is not None:
            missing[label] = why
    todo = [e for e in todo if e[0] not in missing]
    results: dict[str, list[dict[str, Any]]] = {e[0]: [] for e in todo}
    for r in range(args.rounds):
        order = todo[r % len(todo) :] + todo[: r % len(todo)]
        for label, backend, isa in order:
            if label in missing:
                continue
            t = time.perf_counter()
            try:
                res = run_backend(
                    RunSpec(str(model), backend, wls, engine, isa=isa, imitate=imitate)
                )
            except EngineFailed as e:
                missing[label] = f"engine failed: {e.reason}"
                print(f"round {r} {label}: {missing[label]}", flush=True)
                continue
            print(f"round {r} {label}: {time.perf_counter() - t:.0f}s " + ", ".join(
                f"{w['name']}={w['output_tok_s']:.1f} tok/s" for w in res["workloads"]),
                flush=True)  # fmt: skip
            results[label].append(res)
    ran = [label for label, _, _ in todo if results[label] and label not in missing]
    peers = [p for p in ran if not p.startswith("MLA_ABSORB")]
    ours = [p for p in ran if p.startswith("MLA_ABSORB")]
    header = ["workload"] + [f"{b} tok/s (latency s)" for b in ran]
    header += [f"{o} / {p}" for p in peers for o in ours]
    rows = []
    for i, w in enumerate(wls):
        tok = {b: statistics.median(x["workloads"][i]["output_tok_s"] for x in results[b])
               for b in ran}  # fmt: skip
        lat = {b: statistics.median(x["workloads"][i]["latency_s"] for x in results[b])
               for b in ran}  # fmt: skip
        rows.append([w.name] + [f"{tok[b]:.1f} ({lat[b]:.2f})" for b in ran]
                    + [f"{tok[o] / tok[p]:.2f}x" for p in peers for o in ours])  # fmt: skip
    body = harness.table(header, rows)
    cfg_rows = []
    for b in ran:
        x = results[b][0]
        cfg_rows.append([
            b, x["selected"] + (" (forced)" if x.get("amx_forced") else ""),
            x["native_isa"] if x["selected"] == "MLA_ABSORB" else "-", str(x["block_size"]),
            str(x["chunked_prefill"]), str(x["prefix_caching"]), str(x["kv_bytes_per_token"]),
            str(x.get("attn_weight_extra_bytes_per_layer", "-")),
            x.get("torch_capability", "?"), x.get("vllm_kernels", "?"),
        ])  # fmt: skip
    cfg_rows += [[b, f"not available on this CPU: {why}"] + [""] * 8 for b, why in missing.items()]
    body += "\n\n" + harness.table(
        ["engine", "selected", "native ISA", "block size", "chunked prefill", "prefix caching",
         "KV bytes/token", "attention-weight bytes/layer beyond the checkpoint",
         "torch capability", "vLLM kernels"], cfg_rows,
    )  # fmt: skip
    notes = [cpu_imitation.note(imitate)] if imitate else []
    notes += [
        f"tiny DeepSeek-V2 ({model.name}: 16 heads, 512+64, nope 128, v 128, 2 layers, bf16); "
        f"{args.rounds} interleaved rounds; per round best of N timed runs; table = median over "
        "rounds of output tokens/s (latency in s); ratios > 1: ours faster",
        "selected: the backend the model's layers ran (vLLM's CPU platform serves a request for "
        "AMX_MLA with CPU_MLA on a CPU without AMX); native ISA: the level our kernels ran at "
        "(MLA_BACKEND_NATIVE_ISA in that engine's environment); torch capability, vLLM kernels: "
        "what that engine's process reported (torch.backends.cpu.get_cpu_capability(), the "
        "vLLM kernel library it mapped)",
        "attention-weight bytes per layer beyond the checkpoint's kv_b_proj: computed from the "
        "model's dims and each backend's weight handling "
        "(integrations/_testing/vllm_runner.py, attn_weight_extra_bytes)",
    ]
    if any(x.get("amx_forced") for b in ran for x in results[b]):
        notes.append(FORCED_NOTE)
    harness.write_result("vllm", "vLLM CPU backends end to end", notes, body)
    return 0 if ours else 1
