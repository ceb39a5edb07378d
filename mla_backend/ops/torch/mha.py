"""Multi-head attention with its log-sum-exp through torch's fused SDPA kernels: the torch
implementation's normal-path MHA, and the one the others delegate to where they have no kernel
of their own (Triton, FlashInfer; the native one beside its bf16 kernel)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MHA of q [H, Lq, Dqk] over k [H, Lk, Dqk], v [H, Lk, Dv] (top-left causal when
    ``causal``) -> (o [H, Lq, Dv] in q's dtype, lse [H, Lq] float32), through torch's fused
    SDPA (flash on CPU, memory-efficient elsewhere): fp32 accumulation of the scores and the
    softmax."""
    dqk, dv = q.shape[-1], v.shape[-1]
    d = max(dqk, dv)
    if q.device.type != "cpu":  # the GPU kernels take head sizes in multiples of 8
        d = -(-d // 8) * 8
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
