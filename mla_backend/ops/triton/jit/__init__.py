"""Triton kernels for the absorbed MLA path (GPU; verified on CPU under ``TRITON_INTERPRET=1``).

- :mod:`.cache_write`: scatter ``[c_kv ; k_pe]`` rows into the paged latent cache.
- :mod:`.attention`: paged, split-KV, grouped-head absorbed attention (decode and extend)
  and the LSE merge of the split partials.
- :mod:`.heuristics`: tile sizes and the split-count heuristic.

Only :mod:`mla_backend.ops.triton.ops` should call these; it owns argument checking.
"""
