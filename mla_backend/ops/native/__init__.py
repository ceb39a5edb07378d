"""Native CPU kernels for absorbed MLA: the C++ sources under ``csrc/``, their build at first
use, the ``torch.library`` custom ops they register, and thin Python wrappers.

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
  ``native_attention_with_lse`` (``csrc/mha_prefill.cpp``: the normal path's MHA), CPU kernels
  with fake (meta) implementations, so ``torch.compile`` / ``FakeTensorMode`` treat them as
  opaque;
- :func:`absorbed_attention`, :func:`write_latent`, :func:`pack_heads`, :func:`head_gemm` and
  :func:`attention_with_lse`, the interface the core's device seam
  (:mod:`mla_backend.ops.native_kernels`) calls.

Kernel organisation (see the header comment of ``csrc/mla_cpu.cpp``): work items are
(request, block of <= 32 query rows = new tokens x heads, kv split); each item streams its
request's latent rows through the block table in tiles of 64 tokens, loading each tile once for
both the scores (fp32) and P·V; online softmax in fp32; splits merged through their LSE.

Cache layouts (:mod:`mla_backend.cache_layout`): bf16/fp16/fp32 (q's dtype), float8_e4m3fn with a
per-tensor ``kv_scale``, and ``fp8_ds_mla`` (a uint8 cache: per token e4m3 c_kv in tiles of 128
with one float32 scale per tile, then k_pe in q's dtype), read in place: e4m3 bytes are decoded
exactly in registers / an L1 tile (bf16 engine: byte-table shuffles; fp32 engine: the fp16 bit
trick + vcvtph2ps), the ``fp8_ds_mla`` tile scales are applied to the partial scores per tile and
to the probabilities before P·V, never by writing a dequantized copy of the cache.
"""

from __future__ import annotations

import os
import platform
import threading
import warnings
from pathlib import Path

import torch

__all__ = [
    "available",
    "unavailable_reason",
    "absorbed_attention",
    "write_latent",
    "pack_heads",
    "head_gemm",
    "attention_with_lse",
]

_CSRC = Path(__file__).resolve().parent / "csrc"
_SOURCES = ("mla_cpu.cpp", "head_gemm.cpp", "mha_prefill.cpp")
_HEADERS = ("mla_cpu.h",)
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


def _require() -> None:
    if not available():
        raise RuntimeError(f"mla_backend native kernels are unavailable: {unavailable_reason()}")


def simd_level() -> str:
    """'avx512_bf16' when the bf16 engine was compiled in, else 'fp32' (portable engine)."""
    _require()
    if "simd" not in _state:  # asked on every normal-path call: read the build once
        _state["simd"] = "avx512_bf16" if torch.ops.mla_backend.native_simd_info() else "fp32"
    return _state["simd"]  # type: ignore[return-value]


def absorbed_attention(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_lens: torch.Tensor,
    softmax_scale: float,
    kv_scale: torch.Tensor | None = None,
    num_kv_splits: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA attention (MQA over the paged latent cache), decode or extend.

    Args:
        q_lat: [T, H, r] bf16/fp16/fp32 (last dim contiguous; may be a strided view).
        q_pe: [T, H, rope], q_lat's dtype (rope may be 0).
        kv_cache: [num_pages, page_size, r + rope], q's dtype or float8_e4m3fn; row =
            [c_kv ; k_pe]; value = its first r columns. Or uint8 [num_pages, page_size, W]:
            ``fp8_ds_mla`` rows, W = ``CacheLayout.ds_mla(r, rope, q_lat.dtype).width`` (656
            at r 512, rope 64, bf16); value = the dequantized c_kv.
        block_table: [B, max_pages] int32, physical page of each logical page.
        cu_seqlens_q: [B + 1] int32; request i owns query rows cu[i]:cu[i+1] (may be empty).
        kv_lens: [B] int32, cached tokens of request i (prefix + new), >= its new tokens.
        softmax_scale: float > 0.
        kv_scale: float32 0-d tensor; cached value = stored * kv_scale (None = 1.0; ignored for
            ``fp8_ds_mla``, whose scales are in the rows).
        num_kv_splits: kv splits per request (0 = the kernel chooses).

    Returns:
        o_lat: [T, H, r] in q's dtype; lse: [T, H] float32 (natural log).

    Query row j of request i sits at position kv_len_i - n_i + j and attends causally to kv
    positions 0 .. kv_len_i - n_i + j. Scores and softmax are fp32.
    """
    _require()
    return torch.ops.mla_backend.native_absorbed_attention(
        q_lat,
        q_pe,
        kv_cache,
        block_table,
        cu_seqlens_q,
        kv_lens,
        float(softmax_scale),
        kv_scale,
        int(num_kv_splits),
    )


def write_latent(
    kv_cache: torch.Tensor,
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
) -> None:
    """Write ``[c_kv ; k_pe]`` into the paged cache, in place.

    Args:
        kv_cache: [num_pages, page_size, r + rope] bf16/fp16/fp32/float8_e4m3fn, or uint8
            [num_pages, page_size, ``CacheLayout.ds_mla(r, rope, c_kv.dtype).width``]
            (``fp8_ds_mla``: per tile of 128 values scale = max(amax / 448, FLT_MIN), e4m3 of
            clamp(value / scale), k_pe stored in c_kv's dtype; bit-identical to
            ``CacheLayout.pack``, the torch path's writer).
        c_kv: [T, r]; k_pe: [T, rope] (bf16/fp16/fp32).
        slot_mapping: [>= T] int32/int64; token t goes to page slot // page_size, row
            slot % page_size; slot < 0 is padding (skipped).
        kv_scale: float32 0-d tensor (fp8 cache only): stored = clamp(value / kv_scale, -448,
            448) rounded to nearest-even e4m3, bit-identical to torch's ``.to(float8_e4m3fn)``.
    """
    _require()
    torch.ops.mla_backend.native_write_latent(kv_cache, c_kv, k_pe, slot_mapping, kv_scale)


def pack_heads(w: torch.Tensor) -> torch.Tensor:
    """Pack a per-head weight once for :func:`head_gemm`.

    Args:
        w: [H, K, N] bfloat16 (``W_UK`` [H, nope, r] or ``W_UV`` [H, r, v]).
    Returns:
        [H, ceil(N / 64), ceil(K / 2), 64, 2] bfloat16: VNNI pairs of rows in blocks of 64
        columns, zero-padded (same element count as ``w`` up to the padding).
    """
    _require()
    return torch.ops.mla_backend.native_pack_heads(w)


def head_gemm(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """``y[t, h] = x[t, h] · w[h]`` for every head, w given packed (:func:`pack_heads`).

    Args:
        x: [T, H, K] bfloat16, last dim contiguous (any other strides: a view of q is fine).
        packed: :func:`pack_heads` of w [H, K, N].
        n: N, the output width.
    Returns:
        y: [T, H, N] bfloat16, contiguous; fp32 sums, rounded once (nearest even).
    """
    _require()
    return torch.ops.mla_backend.native_head_gemm(x, packed, int(n))


def attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-head attention with its log-sum-exp (the normal path's MHA), bf16, AVX512-BF16.

    Args:
        q: [H, Lq, Dqk]; k: [H, Lk, Dqk]; v: [H, Lk, Dv]; bfloat16, last dims contiguous (any
            other strides).
        causal: top-left causal (key j visible to query i iff j <= i).
        scale: softmax scale of ``q·k``.
    Returns:
        o [H, Lq, Dv] bfloat16 (probabilities rounded to bf16 before P·V, fp32 sums), lse
        [H, Lq] float32 (natural log; -inf and o = 0 for a row that sees no key).
    """
    _require()
    return torch.ops.mla_backend.native_attention_with_lse(q, k, v, bool(causal), float(scale))
