"""The native CPU kernels' loader: one build of the C++ sources under ``csrc/`` per ISA level,
compiled at first use, the best level the CPU executes picked at load time.

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
- the selection (:func:`selected_isa`: ``MLA_BACKEND_NATIVE_ISA`` forces a level of this
  architecture the CPU executes, else the best one). A level the CPU lacks is never built or
  loaded; on other architectures there are no levels and the kernels are unavailable, saying
  why;
- the loader: ``torch.utils.cpp_extension.load`` into torch's extensions directory
  (``TORCH_EXTENSIONS_DIR``) under a name holding the level and a hash of the sources and
  headers (and the SVE vector length; ``_serial`` for the fallback build without OpenMP), one
  build directory per name, each load under the OS lock of :mod:`.build_lock` (a build killed
  midway never blocks later loads). If there is no compiler / ninja, the platform is neither
  x86-64 nor aarch64, or the build fails,
  :func:`available` returns False and one ``warnings.warn`` per level and process says why;
  importing never raises;
- the ops ``torch.ops.mla_backend_<level>.native_absorbed_attention`` /
  ``native_write_latent`` / ``native_fp8_decode`` / ``native_simd_info``
  (``csrc/mla_cpu.cpp``), ``native_pack_heads`` / ``native_head_gemm`` (``csrc/head_gemm.cpp``:
  the per-head absorption GEMMs), ``native_attention_with_lse`` (``csrc/mha_prefill.cpp``: the
  normal path's MHA) and ``native_decompress`` (``csrc/decompress.cpp``: its ``c_kv · W_UK^T`` /
  ``c_kv · W_UV``), the last three over the torch-free GEMM engine ``csrc/gemm_core.h``;
  DSA's ``native_indexer_topk`` / ``native_indexer_logits`` (``csrc/indexer.cpp``, over the
  same GEMM engine) and ``native_sparse_attention`` (``csrc/sparse_attention.cpp``, over the
  absorbed attention's engines); with fake (meta) implementations, so ``torch.compile`` /
  ``FakeTensorMode`` treat them as opaque.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import threading
import warnings
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "AARCH64_LEVELS",
    "HEAD_GEMM_COLS",
    "ISA_LEVELS",
    "SVE_VECTOR_BITS",
    "X86_LEVELS",
    "arch_levels",
    "arm_features",
    "available",
    "host_isas",
    "level_flags",
    "op_namespace",
    "selected_isa",
    "sve_vector_bits",
    "unavailable_reason",
]

_CSRC = Path(__file__).resolve().parent / "csrc"
_SOURCES = (
    "mla_cpu.cpp", "head_gemm.cpp", "mha_prefill.cpp", "decompress.cpp", "indexer.cpp",
    "sparse_attention.cpp",
)  # fmt: skip
_HEADERS = (
    "mla_cpu.h",
    "vec.h",
    "gemm_core.h",
    "amx_tiles.h",
    "attention_core.h",
    "amx_attention.h",
)
_EXT_NAME = "mla_backend_native"
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

#: output columns per packed weight block of ``csrc/head_gemm.cpp`` (its ``kNB``)
HEAD_GEMM_COLS = 64

_lock = threading.Lock()
_states: dict[str, dict[str, Any]] = {}


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
def _proc_cpu_flags() -> frozenset[str] | None:
    """The flags line of ``/proc/cpuinfo`` (read once per process: every op call resolves its
    level through :func:`cpu_features`)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return None


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


def selected_isa() -> str:
    """``MLA_BACKEND_NATIVE_ISA`` when set (validated: a level of this architecture the CPU
    executes), else the best level of :func:`host_isas` ('scalar' elsewhere, where the build
    then reports why not)."""
    forced = os.environ.get(ENV_ISA, "").strip()
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
        return forced
    host = host_isas()
    return host[-1] if host else "scalar"


def _resolve(isa: str | None) -> str:
    return selected_isa() if isa is None else _check_level(isa)


def _build(isa: str) -> None:
    """Compile and load one level's extension (raises on any failure)."""
    arch = _arch()
    if arch not in ("x86_64", "aarch64"):
        raise RuntimeError(
            f"the native kernels target x86-64 and aarch64; this machine is {arch!r}"
        )
    if isa not in arch_levels(arch):
        raise RuntimeError(f"ISA level {isa!r} is not a level of this machine ({arch})")
    lack = _host_lacks(isa)
    if lack:  # never load instructions the CPU lacks
        raise RuntimeError(f"ISA level {isa!r} needs {', '.join(lack)}, which this CPU lacks")
    from torch.utils import cpp_extension

    from .build_lock import locked_load

    cpp_extension.verify_ninja_availability()
    # the sources' hash is part of torch's cache key, but a header change alone is not: the
    # headers' text (and the flags) go into the extension name, with the level.
    h = hashlib.sha1()
    for name in _SOURCES + _HEADERS:
        h.update((_CSRC / name).read_bytes())
    h.update(" ".join(level_flags(isa)).encode())
    vl = str(sve_vector_bits()) if isa == "sve" else ""  # the build's vector length
    # at::parallel_for is inline OpenMP: without -fopenmp the kernels would run on one thread.
    # (torch's wheel ships libgomp.so.1, which the extension then shares.) A compiler without
    # OpenMP still gets a working, single-threaded build.
    last: Exception | None = None
    for omp in (True, False):
        flags = level_flags(isa) + (["-fopenmp"] if omp else [])
        try:
            locked_load(  # cpp_extension.load under our OS lock (:mod:`.build_lock`)
                name=f"{_EXT_NAME}_{isa}{vl}_{h.hexdigest()[:12]}{'' if omp else '_serial'}",
                sources=[str(_CSRC / s) for s in _SOURCES],
                extra_cflags=flags,
                extra_ldflags=["-fopenmp"] if omp else [],
                extra_include_paths=[str(_CSRC)],
                is_python_module=False,
                verbose=os.environ.get("MLA_BACKEND_NATIVE_VERBOSE", "") == "1",
            )
            _states[isa]["openmp"] = omp
            break
        except Exception as e:  # retry without OpenMP, then give up
            last = e
    else:
        raise last  # type: ignore[misc]
    _register_fakes(f"mla_backend_{isa}")


def _register_fakes(ns: str) -> None:
    @torch.library.register_fake(f"{ns}::native_absorbed_attention")
    def _(
        q_lat,
        q_pe,
        kv_cache,
        block_table,
        cu_seqlens_q,
        kv_lens,
        softmax_scale,
        kv_scale=None,
        num_kv_splits=0,
        max_page_id=-1,
        engine=-1,
    ):
        T, H, r = q_lat.shape
        return q_lat.new_empty((T, H, r)), q_lat.new_empty((T, H), dtype=torch.float32)

    @torch.library.register_fake(f"{ns}::native_write_latent")
    def _(kv_cache, c_kv, k_pe, slot_mapping, kv_scale=None):
        return None

    @torch.library.register_fake(f"{ns}::native_pack_heads")
    def _(w):
        H, K, N = w.shape
        return w.new_empty((H, -(-N // HEAD_GEMM_COLS), -(-K // 2), HEAD_GEMM_COLS, 2))

    @torch.library.register_fake(f"{ns}::native_head_gemm")
    def _(x, packed, n):
        return x.new_empty((x.shape[0], x.shape[1], n))

    @torch.library.register_fake(f"{ns}::native_attention_with_lse")
    def _(q, k, v, causal, scale):
        H, Lq, _ = q.shape
        return q.new_empty((H, Lq, v.shape[-1])), q.new_empty((H, Lq), dtype=torch.float32)

    @torch.library.register_fake(f"{ns}::native_decompress")
    def _(c_kv, k_pe, W_UK, W_UV):
        L, (H, nope, _), rope = c_kv.shape[0], W_UK.shape, k_pe.shape[-1]
        return c_kv.new_empty((L, H, nope + rope)), c_kv.new_empty((L, H, W_UV.shape[-1]))

    @torch.library.register_fake(f"{ns}::native_indexer_topk")
    def _(q_I, weights, index_cache, block_table, cu, kv_lens, quant_block_size, topk,
          max_page_id, out):  # fmt: skip
        return None

    @torch.library.register_fake(f"{ns}::native_indexer_logits")
    def _(q_I, weights, index_cache, block_table, cu, kv_lens, quant_block_size, width,
          max_page_id):  # fmt: skip
        return weights.new_empty((q_I.shape[0], width))

    @torch.library.register_fake(f"{ns}::native_sparse_attention")
    def _(q_lat, q_pe, kv_cache, block_table, cu, kv_lens, indices, token_req, softmax_scale,
          kv_scale, max_page_id, engine, out, lse):  # fmt: skip
        return None

    @torch.library.register_fake(f"{ns}::native_fp8_decode")
    def _(data, bf16):
        return data.new_empty((data.numel(),), dtype=torch.float32)


def _state(isa: str) -> dict[str, Any]:
    return _states.setdefault(isa, {"tried": False, "ok": False, "reason": None, "warned": False})


def available(isa: str | None = None) -> bool:
    """Build/load level ``isa`` (default :func:`selected_isa`) on first call; False if that
    failed (see :func:`unavailable_reason`), in which case one warning was issued in this
    process. A bad ``MLA_BACKEND_NATIVE_ISA`` makes the kernels unavailable, saying why."""
    try:
        lvl = _resolve(isa)
    except ValueError as e:
        st = _state("env")
        st.update(tried=True, ok=False, reason=str(e))
        _warn_once(st)
        return False
    st = _state(lvl)
    if st["tried"]:
        return bool(st["ok"])
    with _lock:
        if not st["tried"]:
            try:
                _build(lvl)
                st["ok"] = True
            except Exception as e:  # no compiler, no ninja, compile error, other CPU ...
                st["ok"] = False
                st["reason"] = f"{type(e).__name__}: {e}".strip()[:2000]
                _warn_once(st, lvl)
            st["tried"] = True
    return bool(st["ok"])


def _warn_once(st: dict[str, Any], lvl: str | None = None) -> None:
    if not st["warned"]:
        st["warned"] = True
        where = f" (ISA level {lvl})" if lvl else ""
        warnings.warn(
            f"mla_backend native CPU kernels{where} are unavailable (falling back to the torch "
            f"implementation): {st['reason']}",
            RuntimeWarning,
            stacklevel=3,
        )


def unavailable_reason(isa: str | None = None) -> str | None:
    """Why :func:`available` is False (None when the kernels loaded or were not tried)."""
    try:
        lvl = _resolve(isa)
    except ValueError as e:
        return str(e)
    return _state(lvl)["reason"]


def require(isa: str | None = None) -> str:
    """The resolved level, built and loaded (RuntimeError saying why if it cannot be)."""
    if not available(isa):
        raise RuntimeError(f"mla_backend native kernels are unavailable: {unavailable_reason(isa)}")
    return _resolve(isa)


def op_namespace(isa: str | None = None) -> Any:
    """``torch.ops.mla_backend_<level>`` of level ``isa`` (default :func:`selected_isa`),
    built and loaded."""
    return getattr(torch.ops, f"mla_backend_{require(isa)}")
