"""The native implementation's cost profile for the policy, per ISA level of its kernels.

Each profile is a roofline (:class:`~mla_backend.cost.DeviceProfile`) whose peak is the level's
own GEMM ceiling and whose efficiencies and per-request normal-path overhead are fitted to
``python -m benchmarks policy`` run at that level (``benchmarks/results/policy-history.md``):

- default (``fp32``, unlisted levels): the avx512_bf16 fit of 2026-11-23 (AMD Zen 4, bf16 MHA
  on ``vdpbf16ps``: fresh prefills of >= ~128-192 tokens go normal);
- ``avx512_bf16``: per attention engine (:mod:`.engine`'s rule picks it per CPU): ``fp32``
  (Intel) :data:`CPU_NATIVE_AVX512_BF16_PROFILE` (2026-11-24, Xeon SPR class), ``bf16`` (AMD)
  the default, which was fitted on that engine;
- ``avx2``: :data:`CPU_NATIVE_AVX2_PROFILE` (2026-11-24, Xeon SPR class with torch capped at AVX2);
- ``avx512``: :data:`CPU_NATIVE_AVX512_PROFILE` (2026-11-24, Xeon SPR class, the fp32 engine);
- ``amx``: :data:`CPU_NATIVE_AMX_PROFILE` (2026-11-24, Xeon SPR class, AMX attention engine).
"""

from __future__ import annotations

import dataclasses

from ...cost import DeviceProfile

CPU_NATIVE_PROFILE = DeviceProfile(
    peak_flops=0.6e12,
    bandwidth=7.8e9,
    absorbed_efficiency=2.0,
    attn_efficiency=1.0,
    cache_bytes=32 * 2**20,
    normal_overhead=0.6e-3,
)

#: Level ``amx``: torch's AMX-backed bf16 GEMM and SDPA serve the normal path's big calls (the
#: dispatch rule in :mod:`.kernels`), and the absorbed attention runs AMX tiles for >= 16 query
#: rows per request (:mod:`.engine`). Peak: the AMX bf16 GEMM ceiling measured in the decode
#: benchmark (1.49 TFLOP/s, 2 threads). Refitted 2026-11-24 10:35Z (Xeon Sapphire Rapids class,
#: load average 3.2-4.4) to ``python -m benchmarks policy`` at that level, 24 shapes (H 16/128,
#: P 0/1024, N 32-2048, 3-5 interleaved rounds): 23/24 right (the miss: H128 P1024 N1024,
#: absorbed 418 vs normal 538 ms); the fit it replaces (absorbed_efficiency 0.3, from before the
#: AMX attention engine) picked 7/12 of the N 32-512 shapes right. The absorbed path is now
#: ~6x cheaper: fresh prefills go normal from ~160 (128 heads) / ~440 (16 heads) new tokens,
#: extends onto a 1K prefix from ~700.
CPU_NATIVE_AMX_PROFILE = DeviceProfile(
    peak_flops=1.5e12,
    bandwidth=7.8e9,
    absorbed_efficiency=2.0,
    attn_efficiency=0.8,
    cache_bytes=32 * 2**20,
    normal_overhead=0.3e-3,
)

#: Level ``avx2`` (an AVX2 + FMA CPU without AVX-512 or bf16 dot products; every op of both paths
#: native, fp32 FMA on bf16 widened in registers): peak = the level's GEMM ceiling (fp32 GEMM,
#: 0.138 TFLOP/s at 2 threads, ``benchmarks/results/decode-history.md``); efficiencies and
#: overhead fitted to ``python -m benchmarks policy`` at that level with torch capped at AVX2
#: (``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2``, 2026-11-24 10:36Z, Xeon Sapphire Rapids
#: class imitating an AVX2-only CPU, load average 1.8-1.9, 3-5 interleaved rounds): 24 shapes
#: (H 16/128, P 0/1024, N 32-1024), 23 right (the miss: H128 fresh 128, absorbed 49 vs normal
#: 54 ms); the avx512_bf16 fit it had picked 10/12 right. (A fit to runs at load ~7, absorbed
#: 1.2 / attn 0.5 / overhead 10 ms, was a load artifact: many small parallel ops of the normal
#: path wait on descheduled threads.) Fresh prefills go normal from ~70 (128 heads) / ~200 (16
#: heads) new tokens, extends onto a 1K prefix from ~300.
CPU_NATIVE_AVX2_PROFILE = DeviceProfile(
    peak_flops=0.138e12,
    bandwidth=7.8e9,
    absorbed_efficiency=1.5,
    attn_efficiency=1.0,
    cache_bytes=32 * 2**20,
    normal_overhead=2e-3,
)

#: Level ``avx512`` (AVX-512 F/BW/VL/DQ, no bf16 dot products: the fp32 engine, every op of both
#: paths native, bf16 widened in registers): peak = the level's GEMM ceiling (0.211 TFLOP/s at 2
#: threads, torch capped at the level, ``benchmarks/results/decode-history.md``); efficiencies and
#: overhead fitted to ``python -m benchmarks policy`` at that level (2026-11-24 11:50Z, Xeon
#: Sapphire Rapids class, load average 1.9, 5 interleaved rounds): 24 shapes (H 16/128, P
#: 0/1024, N 32-1024), 23 right (the miss: H128 fresh 128, absorbed 28.2 vs normal 33.4 ms); the
#: default profile it replaces picked 22/24. The same fit as ``avx2``'s, at this level's peak.
CPU_NATIVE_AVX512_PROFILE = dataclasses.replace(CPU_NATIVE_AVX2_PROFILE, peak_flops=0.211e12)

#: Level ``avx512_bf16`` with the fp32 attention engine (the engine rule's pick on Intel; the
#: GEMMs, decompression and MHA on ``vdpbf16ps``; every op of both paths native): refitted
#: 2026-11-24 17:11Z (Xeon Sapphire Rapids class, torch uncapped,
#: ``MLA_BACKEND_NATIVE_ISA=avx512_bf16``, load average 1.3, 5 interleaved rounds) with
#: ``python -m benchmarks policy --prefix 0,1024 --new 32,64,128,256,512,1024 --fit``: 24 shapes
#: (H 16/128, P 0/1024, N 32-1024), 24 right, summed regret 0.05; the default profile (the Zen 4
#: fit) picked 23 (the miss: H128 fresh 128, absorbed 32.3 vs normal 38.7 ms; regret 0.24). Peak
#: kept at the default's 0.6 TF/s (the efficiencies are relative to it). Fresh prefills go normal
#: from ~145 (128 heads) / ~410 (16 heads) new tokens, extends onto a 1K prefix from ~270 / ~320.
CPU_NATIVE_AVX512_BF16_PROFILE = dataclasses.replace(
    CPU_NATIVE_PROFILE, absorbed_efficiency=1.0, attn_efficiency=0.5, normal_overhead=2e-3
)

#: profile by ISA level of the native build and attention engine, where a level's engine
#: differs by CPU and was fitted apart (:func:`profile_for` looks here first)
ENGINE_PROFILES: dict[tuple[str, str], DeviceProfile] = {
    ("avx512_bf16", "bf16"): CPU_NATIVE_PROFILE,
}

#: profile by ISA level of the native build (None: the level the loader picked)
PROFILES: dict[str | None, DeviceProfile] = {
    None: CPU_NATIVE_PROFILE,
    "fp32": CPU_NATIVE_PROFILE,
    "avx2": CPU_NATIVE_AVX2_PROFILE,
    "avx512": CPU_NATIVE_AVX512_PROFILE,
    "avx512_bf16": CPU_NATIVE_AVX512_BF16_PROFILE,
    "amx": CPU_NATIVE_AMX_PROFILE,
}


def profile_for(isa: str | None, engine: str | None = None) -> DeviceProfile:
    """The cost profile of native kernels built for ``isa`` whose absorbed attention runs
    ``engine`` (:data:`ENGINE_PROFILES`, else by level; an unlisted level: the default)."""
    if isa is not None and engine is not None and (isa, engine) in ENGINE_PROFILES:
        return ENGINE_PROFILES[isa, engine]
    return PROFILES.get(isa, CPU_NATIVE_PROFILE)
