"""Checks of the key-set attention's outputs (:mod:`mla_backend.keyset`) against the float64
oracle (:func:`mla_backend.testing.reference.reference_keyset_attention`), shared by the
torch-level tests (tests/test_keyset.py) and the torch-free core driver's
(tests/native_core/)."""

from __future__ import annotations

import torch


def check_keyset(
    o: torch.Tensor, lse: torch.Tensor, ref_o: torch.Tensor, ref_lse: torch.Tensor,
    dtype: torch.dtype,
) -> None:  # fmt: skip
    """o [T, H, dv] (``dtype``) within 2e-5 (fp32) / 2^-6 (bf16, fp16) of the output's scale
    and finite everywhere (no NaN of a never-written row leaks); lse [T, H] float32 -inf
    exactly where the oracle's is, else within 1e-3 (2e-2 at low precision) of its scale."""
    assert o.dtype == dtype and lse.dtype == torch.float32, (o.dtype, lse.dtype)
    assert o.shape == ref_o.shape and lse.shape == ref_lse.shape, (o.shape, ref_o.shape)
    assert torch.isfinite(o).all(), "a NaN or inf leaked into o"
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "empty key sets differ"
    fin = torch.isfinite(ref_lse)
    lse_tol = 1e-3 if dtype == torch.float32 else 2e-2
    if fin.any():
        err = (lse[fin].double() - ref_lse[fin]).abs().max().item()
        assert err <= lse_tol * max(1.0, ref_lse[fin].abs().max().item()), f"lse error {err:.3g}"
    if o.numel() == 0:
        return
    bound = (2e-5 if dtype == torch.float32 else 2.0**-6) * max(1.0, ref_o.abs().max().item())
    err = (o.double() - ref_o).abs().max().item()
    assert err <= bound, f"max error {err:.3g} > {bound:.3g}"
