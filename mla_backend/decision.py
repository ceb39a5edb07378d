"""A decision about what runs, with its reason: the unit of the resolved selection
(:mod:`mla_backend.selection`) that implementations contribute to (``KernelImpl.describe``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Decision:
    """What was chosen (``value``) and why (``why``: the variable that forced it, the CPU flag
    or device property that allowed it, or the fallback and its reason)."""

    value: str
    why: str

    def __str__(self) -> str:
        return f"{self.value} ({self.why})"
