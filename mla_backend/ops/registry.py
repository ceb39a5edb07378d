"""The seam's registry of kernel implementations: each one registered by name with a lazy
loader of its class (mini-sglang's backend registry), the device types it serves, a probe that
says whether it can run here, and what it serves (:meth:`Entry.methods`: each seam method's
serving implementation, from the class's declarations, :func:`mla_backend.ops.base.served_by`).
The registrations themselves, which import the implementations inside their loaders, live above
the implementations (:mod:`mla_backend.selection`); this module imports none."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .base import KernelImpl, served_by

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
        load: its class (imports the implementation: called on first use; the class was
            checked to declare every seam method when it was defined).
        devices: device types it serves (:data:`ANY_DEVICE`: all).
        probe: None when it can run in this process, else why not (called on first use;
            may build or import things).
        summary: one line for ``python -m mla_backend info``.
    """

    name: str
    load: Callable[[], type[KernelImpl]]
    devices: tuple[str, ...]
    probe: Callable[[], str | None]
    summary: str

    def serves(self, device_type: str) -> bool:
        return self.devices == ANY_DEVICE or device_type in self.devices

    def factory(self) -> KernelImpl:
        """Its default instance."""
        return self.load()()

    def methods(self) -> dict[str, str]:
        """Seam method -> the implementation whose code serves it here (its own name, or the
        one it delegates to or composes; imports the implementation)."""
        return served_by(self.load())


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
    ) -> Callable[[Callable[[], type[KernelImpl]]], Callable[[], type[KernelImpl]]]:
        """Decorator: register ``load`` (returns the implementation's class) under ``name`` (a
        name registered twice is an error)."""

        def wrap(load: Callable[[], type[KernelImpl]]) -> Callable[[], type[KernelImpl]]:
            if name in self._entries:
                raise ValueError(f"kernel implementation {name!r} is registered twice")
            self._entries[name] = Entry(name, load, devices, probe, summary)
            return load

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
