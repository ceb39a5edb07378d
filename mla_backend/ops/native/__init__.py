"""Native C++ CPU kernels for absorbed MLA, the device seam's ``native`` implementation.

- :mod:`.isa`: the ISA levels (:data:`ISA_LEVELS`, the running architecture's: scalar, avx2,
  avx512, avx512_bf16, amx on x86-64; scalar, neon, neon_bf16, sve on aarch64), their compiler
  flags, the levels the CPU executes (:func:`host_isas`) and the selected one (the best, or
  ``MLA_BACKEND_NATIVE_ISA``: :func:`selected_isa`, with its reason :func:`isa.select_isa`);
- :mod:`.build`: the loader: one build per level, compiled at first use, each level's ops
  under ``torch.ops.mla_backend_<level>`` (:func:`op_namespace`);
- :mod:`.build_lock`: each build / load under an OS lock, so a killed build's stale torch
  ``lock`` file never blocks later loads (waits bounded by ``MLA_BACKEND_NATIVE_LOCK_TIMEOUT``);
- :mod:`.ops`: thin wrappers of those ops (the seam's records in, outputs back);
- :mod:`.kernels`: :class:`Kernels`, the seam's implementation over them;
- :mod:`.engine`: which compute engine runs the absorbed attention, per level and CPU;
- ``csrc/``: the C++ sources: ``vec.h`` (the vector layer: fp32 vectors of the level's width,
  AVX-512 / AVX2 + FMA + F16C / SVE / NEON / portable, with bf16 / fp16 / e4m3 widening
  loads and narrowing stores), ``isa.h`` (the level's macros, AVX-512 exp and e4m3 decode);
  the torch-free attention cores over raw pointers (threads through a callback):
  ``attention_params.h`` (the call's parameters and their check, scratch), ``rows.h`` (fp32 <->
  storage dtype rows), one header per engine (``f32_attention.h``, ``bf16_attention.h``,
  ``amx_attention.h``), ``absorbed_attention.h`` (work items, their run, the split merge),
  ``cache_writer.h`` (the cache-row writer); ``amx_tiles.h`` (AMX tile configuration and OS
  permission), ``gemm_core.h`` (the torch-free GEMM engine); the torch layer, one file per op,
  each declared in ``ops.h`` and all registered with their schemas in ``api.cpp``:
  ``absorbed_attention.cpp`` / ``cache_write.cpp`` (checks and parameters of the attention and
  the writer), ``head_gemm.cpp`` / ``mha.cpp`` / ``decompress.cpp`` (absorption GEMMs,
  normal-path MHA, its decompression), ``indexer.cpp`` (DSA's lightning indexer: its logits as a
  GEMM over ``gemm_core.h``, the streaming top-k), ``sparse_attention.cpp`` (DSA's sparse
  absorbed attention over the engines above) and ``sparse_mha.cpp`` (DSA's sparse MHA: the MHA
  of ``mha.cpp`` under a per-row mask).

Engines of the absorbed attention (:mod:`.engine` holds the one rule that picks them per level
and CPU, ``MLA_BACKEND_NATIVE_ENGINE`` overrides it): the fp32 engine (any q / cache dtype;
widened tiles, fp32 FMAs) at every level over ``vec.h``; from ``avx512_bf16`` on, bf16 queries
may use the bf16 engine (``vdpbf16ps``; picked where that instruction outruns fp32 FMA: AMD, not
Intel); at ``amx`` requests of >= 16 query rows with a bf16 or fp8 cache run on AMX-BF16 tiles
(``csrc/amx_attention.h``).

Kernel organisation (see the header comment of ``csrc/absorbed_attention.cpp``): work items are
(request, block of <= 32 query rows = new tokens x heads -- 128 on the AMX engine --, kv
split); each item streams its request's latent rows through the block table in tiles of 64
tokens (AMX: 128), loading each tile once for both the scores (fp32) and P·V; online softmax in
fp32; splits merged through their LSE.

Cache layouts (:mod:`mla_backend.cache_layout`): bf16/fp16/fp32 (q's dtype), float8_e4m3fn with a
per-tensor ``kv_scale``, and ``fp8_ds_mla`` (a uint8 cache: per token e4m3 c_kv in tiles of 128
with one float32 scale per tile, then k_pe in q's dtype), read in place: e4m3 bytes are decoded
exactly in registers / an L1 tile (bf16 engine: byte-table shuffles; fp32 engine: the fp16 bit
trick + vcvtph2ps), the ``fp8_ds_mla`` tile scales are applied to the partial scores per tile and
to the probabilities before P·V, never by writing a dequantized copy of the cache.
"""

from __future__ import annotations

from .build import HEAD_GEMM_COLS, available, op_namespace, unavailable_reason
from .isa import ISA_LEVELS, host_isas, selected_isa
from .kernels import Kernels
from .ops import (
    absorbed_attention,
    attention_with_lse,
    decompress,
    head_gemm,
    pack_heads,
    simd_level,
    write_latent,
)

__all__ = [
    "HEAD_GEMM_COLS",
    "ISA_LEVELS",
    "Kernels",
    "absorbed_attention",
    "attention_with_lse",
    "available",
    "decompress",
    "head_gemm",
    "host_isas",
    "op_namespace",
    "pack_heads",
    "selected_isa",
    "simd_level",
    "unavailable_reason",
    "write_latent",
]
