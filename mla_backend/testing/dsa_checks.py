"""Checks of the DSA ops' outputs against the float64 oracle, shared by the torch-level tests
(tests/test_sparse.py) and the torch-free core driver's (tests/native_core/): the indexer
logits' error bound, the top-k selection (the oracle's set where the k-th boundary has a gap
above the slack, near-boundary slack elsewhere) and the sparse attention (absorbed and MHA)
against dense attention masked to the same index sets."""

from __future__ import annotations

import torch

from .cases import DsaCase
from .reference import (
    reference_indexer_logits,
    reference_sparse_attention,
    reference_sparse_mla_attention,
    reference_topk,
)


def logit_bound(d: DsaCase, bf16_inputs: bool) -> torch.Tensor:
    """Per-logit error bound (float64 [T, W]): fp32 sums (2^-20 of the sum of |terms|), plus
    one bf16 rounding of q and k each (2^-7 of it) where an implementation rounds fp16 / fp32
    inputs to bf16."""
    mag = reference_indexer_logits(d.q_I.float().abs(), d.weights.abs(),
                                   [k.abs() for k in d.keys], d.case.batch.new_lens)  # fmt: skip
    return mag * (2.0**-7 if bf16_inputs else 2.0**-20) + 1e-6


def check_logits(lg: torch.Tensor, ref: torch.Tensor, tol: torch.Tensor) -> None:
    """Indexer logits [T, W] float32: -inf exactly where the oracle's are, else within tol."""
    assert lg.dtype == torch.float32 and lg.shape == ref.shape, (lg.dtype, lg.shape)
    assert torch.equal(torch.isneginf(lg), torch.isneginf(ref)), "visibility differs"
    fin = torch.isfinite(ref)
    err = (lg.double() - ref).abs()
    assert (err[fin] <= tol[fin]).all(), f"max logit error {err[fin].max():.3g}"


def check_topk(idx: torch.Tensor, ref_logits: torch.Tensor, topk: int, tol: torch.Tensor) -> None:
    """The selection [T, topk] is the oracle's top-k up to ``tol`` at the boundary: counts are
    min(topk, visible), positions ascending and distinct, then -1; every selected position
    scores at least the oracle's k-th best minus the slack and every visible one left out at
    most the k-th best plus it; where the boundary's gap exceeds the slack, the set is the
    oracle's exactly."""
    assert idx.shape == (ref_logits.shape[0], topk), idx.shape
    ref = reference_topk(ref_logits, topk)
    for t in range(idx.shape[0]):
        row = idx[t].tolist()
        vis = int(torch.isfinite(ref_logits[t]).sum())
        n = min(topk, vis)
        assert row[n:] == [-1] * (topk - n), f"token {t}: padding {row}"
        sel = row[:n]
        assert sel == sorted(set(sel)) and all(0 <= p < vis for p in sel), f"token {t}: {row}"
        if n == vis:
            assert sel == list(range(vis))
            continue
        lg = ref_logits[t, :vis]
        order = torch.sort(lg, descending=True).values
        kth, nxt = order[n - 1].item(), order[n].item()
        slack = 2 * tol[t, :vis].max().item()
        if kth - nxt > slack:
            assert sel == ref[t, :n].tolist(), f"token {t}: {sel} != oracle {ref[t].tolist()}"
        chosen = torch.zeros(vis, dtype=torch.bool)
        chosen[sel] = True
        assert (lg[chosen] >= kth - slack).all() and (lg[~chosen] <= kth + slack).all()


def check_sparse(
    d: DsaCase,
    o: torch.Tensor,
    lse: torch.Tensor,
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    idx: torch.Tensor,
    scale: float,
    qdt: torch.dtype,
) -> None:
    """Sparse attention o [T, H, r] (q's dtype), lse [T, H] float32 against dense attention
    masked to each token's index set (float64): tokens with no index o = 0 and lse = -inf;
    the LSE to 1e-3; o to 2e-5 (fp32) or 2^-6 (bf16 / fp16) of the output's scale."""
    c = d.case
    ro, rl = reference_sparse_attention(q_lat, q_pe, c.c_kv, c.k_pe, c.batch.new_lens, idx, scale)
    assert o.dtype == qdt and lse.dtype == torch.float32
    none = (idx < 0).all(1)
    assert torch.equal(torch.isneginf(lse), none[:, None].expand_as(lse))
    assert (o[none] == 0).all()
    some = ~none
    lse_err = (lse[some].double() - rl[some]).abs().max().item() if some.any() else 0.0
    assert lse_err <= 1e-3, lse_err
    err = (o.double() - ro).abs().max().item()
    bound = (2e-5 if qdt == torch.float32 else 2.0**-6) * max(1.0, ro.abs().max().item())
    assert err <= bound, f"error {err:.3g} > {bound:.3g}"


def check_sparse_mha(
    d: DsaCase, o: torch.Tensor, lse: torch.Tensor, idx: torch.Tensor, scale: float
) -> None:
    """Sparse MHA o [T, H, v] (q's dtype), lse [T, H] float32 against the decompressed
    attention masked to each token's index set (float64, from ``kv_b_proj``): tokens with no
    index o = 0 and lse = -inf; o within the normal path's tolerance of the output's scale
    (fp32 2e-5; bf16 / fp16, whose K / V are rounded once: 2^-5), the LSE within 1e-3 (fp32)
    or 2^-5 of its magnitude."""
    c = d.case
    qdt = c.q_nope.dtype
    ro, rl = reference_sparse_mla_attention(c.q_nope, c.q_pe, c.c_kv, c.k_pe, c.kv_b,
                                            c.dims.qk_nope_head_dim, c.dims.v_head_dim,
                                            c.batch.new_lens, idx, scale)  # fmt: skip
    assert o.dtype == qdt and lse.dtype == torch.float32, (o.dtype, lse.dtype)
    none = (idx < 0).all(1)
    assert torch.equal(torch.isneginf(lse), none[:, None].expand_as(lse))
    assert (o[none] == 0).all()
    some = ~none
    if some.any():
        lse_err = (lse[some].double() - rl[some]).abs()
        tol = 1e-3 if qdt == torch.float32 else 2.0**-5 * rl[some].abs().clamp(min=1.0)
        assert (lse_err <= tol).all(), f"lse error {lse_err.max().item():.3g}"
    err = (o.double() - ro).abs().max().item()
    bound = (2e-5 if qdt == torch.float32 else 2.0**-5) * max(1.0, ro.abs().max().item())
    assert err <= bound, f"error {err:.3g} > {bound:.3g}"
