"""``python -m benchmarks vllm-dsa``: vLLM end to end on a tiny random DSA model (bf16;
``--preset``, a :data:`~mla_backend.testing.tiny_model.DSA_PRESETS` key: ``v32`` the 8-head
tiny V3.2 by default, ``v32_full`` / ``glm5_full`` DeepSeek-V3.2's / GLM-5's own attention
dims), MLA_ABSORB, DeepSeek Sparse Attention at ``index_topk`` 2048 vs the same weights with
``index_topk`` above every context (the selection is everything: the policy runs the dense paths
and the indexer only writes its keys), at every native ISA level this CPU runs (or ``--isas``:
``MLA_BACKEND_NATIVE_ISA`` in each engine's environment).

Both checkpoints come from ``make_tiny_dsa`` with the same seed (identical weights; only
``index_topk`` differs). Workloads of two prompts of ``--prompt-len`` tokens (8192 by default;
at or below 2048 the sparse run's selection is every token, so both runs are dense): one
prefill-heavy (16 new tokens), one decode-heavy (128 new tokens), named
``b2_in<prompt-len>_out<new>``. Each engine runs in a fresh process (``vllm_runner``), one at a
time, interleaved over rounds (round r runs every engine once, in rotated order); per round the
best of N timed generates after a warm-up, all on prompts no run has seen (no prefix hits).

    python -m benchmarks vllm-dsa [--preset v32] [--prompt-len 8192] [--rounds 2]
        [--isas avx2,avx512_bf16] [--workloads NAME,...]

Results: ``benchmarks/results/vllm_dsa-latest.md`` for ``v32``, ``vllm_dsa_<preset>-latest.md``
for another preset.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from mla_backend_integrations._testing.vllm_runner import (
    EngineFailed,
    RunSpec,
    Workload,
    run_backend,
)

from mla_backend.testing.tiny_model import DSA_PRESETS, make_tiny_dsa

from . import harness

SPARSE_TOPK = 2048
PROMPT = 8192


def workloads(prompt_len: int = PROMPT) -> list[Workload]:
    """Two prompts of ``prompt_len`` tokens: 16 new tokens (prefill-heavy), 128 (decode)."""
    return [
        Workload(f"b2_in{prompt_len}_out{new}", 2, prompt_len, new, iters=1, seed=seed)
        for seed, new in ((1, 16), (2, 128))
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks vllm-dsa",
                                 description=__doc__.split("\n\n")[0])  # fmt: skip
    ap.add_argument(
        "--preset",
        choices=sorted(DSA_PRESETS),
        default="v32",
        help="make_tiny_dsa preset (default v32: the 8-head tiny V3.2)",
    )
    ap.add_argument(
        "--prompt-len", type=int, default=PROMPT, help=f"tokens per prompt (default {PROMPT})"
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--model-dir",
        default="/tmp/mla_bench_models/dsa",
        help="checkpoint folder prefix: <prefix>_<preset>_<sparse|dense>",
    )
    ap.add_argument("--isas", default=None, help="our ISA levels (default: all this CPU runs)")
    ap.add_argument("--workloads", default=None, help="comma-separated workload names")
    args = ap.parse_args(argv)

    isas = args.isas.split(",") if args.isas else list(harness.host_isas())
    if args.prompt_len < 1:
        ap.error(f"--prompt-len {args.prompt_len}: must be >= 1")
    wls = workloads(args.prompt_len)
    if args.workloads:
        wanted = args.workloads.split(",")
        unknown = sorted(set(wanted) - {w.name for w in wls})
        if unknown:
            ap.error(f"unknown workloads {unknown}; known: {[w.name for w in wls]}")
        wls = [w for w in wls if w.name in wanted]
    max_len = max(w.input_len + w.output_len for w in wls) + 64
    # the preset's own index_topk (the full presets name DeepSeek's 2048) is the run's
    preset = {k: v for k, v in DSA_PRESETS[args.preset].items() if k != "index_topk"}
    models = {
        mode: make_tiny_dsa(
            f"{args.model_dir}_{args.preset}_{mode}",
            index_topk=topk,
            dtype="bfloat16",
            seed=0,
            **preset,
        )  # fmt: skip
        for mode, topk in (("sparse", SPARSE_TOPK), ("dense", 2 * max_len))
    }
    engine = dict(dtype="bfloat16", max_model_len=max_len, skip_tokenizer_init=True)
    todo = [(f"{mode} {isa}", mode, isa) for isa in isas for mode in models]
    results: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in todo}
    failed: dict[str, str] = {}
    for r in range(args.rounds):
        order = todo[r % len(todo) :] + todo[: r % len(todo)]
        for label, mode, isa in order:
            if label in failed:
                continue
            t = time.perf_counter()
            try:
                res = run_backend(
                    RunSpec(str(models[mode]), "MLA_ABSORB", wls, engine, isa=isa), timeout=3600
                )
            except EngineFailed as e:
                failed[label] = e.reason
                print(f"round {r} {label}: engine failed: {e.reason}", flush=True)
                continue
            print(f"round {r} {label}: {time.perf_counter() - t:.0f}s " + ", ".join(
                f"{w['name']}={w['output_tok_s']:.2f} tok/s ({w['latency_s']:.1f} s)"
                for w in res["workloads"]), flush=True)  # fmt: skip
            results[label].append(res)

    def med(label: str, i: int, key: str) -> float:
        return statistics.median(x["workloads"][i][key] for x in results[label])

    header = ["workload", "ISA", "dense tok/s (latency s)", "sparse tok/s (latency s)",
              "sparse / dense", "per-round latency s (dense; sparse)"]  # fmt: skip
    rows = []
    for i, w in enumerate(wls):
        for isa in isas:
            d, s = f"dense {isa}", f"sparse {isa}"
            if not results[d] or not results[s]:
                rows.append([w.name, isa, failed.get(d, "-"), failed.get(s, "-"), "-", "-"])
                continue
            rounds = "; ".join(
                " / ".join(f"{x['workloads'][i]['latency_s']:.1f}" for x in results[k])
                for k in (d, s)
            )
            rows.append([
                w.name, isa, f"{med(d, i, 'output_tok_s'):.2f} ({med(d, i, 'latency_s'):.1f})",
                f"{med(s, i, 'output_tok_s'):.2f} ({med(s, i, 'latency_s'):.1f})",
                f"{med(d, i, 'latency_s') / med(s, i, 'latency_s'):.2f}x", rounds,
            ])  # fmt: skip
    body = harness.table(header, rows)
    cfg_rows = [
        [label, x["native_isa"], x["selected"], str(x["block_size"]), str(x["chunked_prefill"]),
         str(x["prefix_caching"]), str(x["kv_bytes_per_token"]), f"{x['startup_s']:.0f}"]
        for label, _, _ in todo if results[label] for x in results[label][:1]
    ]  # fmt: skip
    body += "\n\n" + harness.table(
        ["engine", "native ISA", "selected", "block size", "chunked prefill", "prefix caching",
         "latent KV bytes/token", "start-up s"], cfg_rows,
    )  # fmt: skip
    p = preset
    notes = [
        f"tiny {p['arch']} (make_tiny_dsa, preset {args.preset}: {p['num_heads']} heads, "
        f"{p['kv_lora_rank']}+{p['qk_rope_head_dim']}, nope {p['qk_nope_head_dim']}, v "
        f"{p['v_head_dim']}, q_lora {p['q_lora_rank']}, {p['index_n_heads']} index heads of "
        f"{p['index_head_dim']}, {p['num_layers']} layers, bf16), MLA_ABSORB; sparse: "
        f"index_topk {SPARSE_TOPK}; dense: the same weights with index_topk {2 * max_len} (above "
        f"every context); prompts of {args.prompt_len} tokens"
        + (
            " (at most index_topk: the sparse run selects every token too)"
            if args.prompt_len <= SPARSE_TOPK
            else ""
        ),
        f"{args.rounds} interleaved rounds, each engine in a fresh process; per round best of N "
        "timed generates after a warm-up, fresh prompts each (no prefix hits); table = median "
        "over rounds; sparse / dense = dense latency / sparse latency (> 1: sparse faster)",
        "latent KV bytes/token: the engine's allocation per token over all layers, the indexer's "
        "key cache (132 B per token and layer) included",
    ]
    name = "vllm_dsa" if args.preset == "v32" else f"vllm_dsa_{args.preset}"
    harness.write_result(name, f"vLLM end to end, DSA ({args.preset}): sparse vs dense, "
                         "MLA_ABSORB", notes, body)  # fmt: skip
    return 0 if not failed else 1
