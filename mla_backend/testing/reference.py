"""The oracle: the DeepSeek-V2 paper's decompressed MLA attention, written plainly in fp32
(or float64: ``dtype``).

It takes the raw ``kv_b_proj`` weight and contiguous per-request latents, and does its own
split, decompression, causal mask and softmax from the formulas (appendix C of the paper),
calling nothing else in this package. Tests compare every fast path against it.
"""

from __future__ import annotations

import math

import torch


def reference_mla_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    c_kv_seqs: list[torch.Tensor],
    k_pe_seqs: list[torch.Tensor],
    kv_b_weight: torch.Tensor,
    qk_nope_head_dim: int,
    v_head_dim: int,
    new_lens: list[int],
    softmax_scale: float | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Decompressed causal MHA for a ragged batch.

    Args:
        q_nope: [T, H, nope]; q_pe: [T, H, rope] (any float dtype; computed in fp32).
        c_kv_seqs: per request [L_i, r] latents of the whole sequence (prefix + new).
        k_pe_seqs: per request [L_i, rope] rotated shared rope keys.
        kv_b_weight: [H*(nope+v), r] dequantized ``kv_b_proj`` weight.
        new_lens: per request number of new (query) tokens, which are the last ones of
            the sequence; query rows are packed in request order.
        softmax_scale: defaults to 1/sqrt(nope + rope).
        dtype: the precision of every step (float32, or float64 for the exact value of the
            given inputs).
    Returns:
        [T, H, v] in ``dtype``.
    """
    T, H, nope = q_nope.shape
    rope = q_pe.shape[-1]
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(nope + rope)
    w = kv_b_weight.to(dtype).reshape(H, nope + v_head_dim, -1)
    w_k, w_v = w[:, :nope, :], w[:, nope:, :]
    out = torch.zeros(T, H, v_head_dim, dtype=dtype)
    row = 0
    for c_kv, k_pe, n in zip(c_kv_seqs, k_pe_seqs, new_lens, strict=True):
        L = c_kv.shape[0]
        ckv = c_kv.to(dtype).cpu()
        kpe = k_pe.to(dtype).cpu()
        k_nope = torch.einsum("lr,hdr->hld", ckv, w_k.cpu())  # [H, L, nope]
        v = torch.einsum("lr,hdr->hld", ckv, w_v.cpu())  # [H, L, v]
        k = torch.cat([k_nope, kpe.unsqueeze(0).expand(H, L, rope)], dim=-1)
        q = torch.cat([q_nope[row : row + n], q_pe[row : row + n]], -1).to(dtype).cpu()
        q = q.transpose(0, 1)  # [H, n, nope + rope]
        scores = torch.matmul(q, k.transpose(1, 2)) * softmax_scale  # [H, n, L]
        qpos = torch.arange(L - n, L).unsqueeze(1)
        kpos = torch.arange(L).unsqueeze(0)
        scores = scores.masked_fill(kpos > qpos, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[row : row + n] = torch.matmul(probs, v).transpose(0, 1)
        row += n
    return out


def reference_mla_layer(
    weights: dict[str, torch.Tensor],
    hidden: torch.Tensor,
    num_heads: int,
    kv_lora_rank: int,
    qk_nope_head_dim: int,
    qk_rope_head_dim: int,
    v_head_dim: int,
    rope_theta: float = 10000.0,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Whole-sequence DeepSeek-V2 attention layer in fp32 (no cache, no yarn).

    Args:
        weights: DeepSeek parameter names without prefix (``q_proj.weight`` or
            ``q_a_proj.weight``/``q_a_layernorm.weight``/``q_b_proj.weight``,
            ``kv_a_proj_with_mqa.weight``, ``kv_a_layernorm.weight``, ``kv_b_proj.weight``,
            ``o_proj.weight``).
        hidden: [L, hidden] one sequence, positions 0..L-1.
    Returns:
        [L, hidden] float32.
    """
    w = {k: v.float() for k, v in weights.items()}
    x = hidden.float()
    L = x.shape[0]
    H, nope, rope = num_heads, qk_nope_head_dim, qk_rope_head_dim

    def rms(t: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return t / torch.sqrt((t * t).mean(-1, keepdim=True) + eps) * g

    def rotate(t: torch.Tensor) -> torch.Tensor:  # [L, ..., rope], pairs as complex numbers
        if rope == 0:
            return t
        freqs = 1.0 / rope_theta ** (torch.arange(0, rope, 2).float() / rope)
        angles = torch.outer(torch.arange(L).float(), freqs)  # [L, rope/2]
        rot = torch.polar(torch.ones_like(angles), angles)
        tc = torch.view_as_complex(t.reshape(*t.shape[:-1], rope // 2, 2).contiguous())
        shape = [L] + [1] * (t.dim() - 2) + [rope // 2]
        return torch.view_as_real(tc * rot.view(shape)).flatten(-2)

    if "q_proj.weight" in w:
        q = x @ w["q_proj.weight"].T
    else:
        q = rms(x @ w["q_a_proj.weight"].T, w["q_a_layernorm.weight"]) @ w["q_b_proj.weight"].T
    q = q.view(L, H, nope + rope)
    kv_a = x @ w["kv_a_proj_with_mqa.weight"].T
    c_kv = rms(kv_a[:, :kv_lora_rank], w["kv_a_layernorm.weight"])
    k_pe = rotate(kv_a[:, kv_lora_rank:])
    q_pe = rotate(q[..., nope:])
    o = reference_mla_attention(
        q[..., :nope], q_pe, [c_kv], [k_pe], w["kv_b_proj.weight"], nope, v_head_dim, [L]
    )
    return o.reshape(L, H * v_head_dim) @ w["o_proj.weight"].T


def plain_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix: int,
    scale: float,
    plain_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of one request's new tokens, exact or as a plain low-precision
    implementation computes it (the accuracy yardstick of issue 12).

    Args:
        q: [n, H, Dk]; k: [L, H or 1, Dk]; v: [L, H or 1, Dv] (1 = shared by all heads, MQA);
            new token j sees keys ``<= prefix + j``.
        plain_dtype: None: float64 throughout (the exact result). Else what engines' test
            references do: fp32 scores and softmax from the given values, probabilities
            rounded to ``plain_dtype`` before P·V, fp32 P·V, the output rounded once.
    Returns:
        (o [n, H, Dv] float64, lse [n, H] float64).
    """
    n, H, L = q.shape[0], q.shape[1], k.shape[0]
    work = torch.float64 if plain_dtype is None else torch.float32
    s = torch.einsum("nhd,lhd->hnl", q.to(work), k.to(work).expand(L, H, -1)) * scale
    mask = torch.arange(L)[None, :] > (prefix + torch.arange(n))[:, None]
    s = s.masked_fill(mask[None], float("-inf"))
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - m)
    l = p.sum(-1, keepdim=True)
    if plain_dtype is not None:
        p = p.to(plain_dtype).to(work)
    o = torch.einsum("hnl,lhd->nhd", p, v.to(work).expand(L, H, -1)) / l.permute(1, 0, 2)
    lse = (m + torch.log(l)).squeeze(-1).t()
    if plain_dtype is not None:
        o = o.to(plain_dtype)
    return o.double(), lse.double()


# ---- DeepSeek Sparse Attention (DSA) ---------------------------------------------------------
def reference_indexer_logits(
    q_I: torch.Tensor,
    weights: torch.Tensor,
    keys: list[torch.Tensor],
    new_lens: list[int],
) -> torch.Tensor:
    """The lightning indexer's scores in float64, token by token:
    ``I[s, t] = sum_h weights[s, h] * max(0, q_I[s, h] . k[t])`` for the positions t a query
    token sees (its request's, ``<= prefix + j``), -inf elsewhere.

    Args:
        q_I: [T, Hi, Di] (any float dtype, e4m3 included: its values); weights: [T, Hi].
        keys: per request [L_i, Di], the keys as the cache reads them back.
        new_lens: per request, query tokens (the last ones of its sequence).
    Returns:
        float64 [T, max L_i].
    """
    T = q_I.shape[0]
    width = max((k.shape[0] for k in keys), default=0)
    out = torch.full((T, width), float("-inf"), dtype=torch.float64)
    row = 0
    for k, n in zip(keys, new_lens, strict=True):
        L = k.shape[0]
        k64 = k.double()
        for j in range(n):
            q = q_I[row].double()  # [Hi, Di]
            w = weights[row].double()
            vis = L - n + j + 1
            dots = q @ k64[:vis].T  # [Hi, vis]
            out[row, :vis] = (w[:, None] * dots.clamp(min=0)).sum(0)
            row += 1
    return out


def reference_topk(logits: torch.Tensor, topk: int) -> torch.Tensor:
    """The top-k rule, by sorting each row in Python: among a row's visible positions (its
    finite entries), the ``min(topk, visible)`` largest logits, a tie going to the lower
    position, returned ascending and padded with -1.

    Args:
        logits: [T, W]: visible logits finite, invisible ones -inf (as
            :func:`reference_indexer_logits` gives them).
    Returns:
        int64 [T, topk].
    """
    T = logits.shape[0]
    out = torch.full((T, topk), -1, dtype=torch.int64)
    for t in range(T):
        row = logits[t].tolist()
        vis = [p for p, v in enumerate(row) if v != float("-inf")]
        best = sorted(vis, key=lambda p: (-row[p], p))[:topk]
        out[t, : len(best)] = torch.tensor(sorted(best), dtype=torch.int64)
    return out


def reference_sparse_attention(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    c_kv: list[torch.Tensor],
    k_pe: list[torch.Tensor],
    new_lens: list[int],
    indices: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense absorbed attention (MQA over [c_kv ; k_pe], values c_kv) in float64 with a mask
    built from each query token's index set (-1 entries ignored): the sparse attention's
    oracle. A token with no index gets o = 0, lse = -inf.

    Args:
        q_lat: [T, H, r]; q_pe: [T, H, rope]; c_kv / k_pe: per request [L_i, r] / [L_i, rope]
            (the values the cache holds); indices: [T, k] logical positions.
    Returns:
        (o float64 [T, H, r], lse float64 [T, H]).
    """
    T, H, r = q_lat.shape
    o = torch.zeros(T, H, r, dtype=torch.float64)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float64)
    row = 0
    for c, kp, n in zip(c_kv, k_pe, new_lens, strict=True):
        key = torch.cat([c, kp], -1).double()  # [L, r + rope]
        L = key.shape[0]
        for _ in range(n):
            chosen = {int(i) for i in indices[row].tolist() if i >= 0}
            if chosen:
                mask = torch.tensor([p in chosen for p in range(L)])
                q = torch.cat([q_lat[row], q_pe[row]], -1).double()  # [H, D]
                s = (q @ key.T) * scale
                s = s.masked_fill(~mask[None, :], float("-inf"))
                lse[row] = torch.logsumexp(s, -1)
                o[row] = torch.softmax(s, -1) @ c.double()
            row += 1
    return o, lse


def reference_sparse_mla_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    c_kv: list[torch.Tensor],
    k_pe: list[torch.Tensor],
    kv_b_weight: torch.Tensor,
    qk_nope_head_dim: int,
    v_head_dim: int,
    new_lens: list[int],
    indices: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The DeepSeek-V2 paper's decompressed attention in float64 with a mask built from each
    query token's index set (-1 entries ignored): the sparse MHA path's oracle. A token with
    no index gets o = 0, lse = -inf.

    Args:
        q_nope: [T, H, nope]; q_pe: [T, H, rope]; c_kv / k_pe: per request [L_i, r] /
            [L_i, rope] (the values the cache holds); kv_b_weight: [H*(nope+v), r];
            indices: [T, k] logical positions of the token's request.
    Returns:
        (o float64 [T, H, v], lse float64 [T, H]).
    """
    T, H, nope = q_nope.shape
    w = kv_b_weight.double().reshape(H, nope + v_head_dim, -1)
    w_k, w_v = w[:, :nope, :], w[:, nope:, :]
    o = torch.zeros(T, H, v_head_dim, dtype=torch.float64)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float64)
    row = 0
    for c, kp, n in zip(c_kv, k_pe, new_lens, strict=True):
        L = c.shape[0]
        c64 = c.double()
        k = torch.cat([torch.einsum("lr,hdr->hld", c64, w_k),
                       kp.double()[None].expand(H, L, -1)], -1)  # fmt: skip
        v = torch.einsum("lr,hdr->hld", c64, w_v)  # [H, L, v]
        for _ in range(n):
            chosen = {int(i) for i in indices[row].tolist() if i >= 0}
            if chosen:
                mask = torch.tensor([p in chosen for p in range(L)])
                q = torch.cat([q_nope[row], q_pe[row]], -1).double()  # [H, D]
                s = torch.einsum("hd,hld->hl", q, k) * scale
                s = s.masked_fill(~mask[None, :], float("-inf"))
                lse[row] = torch.logsumexp(s, -1)
                o[row] = torch.einsum("hl,hlv->hv", torch.softmax(s, -1), v)
            row += 1
    return o, lse


# ---- attention over key sets (mla_backend.keyset) --------------------------------------------
def reference_keyset_attention(
    q: torch.Tensor,
    rows: list[torch.Tensor],
    new_lens: list[int],
    scale: float,
    *,
    causal_range: bool = True,
    windows: list[int] | None = None,
    indices: torch.Tensor | None = None,
    rows2: list[torch.Tensor] | None = None,
    extra_indices: torch.Tensor | None = None,
    sink: torch.Tensor | None = None,
    value_width: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The key-set attention in float64, token by token: each query token's key set written
    out as Python sets of positions (its window's positions and its indices into ``rows``, then
    its extra indices into ``rows2``; -1 entries skipped, each distinct position of a cache
    once), one softmax over those keys plus the sink (a logit with value 0). A token with no
    key gets o = 0 and lse = sink (-inf without one).

    Args:
        q: [T, H, D] the whole query (``[q_lat ; q_pe]``).
        rows: per request [L_i, D], the main cache's rows as it holds them (``[c_kv ; k_pe]``).
        new_lens: per request, query tokens (the last ones of its sequence).
        causal_range / windows: token at position p sees ``max(0, p - windows[i] + 1) .. p``
            (windows None: from 0) when causal_range.
        indices: [T, k] positions into ``rows``; rows2 / extra_indices: per request
            [L2_i, D] rows of the second cache and [T, k2] entries into them.
        sink: [H] logits (-inf: none); value_width: columns of a row that are its value
            (default D).
    Returns:
        (o float64 [T, H, value_width], lse float64 [T, H]).
    """
    T, H, D = q.shape
    dv = D if value_width is None else value_width
    o = torch.zeros(T, H, dv, dtype=torch.float64)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float64)
    t = 0
    for i, (R, n) in enumerate(zip(rows, new_lens, strict=True)):
        L = R.shape[0]
        for j in range(n):
            p = L - n + j
            main: set[int] = set()  # the key set: distinct positions per cache
            if causal_range:
                start = 0 if windows is None else max(0, p - windows[i] + 1)
                main |= set(range(start, p + 1))
            if indices is not None:
                main |= {k for k in indices[t].tolist() if k >= 0}
            keys: list[torch.Tensor] = [R[k] for k in sorted(main)]
            if extra_indices is not None:
                assert rows2 is not None
                extra = {e for e in extra_indices[t].tolist() if e >= 0}
                keys += [rows2[i][e] for e in sorted(extra)]
            logits = torch.full((H, 0), 0.0, dtype=torch.float64)
            if keys:
                K = torch.stack(keys).double()  # [n_keys, D]
                logits = (q[t].double() @ K.T) * scale  # [H, n_keys]
            if sink is not None:
                logits = torch.cat([logits, sink.double()[:, None]], 1)
            if logits.shape[1]:
                lse[t] = torch.logsumexp(logits, 1)
                if keys:
                    w = torch.exp(logits[:, : len(keys)] - lse[t][:, None])
                    w = torch.nan_to_num(w)  # lse = -inf: every logit -inf (sink only)
                    o[t] = w @ K[:, :dv]
            t += 1
    return o, lse
