"""DSA's sparse MHA in plain torch: multi-head attention over decompressed keys and values with a
per-query-token mask (the query tokens' index sets); the torch implementation's, and the one the
others delegate to where they have no kernel of their own for it (Triton, FlashInfer; the native
one for the dtypes its kernel does not take).

Scores and the softmax are fp32; the probabilities are rounded to q's dtype before P·V (as the
normal path's MHA), whose sums are fp32; the output is rounded once. A row whose mask selects
nothing gets o = 0 and lse = -inf. Query rows are taken in blocks, so the fp32 scores never
exceed :data:`BLOCK_ELEMENTS` elements.
"""

from __future__ import annotations

import torch

from ..base import MaskedMHACall

#: fp32 score elements (heads x query rows x keys) per block of query rows
BLOCK_ELEMENTS = 1 << 24


def masked_attention_with_lse(call: MaskedMHACall) -> tuple[torch.Tensor, torch.Tensor]:
    """MHA of q [H, Lq, Dqk] over k [H, Lk, Dqk], v [H, Lk, Dv] where query row i sees key j
    iff ``mask[i, j]`` (mask [Lq, Lk] bool, shared by the heads) -> (o [H, Lq, Dv] in q's dtype,
    lse [H, Lq] float32, natural log) (see :class:`~mla_backend.ops.base.MaskedMHACall`)."""
    q, k, v, mask, scale = call.q, call.k, call.v, call.mask, call.scale
    H, Lq, _ = q.shape
    Lk, Dv = k.shape[1], v.shape[-1]
    o = torch.empty(H, Lq, Dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(H, Lq, dtype=torch.float32, device=q.device)
    step = max(1, BLOCK_ELEMENTS // max(1, H * Lk))
    kf, vf = k.float(), v.float()
    for i0 in range(0, Lq, step):
        i1 = min(Lq, i0 + step)
        s = torch.matmul(q[:, i0:i1].float(), kf.transpose(1, 2)) * scale  # [H, n, Lk]
        s.masked_fill_(~mask[None, i0:i1], float("-inf"))
        m = s.amax(-1, keepdim=True)
        m = torch.where(torch.isneginf(m), 0.0, m)  # a row with no key: p = 0, lse = -inf
        p = torch.exp(s - m)
        lsum = p.sum(-1, keepdim=True)
        acc = torch.matmul(p.to(q.dtype).float(), vf)
        o[:, i0:i1] = torch.where(lsum > 0, acc / lsum, 0.0).to(q.dtype)
        lse[:, i0:i1] = (m + torch.log(lsum)).squeeze(-1)
    return o, lse
