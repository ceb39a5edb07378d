"""The device seam's declarations (:mod:`mla_backend.ops.base`): every registered implementation
declares every seam method (:data:`~mla_backend.ops.base.SEAM_METHODS`), by its own code or an
explicit delegation to the torch implementation's; a class that leaves one undeclared is refused
when it is defined, naming it; a seam method added to the list reaches every implementation's
check; the registry and ``python -m mla_backend info`` list who serves what. (Triton and
FlashInfer are checked where triton imports.)"""

from __future__ import annotations

import pytest
import torch

from mla_backend.__main__ import seam_table
from mla_backend.ops import base
from mla_backend.ops.base import SEAM_METHODS, KernelImpl, check_declared, served_by
from mla_backend.ops.registry import IMPLS
from mla_backend.ops.torch import torch_default


def _impl_class(name: str) -> type[KernelImpl]:
    """The registered class of ``name`` (skipped where it cannot be imported here)."""
    try:
        return IMPLS.entry(name).load()
    except ImportError as e:
        pytest.skip(f"{name} cannot be imported here: {e}")


@pytest.mark.parametrize("name", IMPLS.names())
def test_every_implementation_declares_every_seam_method(name: str) -> None:
    cls = _impl_class(name)
    served = served_by(cls)
    assert tuple(served) == SEAM_METHODS
    assert set(served.values()) <= set(IMPLS.names()), served
    assert IMPLS.entry(name).methods() == served
    for m, who in served.items():  # a delegation is a torch_default, never an inherited body
        attr = getattr(cls, m)
        assert not getattr(attr, "__isabstractmethod__", False), m
        if who == "torch" and name != "torch":
            assert getattr(attr, base.DELEGATE_ATTR, None) == "torch", m


@pytest.mark.parametrize("name", IMPLS.names())
def test_a_new_seam_method_reaches_every_declaration_check(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Adding a method to SEAM_METHODS (the one list) makes every registered implementation's
    check fail, naming it, until the implementation declares it."""
    cls = _impl_class(name)
    monkeypatch.setattr(base, "SEAM_METHODS", (*SEAM_METHODS, "brand_new_op"))
    with pytest.raises(TypeError, match="brand_new_op") as e:
        check_declared(cls)
    assert "torch_default('brand_new_op')" in str(e.value)
    with pytest.raises(TypeError, match="brand_new_op"):
        IMPLS.entry(name).methods()


def test_an_undeclared_seam_method_is_refused_when_the_class_is_defined() -> None:
    own = {m: torch_default(m) for m in SEAM_METHODS if m != "indexer_topk"}
    with pytest.raises(TypeError, match=r"\('partial'\) neither implements nor delegates.*"
                                        r"indexer_topk"):  # fmt: skip
        type("Partial", (KernelImpl,), {"name": "partial", **own})
    # nothing inherited silently: the base class's methods are abstract
    with pytest.raises(TypeError):
        KernelImpl()  # type: ignore[abstract]


def test_explicit_delegation_runs_the_torch_implementation_and_is_reported() -> None:
    methods = {m: torch_default(m) for m in SEAM_METHODS}
    delegating = type("Delegating", (KernelImpl,), {"name": "delegating", **methods})
    assert set(served_by(delegating).values()) == {"torch"}
    q, k, v = (torch.randn(2, 5, 8, dtype=torch.float64) for _ in range(3))
    o, lse = delegating().attention_with_lse(q, k, v, True, 0.3)
    s = (q @ k.transpose(1, 2)) * 0.3  # an independent causal softmax
    s = s.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(o, torch.softmax(s, -1) @ v)
    torch.testing.assert_close(lse, torch.logsumexp(s, -1).float())
    with pytest.raises(ValueError, match="'no_such_op' is not a seam method"):
        torch_default("no_such_op")


def test_info_lists_who_serves_each_seam_method() -> None:
    lines = seam_table()
    header = lines[0].split()
    assert header[:2] == ["seam", "method"] and set(header[2:]) <= set(IMPLS.names())
    rows = {line.split()[0]: line.split()[1:] for line in lines[1 : 1 + len(SEAM_METHODS)]}
    assert list(rows) == list(SEAM_METHODS)
    col = header[2:].index("torch")
    assert all(r[col] == "torch" for r in rows.values())
