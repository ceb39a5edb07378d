"""The native CPU kernels' loader: one build of the C++ sources under ``csrc/`` per ISA level
(:mod:`.isa`: the levels, their flags, which ones this CPU runs), compiled at first use.

This module owns the loader: ``torch.utils.cpp_extension.load`` into torch's extensions
directory (``TORCH_EXTENSIONS_DIR``) under a name holding the level and a hash of the sources
and headers (and the SVE vector length; ``_serial`` for the fallback build without OpenMP), one
build directory per name, each load under the OS lock of :mod:`.build_lock` (a build killed
midway never blocks later loads). A level the CPU lacks is never built or loaded. If there is no
compiler / ninja, the platform is neither x86-64 nor aarch64, or the build fails,
:func:`available` returns False and one ``warnings.warn`` per level and process says why;
importing never raises.

The ops ``torch.ops.mla_backend_<level>.native_absorbed_attention`` / ``native_write_latent`` /
``native_fp8_decode`` / ``native_simd_info`` (``csrc/mla_cpu.cpp``), ``native_pack_heads`` /
``native_head_gemm`` / ``native_head_gemm_out`` (``csrc/head_gemm.cpp``: the per-head absorption
GEMMs), ``native_attention_with_lse`` (``csrc/mha_prefill.cpp``: the normal path's MHA) and
``native_decompress`` (``csrc/decompress.cpp``: its ``c_kv · W_UK^T`` / ``c_kv · W_UV``), the
last three over the torch-free GEMM engine ``csrc/gemm_core.h``, and DSA's
``native_indexer_topk`` / ``native_indexer_logits`` (``csrc/indexer.cpp``, over the same GEMM
engine) and ``native_sparse_attention`` (``csrc/sparse_attention.cpp``, over the absorbed
attention's engines), and ``native_keyset_attention`` (``csrc/keyset_attention.cpp``: absorbed
attention over key sets -- windows, index lists into one or two caches, sinks -- over the same
engines) have fake (meta) implementations, so ``torch.compile`` /
``FakeTensorMode`` treat them as opaque.
"""

from __future__ import annotations

import hashlib
import threading
import warnings
from pathlib import Path
from typing import Any

import torch

from ...config import current
from . import isa as _isa
from .isa import arch_levels, level_flags, sve_vector_bits

__all__ = ["HEAD_GEMM_COLS", "available", "op_namespace", "require", "unavailable_reason"]

_CSRC = Path(__file__).resolve().parent / "csrc"
_SOURCES = (
    "mla_cpu.cpp", "head_gemm.cpp", "mha_prefill.cpp", "decompress.cpp", "indexer.cpp",
    "sparse_attention.cpp", "keyset_attention.cpp",
)  # fmt: skip
_HEADERS = (
    "isa.h",
    "vec.h",
    "gemm_core.h",
    "amx_tiles.h",
    "attention_params.h",
    "rows.h",
    "f32_attention.h",
    "bf16_attention.h",
    "amx_attention.h",
    "absorbed_attention.h",
    "cache_writer.h",
)
_EXT_NAME = "mla_backend_native"

#: output columns per packed weight block of ``csrc/head_gemm.cpp`` (its ``kNB``)
HEAD_GEMM_COLS = 64

_lock = threading.Lock()
_states: dict[str, dict[str, Any]] = {}


def _resolve(isa: str | None) -> str:
    return _isa.selected_isa() if isa is None else _isa._check_level(isa)


def _build(isa: str) -> None:
    """Compile and load one level's extension (raises on any failure)."""
    arch = _isa._arch()
    if arch not in ("x86_64", "aarch64"):
        raise RuntimeError(
            f"the native kernels target x86-64 and aarch64; this machine is {arch!r}"
        )
    if isa not in arch_levels(arch):
        raise RuntimeError(f"ISA level {isa!r} is not a level of this machine ({arch})")
    lack = _isa._host_lacks(isa)
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
                verbose=current().flag("native_verbose"),
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

    @torch.library.register_fake(f"{ns}::native_head_gemm_out")
    def _(x, packed, y):
        return None

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

    @torch.library.register_fake(f"{ns}::native_keyset_attention")
    def _(q_lat, q_pe, kv_cache, block_table, cu, kv_lens, range_, window, indices, cache2,
          block_table2, lens2, indices2, sink, softmax_scale, kv_scale, max_page_id,
          num_kv_splits, engine, out, lse):  # fmt: skip
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
