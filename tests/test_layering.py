"""The import graph of ``mla_backend/`` (every import statement, inside functions and
``TYPE_CHECKING`` blocks included, read with ``ast``): no cycle, no module importing one in a
higher layer, and no kernel implementation importing another one except its declared
fallback (:data:`FALLBACKS`: FlashInfer composes the Triton implementation for the cases its
wrapper cannot serve).

Layers, lowest first (a module may import its own layer or lower ones):

0. core types: dims, batch, fp8, merge, cache_layout, index_cache, weights, parts (the seam's
   input types), cost (the roofline and its profiles);
1. policy (asks the implementation for its cost profile, imports none);
2. the device seam (``ops/__init__``, ``ops/seam``) and the helpers implementations share
   (``ops/*.py``);
3. the implementations, sibling packages ``ops/torch``, ``ops/native``, ``ops/triton`` (and
   any new one under ``ops/``);
4. plan (resolves the implementation through the seam, asks it for its work shape);
5. entry points: checks, normal, attention, sparse;
6. the package itself and ``testing/``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "mla_backend"

CORE = (
    "dims", "batch", "fp8", "merge", "cache_layout", "index_cache", "weights", "parts", "cost",
)  # fmt: skip
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


def _imports(path: Path) -> set[str]:
    """The ``mla_backend`` modules ``path`` imports (relative imports resolved)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("mla_backend"))
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


def layer(module: str) -> int:
    """The layer of a ``mla_backend`` module (see the module docstring)."""
    parts = module.split(".")[1:]
    if not parts or parts[0] == "testing":
        return 6
    head = parts[0]
    if head in CORE:
        return 0
    if head == "policy":
        return 1
    if head == "ops":
        if len(parts) == 1 or parts[1] == "seam":
            return 2
        sub = ROOT / "ops" / parts[1]
        return 3 if sub.is_dir() else 2
    if head == "plan":
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
    assert "mla_backend.ops.seam" in GRAPH["mla_backend.plan"] or any(
        m.startswith("mla_backend.ops") for m in GRAPH["mla_backend.plan"]
    )
    assert "mla_backend.parts" in GRAPH["mla_backend.ops.seam"]  # a TYPE_CHECKING import
    assert "mla_backend.ops.native.ops" in GRAPH["mla_backend.ops.native.kernels"]


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
