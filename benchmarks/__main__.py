"""``python -m benchmarks <subcommand> [-h]``: one subcommand per benchmark (decode, extend, gemm,
layer, policy, sparse, vllm, vllm-dsa, serve, sglang, gpu, fp8-accuracy); each writes
``benchmarks/results/<name>-latest.md`` and appends to ``<name>-history.md``. ``plot`` redraws
the roofline PNGs from ``decode-latest.md``."""

from __future__ import annotations

import importlib
import sys

#: subcommand -> (module, one line)
COMMANDS = {
    "decode": ("decode", "absorbed decode per native ISA level vs vLLM CPU_MLA / AMX_MLA"),
    "extend": ("extend", "absorbed extend (prefix + new tokens) per ISA level vs AMX_MLA"),
    "gemm": ("gemm", "absorption GEMMs, MHA, decompression per native ISA level vs torch"),
    "layer": ("layer", "one MLA layer incl. both absorptions vs CPU_MLA / AMX_MLA op sequences"),
    "policy": ("policy", "does the cost policy pick the faster path (absorbed / normal)"),
    "sparse": ("sparse", "DSA decode: indexer top-k + sparse attention vs dense absorbed"),
    "vllm": ("vllm_e2e", "vLLM end to end: MLA_ABSORB vs CPU_MLA (and AMX_MLA where it runs)"),
    "vllm-dsa": ("vllm_dsa", "vLLM end to end, DSA (tiny V3.2, 8K prompts): sparse vs dense"),
    "serve": ("serve", "online serving through each engine's own bench client"),
    "sglang": ("sglang_batch", "SGLang one-batch: mla_absorb vs torch_native"),
    "plot": ("plot", "roofline PNG per ISA level from decode-latest.md (needs matplotlib)"),
    "gpu": ("gpu", "Triton kernels on a GPU vs FlashMLA-style baselines"),
    "fp8-accuracy": ("fp8_accuracy", "where fp8 latent caches lose accuracy (no engine)"),
}


def usage() -> str:
    lines = ["usage: python -m benchmarks <subcommand> [-h] [options]", "", "subcommands:"]
    lines += [f"  {name:<13} {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(usage())
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(f"benchmarks.{COMMANDS[argv[0]][0]}")
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
