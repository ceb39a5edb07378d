"""Test and benchmark support, not used by the runtime path.

- :mod:`.cases`: the shared test-case builder (random latents in shuffled pages, NaN elsewhere).
- :mod:`.native_checks`: the native kernels' accuracy checks against the float64 oracle.
- :mod:`.core_driver`, :mod:`.cross_tools`: the torch-free core driver's targets (x86 levels,
  sanitizers, aarch64 under qemu-user), builds and case files; its aarch64 tools' installer.
- :mod:`.oracle`: teacher-forced log-probs of a transformers model for many served requests.
- :mod:`.reference`: the oracle, the paper's decompressed attention written plainly in fp32.
- :mod:`.tiny_model`: generator of tiny DeepSeek-V2 checkpoints (config, safetensors, tokenizer).
- :mod:`.tiny_v4`: generator of tiny DeepSeek-V4 checkpoints (DeepSeek's original names;
  transformers draws the module shapes).
- :mod:`.layer`, :mod:`.rope`, :mod:`.decompressed`: a full MLA layer (q_lora, RMSNorm, RoPE +
  yarn) with the paper's absorbed and decompressed-cache (CD) variants.
- :mod:`.host`: the CPU model, torch's capability and our native ISA levels (every demo and
  benchmark result names them).
- :mod:`.v4_oracle`: DeepSeek-V4's tests' shared parts (tiny transformers configs and modules,
  request chunking, slots, a compressor step through the core).

Nothing here imports or drives an engine (``tests/test_repo_imports.py`` checks): the scaffolding
that does (vLLM runs, CPU imitation, engine servers) is ``mla_backend_integrations._testing``
(``integrations/_testing/``).
"""

from . import cases, reference

__all__ = ["cases", "reference"]
