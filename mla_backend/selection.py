"""What runs on a device, decided once: :func:`resolve` returns the :class:`Selection` (kernel
implementation, native ISA level, attention engine, GEMM dispatch rule, cost profile, policy
mode), each with why (the variable that forced it, the CPU flag that allowed it, the fallback
and its reason). Every consumer reads it: :func:`mla_backend.plan` takes its kernels and
policy (:func:`resolve_policy`: made once per configuration, never parsed per step), the engine
adapters log it once at start-up and plan with its policy, ``python -m mla_backend info``
prints it.

It is computed once per process, device type and configuration (:func:`mla_backend.config.current`:
a changed ``MLA_BACKEND_*`` variable gives a new selection).

The implementations are registered here (:data:`mla_backend.ops.registry.IMPLS`), each with a
lazy loader that imports its class on first use, the device types it serves and a probe saying
whether it can run. ``auto`` takes the first runnable implementation of the device type's
order (:data:`AUTO_ORDER`); a named one that cannot run either falls back (native -> torch,
with one warning saying why) or raises (triton, flashinfer: nothing to fall back to that the
user would want instead).
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass, field

import torch

from . import config
from .decision import Decision
from .ops.base import KernelImpl
from .ops.registry import IMPLS, Entry
from .policy import Policy

__all__ = [
    "AUTO_ORDER", "OTHER_ORDER", "Selection", "auto_order_table", "get_impl", "impl_name",
    "log_once", "resolve", "resolve_policy",
]

ENV_VAR = "MLA_BACKEND_IMPL"
#: per device type, the implementations ``auto`` tries in order (other device types:
#: :data:`OTHER_ORDER`). On CUDA FlashInfer's wrapper comes first where it is installed (it
#: composes the Triton kernels for what it does not serve): it beat our best kernel on the H200
#: run by more than the margin ``benchmarks/results/gpu-plan.md`` set for it to become the
#: default (the figures: ``benchmarks/results/gpu-latest.md``). docs/design.md shows this table
#: (:func:`auto_order_table`).
AUTO_ORDER: dict[str, tuple[str, ...]] = {
    "cpu": ("native", "torch"),
    "cuda": ("flashinfer", "triton", "torch"),
}
#: what ``auto`` tries on a device type :data:`AUTO_ORDER` does not name
OTHER_ORDER: tuple[str, ...] = ("torch",)


def auto_order_table() -> str:
    """The markdown table of :data:`AUTO_ORDER` (docs/design.md's, where a test keeps it)."""
    rows = ["| device type | `auto` takes the first of these that can run |", "|---|---|"]
    orders = [(f"`{d}`", o) for d, o in AUTO_ORDER.items()] + [("any other", OTHER_ORDER)]
    for device, order in orders:
        rows.append(f"| {device} | {', '.join(f'`{name}`' for name in order)} |")
    return "\n".join(rows)


# ---- the registrations (lazy: each loader imports its implementation) ------------------------
@IMPLS.register("torch", summary="plain PyTorch on every device: the fallback")
def _torch() -> type[KernelImpl]:
    from .ops.torch import Kernels

    return Kernels


def _native_probe() -> str | None:
    from .ops.native import build

    if build.available():
        return None
    return build.unavailable_reason() or "the native kernels did not load"


@IMPLS.register(
    "native", devices=("cpu",), probe=_native_probe,
    summary="C++ CPU kernels, one build per ISA level, compiled on first use",
)
def _native() -> type[KernelImpl]:
    from .ops.native import Kernels

    return Kernels


def _triton_probe() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "triton cannot be imported (pip install triton)"
    return None


@IMPLS.register(
    "triton", probe=_triton_probe,
    summary="Triton kernels: CUDA/ROCm (CPU tensors under TRITON_INTERPRET=1, for tests)",
)
def _triton() -> type[KernelImpl]:
    from .ops.triton import Kernels

    return Kernels


def _flashinfer_probe() -> str | None:
    problem = _triton_probe()
    if problem:
        return problem
    from .ops.flashinfer import wrapper

    if not wrapper.available():
        return (
            "flashinfer's MLA wrapper cannot be imported (pip install flashinfer-python), or "
            "use MLA_BACKEND_IMPL=triton"
        )
    return None


@IMPLS.register(
    "flashinfer", probe=_flashinfer_probe,
    summary="FlashInfer's MLA wrapper for the absorbed path where it serves, Triton elsewhere",
)
def _flashinfer() -> type[KernelImpl]:
    from .ops.flashinfer import Kernels

    return Kernels


#: a named implementation that cannot run falls back to this one (with a warning); a name
#: missing here raises instead
FALLBACK = {"native": "torch"}


# ---- the record --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Selection:
    """What runs on one device type in this process, and why.

    Attributes:
        device: the device type (``cpu``, ``cuda``, ...).
        impl: the kernel implementation.
        isa / attention_engine / gemm_dispatch: the native kernels' ISA level, absorbed
            attention engine and GEMM dispatch rule (None for other implementations).
        cost_profile: the roofline the ``cost`` policy prices both paths on.
        policy: the policy mode (and for ``sglang``, its chunked-prefix threshold).
        plan_policy: that policy (:func:`resolve_policy`): the one :func:`mla_backend.plan`
            uses when its caller passes none.
        other: further decisions of the implementation (name, decision).
        variables: the ``MLA_BACKEND_*`` variables this process sets (name, value).
        kernels: the implementation's instance (the plan's ``impl``).
    """

    device: str
    impl: Decision
    isa: Decision | None
    attention_engine: Decision | None
    gemm_dispatch: Decision | None
    cost_profile: Decision
    policy: Decision
    other: tuple[tuple[str, Decision], ...]
    variables: tuple[tuple[str, str], ...]
    kernels: KernelImpl = field(compare=False, repr=False)
    plan_policy: Policy = field(compare=False, repr=False)

    def rows(self) -> list[tuple[str, Decision]]:
        """(label, decision) for every decision made, in display order."""
        named = [
            ("implementation", self.impl), ("ISA level", self.isa),
            ("attention engine", self.attention_engine), ("GEMM dispatch", self.gemm_dispatch),
            ("cost profile", self.cost_profile), ("policy", self.policy),
        ]
        rows = [(k, d) for k, d in named if d is not None]
        return rows + [(k.replace("_", " "), d) for k, d in self.other]

    def report(self) -> str:
        """Multi-line text: one decision per line, with its reason."""
        lines = [f"device {self.device}:"]
        lines += [f"  {k:<17} {d.value}  [{d.why}]" for k, d in self.rows()]
        if self.variables:
            lines.append("  set: " + " ".join(f"{k}={v}" for k, v in self.variables))
        return "\n".join(lines)

    def summary(self) -> str:
        """One line (for an engine's start-up log)."""
        parts = [f"{k}={d.value}" for k, d in self.rows()]
        return f"mla_backend on {self.device}: " + ", ".join(parts)


# ---- resolving ---------------------------------------------------------------------------------
_CACHE: dict[tuple[str, str | None, config.Settings], Selection] = {}
_INSTANCES: dict[tuple[str, config.Settings], KernelImpl] = {}
_PROBES: dict[tuple[str, config.Settings], str | None] = {}
_warned: set[tuple[str, str]] = set()
logger = logging.getLogger("mla_backend")


def _probe(entry: Entry, settings: config.Settings) -> str | None:
    key = (entry.name, settings)
    if key not in _PROBES:
        _PROBES[key] = entry.probe()
    return _PROBES[key]


def _choose(device: torch.device, asked: str, source: str, s: config.Settings) -> tuple[str, str]:
    """(implementation name, why) for ``device``; ``asked`` came from ``source``."""
    if asked == "auto":
        order = AUTO_ORDER.get(device.type, OTHER_ORDER)
        skipped = []
        for name in order:
            problem = _probe(IMPLS.entry(name), s)
            if problem is None:
                why = f"auto on {device.type}"
                if skipped:
                    why += "; " + "; ".join(skipped)
                return name, why
            skipped.append(f"{name} unavailable: {problem}")
        raise RuntimeError(f"no kernel implementation can run on {device.type}: {skipped}")
    entry = IMPLS.entry(asked) if asked in IMPLS.names() else None
    if entry is None:  # (the variable's name, also for a caller's impl=: it is its value)
        raise ValueError(
            f"{ENV_VAR}={asked!r} is not supported; supported: auto, {', '.join(IMPLS.names())}"
        )
    if not entry.serves(device.type):
        raise ValueError(
            f"{ENV_VAR}={asked} serves {', '.join(entry.devices)} tensors, not {device.type}"
        )
    problem = _probe(entry, s)
    if problem is None:
        return asked, source
    fallback = FALLBACK.get(asked)
    if fallback is None:
        raise RuntimeError(f"{ENV_VAR}={asked} but {problem}")
    key = (asked, problem)
    if key not in _warned:  # the loader has warned once already; say what we do instead
        _warned.add(key)
        logger.warning("%s: %s; using %s", source, problem, fallback)
    return fallback, f"{source}, but {problem}: fell back to {fallback}"


_POLICIES: dict[config.Settings, tuple[Policy, Decision]] = {}


def _policy(s: config.Settings) -> tuple[Policy, Decision]:
    """The configuration's policy and its decision row, made once per configuration."""
    made = _POLICIES.get(s)
    if made is None:
        policy = Policy.from_settings(s)
        why = "MLA_BACKEND_POLICY" if s.is_set("MLA_BACKEND_POLICY") else "default"
        value = policy.mode
        if value == "sglang":
            value += f" (threshold {policy.chunked_prefix_threshold})"
        elif value == "cost":
            why += ": each request priced on both paths with the cost profile"
        made = _POLICIES[s] = (policy, Decision(value, why))
    return made


def resolve_policy() -> Policy:
    """The absorbed-vs-normal :class:`~mla_backend.policy.Policy` of this configuration
    (``MLA_BACKEND_POLICY``, ``MLA_BACKEND_CHUNKED_PREFIX_THRESHOLD``), made once per
    configuration: the one every :class:`Selection` of it carries (``plan_policy``), which
    :func:`mla_backend.plan` uses when given none.

    Raises:
        ValueError: an unknown mode or a bad threshold, naming the variable and its value.
    """
    return _policy(config.current())[0]


def resolve(device: torch.device | str = "cpu", impl: str | None = None) -> Selection:
    """The :class:`Selection` for ``device`` (``impl``: a name that overrides
    ``MLA_BACKEND_IMPL``), made once per device type, name and configuration.

    Raises:
        ValueError: an unknown implementation or policy name, or one that does not serve the
            device, naming the value and what is supported.
        RuntimeError: triton / flashinfer asked for but not importable.
    """
    dev = torch.device(device)
    s = config.current()
    key = (dev.type, impl, s)
    sel = _CACHE.get(key)
    if sel is not None:
        return sel
    asked = (impl if impl is not None else s.impl).strip().lower()
    source = f"impl={asked!r} (the caller's)" if impl is not None else f"{ENV_VAR}={asked}"
    name, why = _choose(dev, asked, source, s)
    ikey = (name, s)
    kernels = _INSTANCES.get(ikey)
    if kernels is None:
        kernels = _INSTANCES[ikey] = IMPLS.entry(name).factory()
    own = kernels.describe(dev)
    sel = Selection(
        device=dev.type,
        impl=Decision(name, why),
        isa=own.pop("isa", None),
        attention_engine=own.pop("attention_engine", None),
        gemm_dispatch=own.pop("gemm_dispatch", None),
        cost_profile=own.pop("cost_profile"),
        policy=_policy(s)[1],
        other=tuple(own.items()),
        variables=tuple(s.explicit().items()),
        kernels=kernels,
        plan_policy=_policy(s)[0],
    )
    _CACHE[key] = sel
    return sel


def get_impl(device: torch.device, override: str | KernelImpl | None = None) -> KernelImpl:
    """The kernel implementation for ``device`` (``override``: a name or an instance)."""
    if override is not None and not isinstance(override, str):
        if not isinstance(override, KernelImpl):
            raise ValueError(f"impl={override!r} is not a name or a KernelImpl")
        return override
    return resolve(device, override).kernels


def impl_name(device: torch.device, override: str | None = None) -> str:
    """Which implementation serves ``device``: 'torch', 'native', 'triton' or 'flashinfer'."""
    return resolve(device, override).impl.value


_logged: set[str] = set()


def log_once(log: logging.Logger, device: torch.device | str) -> Selection:
    """Log the selection for ``device`` once per process and device type (engine adapters
    call this at start-up); returns it."""
    sel = resolve(device)
    if sel.device not in _logged:
        _logged.add(sel.device)
        log.info("%s", sel.summary())
    return sel
