"""The native CPU kernels' loader: one build of the C++ sources under ``csrc/`` per ISA level
(:mod:`.isa`: the levels, their flags, which ones this CPU runs), compiled at first use.

This module owns the loader: ``torch.utils.cpp_extension.load`` into torch's extensions
directory (``TORCH_EXTENSIONS_DIR``) under a name holding the level and a hash of the sources,
headers and flags and of what the binary depends on (:func:`binary_identity`: torch's build and
C++ ABI, Python, the compiler), the SVE vector length, ``_serial`` for the fallback build
without OpenMP; one build directory per name, each load under the OS lock of
:mod:`.build_lock` (a build killed midway never blocks later loads). A level the CPU lacks is
never built or loaded. If there is no compiler / ninja, the platform is neither x86-64 nor
aarch64, or the build fails, :func:`available` returns False and one ``warnings.warn`` per level
and process says why; importing never raises.

The ops, all registered with their schemas in one file, ``csrc/api.cpp``, and each defined in
the file of its job (declared in ``csrc/ops.h``): ``torch.ops.mla_backend_<level>.``
``native_absorbed_attention`` / ``native_fp8_decode`` / ``native_simd_info``
(``csrc/absorbed_attention.cpp``), ``native_write_latent`` (``csrc/cache_write.cpp``),
``native_pack_heads`` / ``native_head_gemm`` / ``native_head_gemm_out`` (``csrc/head_gemm.cpp``:
the per-head absorption GEMMs), ``native_attention_with_lse`` (``csrc/mha.cpp``: the normal
path's MHA) and ``native_decompress`` (``csrc/decompress.cpp``: its ``c_kv · W_UK^T`` /
``c_kv · W_UV``), the last three over the torch-free GEMM engine ``csrc/gemm_core.h``, and DSA's
``native_indexer_topk`` / ``native_indexer_logits`` (``csrc/indexer.cpp``, over the same GEMM
engine), ``native_sparse_attention`` (``csrc/sparse_attention.cpp``, over the absorbed
attention's engines), ``native_masked_attention_with_lse`` (``csrc/sparse_mha.cpp``: DSA's
sparse MHA, the normal path's MHA with a per-row mask) and ``native_keyset_attention``
(``csrc/keyset_attention.cpp``: absorbed attention over key sets -- windows, index lists into
one or two caches, sinks -- over the absorbed attention's engines) with
``native_v4_slot_attention`` (the same file: DeepSeek-V4's fp8 rows read in place, per token
flat slots into a window and a compressed cache). Each op that takes a tensor
has a fake (meta) function (:data:`FAKES`), checked against the loaded build's schemas
(:func:`schema_mismatches`), so ``torch.compile`` / ``FakeTensorMode`` treat them as opaque.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ...config import current
from . import isa as _isa
from .isa import arch_levels, level_flags, sve_vector_bits

__all__ = [
    "FAKES", "HEAD_GEMM_COLS", "available", "op_namespace", "registered_schemas", "require",
    "schema_mismatches", "unavailable_reason",
]  # fmt: skip

_CSRC = Path(__file__).resolve().parent / "csrc"
#: the torch layer, one file per op (declared in ``ops.h``), and ``api.cpp``, which registers them
_SOURCES = (
    "api.cpp", "absorbed_attention.cpp", "cache_write.cpp", "head_gemm.cpp", "mha.cpp",
    "decompress.cpp", "indexer.cpp", "sparse_attention.cpp", "sparse_mha.cpp",
    "keyset_attention.cpp",
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
    "ops.h",
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
    # at::parallel_for is inline OpenMP: without -fopenmp the kernels would run on one thread.
    # (torch's wheel ships libgomp.so.1, which the extension then shares.) A compiler without
    # OpenMP still gets a working, single-threaded build.
    last: Exception | None = None
    for omp in (True, False):
        flags = level_flags(isa) + (["-fopenmp"] if omp else [])
        try:
            locked_load(  # cpp_extension.load under our OS lock (:mod:`.build_lock`)
                name=extension_name(isa, omp),
                sources=[str(_CSRC / s) for s in _SOURCES],
                extra_cflags=flags,
                extra_ldflags=["-fopenmp"] if omp else [],
                extra_include_paths=[str(_CSRC)],
                is_python_module=False,
                verbose=current().flag("native_verbose"),
                identity=binary_identity(),
            )
            _states[isa]["openmp"] = omp
            break
        except Exception as e:  # retry without OpenMP, then give up
            last = e
    else:
        raise last  # type: ignore[misc]
    _register_fakes(f"mla_backend_{isa}")


# ---- the ops' fake (meta) functions ---------------------------------------------------------
# One per op of ``csrc/api.cpp`` that takes a tensor, its parameters named, ordered and
# defaulted as the op's schema (:func:`schema_mismatches` checks that when a build loads), so
# ``torch.compile`` / ``FakeTensorMode`` treat the ops as opaque.
def _absorbed_attention(
    q_lat, q_pe, kv_cache, block_table, cu_seqlens_q, kv_lens, softmax_scale, kv_scale=None,
    num_kv_splits=0, max_page_id=-1, engine=-1,
):  # fmt: skip
    T, H, r = q_lat.shape
    return q_lat.new_empty((T, H, r)), q_lat.new_empty((T, H), dtype=torch.float32)


def _fp8_decode(bytes, bf16):  # (``bytes``: the schema's name)
    return bytes.new_empty((bytes.numel(),), dtype=torch.float32)


def _write_latent(kv_cache, c_kv, k_pe, slot_mapping, kv_scale=None):
    return None


def _pack_heads(w):
    H, K, N = w.shape
    return w.new_empty((H, -(-N // HEAD_GEMM_COLS), -(-K // 2), HEAD_GEMM_COLS, 2))


def _head_gemm(x, packed, n):
    return x.new_empty((x.shape[0], x.shape[1], n))


def _head_gemm_out(x, packed, y):
    return None


def _attention_with_lse(q, k, v, causal, scale):
    H, Lq, _ = q.shape
    return q.new_empty((H, Lq, v.shape[-1])), q.new_empty((H, Lq), dtype=torch.float32)


def _masked_attention_with_lse(q, k, v, mask, scale):
    H, Lq, _ = q.shape
    return q.new_empty((H, Lq, v.shape[-1])), q.new_empty((H, Lq), dtype=torch.float32)


def _decompress(c_kv, k_pe, W_UK, W_UV):
    L, (H, nope, _), rope = c_kv.shape[0], W_UK.shape, k_pe.shape[-1]
    return c_kv.new_empty((L, H, nope + rope)), c_kv.new_empty((L, H, W_UV.shape[-1]))


def _indexer_topk(
    q_I, weights, index_cache, block_table, cu_seqlens_q, kv_lens, quant_block_size, topk,
    max_page_id, out, ratio=1,
):  # fmt: skip
    return None


def _indexer_logits(
    q_I, weights, index_cache, block_table, cu_seqlens_q, kv_lens, quant_block_size, width,
    max_page_id, ratio=1,
):  # fmt: skip
    return weights.new_empty((q_I.shape[0], width))


def _sparse_attention(
    q_lat, q_pe, kv_cache, block_table, cu_seqlens_q, kv_lens, indices, token_req,
    softmax_scale, kv_scale, max_page_id, engine, out, lse,
):  # fmt: skip
    return None


def _keyset_attention(
    q_lat, q_pe, kv_cache, block_table, cu_seqlens_q, kv_lens, range, window, indices, cache2,
    block_table2, lens2, indices2, sink, softmax_scale, kv_scale, max_page_id, num_kv_splits,
    engine, out, lse,
):  # fmt: skip  (``range``: the schema's name)
    return None


def _v4_slot_attention(
    q, window_cache, window_slots, window_page_size, compressed_cache, compressed_slots,
    compressed_page_size, sink, softmax_scale, num_kv_splits, engine, out, lse,
):  # fmt: skip
    return None


#: op name -> its fake (every op of ``csrc/api.cpp`` with a tensor argument)
FAKES: dict[str, Callable[..., Any]] = {
    "native_absorbed_attention": _absorbed_attention,
    "native_fp8_decode": _fp8_decode,
    "native_write_latent": _write_latent,
    "native_pack_heads": _pack_heads,
    "native_head_gemm": _head_gemm,
    "native_head_gemm_out": _head_gemm_out,
    "native_attention_with_lse": _attention_with_lse,
    "native_masked_attention_with_lse": _masked_attention_with_lse,
    "native_decompress": _decompress,
    "native_indexer_topk": _indexer_topk,
    "native_indexer_logits": _indexer_logits,
    "native_sparse_attention": _sparse_attention,
    "native_keyset_attention": _keyset_attention,
    "native_v4_slot_attention": _v4_slot_attention,
}


def registered_schemas(ns: str) -> dict[str, torch.FunctionSchema]:
    """The schemas of the ops registered under ``torch.ops.<ns>`` (a loaded build), by op
    name."""
    names = sorted({n.split("::", 1)[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names()
                    if n.startswith(f"{ns}::")})  # fmt: skip
    return {n: getattr(getattr(torch.ops, ns), n).default._schema for n in names}


def fake_mismatch(schema: torch.FunctionSchema, fake: Callable[..., Any]) -> str | None:
    """How ``fake``'s parameters differ from ``schema``'s arguments (names, order, which have a
    default and its value), or None when they agree."""
    params = list(inspect.signature(fake).parameters.values())
    want = [a.name for a in schema.arguments]
    got = [p.name for p in params]
    if got != want:
        return f"parameters ({', '.join(got)}) != the schema's ({', '.join(want)})"
    for a, p in zip(schema.arguments, params, strict=True):
        has = p.default is not inspect.Parameter.empty
        if has != a.has_default_value() or (has and p.default != a.default_value):
            schema_default = a.default_value if a.has_default_value() else "none"
            fake_default = p.default if has else "none"
            return f"{a.name}: default {fake_default!r} != the schema's {schema_default!r}"
    return None


def schema_mismatches(
    schemas: dict[str, torch.FunctionSchema], fakes: dict[str, Callable[..., Any]] = FAKES
) -> list[str]:
    """Every disagreement between ``schemas`` (op name -> schema) and ``fakes``: an op with a
    tensor argument and no fake, a fake of no op, a fake whose parameters are not the schema's
    arguments."""
    problems = []
    for name, schema in schemas.items():
        takes_tensor = any("Tensor" in str(a.type) for a in schema.arguments)
        if name not in fakes:
            if takes_tensor:
                problems.append(f"{name}: no fake function (add it to build.FAKES)")
            continue
        why = fake_mismatch(schema, fakes[name])
        if why:
            problems.append(f"{name}: its fake's {why}")
    problems += [f"{name}: a fake of no registered op" for name in fakes if name not in schemas]
    return problems


def extension_name(isa: str, openmp: bool = True) -> str:
    """The build's name (its directory under ``TORCH_EXTENSIONS_DIR``): the level, a hash of
    the sources and headers (torch's own cache key hashes the sources only), the level's flags
    and :func:`binary_identity`, the SVE vector length, ``_serial`` without OpenMP."""
    h = hashlib.sha1()
    for name in _SOURCES + _HEADERS:
        h.update((_CSRC / name).read_bytes())
    h.update(" ".join(level_flags(isa)).encode())
    h.update(binary_identity().encode())
    vl = str(sve_vector_bits()) if isa == "sve" else ""  # the build's vector length
    return f"{_EXT_NAME}_{isa}{vl}_{h.hexdigest()[:12]}{'' if openmp else '_serial'}"


def binary_identity() -> str:
    """What a build links and is compiled with besides its sources and flags: torch's version,
    git revision, CUDA / ROCm build and C++ ABI, the Python ABI, the compiler (``CXX``, its
    resolved path and version line). It goes into the extension name, so two environments that
    differ in any of them never share (or replace) a build directory; environments that differ
    only in where the same torch and Python are installed share one build (:mod:`.build_lock`
    loads it without rebuilding)."""
    cxx = os.environ.get("CXX", "c++")
    path = shutil.which(cxx) or cxx
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
        version = out.stdout.splitlines()[0] if out.stdout else out.stderr.strip()[:200]
    except (OSError, subprocess.SubprocessError) as e:
        version = f"unknown ({type(e).__name__})"
    parts = (
        torch.__version__,
        str(getattr(torch.version, "git_version", "")),
        str(torch.version.cuda),
        str(getattr(torch.version, "hip", None)),
        f"cxx11abi={int(torch.compiled_with_cxx11_abi())}",
        sys.implementation.cache_tag or "",
        sysconfig.get_config_var("SOABI") or "",
        str(Path(os.path.realpath(path))),
        version,
    )
    return "\n".join(parts)


def _register_fakes(ns: str) -> None:
    """Register :data:`FAKES` for a loaded build (RuntimeError if one disagrees with the
    build's schemas: the build is then unavailable, saying why)."""
    problems = schema_mismatches(registered_schemas(ns))
    if problems:
        raise RuntimeError(
            "the native ops' fakes disagree with csrc/api.cpp: " + "; ".join(problems)
        )
    for name, fake in FAKES.items():
        torch.library.register_fake(f"{ns}::{name}")(fake)


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
