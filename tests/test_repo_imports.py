"""The whole repository's import graph (:mod:`import_graph`: ``mla_backend``, the integrations,
``benchmarks``, ``examples``, ``tests``, read with ``ast``): no import cycle anywhere, and the
core package imports no engine (nor the engine adapters) anywhere, lazily or not. The layers
inside ``mla_backend`` are ``tests/test_layering.py``'s."""

from __future__ import annotations

import ast

import pytest
from import_graph import (
    ROOT,
    _resolve,
    cycles,
    external_imports,
    imported_names,
    module_graph,
    module_name,
    source_files,
)

#: top-level names of the serving engines and of our adapters to them
ENGINES = frozenset({"vllm", "sglang", "sgl_kernel", "mla_backend_integrations"})

FILES = source_files()
GRAPH = module_graph(FILES)
CORE = [p for p in FILES if p.relative_to(ROOT).parts[0] == "mla_backend"]


def test_graph_is_read() -> None:
    assert len(CORE) > 40 and len(GRAPH) > len(CORE)
    assert "mla_backend.cache_layout" in GRAPH["mla_backend_integrations.vllm.backend"]
    assert "benchmarks.harness" in GRAPH["benchmarks.decode"]


def test_reader_sees_every_kind_of_import() -> None:
    src = (
        "import a.b\nfrom . import sib\nfrom ..up import x\n"
        "def f():\n    from typing import TYPE_CHECKING\n    import lazy\n"
        "importlib.import_module('by.name')\n__import__('dunder')\n"
        "importlib.import_module('.rel', __package__)\nimport_module(f'{x}')\n"
    )
    got = set(imported_names(ast.parse(src), "p.q.mod", is_package=False))
    assert got == {
        "a.b", "p.q.sib", "p.up.x", "typing.TYPE_CHECKING", "lazy", "by.name", "dunder",
        "p.q.rel",
    }  # fmt: skip


def test_cycle_finder_finds_a_cycle() -> None:
    g = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert cycles(g) == [["a", "b", "c", "a"], ["e", "e"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_the_repository() -> None:
    found = cycles(GRAPH)
    assert not found, "import cycles: " + "; ".join(" -> ".join(c) for c in found)


@pytest.mark.parametrize("path", CORE, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_core_imports_no_engine(path) -> None:
    engines = sorted(external_imports(path) & ENGINES)
    assert not engines, f"{path.relative_to(ROOT)} imports {engines}: engines live in integrations/"


#: top-level names of this repository's own packages
FIRST_PARTY = ("mla_backend", "mla_backend_integrations", "benchmarks")


def missing_modules(tree: ast.AST, module: str, is_package: bool, known: set[str]) -> list[str]:
    """The first-party modules ``from X import ...`` / ``import X`` in ``tree`` names that are
    not in ``known`` (a module moved away and an importer left behind)."""
    package = module if is_package else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            names = [_resolve(node.module or "", node.level, package)]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out += [n for n in names if n.split(".")[0] in FIRST_PARTY and n not in known]
    return out


def test_missing_module_finder_finds_one() -> None:
    tree = ast.parse("from mla_backend.gone import x\nfrom . import here\nimport benchmarks.nope\n")
    known = {"mla_backend", "mla_backend.here", "benchmarks"}
    got = missing_modules(tree, "mla_backend.mod", False, known)
    assert got == ["mla_backend.gone", "benchmarks.nope"]


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_first_party_imports_name_existing_modules(path) -> None:
    known = {module_name(p) for p in FILES}
    name = module_name(path)
    tree = ast.parse(path.read_text(), str(path))
    gone = missing_modules(tree, name, path.name == "__init__.py", known)
    assert not gone, f"{path.relative_to(ROOT)} imports modules that do not exist: {gone}"
