"""The import graph of ``mla_backend/`` (every import statement, inside functions and
``TYPE_CHECKING`` blocks included, and every ``importlib.import_module`` / ``__import__`` of a
literal module name, read with ``ast`` by :mod:`import_graph`): no cycle, no module importing
one in a higher layer, and no kernel implementation importing another one except the torch
implementation (:data:`DEFAULT`: every implementation may delegate a seam method to it, by name,
``torch_default``) and its declared fallback (:data:`FALLBACKS`: FlashInfer composes the Triton
implementation for the cases its wrapper cannot serve).

Layers, lowest first (a module may import its own layer or lower ones):

0. core types: dims, batch, fp8, merge, cache_layout, index_cache, weights, parts (the seam's
   input types), cost (the roofline and its profiles), config (the environment variables),
   decision (a choice and its reason), rope (the interleaved rotation the core applies),
   v4_cache (DeepSeek-V4's fp8 KV-cache page layout, its writer and reader);
1. policy (asks the implementation for its cost profile, imports none);
2. the device seam (``ops/__init__``, ``ops/base``: the base class and the seam's records;
   ``ops/registry``): no torch code of the ops;
3. the implementations, sibling packages ``ops/torch`` (also the code the others delegate to),
   ``ops/native``, ``ops/triton``, ``ops/flashinfer`` (and any new one under ``ops/``);
4. selection (registers the implementations with lazy loaders, resolves what runs) and plan;
5. entry points: checks, normal, attention, sparse, sparse_normal (DSA's sparse MHA path),
   sparse_layer (a DSA layer's routed call, over sparse and sparse_normal), keyset,
   compressor (DeepSeek-V4's KV compressor), v4_layer (V4's attention layer, over keyset),
   context_parallel (decode context parallel: shard layout, planner, per-layer attention),
   indexer_rows (the indexer over rows with their own key counts: engines' paged indexer ops);
6. the package itself, ``__main__`` and ``testing/``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from import_graph import module_graph, source_files

ROOT = Path(__file__).resolve().parents[1] / "mla_backend"

CORE = (
    "dims", "batch", "fp8", "merge", "cache_layout", "index_cache", "weights", "parts", "cost",
    "config", "decision", "rope", "v4_cache",
)
SELECTION = ("selection", "plan")
ENTRY = ("checks", "normal", "attention", "sparse", "sparse_normal", "sparse_layer", "keyset",
         "compressor", "v4_layer", "context_parallel", "indexer_rows")  # fmt: skip
#: implementation -> the one other implementation it may compose as its fallback
FALLBACKS = {"flashinfer": "triton"}
#: the implementation every other one may delegate seam methods to (``torch_default``)
DEFAULT = "torch"
#: upward imports in files another branch owns, to drop when it lands (see the merge note)
PENDING: set[tuple[str, str]] = set()


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
    m: {t for t in edges if t.split(".")[0] == "mla_backend"}
    for m, edges in module_graph(p for p in source_files() if p.is_relative_to(ROOT)).items()
}


def test_graph_is_read() -> None:
    assert "mla_backend.selection" in GRAPH["mla_backend.plan"]
    assert "mla_backend.parts" in GRAPH["mla_backend.ops.base"]
    assert "mla_backend.cache_layout" in GRAPH["mla_backend.ops.base"]  # a TYPE_CHECKING import
    assert "mla_backend.ops.native.ops" in GRAPH["mla_backend.ops.native.kernels"]
    # the registrations import each implementation inside its loader
    assert "mla_backend.ops.native" in GRAPH["mla_backend.selection"]


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
    allowed = (None, mine, DEFAULT, FALLBACKS.get(mine))
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
