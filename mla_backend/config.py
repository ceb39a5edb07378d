"""Every ``MLA_BACKEND_*`` environment variable: the one table (:data:`VARIABLES`) and the one
place that reads them (:func:`current`).

The core and the engine adapters read the variables here and nowhere else; what they mean for
a device is resolved once per process and device by :func:`mla_backend.selection.resolve`
(``python -m mla_backend info`` prints it). Values are validated where they are used (the
error names the variable, its value and what is supported).

``current()`` returns a frozen :class:`Settings` snapshot, remade only when one of the variables
changed since the last call (tests and benchmarks set them in-process), so callers may ask on
every call.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["VARIABLES", "Settings", "Variable", "current", "markdown_table"]


@dataclass(frozen=True)
class Variable:
    """One environment variable: its name, default (as text; '' = unset), who reads it and
    what it does."""

    name: str
    default: str
    scope: str
    meaning: str


#: every MLA_BACKEND_* variable, in the order the README's configuration table lists them
VARIABLES: tuple[Variable, ...] = (
    Variable(
        "MLA_BACKEND_IMPL", "auto", "core",
        "kernel implementation: auto (per device type, the first that can run of the order in "
        "docs/design.md), native, triton, flashinfer, torch",
    ),
    Variable(
        "MLA_BACKEND_NATIVE_ISA", "", "core",
        "force a lower ISA level of the native CPU kernels (x86: scalar, avx2, avx512, "
        "avx512_bf16, amx; aarch64: scalar, neon, neon_bf16, sve); default the best this CPU runs",
    ),
    Variable(
        "MLA_BACKEND_NATIVE_ENGINE", "", "core",
        "force the native absorbed attention's compute engine (fp32, bf16, amx+fp32, amx+bf16); "
        "default: the per-CPU rule",
    ),
    Variable(
        "MLA_BACKEND_POLICY", "cost", "core",
        "absorbed-vs-normal policy: cost, sglang, absorb, normal",
    ),
    Variable(
        "MLA_BACKEND_CHUNKED_PREFIX_THRESHOLD", "8192", "core",
        "sglang policy: cached-prefix tokens from which an extend goes normal (chunked-prefix MHA)",
    ),
    Variable(
        "MLA_BACKEND_NATIVE_LOCK_TIMEOUT", "1800", "core",
        "seconds a process waits for another's native build of the same kernels",
    ),
    Variable(
        "MLA_BACKEND_NATIVE_VERBOSE", "0", "core",
        "1: print the native kernels' compiler output",
    ),
    Variable(
        "MLA_BACKEND_ALLOW_UNTESTED_VLLM", "0", "vllm adapter",
        "1: run on a vLLM version outside the tested range (a warning instead of an error)",
    ),
    Variable(
        "MLA_BACKEND_V4_OPS", "0", "vllm adapter",
        "which of vLLM's DeepSeek-V4 CPU ops ours replace (set by the adapter for the engine "
        "processes when mla_absorb serves a V4 model): all (or 1); faster: the attention and the "
        "indexer logits; 0: none (ours serve only the ops vLLM's build lacks)",
    ),
    Variable(
        "MLA_BACKEND_SGLANG_QK", "split", "sglang adapter",
        "split: q_lat / q_pe passed separately; concat: SGLang's concatenated [q_lat ; q_pe]",
    ),
    Variable(
        "MLA_BACKEND_TEST_ISAS", "", "tests",
        "comma-separated native ISA levels the tests run (default every level this CPU runs)",
    ),
    Variable(
        "MLA_BACKEND_CACHE", "~/.cache/mla-backend", "tools",
        "where vLLM's grid runner caches the vLLM sdist it tests against",
    ),
    Variable(
        "MLA_BACKEND_KEEP_ENVS", "0", "noxfile",
        "1: keep each nox test session's environment (they are removed to save disk)",
    ),
)
_BY_NAME = {v.name: v for v in VARIABLES}


@dataclass(frozen=True)
class Settings:
    """The variables' values in this process (stripped; a variable left unset or empty reads
    as its default). Attribute names drop the ``MLA_BACKEND_`` prefix, lower-cased."""

    impl: str
    native_isa: str
    native_engine: str
    policy: str
    chunked_prefix_threshold: str
    native_lock_timeout: str
    native_verbose: str
    allow_untested_vllm: str
    v4_ops: str
    sglang_qk: str
    test_isas: str
    cache: str
    keep_envs: str

    def value(self, name: str) -> str:
        """The value of the variable ``name`` (full name; its default when unset)."""
        return str(getattr(self, _attr(name)))

    def is_set(self, name: str) -> bool:
        """Whether the variable ``name`` (full name) was set to a non-empty value."""
        return bool(os.environ.get(name, "").strip())

    def flag(self, attr: str) -> bool:
        """A 0/1 variable, by attribute name: true unless '' or '0'."""
        return getattr(self, attr) not in ("", "0")

    def explicit(self) -> dict[str, str]:
        """The variables this process sets (name -> value)."""
        return {v.name: os.environ[v.name].strip() for v in VARIABLES if self.is_set(v.name)}


def _attr(name: str) -> str:
    return name.removeprefix("MLA_BACKEND_").lower()


_snapshot: tuple[tuple[str | None, ...], Settings] | None = None


def current() -> Settings:
    """The variables' values now (a cached :class:`Settings`, remade when one changed)."""
    global _snapshot
    raw = tuple(os.environ.get(v.name) for v in VARIABLES)
    if _snapshot is None or _snapshot[0] != raw:
        values = {
            _attr(v.name): (r.strip() if r is not None and r.strip() else v.default)
            for v, r in zip(VARIABLES, raw, strict=True)
        }
        _snapshot = (raw, Settings(**values))
    return _snapshot[1]


def variable(name: str) -> Variable:
    """The table row of ``name`` (KeyError for an unknown variable)."""
    return _BY_NAME[name]


def markdown_table() -> str:
    """The configuration table (the README's), from :data:`VARIABLES`."""
    rows = ["| variable | default | read by | what it does |", "|---|---|---|---|"]
    for v in VARIABLES:
        default = f"`{v.default}`" if v.default else "unset"
        rows.append(f"| `{v.name}` | {default} | {v.scope} | {v.meaning} |")
    return "\n".join(rows)
