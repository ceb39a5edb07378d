"""Test and benchmark support, not used by the runtime path.

- :mod:`.cases`: the shared test-case builder (random latents in shuffled pages, NaN elsewhere).
- :mod:`.oracle`: teacher-forced log-probs of a transformers model for many served requests.
- :mod:`.reference`: the oracle, the paper's decompressed attention written plainly in fp32.
- :mod:`.tiny_model`: generator of tiny DeepSeek-V2 checkpoints (config, safetensors, tokenizer).
- :mod:`.layer`, :mod:`.rope`, :mod:`.decompressed`: a full MLA layer (q_lora, RMSNorm, RoPE +
  yarn) with the paper's absorbed and decompressed-cache (CD) variants.
"""

from . import cases, reference

__all__ = ["cases", "reference"]
