"""Accuracy checks of the native kernels' outputs against the float64 oracle, with the tolerances
every native test uses (tests/test_native*.py through torch, tests/native_core/ through the
torch-free core driver): absorbed attention (a float64 reference and a plain compute-dtype one;
for bf16 q on ``fp8_ds_mla`` caches an emulation of the kernel's own roundings), the bf16
GEMMs (one bf16 rounding of an fp32 sum) and the normal path's MHA (output and LSE)."""

from __future__ import annotations

from typing import Any

import torch

from ..cache_layout import FP8_TILE, CacheLayout
from .cases import Case
from .reference import plain_attention

FP8 = torch.float8_e4m3fn
DS = torch.uint8  # fp8_ds_mla rows
#: (q dtype, cache dtype) of absorbed attention: plain caches, per-tensor fp8, fp8_ds_mla
ATTENTION_DTYPES = [
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16),
    (torch.float32, torch.float32),
    (torch.bfloat16, FP8),
    (torch.float32, FP8),
    (torch.bfloat16, DS),
    (torch.float16, DS),
    (torch.float32, DS),
]


def absorbed_references(
    case: Case, q_lat: torch.Tensor, q_pe: torch.Tensor, scale: float, qdt: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o64, lse64, o_plain) of absorbed attention over ``case``'s stored latents (MQA: keys
    [c_kv ; k_pe], values c_kv): the float64 oracle (:func:`plain_attention`) and a plain
    compute-dtype one (fp32 scores and softmax, probabilities rounded to the compute dtype
    before P·V, fp32 accumulation, the output rounded to the compute dtype)."""
    T, H, r = q_lat.shape
    o64 = torch.zeros(T, H, r, dtype=torch.float64)
    lse64 = torch.zeros(T, H, dtype=torch.float64)
    o_pl = torch.zeros(T, H, r, dtype=torch.float32)
    cu = case.batch.cu_new
    for i, (c, kp) in enumerate(zip(case.c_kv, case.k_pe)):
        n = cu[i + 1] - cu[i]
        if n == 0:
            continue
        L = c.shape[0]
        ql, qp = q_lat[cu[i] : cu[i + 1]], q_pe[cu[i] : cu[i + 1]]
        pos = torch.arange(L)
        qpos = L - n + torch.arange(n)
        mask = pos[None, :] > qpos[:, None]  # [n, L]
        o64[cu[i] : cu[i + 1]], lse64[cu[i] : cu[i + 1]] = plain_attention(
            torch.cat([ql, qp], -1), torch.cat([c, kp], -1)[:, None], c[:, None], L - n, scale, None
        )
        # plain compute dtype
        cq = c.to(qdt).float()
        kq = kp.to(qdt).float()
        s32 = (ql.float() @ cq.T + qp.float() @ kq.T) * scale
        s32 = s32.masked_fill(mask[:, None, :], float("-inf"))
        m = s32.amax(-1, keepdim=True)
        p = torch.exp(s32 - m)
        lsum = p.sum(-1, keepdim=True)
        o_pl[cu[i] : cu[i + 1]] = ((p.to(qdt).float() @ cq) / lsum).to(qdt).float()
    return o64, lse64, o_pl


def ds_emulation(
    case: Case, q_lat: torch.Tensor, q_pe: torch.Tensor, scale: float, qdt: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """What the bf16 engine computes on an ``fp8_ds_mla`` cache, from the stored bytes: fp32
    scores over e4m3 x tile scale and k_pe, fp32 softmax, each probability times its kv row's
    tile scale rounded to ``qdt``, times the e4m3 values, fp32 sums, output rounded to ``qdt``.
    Returns float32 [T, H, r] and the same sums over absolute values (the scale of the
    rounding errors of a sum with cancellation)."""
    T, H, r = q_lat.shape
    rope = q_pe.shape[-1]
    lay = CacheLayout.ds_mla(r, rope, qdt)
    ps = case.kv_cache.shape[1]
    bt, cu = case.batch.block_table, case.batch.cu_new
    out, mag = torch.zeros(T, H, r), torch.zeros(T, H, r)
    for i, L in enumerate(case.batch.kv_lens):
        n = cu[i + 1] - cu[i]
        if n == 0:
            continue
        pos = torch.arange(L)
        rows = case.kv_cache[bt[i, pos // ps].long(), pos % ps]  # [L, width] uint8
        v8 = rows[:, :r].contiguous().view(FP8).float()
        sc = rows[:, lay.scale_offset : lay.rope_offset].contiguous().view(torch.float32)
        kp = rows[:, lay.rope_offset :].contiguous().view(qdt).float()
        c = v8 * sc.repeat_interleave(FP8_TILE, 1)[:, :r]
        ql, qp = q_lat[cu[i] : cu[i + 1]].float(), q_pe[cu[i] : cu[i + 1]].float()
        s = (ql @ c.T + qp @ kp.T) * scale  # [n, H, L]
        qpos = L - n + torch.arange(n)
        s = s.masked_fill((pos[None, :] > qpos[:, None])[:, None, :], float("-inf"))
        p = torch.exp(s - s.amax(-1, keepdim=True))
        o, a = torch.zeros(n, H, r), torch.zeros(n, H, r)
        for t in range(lay.tiles):
            cols = slice(t * FP8_TILE, (t + 1) * FP8_TILE)
            ps_t = (p * sc[:, t]).to(qdt).float()
            o[..., cols] = ps_t @ v8[:, cols]
            a[..., cols] = ps_t.abs() @ v8[:, cols].abs()
        lsum = p.sum(-1, keepdim=True)
        out[cu[i] : cu[i + 1]] = (o / lsum).to(qdt).float()
        mag[cu[i] : cu[i + 1]] = a / lsum
    return out, mag


def check_absorbed(
    case: Case,
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    scale: float,
    o: torch.Tensor,
    lse: torch.Tensor,
    qdt: torch.dtype,
    memo: dict[str, Any] | None = None,
) -> tuple[float, float]:
    """Absorbed attention's o [T, H, r] (q's dtype) and lse [T, H] float32 on ``case``'s cache
    against :func:`absorbed_references` (fp32: 2e-5 relative; else within 1.1x the plain
    compute-dtype error plus 2^-10; bf16 q on fp8_ds_mla: against :func:`ds_emulation`); the LSE
    to 1e-3. ``memo``: the references of earlier calls on the same inputs (filled on the first
    call), for checking several outputs of one case. Returns (max output error, max LSE error)."""
    memo = {} if memo is None else memo
    T, H, r = q_lat.shape
    assert o.shape == (T, H, r) and o.dtype == qdt
    assert lse.shape == (T, H) and lse.dtype == torch.float32
    if "refs" not in memo:
        memo["refs"] = absorbed_references(case, q_lat, q_pe, scale, qdt)
    o64, lse64, o_pl = memo["refs"]
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    err = (o.double() - o64).abs().max().item()
    lse_err = (lse.double() - lse64).abs().max().item()
    assert lse_err <= 1e-3, f"lse error {lse_err:.2e}"
    if qdt == torch.float32:
        bound = 2e-5 * max(1.0, o64.abs().max().item())
        assert err <= bound, f"fp32 error {err:.3e} > {bound:.3e}"
    elif case.kv_cache.dtype == DS and qdt == torch.bfloat16:
        # the kernel rounds p x tile scale (not p) to bf16 and keeps the e4m3 values exact:
        # a rounding of its own, checked against its emulation (slack: one bf16 ulp of the
        # output plus one of the sum of |terms|, since the emulation's p differs from the
        # kernel's in the last fp32 bits, which can flip a bf16 rounding of p x scale, and the
        # sums run in another order; a wrongly applied tile scale is off by O(|terms|)) and,
        # looser, against float64
        if "emu" not in memo:
            memo["emu"] = ds_emulation(case, q_lat, q_pe, scale, qdt)
        emu, mag = memo["emu"]
        bound = 2.0**-7 * (emu.abs() + mag) + 1e-6
        bad = (o.float() - emu).abs() > bound
        assert not bad.any(), f"{int(bad.sum())} outputs differ from the emulation"
        err_pl = (o_pl.double() - o64).abs().max().item()
        bound = 1.1 * err_pl + 2.0**-8 * max(1.0, o64.abs().max().item())
        assert err <= bound, f"error {err:.3e} > {bound:.3e} (plain {qdt} {err_pl:.3e})"
    else:
        # plus an eighth of a bf16 ulp at 1: a single output's rounding can land either way
        # (seen at H=2, one decode token: 1.08e-3 vs the plain reference's 0.88e-3)
        err_pl = (o_pl.double() - o64).abs().max().item()
        bound = 1.1 * err_pl + 2.0**-10 * max(1.0, o64.abs().max().item())
        assert err <= bound, f"error {err:.3e} > {bound:.3e} (plain {qdt} {err_pl:.3e})"
    return err, lse_err


def check_bf16_gemm(
    got: torch.Tensor, ref: torch.Tensor, mag: torch.Tensor, what: str = ""
) -> None:
    """A bf16 GEMM output against its float64 value ``ref`` (``mag``: the same sums over
    absolute values): one rounding of the fp32 sum to bf16 (2^-8 relative) + fp32 summation
    error."""
    bound = ref.abs() * 2.0**-8 + mag * 2.0**-20 + 1e-30
    err = (got.double() - ref).abs()
    assert bool((err <= bound).all()), f"max err {err.max():.3g} {what}"


def check_mha(
    o: torch.Tensor,
    lse: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
) -> None:
    """The normal path's MHA: o [H, Lq, Dv] bf16, lse [H, Lq] float32 for q [H, Lq, D],
    k [H, Lk, D], v [H, Lk, Dv] (bf16; causal = top-left) against float64: probabilities
    rounded to bf16 before P·V and one rounding of the output (2^-8 each) relative to the
    sum of |terms|; the LSE to 1e-5 relative; no key: o = 0 and lse = -inf."""
    H, Lq, Lk = q.shape[0], q.shape[1], k.shape[1]
    assert o.shape == (H, Lq, v.shape[-1]) and o.dtype == torch.bfloat16
    assert lse.shape == (H, Lq) and lse.dtype == torch.float32
    sc = torch.einsum("hid,hjd->hij", q.double(), k.double()) * scale
    if causal:
        sc = sc.masked_fill(~torch.ones(Lq, Lk, dtype=torch.bool).tril(), float("-inf"))
    if Lk == 0:
        assert torch.equal(o, torch.zeros_like(o)) and bool(torch.isneginf(lse).all())
        return
    ref_lse = torch.logsumexp(sc, -1)
    p = torch.softmax(sc, -1)
    ref = p @ v.double()
    mag = p @ v.double().abs()
    bound = mag * 2.0**-7 + 1e-6
    err = (o.double() - ref).abs()
    assert bool((err <= bound).all()), f"max err {err.max():.3g}"
    lse_err = (lse.double() - ref_lse).abs().max().item()
    assert lse_err <= 1e-5 * max(1.0, ref_lse.abs().max().item()), lse_err
