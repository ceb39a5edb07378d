"""The native implementation's cost profile for the policy, per ISA level of its kernels.

Measured on the project's CPUs (2 threads): the absorbed attention and, for bf16, the normal
path's MHA run near the machine's peak, the normal path paying a fixed per-request cost (fitted
to the policy benchmark, see ``benchmarks/results/mla_policy-latest.md``: fresh prefills of
>= ~128-192 tokens go normal). Every level has today's numbers until each is refitted on its
own build.
"""

from __future__ import annotations

from ...cost import DeviceProfile

CPU_NATIVE_PROFILE = DeviceProfile(
    peak_flops=0.6e12,
    bandwidth=7.8e9,
    absorbed_efficiency=2.0,
    attn_efficiency=1.0,
    cache_bytes=32 * 2**20,
    normal_overhead=0.6e-3,
)

#: profile by ISA level of the native build (None: the level the loader picked)
PROFILES: dict[str | None, DeviceProfile] = {
    None: CPU_NATIVE_PROFILE,
    "fp32": CPU_NATIVE_PROFILE,
    "avx2": CPU_NATIVE_PROFILE,
    "avx512": CPU_NATIVE_PROFILE,
    "avx512_bf16": CPU_NATIVE_PROFILE,
    "amx": CPU_NATIVE_PROFILE,
}


def profile_for(isa: str | None) -> DeviceProfile:
    """The cost profile of native kernels built for ``isa`` (an unlisted level: the default)."""
    return PROFILES.get(isa, CPU_NATIVE_PROFILE)
