"""The native kernels' ISA levels and the CPU they run on: what each level is, what it needs,
which ones this CPU executes and which one is selected (and why).

This module owns:

- the ISA levels of each architecture, lowest first: :data:`X86_LEVELS` (scalar, avx2, avx512,
  avx512_bf16, amx) and :data:`AARCH64_LEVELS` (scalar, neon: Armv8.2-A + fp16, neon_bf16:
  + BF16 dot products, sve: SVE + BF16 built per vector length), :data:`ISA_LEVELS` those of
  the running machine; and their compiler flags (:func:`level_flags`, for any level on any
  host, so a cross compiler can use them): explicit flags per level (never a
  tune-for-this-CPU flag), the macros ``MLA_ISA_<LEVEL>`` (exactly one), cumulative
  ``MLA_HAS_AVX2`` / ``MLA_HAS_AVX512`` / ``MLA_HAS_AVX512BF16`` / ``MLA_HAS_AMX`` or
  ``MLA_HAS_NEON`` / ``MLA_HAS_NEON_BF16`` / ``MLA_HAS_SVE``, ``MLA_OPS_NS`` (the
  ``torch.library`` namespace ``mla_backend_<level>``) and a C++ namespace of its own
  (``mla_native`` is renamed ``mla_native_<level>``), so several levels load into one process
  side by side;
- CPU feature detection: x86 (:func:`cpu_features`: ``/proc/cpuinfo`` flags, else torch's
  capability; AMX also needs the OS permission torch requests,
  ``torch.cpu._is_amx_tile_supported()``); aarch64 from the Linux hwcaps
  (:func:`arm_features`, a pure function of ``getauxval(AT_HWCAP)`` / ``getauxval(AT_HWCAP2)``)
  and the process's SVE vector length (:func:`sve_vector_bits`, ``prctl(PR_SVE_GET_VL)``): 'sve'
  runs only at a length it is built for (:data:`SVE_VECTOR_BITS`), else neon_bf16 is the best;
- the selection (:func:`select_isa`: ``MLA_BACKEND_NATIVE_ISA`` forces a level of this
  architecture the CPU executes, else the best one; it returns the level and why).

The loader (:mod:`.build`) builds and loads the selected level.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path
from typing import Any

import torch

from ...config import current

__all__ = [
    "AARCH64_LEVELS",
    "ENV_ISA",
    "ISA_LEVELS",
    "SVE_VECTOR_BITS",
    "X86_LEVELS",
    "arch_levels",
    "arm_features",
    "cpu_features",
    "host_isas",
    "level_flags",
    "missing_features",
    "select_isa",
    "selected_isa",
    "sve_vector_bits",
]

ENV_ISA = "MLA_BACKEND_NATIVE_ISA"

#: the x86-64 levels, lowest first
X86_LEVELS = ("scalar", "avx2", "avx512", "avx512_bf16", "amx")
#: the aarch64 levels, lowest first ('scalar': the portable build, for Armv8.0 CPUs)
AARCH64_LEVELS = ("scalar", "neon", "neon_bf16", "sve")
#: the SVE vector lengths (bits) the 'sve' level is built for (GCC's -msve-vector-bits values);
#: a process with another vector length runs neon_bf16
SVE_VECTOR_BITS = (128, 256, 512, 1024, 2048)

# per level: (compiler flags, CPU features it needs). x86: flags and features add to the lower
# levels'. aarch64: the flags are the level's whole -march (a later -march replaces an earlier
# one), the features (the Linux hwcap names, as /proc/cpuinfo's "Features") add up.
_LEVEL_SPEC: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "scalar": ((), ()),
    "avx2": (("-mavx2", "-mfma", "-mf16c", "-mbmi2"), ("avx2", "fma", "f16c", "bmi2")),
    "avx512": (
        ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"),
        ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
    ),
    "avx512_bf16": (("-mavx512bf16", "-mavx512vnni"), ("avx512_bf16", "avx512_vnni")),
    "amx": (("-mamx-tile", "-mamx-bf16"), ("amx_tile", "amx_bf16")),
    "neon": (("-march=armv8.2-a+fp16",), ("asimd", "fphp", "asimdhp")),
    "neon_bf16": (("-march=armv8.2-a+fp16+bf16",), ("bf16",)),
    "sve": (("-march=armv8.2-a+fp16+bf16+sve",), ("sve", "svebf16")),
}
_MACRO = {
    "scalar": "SCALAR",
    "avx2": "AVX2",
    "avx512": "AVX512",
    "avx512_bf16": "AVX512BF16",
    "amx": "AMX",
    "neon": "NEON",
    "neon_bf16": "NEON_BF16",
    "sve": "SVE",
}

# Linux aarch64 hwcaps (arch/arm64/include/uapi/asm/hwcap.h): name -> (1: AT_HWCAP or
# 2: AT_HWCAP2, bit)
_HWCAP_BITS = {
    "asimd": (1, 1),
    "fphp": (1, 9),
    "asimdhp": (1, 10),
    "sve": (1, 22),
    "sve2": (2, 1),
    "svebf16": (2, 12),
    "i8mm": (2, 13),
    "bf16": (2, 14),
}
_AT_HWCAP, _AT_HWCAP2 = 16, 26
_PR_SVE_GET_VL, _PR_SVE_VL_LEN_MASK = 51, 0xFFFF


def _arch() -> str:
    """'x86_64', 'aarch64' or the machine's own name (no native levels)."""
    m = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


def arch_levels(arch: str | None = None) -> tuple[str, ...]:
    """The levels of ``arch`` (default: this machine's; the x86 names elsewhere)."""
    return AARCH64_LEVELS if (arch or _arch()) == "aarch64" else X86_LEVELS


#: the ISA levels of the running architecture, lowest first
ISA_LEVELS = arch_levels()


def _chain(isa: str) -> tuple[str, ...]:
    """The levels ``isa`` builds on, itself last (its architecture's order)."""
    levels = AARCH64_LEVELS if isa in AARCH64_LEVELS[1:] else X86_LEVELS
    return levels[: levels.index(isa) + 1]


def _check_level(isa: str, levels: tuple[str, ...] | None = None) -> str:
    allowed = levels or tuple(dict.fromkeys(X86_LEVELS + AARCH64_LEVELS))
    if isa not in allowed:
        raise ValueError(f"ISA level {isa!r} is not supported; use one of {allowed}")
    return isa


def level_flags(isa: str, vector_bits: int | None = None) -> list[str]:
    """The compiler flags and macros of one level's build, for ANY level on any host (a cross
    compiler takes them as they are: ``aarch64-linux-gnu-g++ -static ... *level_flags('sve',
    vector_bits=256)``).

    x86 levels: ``-m`` flags cumulative over the lower levels; aarch64 levels: the level's
    ``-march=armv8.2-a+...``; every level: ``-O3 -std=c++17``, ``-DMLA_ISA_<LEVEL>`` (exactly
    one), the cumulative ``-DMLA_HAS_<LEVEL>`` of its architecture's levels above scalar,
    ``-DMLA_OPS_NS=mla_backend_<level>`` and ``-Dmla_native=mla_native_<level>``.
    ``vector_bits`` (SVE vector length in bits, one of :data:`SVE_VECTOR_BITS`) is the 'sve'
    level's build parameter (``-msve-vector-bits``): default the running process's vector
    length on an SVE machine, required elsewhere; ValueError for the other levels."""
    _check_level(isa)
    chain = _chain(isa)
    flags = ["-O3", "-std=c++17", f"-DMLA_ISA_{_MACRO[isa]}", f"-DMLA_OPS_NS=mla_backend_{isa}"]
    flags.append(f"-Dmla_native=mla_native_{isa}")  # one C++ namespace per level and process
    for lvl in chain[1:]:
        if lvl in X86_LEVELS or lvl == isa:  # aarch64: only the level's own -march
            flags += list(_LEVEL_SPEC[lvl][0])
        flags.append(f"-DMLA_HAS_{_MACRO[lvl]}")
    if isa == "sve":
        bits = vector_bits if vector_bits is not None else sve_vector_bits()
        if bits is None:
            raise ValueError(
                f"ISA level 'sve' needs vector_bits (one of {SVE_VECTOR_BITS}): this process "
                "has no SVE vector length to default to"
            )
        if bits not in SVE_VECTOR_BITS:
            raise ValueError(
                f"SVE vector_bits={bits!r} is not supported; use one of {SVE_VECTOR_BITS}"
            )
        flags.append(f"-msve-vector-bits={bits}")
    elif vector_bits is not None:
        raise ValueError(f"vector_bits applies to the 'sve' level only, not {isa!r}")
    return flags


def arm_features(hwcap: int, hwcap2: int) -> frozenset[str]:
    """The aarch64 features (Linux hwcap names: asimd, fphp, asimdhp, sve, sve2, svebf16, i8mm,
    bf16) set in ``getauxval(AT_HWCAP)`` / ``getauxval(AT_HWCAP2)``."""
    words = {1: hwcap, 2: hwcap2}
    return frozenset(n for n, (w, bit) in _HWCAP_BITS.items() if (words[w] >> bit) & 1)


def _libc() -> Any:
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


@functools.cache
def _hwcaps() -> tuple[int, int]:
    """This process's (AT_HWCAP, AT_HWCAP2) (0, 0 where getauxval is missing)."""
    import ctypes

    try:
        getauxval = _libc().getauxval
    except (OSError, AttributeError):
        return 0, 0
    getauxval.restype, getauxval.argtypes = ctypes.c_ulong, [ctypes.c_ulong]
    return int(getauxval(_AT_HWCAP)), int(getauxval(_AT_HWCAP2))


@functools.cache
def sve_vector_bits() -> int | None:
    """This process's SVE vector length in bits (``prctl(PR_SVE_GET_VL)``); None off aarch64
    Linux or without SVE."""
    if _arch() != "aarch64" or "sve" not in arm_features(*_hwcaps()):
        return None
    import ctypes

    try:
        prctl = _libc().prctl
    except (OSError, AttributeError):
        return None
    prctl.restype = ctypes.c_int
    z = ctypes.c_ulong(0)
    ret = int(prctl(ctypes.c_int(_PR_SVE_GET_VL), z, z, z, z))
    return (ret & _PR_SVE_VL_LEN_MASK) * 8 if ret > 0 else None


@functools.cache
def _cpuinfo_text() -> str | None:
    """``/proc/cpuinfo`` (read once per process: every op call resolves its level through
    :func:`cpu_features`); None where there is none."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return None


def cpuinfo_field(*keys: str) -> str | None:
    """The value of the first ``/proc/cpuinfo`` line whose key is one of ``keys`` (``flags``,
    ``Features``, ``vendor_id``, ``model name``, ...), stripped; None where there is none: the
    one reader of that file (the ISA levels, the engine rule, the test host's report)."""
    for line in (_cpuinfo_text() or "").splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in keys:
            return value.strip()
    return None


def _proc_cpu_flags() -> frozenset[str] | None:
    """The flags line of ``/proc/cpuinfo`` (None where there is none)."""
    flags = cpuinfo_field("flags")
    return None if flags is None else frozenset(flags.split())


def cpu_features() -> frozenset[str]:
    """The CPU's feature flags: on aarch64 the hwcap names (:func:`arm_features`); on x86 the
    ``/proc/cpuinfo`` names, ``amx_os`` when the OS lets this process use AMX tiles, and off
    Linux torch's capability (AVX2 / AVX512 only)."""
    if _arch() == "aarch64":
        return arm_features(*_hwcaps())
    flags = _proc_cpu_flags()
    if flags is None:
        cap = torch.backends.cpu.get_cpu_capability()
        flags = frozenset()
        if cap in ("AVX2", "AVX512"):
            flags |= set(_LEVEL_SPEC["avx2"][1])
        if cap == "AVX512":
            flags |= set(_LEVEL_SPEC["avx512"][1])
    if _amx_os():
        flags = flags | {"amx_os"}
    return frozenset(flags)


@functools.cache
def _amx_os() -> bool:
    """Whether this process may use AMX tiles (torch asks the OS once; asked once here)."""
    amx_ok = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(amx_ok is not None and amx_ok())


def missing_features(isa: str, features: frozenset[str] | None = None) -> list[str]:
    """The CPU features ``isa`` needs that this CPU (or ``features``) lacks."""
    _check_level(isa)
    feats = cpu_features() if features is None else features
    need: list[str] = []
    for lvl in _chain(isa)[1:]:
        need += _LEVEL_SPEC[lvl][1]
    if isa == "amx":
        need.append("amx_os")  # the OS permission (arch_prctl) torch requests
    return [f for f in need if f not in feats]


def _sve_vl_problem(bits: int | None) -> str | None:
    """Why the 'sve' level cannot run at this vector length (None: it can)."""
    if bits in SVE_VECTOR_BITS:
        return None
    return (
        f"this process's SVE vector length is {bits} bits; the 'sve' level is built for "
        f"{', '.join(map(str, SVE_VECTOR_BITS))}"
    )


def _host_lacks(isa: str) -> list[str]:
    """What this machine lacks for ``isa`` (features, or the SVE vector length)."""
    lack = missing_features(isa)
    if isa == "sve" and not lack:
        problem = _sve_vl_problem(sve_vector_bits())
        if problem:
            lack.append(problem)
    return lack


def host_isas() -> tuple[str, ...]:
    """The levels this CPU executes, lowest first (empty off x86-64 / aarch64). On aarch64
    'sve' needs SVE, SVE-BF16 and a vector length of :data:`SVE_VECTOR_BITS`."""
    arch = _arch()
    if arch not in ("x86_64", "aarch64"):
        return ()
    return tuple(lvl for lvl in arch_levels(arch) if not _host_lacks(lvl))


def select_isa() -> tuple[str, str]:
    """(level, why): ``MLA_BACKEND_NATIVE_ISA`` when set (validated: a level of this
    architecture the CPU executes; ValueError naming the value otherwise), else the best level
    of :func:`host_isas` ('scalar' elsewhere, where the build then reports why not)."""
    forced = current().native_isa
    if forced:
        arch = _arch()
        if arch not in ("x86_64", "aarch64"):
            raise ValueError(f"{ENV_ISA}={forced!r}: this machine is {arch!r}")
        levels = arch_levels(arch)
        if forced not in levels:
            raise ValueError(
                f"{ENV_ISA}={forced!r} is not supported on {arch}; use one of {levels}"
            )
        lack = _host_lacks(forced)
        if lack:
            raise ValueError(f"{ENV_ISA}={forced!r}: this CPU lacks {', '.join(lack)}")
        return forced, f"{ENV_ISA}={forced}"
    host = host_isas()
    if not host:
        return "scalar", f"no native level for this machine ({_arch()})"
    best = host[-1]
    need = [f for lvl in _chain(best)[1:] for f in _LEVEL_SPEC[lvl][1]]
    why = f"the best level this CPU runs ({_arch()}"
    why += f": {' '.join(need)})" if need else ")"
    return best, why


def selected_isa() -> str:
    """The selected level (:func:`select_isa` without the reason)."""
    return select_isa()[0]
