"""The normal path: decompress latents to per-head K/V and run causal varlen MHA.

Good for long fresh prefills. New tokens attend causally to themselves; a cached prefix is
decompressed in bounded chunks (``chunk_tokens``) whose results are merged with the new-token
attention through the log-sum-exp, so peak memory does not grow with the prefix length.
Attention itself is torch's fused SDPA kernel (flash on CPU, memory-efficient on GPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .batch import MLABatch
from .checks import check_step
from .merge import merge_attention_states
from .ops.torch_ops import gather_latent
from .weights import AbsorbWeights

DEFAULT_CHUNK_TOKENS = 4096


def sdpa_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused scaled-dot-product attention that also returns the log-sum-exp.

    Args:
        q: [H, Lq, Dqk]; k: [H, Lk, Dqk]; v: [H, Lk, Dv] (same dtype).
        causal: top-left aligned causal mask (used with Lq == Lk).
    Returns:
        (o [H, Lq, Dv] in q's dtype, lse [H, Lq] float32).
    """
    dqk, dv = q.shape[-1], v.shape[-1]
    d = max(dqk, dv)
    if dqk < d:  # zero columns do not change q·k
        q, k = F.pad(q, (0, d - dqk)), F.pad(k, (0, d - dqk))
    if dv < d:
        v = F.pad(v, (0, d - dv))
    q4, k4, v4 = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    if q.device.type == "cpu":
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q4, k4, v4, 0.0, causal, scale=scale
        )[:2]
    else:
        o, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            q4, k4, v4, None, True, 0.0, causal, scale=scale
        )[:2]
    Lq = q.shape[1]
    return o[0, :, :, :dv], lse[0, :, :Lq].float()


def decompress(
    latent: torch.Tensor, weights: AbsorbWeights, nope: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Latent rows -> per-head keys and values.

    Args:
        latent: [L, r + rope] rows ``[c_kv ; k_pe]`` (already dequantized, compute dtype).
    Returns:
        k: [H, L, nope + rope] (``[W_UK·c_kv ; k_pe]``), v: [H, L, v] (``W_UV·c_kv``).
    """
    kv_b = weights.kv_b.to(dtype)
    r = kv_b.shape[1]
    L = latent.shape[0]
    H = weights.W_UK.shape[0]
    kv = torch.mm(latent[:, :r], kv_b.t()).view(L, H, kv_b.shape[0] // H)  # [L, H, nope + v]
    k_pe = latent[:, r:]
    k = torch.cat([kv[..., :nope], k_pe.unsqueeze(1).expand(L, H, k_pe.shape[-1])], dim=-1)
    return k.transpose(0, 1), kv[..., nope:].transpose(0, 1)


def _dequant(rows: torch.Tensor, dtype: torch.dtype, kv_scale: torch.Tensor | None) -> torch.Tensor:
    if rows.dtype == dtype and kv_scale is None:
        return rows
    out = rows.to(dtype) if kv_scale is None else (rows.float() * kv_scale.float()).to(dtype)
    return out


def normal_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    batch: MLABatch,
    weights: AbsorbWeights,
    softmax_scale: float,
    kv_scale: torch.Tensor | None = None,
    new_c_kv: torch.Tensor | None = None,
    new_k_pe: torch.Tensor | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decompressed causal MHA over prefix + new tokens.

    Args:
        q_nope: [T, H, nope]; q_pe: [T, H, rope] (T == batch.num_tokens).
        kv_cache: [num_pages, page_size, r + rope], holding at least every request's prefix
            (and the new tokens too, unless ``new_c_kv``/``new_k_pe`` are given).
        weights: the layer's :class:`AbsorbWeights` (``kv_b`` decompresses).
        new_c_kv: optional [T, r], new_k_pe: optional [T, rope]: the new tokens' latents,
            used directly instead of reading them back from the cache.
        chunk_tokens: prefix tokens decompressed at a time.
    Returns:
        (o [T, H, v] in q_nope's dtype, lse [T, H] float32).
    """
    H, r, v_dim = weights.W_UV.shape
    check_step(q_nope, q_pe, kv_cache, batch, r + q_pe.shape[-1], kv_scale)
    T, _, nope = q_nope.shape
    if q_nope.shape[1:] != (H, weights.W_UK.shape[1]):
        raise ValueError(
            f"q_nope shape {tuple(q_nope.shape)} does not match the weights' "
            f"[T, H={H}, nope={weights.W_UK.shape[1]}]"
        )
    cd = q_nope.dtype
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1")
    o_out = torch.empty(T, H, v_dim, dtype=cd, device=q_nope.device)
    lse_out = torch.empty(T, H, dtype=torch.float32, device=q_nope.device)
    for i in range(batch.num_reqs):
        n = batch.new_lens[i]
        if n == 0:
            continue
        P = batch.prefix_lens[i]
        t0 = batch.cu_new[i]
        q = torch.cat([q_nope[t0 : t0 + n], q_pe[t0 : t0 + n].to(cd)], -1).transpose(0, 1)
        block_row = batch.block_table[i]
        if new_c_kv is not None and new_k_pe is not None:
            latent = torch.cat([new_c_kv[t0 : t0 + n], new_k_pe[t0 : t0 + n]], -1).to(cd)
        else:
            latent = _dequant(gather_latent(kv_cache, block_row, P, P + n), cd, kv_scale)
        k, v = decompress(latent, weights, nope, cd)
        o, lse = sdpa_with_lse(q, k, v, causal=True, scale=softmax_scale)
        o, lse = o.transpose(0, 1).float(), lse.transpose(0, 1)  # [n, H, v], [n, H]
        for s in range(0, P, chunk_tokens):
            e = min(P, s + chunk_tokens)
            latent = _dequant(gather_latent(kv_cache, block_row, s, e), cd, kv_scale)
            k, v = decompress(latent, weights, nope, cd)
            o_c, lse_c = sdpa_with_lse(q, k, v, causal=False, scale=softmax_scale)
            o, lse = merge_attention_states(o, lse, o_c.transpose(0, 1), lse_c.transpose(0, 1))
        o_out[t0 : t0 + n] = o
        lse_out[t0 : t0 + n] = lse
    return o_out, lse_out
