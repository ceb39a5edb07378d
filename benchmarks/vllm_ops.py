"""vLLM's CPU MLA kernels, called through ``vllm._custom_ops`` the way its backends call them, on
a benchmark's problem (built outside the timing, as each backend's metadata builder does once
per step):

* CPU_MLA (``vllm/v1/attention/backends/mla/cpu_mla.py``, any CPU): decode through
  ``torch.ops._C.mla_decode_kvcache(out, q [B, H, 576], cache, scale, block_tables int32,
  seq_lens int32)`` on page-16 caches; the layer's absorptions are ``MLAAttention``'s generic
  ``torch.bmm``s on vLLM's weight views (``W_UK_T`` = kv_b's ``[r, H, nope]`` permuted to
  ``[H, nope, r]``, ``W_UV`` = ``[r, H, v]`` transposed to ``[H, r, v]``: strided views of the
  checkpoint's ``kv_b_proj`` weight).
* AMX_MLA (``amx_mla.py``; only where its kernels run, see
  ``mla_backend_integrations._testing.vllm_backends.amx_mla_unavailable``): ``bmm_cpu`` over
  weights packed by ``convert_weight_packed``, ``cpu_mla_decode`` / ``cpu_mla_extend``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from mla_backend_integrations._testing.vllm_backends import amx_mla_unavailable

import mla_backend as mb

Fn = Callable[[], torch.Tensor]


def imitates_avx2() -> bool:
    """True where torch's own kernels are capped at AVX2 (``ATEN_CPU_CAPABILITY=avx2``) on a CPU
    with AVX-512: an AVX2-only CPU imitated on an AVX-512 host."""
    return torch.backends.cpu.get_cpu_capability() == "AVX2" and torch.cpu._is_avx512_supported()


def vllm_ops() -> Any | None:
    """``vllm._custom_ops`` (its CPU kernels loaded), or None outside the vLLM environment.

    vLLM picks its kernel library by ``torch.cpu._is_avx512_supported()`` (the CPU's flags:
    ``CpuPlatform.import_kernels``); where torch is capped at AVX2 (:func:`imitates_avx2`) that
    check answers False while the library loads, so vLLM loads ``_C_AVX2``, the library an
    AVX2-only CPU runs."""
    real = torch.cpu._is_avx512_supported
    if imitates_avx2():
        torch.cpu._is_avx512_supported = lambda: False
    try:  # (importing _custom_ops already loads the kernels)
        from vllm import _custom_ops as ops
        from vllm.platforms import current_platform

        current_platform.import_kernels()
        torch.ops._C.mla_decode_kvcache  # noqa: B018  (raises when the kernels are missing)
        return ops
    except Exception:
        return None
    finally:
        torch.cpu._is_avx512_supported = real


def library_note() -> str:
    """Which of vLLM's CPU kernel libraries this process loaded (from its memory map)."""
    try:
        with open("/proc/self/maps") as f:
            libs = {line.split()[-1].rsplit("/", 1)[-1] for line in f if "vllm/_C" in line}
    except OSError:
        return "vLLM kernel library: unknown"
    return "vLLM kernel library: " + (", ".join(sorted(libs)) or "none loaded")


def amx_mla_runs(ops: Any | None) -> bool:
    """True where AMX_MLA's kernels are loaded and this CPU runs them."""
    return (
        ops is not None
        and amx_mla_unavailable() is None
        and not imitates_avx2()
        and hasattr(torch.ops._C, "decode_attention_cpu")
    )


def peer_notes(ops: Any | None, amx: bool, cpu_mla: str, amx_mla: str) -> list[str]:
    """Table notes: what the CPU_MLA / AMX_MLA columns ran, or why a column is missing."""
    if ops is None:
        return ["vLLM not importable here: no CPU_MLA / AMX_MLA columns"]
    why = amx_mla_unavailable() or "its kernels are not loaded"
    if imitates_avx2():
        why = "torch capped at AVX2 (an AVX2-only CPU imitated), where vLLM loads _C_AVX2"
    return [f"CPU_MLA = {cpu_mla} ({library_note()})",
            f"AMX_MLA = {amx_mla}" if amx else f"AMX_MLA: {why} (no column)"]  # fmt: skip


def _splits(max_len: int) -> int:
    """AMX_MLA's builder: the power of two >= max_seq // 512, at most 2 x threads."""
    s = 1
    while s < max(1, max_len // 512):
        s *= 2
    return min(s, 2 * torch.get_num_threads())


def _req_to_token(table: torch.Tensor, length: int, page: int) -> torch.Tensor:
    pos = torch.arange(length)
    return (table.long()[:, pos // page] * page + pos % page).contiguous()


def cpu_mla_decode(ops: Any, q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor,
                   seq_lens: torch.Tensor, scale: float) -> Fn:  # fmt: skip
    """CPU_MLA's decode kernel on ``q`` [B, H, r + rope] (contiguous) and a page-16 cache."""
    B, H, _ = q.shape
    r = cache.shape[-1] - 64
    bt, sl = table.to(torch.int32), seq_lens.to(torch.int32)

    def run() -> torch.Tensor:
        out = torch.zeros(B, H, r, dtype=q.dtype)
        ops.mla_decode_kvcache_cpu(out, q, cache, scale, bt, sl)
        return out

    return run


def amx_mla_decode(ops: Any, q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor,
                   kv_len: int, scale: float) -> Fn:  # fmt: skip
    """AMX_MLA's decode kernel (sgl-kernel's ``decode_attention_cpu``), every request
    ``kv_len`` tokens, on the same cache viewed as rows."""
    B, H, D = q.shape
    r = D - 64
    page = cache.shape[1]
    rows = cache.view(-1, 1, D)
    r2t = _req_to_token(table, kv_len, page)
    req = torch.arange(B, dtype=torch.int64)
    seq = torch.full((B,), kv_len, dtype=torch.int64)
    splits = _splits(kv_len)

    def run() -> torch.Tensor:
        out = torch.empty(B, H, r, dtype=q.dtype)
        logits = torch.empty(B, H, splits, r + 1, dtype=torch.float32)
        ops.cpu_mla_decode(q, rows, rows[..., :r], out, None, None, None, logits, r2t, req,
                           seq, scale, 0.0, False, 0, None, None)  # fmt: skip
        return out

    return run


def vllm_weight_views(kv_b: torch.Tensor, dims: mb.MLADims) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's ``W_UK_T`` [H, nope, r] and ``W_UV`` [H, r, v]: strided views of the checkpoint's
    ``kv_b_proj`` weight [H * (nope + v), r] (``split_kv_b_proj``, then
    ``process_weights_after_loading``)."""
    w = kv_b.T.view(dims.kv_lora_rank, dims.num_heads, dims.qk_nope_head_dim + dims.v_head_dim)
    w_uk, w_uv = w.split([dims.qk_nope_head_dim, dims.v_head_dim], dim=-1)
    return w_uk.permute(1, 2, 0), w_uv.transpose(0, 1)


def cpu_mla_layer(ops: Any, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                  table: torch.Tensor, kv_len: int, kv_b: torch.Tensor, dims: mb.MLADims,
                  scale: float) -> Fn:  # fmt: skip
    """CPU_MLA's decode layer (one new token per request): ``torch.bmm(q_nope, W_UK_T)``,
    cat with q_pe, ``mla_decode_kvcache``, ``torch.bmm(o_lat, W_UV)``, as ``MLAAttention``
    runs them for that backend."""
    w_uk_t, w_uv = vllm_weight_views(kv_b, dims)
    B, H = q_nope.shape[:2]
    r, v = dims.kv_lora_rank, dims.v_head_dim
    bt = table.to(torch.int32)
    sl = torch.full((B,), kv_len, dtype=torch.int32)

    def run() -> torch.Tensor:
        ql = q_nope.new_empty((B, H, r))
        torch.bmm(q_nope.transpose(0, 1), w_uk_t, out=ql.transpose(0, 1))
        q = torch.cat([ql, q_pe], dim=-1).contiguous()
        o_lat = torch.zeros(B, H, r, dtype=q.dtype)
        ops.mla_decode_kvcache_cpu(o_lat, q, cache, scale, bt, sl)
        out = q_nope.new_empty((B, H * v))
        torch.bmm(o_lat.transpose(0, 1), w_uv, out=out.view(B, H, v).transpose(0, 1))
        return out.view(B, H, v)

    return run


def amx_mla_layer(ops: Any, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                  table: torch.Tensor, w: mb.AbsorbWeights, B: int, P: int, N: int,
                  scale: float) -> Fn:  # fmt: skip
    """AMX_MLA's per-layer sequence: ``bmm_cpu`` absorption over packed weights, cat,
    ``cpu_mla_decode`` (N == 1) or ``cpu_mla_extend`` (N new tokens per request onto a P-token
    prefix, their rows as the contiguous ``k_extend`` it takes), ``bmm_cpu`` with W_UV."""
    H, T = q_nope.shape[1], q_nope.shape[0]
    R = w.W_UK.shape[-1]
    V = w.W_UV.shape[-1]
    D = cache.shape[-1]
    w_uk = torch.ops._C.convert_weight_packed(w.W_UK.transpose(1, 2).contiguous())
    w_uv = torch.ops._C.convert_weight_packed(w.W_UV.transpose(1, 2).contiguous())
    rows = cache.view(-1, 1, D)
    r2t = _req_to_token(table, P + N, cache.shape[1])
    req = torch.arange(B, dtype=torch.long)
    seq = torch.full((B,), P + N, dtype=torch.long)
    ext_lens = torch.full((B,), N, dtype=torch.long)
    ext_start = torch.arange(B, dtype=torch.long) * N
    k_ext = rows[r2t[:, P:].reshape(-1)].contiguous()
    splits = _splits(P + N)

    def run() -> torch.Tensor:
        q_lat = torch.empty(T, H, R, dtype=q_nope.dtype)
        ops.bmm_cpu(q_lat.transpose(0, 1), q_nope.transpose(0, 1), w_uk, True, None)
        mq = torch.cat([q_lat, q_pe], dim=-1)
        o_lat = torch.empty(T, H, R, dtype=q_nope.dtype)
        if N == 1:
            logits = torch.zeros(T, H, splits, R + 1, dtype=torch.float32)
            ops.cpu_mla_decode(mq, rows, rows[..., :R], o_lat, None, None, None, logits, r2t,
                               req, seq, scale, 0.0, False, 0, None, None)  # fmt: skip
        else:
            ops.cpu_mla_extend(mq, k_ext, k_ext[..., :R], o_lat, rows, rows[..., :R], r2t, req,
                               seq, ext_lens, ext_start, N, scale, 0.0, False, 0, None, None,
                               None)  # fmt: skip
        out = torch.empty(T, H * V, dtype=q_nope.dtype)
        ops.bmm_cpu(out.view(T, H, V).transpose(0, 1), o_lat.transpose(0, 1), w_uv, True, None)
        return out.view(T, H, V)

    return run
