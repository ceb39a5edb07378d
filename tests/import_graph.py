"""The repository's import graph, read with ``ast`` (no module is imported): every ``import`` /
``from ... import`` statement (inside functions and ``TYPE_CHECKING`` blocks included) and every
``importlib.import_module`` / ``__import__`` call whose module name is a string constant
(relative names resolved against the caller's package). Names built at run time (f-strings) are
not edges.

Modules are named as they are imported: ``mla_backend/...`` as ``mla_backend....``,
``integrations/...`` as ``mla_backend_integrations....`` (its installed name), ``benchmarks/``,
``examples/`` and ``tests/`` by their path from the repository root. Importing ``pkg.mod`` is an
edge to ``pkg.mod`` only (not to ``pkg``'s ``__init__``, which Python has already started).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: source folder -> the package name it is imported as
PACKAGES = {
    "mla_backend": "mla_backend",
    "integrations": "mla_backend_integrations",
    "benchmarks": "benchmarks",
    "examples": "examples",
    "tests": "tests",
}
#: folders that are not the project's modules (import-only stand-ins of other packages)
SKIP = ("integrations/sglang/tests/stubs",)


def module_name(path: Path, root: Path = ROOT) -> str:
    """The name ``path`` (a ``.py`` file under ``root``) is imported as."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    parts[0] = PACKAGES.get(parts[0], parts[0])
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_files(root: Path = ROOT) -> list[Path]:
    """The project's Python files: the folders of :data:`PACKAGES` and the root's ``*.py``."""
    files = sorted(root.glob("*.py"))
    for folder in PACKAGES:
        for p in sorted((root / folder).rglob("*.py")):
            rel = p.relative_to(root).as_posix()
            if "__pycache__" not in p.parts and not rel.startswith(SKIP):
                files.append(p)
    return files


def _resolve(name: str, level: int, package: str) -> str:
    if not level:
        return name
    base = package.split(".")
    base = base[: len(base) - level + 1]
    return ".".join(base + ([name] if name else []))


def imported_names(tree: ast.AST, module: str, is_package: bool) -> Iterator[str]:
    """Every module name ``tree`` (the source of ``module``) imports, resolved to absolute names;
    ``from pkg import x`` yields ``pkg.x`` (x may be a submodule; :func:`module_graph` keeps the
    longest prefix that is a module), ``from pkg import *`` yields ``pkg``."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(node.module or "", node.level, package)
            yield from (target if a.name == "*" else f"{target}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Call) and node.args:
            f = node.func
            fname = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            arg = node.args[0]
            if fname in ("import_module", "__import__") and isinstance(arg, ast.Constant):
                if isinstance(arg.value, str):
                    name = arg.value
                    level = len(name) - len(name.lstrip("."))
                    yield _resolve(name.lstrip("."), level, package) if level else name


def module_graph(files: Iterable[Path], root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the project modules it imports (names outside ``files`` dropped; a name that
    is an attribute, not a module, counts as its module)."""
    parsed = {module_name(p, root): p for p in files}
    graph: dict[str, set[str]] = {}
    for name, path in parsed.items():
        tree = ast.parse(path.read_text(), str(path))
        edges = set()
        for target in imported_names(tree, name, path.name == "__init__.py"):
            while target and target not in parsed:
                target = target.rpartition(".")[0]
            if target and target != name:
                edges.add(target)
        graph[name] = edges
    return graph


def external_imports(path: Path, root: Path = ROOT) -> set[str]:
    """The top-level names of every module ``path`` imports (its own project's included)."""
    name = module_name(path, root)
    tree = ast.parse(path.read_text(), str(path))
    return {n.split(".")[0] for n in imported_names(tree, name, path.name == "__init__.py") if n}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's cycles, one per strongly connected component of more than one module (or a
    module importing itself), each as a path ``a -> b -> ... -> a`` (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                found.append(_path_within(sorted(comp), graph))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return found


def _path_within(comp: list[str], graph: dict[str, set[str]]) -> list[str]:
    """One cycle through ``comp[0]`` inside the component ``comp`` (breadth-first)."""
    members, start = set(comp), comp[0]
    prev: dict[str, str] = {}
    todo = [start]
    while todo:
        v = todo.pop(0)
        for w in sorted(graph[v] & members):
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(prev[path[-1]])
                return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, start]
            if w not in prev:
                prev[w] = v
                todo.append(w)
    return comp
