"""The seam's registry of kernel implementations: each one registered by name with a lazy
factory (mini-sglang's backend registry), the device types it serves and a probe that says
whether it can run here. The registrations themselves, which import the implementations inside
their factories, live above the implementations (:mod:`mla_backend.selection`); this module
imports none."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .base import KernelImpl

__all__ = ["ANY_DEVICE", "IMPLS", "Entry", "Registry"]

#: ``devices`` of an implementation that serves tensors on any device
ANY_DEVICE = ("*",)


def _always() -> str | None:
    return None


@dataclass(frozen=True)
class Entry:
    """One registered implementation.

    Attributes:
        name: its ``MLA_BACKEND_IMPL`` value.
        factory: makes its default instance (imports the implementation: called on first use).
        devices: device types it serves (:data:`ANY_DEVICE`: all).
        probe: None when it can run in this process, else why not (called on first use;
            may build or import things).
        summary: one line for ``python -m mla_backend info``.
    """

    name: str
    factory: Callable[[], KernelImpl]
    devices: tuple[str, ...]
    probe: Callable[[], str | None]
    summary: str

    def serves(self, device_type: str) -> bool:
        return self.devices == ANY_DEVICE or device_type in self.devices


class Registry:
    """Implementations by name, in registration order."""

    def __init__(self) -> None:
        self._entries: dict[str, Entry] = {}

    def register(
        self,
        name: str,
        *,
        devices: tuple[str, ...] = ANY_DEVICE,
        probe: Callable[[], str | None] = _always,
        summary: str = "",
    ) -> Callable[[Callable[[], KernelImpl]], Callable[[], KernelImpl]]:
        """Decorator: register ``factory`` under ``name`` (a name registered twice is an
        error)."""

        def wrap(factory: Callable[[], KernelImpl]) -> Callable[[], KernelImpl]:
            if name in self._entries:
                raise ValueError(f"kernel implementation {name!r} is registered twice")
            self._entries[name] = Entry(name, factory, devices, probe, summary)
            return factory

        return wrap

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def entry(self, name: str) -> Entry:
        """The entry of ``name`` (ValueError naming the registered ones otherwise)."""
        if name not in self._entries:
            raise ValueError(
                f"kernel implementation {name!r} is not supported; supported: "
                f"{', '.join(self._entries)}"
            )
        return self._entries[name]


#: the project's implementations (registered in :mod:`mla_backend.selection`)
IMPLS = Registry()
