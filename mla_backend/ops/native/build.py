"""The native CPU kernels' loader: the C++ sources under ``csrc/``, their build at first use and
the ``torch.library`` custom ops (with fake implementations) they register.

This module owns:

- the loader: ``torch.utils.cpp_extension.load`` compiles ``csrc/mla_cpu.cpp`` with
  ``-O3 -march=native`` on the user's machine the first time :func:`available` (or a wrapper)
  is called, cached in torch's extensions directory (``TORCH_EXTENSIONS_DIR``). If there is no
  compiler / ninja, the platform is not x86-64, or the build fails, :func:`available` returns
  False and one ``warnings.warn`` (once per process) says why; importing never raises;
- the ops ``torch.ops.mla_backend.native_absorbed_attention``,
  ``torch.ops.mla_backend.native_write_latent`` (``csrc/mla_cpu.cpp``) and
  ``native_pack_heads`` / ``native_head_gemm`` (``csrc/head_gemm.cpp``: the per-head absorption
  GEMMs ``q_nope · W_UK`` and ``o_lat · W_UV`` over weights packed once per layer) and
  ``native_attention_with_lse`` (``csrc/mha_prefill.cpp``: the normal path's MHA) and
  ``native_decompress`` (``csrc/decompress.cpp``: its ``c_kv · W_UK^T`` / ``c_kv · W_UV``), all
  three over the torch-free GEMM engine ``csrc/gemm_core.h``; CPU kernels
  with fake (meta) implementations, so ``torch.compile`` / ``FakeTensorMode`` treat them as
  opaque.
"""

from __future__ import annotations

import os
import platform
import threading
import warnings
from pathlib import Path

import torch

__all__ = ["available", "unavailable_reason", "HEAD_GEMM_COLS"]

_CSRC = Path(__file__).resolve().parent / "csrc"
_SOURCES = ("mla_cpu.cpp", "head_gemm.cpp", "mha_prefill.cpp", "decompress.cpp")
_HEADERS = ("mla_cpu.h", "gemm_core.h")
_EXT_NAME = "mla_backend_native"
_FLAGS = ["-O3", "-march=native", "-std=c++17"]

#: output columns per packed weight block of ``csrc/head_gemm.cpp`` (its ``kNB``)
HEAD_GEMM_COLS = 64

_lock = threading.Lock()
_state: dict[str, object] = {"tried": False, "ok": False, "reason": None, "warned": False}


def _build() -> None:
    """Compile and load the extension (raises on any failure)."""
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        raise RuntimeError(f"the native kernels target x86-64; this machine is {machine!r}")
    from torch.utils import cpp_extension

    cpp_extension.verify_ninja_availability()
    # the sources' hash is part of torch's cache key, but a header change alone is not:
    # the header text goes into the extension name.
    import hashlib

    h = hashlib.sha1()
    for name in _SOURCES + _HEADERS:
        h.update((_CSRC / name).read_bytes())
    # at::parallel_for is inline OpenMP: without -fopenmp the kernels would run on one thread.
    # (torch's wheel ships libgomp.so.1, which the extension then shares.) A compiler without
    # OpenMP still gets a working, single-threaded build.
    last: Exception | None = None
    for omp in (True, False):
        flags = _FLAGS + (["-fopenmp"] if omp else [])
        try:
            cpp_extension.load(
                name=f"{_EXT_NAME}_{h.hexdigest()[:12]}{'' if omp else '_serial'}",
                sources=[str(_CSRC / s) for s in _SOURCES],
                extra_cflags=flags,
                extra_ldflags=["-fopenmp"] if omp else [],
                extra_include_paths=[str(_CSRC)],
                is_python_module=False,
                verbose=os.environ.get("MLA_BACKEND_NATIVE_VERBOSE", "") == "1",
            )
            _state["openmp"] = omp
            break
        except Exception as e:  # retry without OpenMP, then give up
            last = e
    else:
        raise last  # type: ignore[misc]
    _register_fakes()


def _register_fakes() -> None:
    @torch.library.register_fake("mla_backend::native_absorbed_attention")
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
    ):
        T, H, r = q_lat.shape
        return q_lat.new_empty((T, H, r)), q_lat.new_empty((T, H), dtype=torch.float32)

    @torch.library.register_fake("mla_backend::native_write_latent")
    def _(kv_cache, c_kv, k_pe, slot_mapping, kv_scale=None):
        return None

    @torch.library.register_fake("mla_backend::native_pack_heads")
    def _(w):
        H, K, N = w.shape
        return w.new_empty((H, -(-N // HEAD_GEMM_COLS), -(-K // 2), HEAD_GEMM_COLS, 2))

    @torch.library.register_fake("mla_backend::native_head_gemm")
    def _(x, packed, n):
        return x.new_empty((x.shape[0], x.shape[1], n))

    @torch.library.register_fake("mla_backend::native_attention_with_lse")
    def _(q, k, v, causal, scale):
        H, Lq, _ = q.shape
        return q.new_empty((H, Lq, v.shape[-1])), q.new_empty((H, Lq), dtype=torch.float32)

    @torch.library.register_fake("mla_backend::native_decompress")
    def _(c_kv, k_pe, W_UK, W_UV):
        L, (H, nope, _), rope = c_kv.shape[0], W_UK.shape, k_pe.shape[-1]
        return c_kv.new_empty((L, H, nope + rope)), c_kv.new_empty((L, H, W_UV.shape[-1]))

    @torch.library.register_fake("mla_backend::native_fp8_decode")
    def _(data, bf16):
        return data.new_empty((data.numel(),), dtype=torch.float32)


def available() -> bool:
    """Build/load the kernels on first call; False if that failed (see
    :func:`unavailable_reason`), in which case one warning was issued in this process."""
    if _state["tried"]:
        return bool(_state["ok"])
    with _lock:
        if not _state["tried"]:
            try:
                _build()
                _state["ok"] = True
            except Exception as e:  # no compiler, no ninja, compile error, non-x86 ...
                _state["ok"] = False
                _state["reason"] = f"{type(e).__name__}: {e}".strip()[:2000]
                if not _state["warned"]:
                    _state["warned"] = True
                    warnings.warn(
                        "mla_backend native CPU kernels are unavailable (falling back to the "
                        f"torch implementation): {_state['reason']}",
                        RuntimeWarning,
                        stacklevel=2,
                    )
            _state["tried"] = True
    return bool(_state["ok"])


def unavailable_reason() -> str | None:
    """Why :func:`available` is False (None when the kernels loaded or were not tried)."""
    return _state["reason"]  # type: ignore[return-value]


def require() -> None:
    if not available():
        raise RuntimeError(f"mla_backend native kernels are unavailable: {unavailable_reason()}")
