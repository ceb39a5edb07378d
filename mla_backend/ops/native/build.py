"""The native CPU kernels' loader: one build of the C++ sources under ``csrc/`` per ISA level,
compiled at first use, the best level the CPU executes picked at load time.

This module owns:

    @torch.library.register_fake(f"{ns}::native_decompress")
    def _(c_kv, k_pe, W_UK, W_UV):
        L, (H, nope, _), rope = c_kv.shape[0], W_UK.shape, k_pe.shape[-1]
        return c_kv.new_empty((L, H, nope + rope)), c_kv.new_empty((L, H, W_UV.shape[-1]))

- the ISA levels (:data:`ISA_LEVELS`, lowest first) and their compiler flags: each level gets
  explicit flags (never a tune-for-this-CPU flag), the macros ``MLA_ISA_<LEVEL>`` (exactly one),
  cumulative ``MLA_HAS_AVX2`` / ``MLA_HAS_AVX512`` / ``MLA_HAS_AVX512BF16`` / ``MLA_HAS_AMX``,
  ``MLA_OPS_NS`` (the ``torch.library`` namespace ``mla_backend_<level>``) and a C++ namespace
  of its own (``mla_native`` is renamed ``mla_native_<level>``), so several levels load into one
  process side by side;
- CPU feature detection (:func:`host_isas`: ``/proc/cpuinfo`` flags, else torch's capability;
  AMX also needs the OS permission torch requests, ``torch.cpu._is_amx_tile_supported()``) and
  the selection (:func:`selected_isa`: ``MLA_BACKEND_NATIVE_ISA`` forces a level the CPU
  executes, else the best one). A level the CPU lacks is never built or loaded;
- the loader: ``torch.utils.cpp_extension.load`` into torch's extensions directory
  (``TORCH_EXTENSIONS_DIR``) under a name holding the level and a hash of the sources and
  headers. If there is no compiler / ninja, the platform is not x86-64, or the build fails,
  :func:`available` returns False and one ``warnings.warn`` per level and process says why;
  importing never raises;
- the ops ``torch.ops.mla_backend_<level>.native_absorbed_attention`` /
  ``native_write_latent`` / ``native_fp8_decode`` / ``native_simd_info``
  (``csrc/mla_cpu.cpp``), ``native_pack_heads`` / ``native_head_gemm`` (``csrc/head_gemm.cpp``:
  the per-head absorption GEMMs), ``native_attention_with_lse`` (``csrc/mha_prefill.cpp``: the
  normal path's MHA) and ``native_decompress`` (``csrc/decompress.cpp``: its ``c_kv · W_UK^T`` /
  ``c_kv · W_UV``), the last three over the torch-free GEMM engine ``csrc/gemm_core.h``, with
  fake (meta) implementations, so ``torch.compile`` / ``FakeTensorMode`` treat them as opaque.
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
    "HEAD_GEMM_COLS",
    "ISA_LEVELS",
    "available",
    "host_isas",
    "op_namespace",
    "selected_isa",
    "unavailable_reason",
]

_CSRC = Path(__file__).resolve().parent / "csrc"
_SOURCES = ("mla_cpu.cpp", "head_gemm.cpp", "mha_prefill.cpp", "decompress.cpp")
_HEADERS = ("mla_cpu.h", "vec.h", "gemm_core.h", "attention_core.h")
_EXT_NAME = "mla_backend_native"
ENV_ISA = "MLA_BACKEND_NATIVE_ISA"

#: the ISA levels, lowest first
ISA_LEVELS = ("scalar", "avx2", "avx512", "avx512_bf16", "amx")

# per level: (compiler flags added to the previous level's, /proc/cpuinfo flags it needs)
_LEVEL_SPEC: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "scalar": ((), ()),
    "avx2": (("-mavx2", "-mfma", "-mf16c", "-mbmi2"), ("avx2", "fma", "f16c", "bmi2")),
    "avx512": (
        ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"),
        ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
    ),
    "avx512_bf16": (("-mavx512bf16", "-mavx512vnni"), ("avx512_bf16", "avx512_vnni")),
    "amx": (("-mamx-tile", "-mamx-bf16"), ("amx_tile", "amx_bf16")),
}
_MACRO = {
    "scalar": "SCALAR",
    "avx2": "AVX2",
    "avx512": "AVX512",
    "avx512_bf16": "AVX512BF16",
    "amx": "AMX",
}

#: output columns per packed weight block of ``csrc/head_gemm.cpp`` (its ``kNB``)
HEAD_GEMM_COLS = 64

_lock = threading.Lock()
_states: dict[str, dict[str, Any]] = {}


def _check_level(isa: str) -> str:
    if isa not in ISA_LEVELS:
        raise ValueError(f"ISA level {isa!r} is not supported; use one of {ISA_LEVELS}")
    return isa


def level_flags(isa: str) -> list[str]:
    """The compiler flags and macros of one level's build (cumulative over lower levels)."""
    _check_level(isa)
    idx = ISA_LEVELS.index(isa)
    flags = ["-O3", "-std=c++17", f"-DMLA_ISA_{_MACRO[isa]}", f"-DMLA_OPS_NS=mla_backend_{isa}"]
    flags.append(f"-Dmla_native=mla_native_{isa}")  # one C++ namespace per level and process
    for lvl in ISA_LEVELS[1 : idx + 1]:
        flags += list(_LEVEL_SPEC[lvl][0])
        flags.append(f"-DMLA_HAS_{_MACRO[lvl]}")
    return flags


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
    """The CPU's feature flags (``/proc/cpuinfo`` names; ``amx_os`` when the OS lets this
    process use AMX tiles). Off Linux, from torch's capability (AVX2 / AVX512 only)."""
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
    for lvl in ISA_LEVELS[1 : ISA_LEVELS.index(isa) + 1]:
        need += _LEVEL_SPEC[lvl][1]
    if isa == "amx":
        need.append("amx_os")  # the OS permission (arch_prctl) torch requests
    return [f for f in need if f not in feats]


def _is_x86_64() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def host_isas() -> tuple[str, ...]:
    """The levels this CPU executes, lowest first (empty off x86-64 for now)."""
    if not _is_x86_64():
        return ()
    feats = cpu_features()
    return tuple(lvl for lvl in ISA_LEVELS if not missing_features(lvl, feats))


def selected_isa() -> str:
    """``MLA_BACKEND_NATIVE_ISA`` when set (validated: a level this CPU executes), else the best
    level of :func:`host_isas` ('scalar' off x86-64, where the build then reports why not)."""
    forced = os.environ.get(ENV_ISA, "").strip()
    if forced:
        if forced not in ISA_LEVELS:
            raise ValueError(f"{ENV_ISA}={forced!r} is not supported; use one of {ISA_LEVELS}")
        if not _is_x86_64():
            raise ValueError(f"{ENV_ISA}={forced!r}: this machine is {platform.machine()!r}")
        lack = missing_features(forced)
        if lack:
            raise ValueError(f"{ENV_ISA}={forced!r}: this CPU lacks {', '.join(lack)}")
        return forced
    host = host_isas()
    return host[-1] if host else "scalar"


def _resolve(isa: str | None) -> str:
    return selected_isa() if isa is None else _check_level(isa)


def _build(isa: str) -> None:
    """Compile and load one level's extension (raises on any failure)."""
    if not _is_x86_64():
        raise RuntimeError(
            f"the native kernels target x86-64; this machine is {platform.machine().lower()!r}"
        )
    lack = missing_features(isa)
    if lack:  # never load instructions the CPU lacks
        raise RuntimeError(f"ISA level {isa!r} needs {', '.join(lack)}, which this CPU lacks")
    from torch.utils import cpp_extension

    cpp_extension.verify_ninja_availability()
    # the sources' hash is part of torch's cache key, but a header change alone is not: the
    # headers' text (and the flags) go into the extension name, with the level.
    h = hashlib.sha1()
    for name in _SOURCES + _HEADERS:
        h.update((_CSRC / name).read_bytes())
    h.update(" ".join(level_flags(isa)).encode())
    # at::parallel_for is inline OpenMP: without -fopenmp the kernels would run on one thread.
    # (torch's wheel ships libgomp.so.1, which the extension then shares.) A compiler without
    # OpenMP still gets a working, single-threaded build.
    last: Exception | None = None
    for omp in (True, False):
        flags = level_flags(isa) + (["-fopenmp"] if omp else [])
        try:
            cpp_extension.load(
                name=f"{_EXT_NAME}_{isa}_{h.hexdigest()[:12]}{'' if omp else '_serial'}",
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
            except Exception as e:  # no compiler, no ninja, compile error, non-x86 ...
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
