"""The native implementation's cost profile for the policy, per ISA level of its kernels and,
where a level's attention engine differs by CPU and was fitted apart, per engine.

Each profile is a roofline (:class:`~mla_backend.cost.DeviceProfile`) whose peak is the level's
own GEMM ceiling and whose efficiencies and per-request normal-path overhead are fitted to
``python -m benchmarks policy --fit`` run at that level. The values live in the package's data
file (``mla_backend/profiles.json``, :func:`mla_backend.cost.stored_profile`) as
``native:<level>`` and ``native:<level>:<engine>``, each with the fit's CPU, date and score; the
runs are in ``benchmarks/results/policy-*.md``. A level with no entry of its own (``scalar``,
the aarch64 levels) gets :data:`CPU_NATIVE_PROFILE`, the first fit (avx512_bf16 on its bf16
engine).
"""

from __future__ import annotations

from ...cost import DeviceProfile, stored_profile

__all__ = [
    "CPU_NATIVE_PROFILE",
    "DEFAULT_KEY",
    "ENGINE_PROFILES",
    "PROFILES",
    "profile_for",
    "profile_key",
]

#: the stored profile of levels that have none of their own
DEFAULT_KEY = "native:avx512_bf16:bf16"
#: the levels and (level, engine) pairs with a stored profile of their own
_LEVELS = ("avx2", "avx512", "avx512_bf16", "amx")
_ENGINES = (("avx512_bf16", "bf16"),)


def profile_key(isa: str | None, engine: str | None = None) -> str:
    """The data file's name of the profile of native kernels built for ``isa`` whose absorbed
    attention runs ``engine``: ``native:<isa>:<engine>`` where that pair was fitted apart, else
    ``native:<isa>``, else (an unlisted level) :data:`DEFAULT_KEY`. A fit at that level and
    engine is stored under this name."""
    if (isa, engine) in _ENGINES:
        return f"native:{isa}:{engine}"
    return f"native:{isa}" if isa in _LEVELS else DEFAULT_KEY


_BY_KEY: dict[str, DeviceProfile] = {
    key: stored_profile(key)
    for key in (DEFAULT_KEY, *(f"native:{i}" for i in _LEVELS),
                *(f"native:{i}:{e}" for i, e in _ENGINES))
}  # fmt: skip
CPU_NATIVE_PROFILE = _BY_KEY[DEFAULT_KEY]
#: profile by ISA level of the native build and attention engine, where a level's engine
#: differs by CPU and was fitted apart (:func:`profile_for` looks here first)
ENGINE_PROFILES: dict[tuple[str, str], DeviceProfile] = {
    (i, e): _BY_KEY[f"native:{i}:{e}"] for i, e in _ENGINES
}
#: profile by ISA level of the native build (None: the level the loader picked; ``fp32``: a
#: build whose simd class is fp32)
PROFILES: dict[str | None, DeviceProfile] = {
    None: CPU_NATIVE_PROFILE,
    "fp32": CPU_NATIVE_PROFILE,
    **{i: _BY_KEY[f"native:{i}"] for i in _LEVELS},
}


def profile_for(isa: str | None, engine: str | None = None) -> DeviceProfile:
    """The cost profile of native kernels built for ``isa`` whose absorbed attention runs
    ``engine`` (:func:`profile_key`'s entry of the data file)."""
    return _BY_KEY[profile_key(isa, engine)]
