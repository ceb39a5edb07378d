"""Shared machinery for the import-only stand-ins (test tooling, never shipped).

SGLang 0.5.23 imports ``torchvision`` and ``sgl_kernel`` at module level in code
paths that are never executed on a CPU-only machine.  PyPI's torchvision does
not load against torch 2.13.0+cpu and no CPU build of sgl-kernel exists, so
these stand-ins satisfy the imports.  Any attribute is a placeholder; calling
one raises ``NotImplementedError`` naming it, so an accidental use is loud.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any


class Placeholder:
    """An attribute of a stand-in module: any access chains, any call raises."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, item: str) -> Placeholder:
        if item.startswith("__"):
            raise AttributeError(item)
        return Placeholder(f"{self._name}.{item}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"{self._name} is an import-only test stand-in (no CPU build exists here)"
        )

    def __mro_entries__(self, bases: tuple) -> tuple:
        return (object,)

    def __repr__(self) -> str:
        return f"<stand-in {self._name}>"


def _module_getattr(modname: str):
    def __getattr__(item: str) -> Any:
        if item.startswith("__"):
            raise AttributeError(item)
        return Placeholder(f"{modname}.{item}")

    return __getattr__


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, root: str) -> None:
        self.root = root

    def find_spec(self, fullname, path=None, target=None):  # noqa: D401
        if fullname.startswith(self.root + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = types.ModuleType(spec.name)
        mod.__path__ = []  # a package, so deeper submodules resolve too
        mod.__getattr__ = _module_getattr(spec.name)  # type: ignore[attr-defined]
        return mod

    def exec_module(self, module) -> None:
        return None


def install(root_module: types.ModuleType) -> None:
    """Make ``root_module`` and every ``root.*`` submodule an import-only stand-in."""
    name = root_module.__name__
    root_module.__getattr__ = _module_getattr(name)  # type: ignore[attr-defined]
    if not any(isinstance(f, _Finder) and f.root == name for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(name))
