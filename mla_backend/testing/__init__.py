"""Test and benchmark support, not used by the runtime path.

- :mod:`.cases`: the shared test-case builder (random latents in shuffled pages, NaN elsewhere).
- :mod:`.native_checks`: the native kernels' accuracy checks against the float64 oracle.
- :mod:`.core_driver`, :mod:`.cross_tools`: the torch-free core driver's targets (x86 levels,
  sanitizers, aarch64 under qemu-user), builds and case files; its aarch64 tools' installer.
- :mod:`.oracle`: teacher-forced log-probs of a transformers model for many served requests.
- :mod:`.reference`: the oracle, the paper's decompressed attention written plainly in fp32.
- :mod:`.tiny_model`: generator of tiny DeepSeek-V2 checkpoints (config, safetensors, tokenizer).
- :mod:`.layer`, :mod:`.rope`, :mod:`.decompressed`: a full MLA layer (q_lora, RMSNorm, RoPE +
  yarn) with the paper's absorbed and decompressed-cache (CD) variants.
- :mod:`.host`: the CPU model, torch's capability and our native ISA levels (every demo and
  benchmark result names them).
- :mod:`.vllm_backends`, :mod:`.vllm_runner` (+ ``amx_shim/``): which vLLM CPU MLA backends run
  on this CPU, and one backend's engine run in a fresh process (the demo and ``benchmarks``).
- :mod:`.cpu_imitation` (+ ``imitate_shim/``): engine processes on an imitated CPU with fewer
  instructions (an AVX2-only one on an AVX-512/AMX host): torch capped, vLLM's CPU checks shimmed.
- :mod:`.engine_server`: an engine's server process, started and always stopped.
"""

from . import cases, reference

__all__ = ["cases", "reference"]
