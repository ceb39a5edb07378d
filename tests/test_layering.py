"""The import graph of ``mla_backend/`` (every import statement, inside functions and
``TYPE_CHECKING`` blocks included, and every ``importlib.import_module`` / ``__import__`` of a
literal module name, read with ``ast``): no cycle, no module importing one in a higher layer,
and no kernel implementation importing another one except its declared fallback
(:data:`FALLBACKS`: FlashInfer composes the Triton implementation for the cases its wrapper
cannot serve).

Layers, lowest first (a module may import its own layer or lower ones):

0. core types: dims, batch, fp8, merge, cache_layout, index_cache, weights, parts (the seam's
   input types), cost (the roofline and its profiles), config (the environment variables),
   decision (a choice and its reason);
1. policy (asks the implementation for its cost profile, imports none);
2. the device seam (``ops/__init__``, ``ops/base``: the base class; ``ops/registry``) and the
   helpers implementations share (``ops/*.py``);
3. the implementations, sibling packages ``ops/torch``, ``ops/native``, ``ops/triton``,
   ``ops/flashinfer`` (and any new one under ``ops/``);
4. selection (registers the implementations with lazy factories, resolves what runs) and plan;
5. entry points: checks, normal, attention, sparse;
6. the package itself, ``__main__`` and ``testing/``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "mla_backend"

CORE = (
    "dims", "batch", "fp8", "merge", "cache_layout", "index_cache", "weights", "parts", "cost",
    "config", "decision",
)
SELECTION = ("selection", "plan")
ENTRY = ("checks", "normal", "attention", "sparse")
#: implementation -> the one other implementation it may compose as its fallback
FALLBACKS = {"flashinfer": "triton"}
#: upward imports in files another branch owns, to drop when it lands (see the merge note)
PENDING: set[tuple[str, str]] = set()


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _exists(module: str) -> bool:
    rel = Path(*module.split("."))
    return (ROOT.parent / rel).with_suffix(".py").is_file() or (
        ROOT.parent / rel / "__init__.py"
    ).is_file()


def _literal_import(node: ast.Call) -> str | None:
    """The module a call ``importlib.import_module("x", ...)`` / ``import_module("x")`` /
    ``__import__("x")`` names, when it is a string literal (relative names resolved later)."""
    f = node.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
    if name not in ("import_module", "__import__") or not node.args:
        return None
    arg = node.args[0]
    return arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None


def _imports_of(source: str, name: str, is_package: bool) -> set[str]:
    """The ``mla_backend`` modules that module ``name`` (its ``source``) imports (relative
    imports resolved)."""
    package = name if is_package else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("mla_backend"))
        elif isinstance(node, ast.Call):
            target = _literal_import(node)
            if target is not None and target.startswith("."):
                level = len(target) - len(target.lstrip("."))
                base = package.split(".")
                rest = target.lstrip(".")
                target = ".".join(base[: len(base) - level + 1] + ([rest] if rest else []))
            if target is not None and target.startswith("mla_backend"):
                out.add(target)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("mla_backend"):
                continue
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                sub = f"{target}.{alias.name}"
                out.add(sub if _exists(sub) else target)
    out.discard(name)
    return out


def _imports(path: Path) -> set[str]:
    """The ``mla_backend`` modules ``path`` imports."""
    return _imports_of(path.read_text(), _module_name(path), path.name == "__init__.py")


def layer(module: str) -> int:
    """The layer of a ``mla_backend`` module (see the module docstring)."""
    parts = module.split(".")[1:]
    if not parts or parts[0] in ("testing", "__main__"):
        return 6
    head = parts[0]
    if head in CORE:
        return 0
    if head == "policy":
        return 1
    if head == "ops":
        if len(parts) == 1:
            return 2
        sub = ROOT / "ops" / parts[1]
        return 3 if sub.is_dir() else 2
    if head in SELECTION:
        return 4
    if head in ENTRY:
        return 5
    raise AssertionError(f"{module} has no layer: add it to tests/test_layering.py")


def implementation(module: str) -> str | None:
    """The implementation package a module belongs to (``torch``, ``native``, ...), if any."""
    parts = module.split(".")
    if len(parts) >= 3 and parts[1] == "ops" and (ROOT / "ops" / parts[2]).is_dir():
        return parts[2]
    return None


GRAPH = {
    _module_name(p): _imports(p) for p in sorted(ROOT.rglob("*.py")) if "csrc" not in p.parts
}


def test_graph_is_read() -> None:
    assert "mla_backend.selection" in GRAPH["mla_backend.plan"]
    assert "mla_backend.parts" in GRAPH["mla_backend.ops.base"]
    assert "mla_backend.cache_layout" in GRAPH["mla_backend.ops.base"]  # a TYPE_CHECKING import
    assert "mla_backend.ops.native.ops" in GRAPH["mla_backend.ops.native.kernels"]
    # the registrations import each implementation inside its factory
    assert "mla_backend.ops.native" in GRAPH["mla_backend.selection"]


def test_importlib_edges_are_read() -> None:
    """``importlib.import_module`` / ``__import__`` of a literal name is an edge too (absolute
    and relative), so a module cannot hide an upward import behind it."""
    src = (
        "import importlib\n"
        "def f():\n"
        "    importlib.import_module('mla_backend.plan')\n"
        "    importlib.import_module('.native', 'x')\n"
        "    __import__('mla_backend.attention')\n"
        "    importlib.import_module('numpy')\n"
    )
    got = _imports_of(src, "mla_backend.ops.base", False)
    assert got == {"mla_backend.plan", "mla_backend.ops.native", "mla_backend.attention"}
    assert any(layer(m) > layer("mla_backend.ops.base") for m in got)


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_no_upward_import(module: str) -> None:
    up = sorted(
        m for m in GRAPH[module]
        if layer(m) > layer(module) and (module, m) not in PENDING
    )
    assert not up, f"{module} (layer {layer(module)}) imports higher layers: {up}"


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_implementations_do_not_import_each_other(module: str) -> None:
    mine = implementation(module)
    if mine is None:
        return
    allowed = (None, mine, FALLBACKS.get(mine))
    other = sorted(m for m in GRAPH[module] if implementation(m) not in allowed)
    assert not other, f"{module} imports another implementation: {other}"


def test_no_cycle() -> None:
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(GRAPH.get(m, ())):
            if state.get(n) == 1:
                cycle = stack[stack.index(n):] + [n]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m)


def test_pending_exemptions_are_still_needed() -> None:
    """Drop an entry of PENDING once its import is gone."""
    stale = sorted(p for p in PENDING if p[1] not in GRAPH.get(p[0], ()))
    assert not stale, f"PENDING entries no longer needed: {stale}"
