"""The main job: a tiny DeepSeek-V2 model on vLLM with ``--attention-backend mla_absorb``,
side by side with vLLM's in-tree AMX_MLA and CPU_MLA on the same prompts.

Generates the built-in tiny model (config, WordLevel tokenizer, random safetensors weights;
DeepSeek-V2-Lite attention dims: 16 heads, latent 512 + rope 64), runs each backend in its own
fresh vLLM engine, and prints the generations, output tokens/s (best of ``--iters`` timed runs
on new prompts: on a shared 2-core machine one run is noise), KV-cache bytes per token and
the attention-weight bytes per layer each backend holds beyond the checkpoint's ``kv_b_proj``
(computed, see ``integrations/_testing/vllm_runner.py``), the backend vLLM really ran, and the CPU
and ISA level our native kernels run at. A backend that cannot run on this CPU (AMX_MLA's
kernels need AVX-512 and AVX512-BF16) or whose engine fails is one row "not available on this
CPU: <reason>"; the others are still printed. Exit status 0 unless MLA_ABSORB itself failed.
``--imitate avx2`` runs every engine on an imitated AVX2-only CPU
(``integrations/_testing/cpu_imitation.py``).

    python examples/vllm_demo.py [--model-dir DIR] [--max-tokens 24] [--kv-cache-dtype fp8_ds_mla]
                                 [--iters 3] [--imitate avx2] [--profile-dir DIR]
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from mla_backend_integrations._testing import cpu_imitation
from mla_backend_integrations._testing.vllm_backends import FORCED_NOTE, unavailable_reason
from mla_backend_integrations._testing.vllm_runner import (
    EngineFailed,
    RunSpec,
    Workload,
    run_backend,
)

from mla_backend.testing.host import describe
from mla_backend.testing.tiny_model import PRESETS, make_tiny_deepseek_v2, synthetic_words

BACKENDS = ("MLA_ABSORB", "AMX_MLA", "CPU_MLA")


def demo_prompts() -> list[str]:
    """Four prompts written in the tiny tokenizer's pseudo-words (one id per word)."""
    w = synthetic_words(3000)
    return [
        " ".join(w[i] for i in (5, 77, 300, 12, 999, 41, 2500, 7)),
        " ".join(w[i] for i in range(100, 160)),
        " ".join(w[(i * 37) % 3000] for i in range(400)),
        " ".join(w[i] for i in (1, 2, 3)),
    ]


def run_all(
    model: str,
    backends: list[str],
    wl: Workload,
    engine: dict[str, Any],
    kv_dtype: str,
    imitate: str | None = None,
    profile_dir: str | None = None,
) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Each backend in its own engine (on an imitated CPU of level ``imitate`` when given; one
    more generate under vLLM's torch profiler, files in ``profile_dir``, when given):
    (results, reasons the others could not run)."""
    results: dict[str, dict[str, Any]] = {}
    missing: dict[str, str] = {}
    for b in backends:
        why = unavailable_reason(b, imitate)
        if why is not None:
            print(f"skipping {b}: not available on this CPU: {why}", flush=True)
            missing[b] = why
            continue
        kv = kv_dtype if b == "MLA_ABSORB" else "auto"
        print(f"running {b} (kv cache {kv}) ...", flush=True)
        try:
            spec = RunSpec(model, b, [wl], dict(engine, kv_cache_dtype=kv), imitate=imitate,
                           profile_dir=profile_dir)  # fmt: skip
            results[b] = run_backend(spec)
        except EngineFailed as e:
            print(f"{b} failed: {e.reason}", flush=True)
            missing[b] = f"engine failed: {e.reason}"
    return results, missing


def print_table(results: dict[str, dict[str, Any]], missing: dict[str, str]) -> None:
    print(
        f"{'backend':>10} | {'selected':>10} | {'native ISA':>11} | {'out tok/s':>9} | "
        f"{'latency s':>9} | {'KV dtype':>10} | {'KV B/token':>10} | {'+attn W B/layer':>15} | "
        "block | chunked prefill | prefix caching"
    )
    for b, r in results.items():
        w = r["workloads"][0]
        isa = r["native_isa"] if r["selected"] == "MLA_ABSORB" else "-"
        print(
            f"{b:>10} | {r['selected']:>10} | {isa:>11} | {w['output_tok_s']:9.1f} | "
            f"{w['latency_s']:9.2f} | {r.get('kv_cache_dtype', 'auto'):>10} | "
            f"{r['kv_bytes_per_token']:10d} | "
            f"{r['attn_weight_extra_bytes_per_layer']:15d} | {r['block_size']:5d} | "
            f"{r['chunked_prefill']!s:>15} | {r['prefix_caching']}"
        )
    for b, why in missing.items():
        print(f"{b:>10} | not available on this CPU: {why}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", default="/tmp/mla_demo_model")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument(
        "--iters", type=int, default=3, help="timed runs per backend (new prompts; table: best)"
    )
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="auto (bf16) | fp8 | fp8_ds_mla (MLA_ABSORB only; in-tree CPU backends refuse "
        "fp8 caches, so they run with auto)",
    )
    ap.add_argument("--imitate", default=None, choices=cpu_imitation.IMITABLE,
                    help="run every engine on an imitated CPU of this level")  # fmt: skip
    ap.add_argument("--profile-dir", default=None,
                    help="also profile one generate per backend with vLLM's torch profiler; "
                    "its op tables (<backend>-demo_*.profiler_out.txt) land here")  # fmt: skip
    args = ap.parse_args()
    host = describe() + (f"\n{cpu_imitation.note(args.imitate)}" if args.imitate else "")

    print(host)
    model = make_tiny_deepseek_v2(args.model_dir, **PRESETS["default"], dtype="bfloat16")
    print(f"model: {model} (tiny DeepSeek-V2, 16 heads, kv_lora_rank 512 + rope 64, bf16)")
    prompts = demo_prompts()
    wl = Workload("demo", len(prompts), 0, args.max_tokens, iters=args.iters, texts=prompts)
    engine = dict(dtype="bfloat16", max_model_len=2048)
    results, missing = run_all(
        str(model),
        args.backends.split(","),
        wl,
        engine,
        args.kv_cache_dtype,
        args.imitate,
        args.profile_dir,
    )

    print()
    for i, p in enumerate(prompts):
        print(f"prompt {i} ({len(p.split())} words): {p[:70]}{'...' if len(p) > 70 else ''}")
        for b, r in results.items():
            print(f"  {b:>10}: {r['workloads'][0]['texts'][i][:100]}")
    print()
    print(host)
    print_table(results, missing)
    print(
        "KV B/token: all layers, what the engine allocated (VLLM_CPU_KVCACHE_SPACE / blocks); "
        "per layer: bf16 1152, fp8 576, fp8_ds_mla 656 at r 512 + rope 64. native ISA: the "
        "level our kernels ran at in MLA_ABSORB's engine."
    )
    if any(r.get("amx_forced") for r in results.values()):
        print(FORCED_NOTE)
    return 1 if "MLA_ABSORB" in missing else 0


if __name__ == "__main__":
    sys.exit(main())
