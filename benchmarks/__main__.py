"""``python -m benchmarks <subcommand> [-h]``: one subcommand per benchmark (decode, extend, gemm,
layer, policy, sparse, sparse-mha, vllm, vllm-dcp, vllm-dsa, vllm-steps, serve, sglang, gpu,
gpu-resources, gpu-sweep, gpu-run, gpu-sparse, fp8-accuracy, v4); each writes
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
    "sparse-mha": ("sparse_mha", "DSA per shape: sparse absorbed vs sparse MHA (masked / gather)"),
    "vllm": ("vllm_e2e", "vLLM end to end: MLA_ABSORB vs CPU_MLA (and AMX_MLA where it runs)"),
    "vllm-dcp": ("vllm_dcp", "vLLM decode context parallel: KV per rank, decode, TP vs TP x DCP"),
    "vllm-dsa": ("vllm_dsa", "vLLM end to end, DSA (tiny V3.2, 8K prompts): sparse vs dense"),
    "vllm-steps": ("vllm_steps", "vLLM decode step profiled: where ours and a peer's time goes"),
    "serve": ("serve", "online serving through each engine's own bench client"),
    "sglang": ("sglang_batch", "SGLang one-batch: mla_absorb vs torch_native"),
    "plot": ("plot", "roofline PNG per ISA level from decode-latest.md (needs matplotlib)"),
    "gpu": ("gpu", "Triton kernels on a GPU vs FlashMLA-style baselines"),
    "gpu-resources": ("gpu_resources", "Triton kernels compiled for sm_90a / sm_100a on the CPU"),
    "gpu-sweep": ("gpu_sweep", "tile knobs of the Triton / Gluon kernels timed on a GPU"),
    "gpu-run": ("gpu_run", "the one prepared GPU run: tests, benchmarks, sweep, summary"),
    "gpu-sparse": ("gpu_sparse", "DSA decode on a GPU (Triton): indexer + sparse vs dense"),
    "fp8-accuracy": ("fp8_accuracy", "where fp8 latent caches lose accuracy (no engine)"),
    "v4": ("v4", "DeepSeek-V4 decode per layer kind, roofline; vs vLLM's own V4 CPU ops"),
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
