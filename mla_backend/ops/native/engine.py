"""The one rule that picks the compute engine of the native absorbed attention, per ISA level and
CPU (the op's ``engine`` argument; the engines are in ``csrc/f32_attention.h``,
``csrc/bf16_attention.h`` and ``csrc/amx_attention.h``).

Engines (names, and the op's bit set):

- ``fp32`` (0): the fp32 engine (tiles widened to fp32, fp32 FMAs), every level and dtype;
- ``bf16`` (1): bf16 queries on the AVX512-BF16 engine (``vdpbf16ps``), levels
  ``avx512_bf16`` / ``amx``;
- ``amx+fp32`` (2) / ``amx+bf16`` (3): level ``amx``: requests of >= 16 query rows (heads x new
  tokens) with bf16 queries and a bf16 or fp8 cache on AMX-BF16 tiles; the other work on the
  vector engine named after the ``+``.

The rule (:func:`attention_engine`): ``fp32`` below ``avx512_bf16``; from there the vector engine
is ``bf16`` only where ``vdpbf16ps`` gives more FLOPs per cycle than fp32 FMA, which is a property
of the core, told apart by the CPU vendor:

- Intel (Sapphire Rapids class: one ``vdpbf16ps zmm`` per ~2 cycles against two
  ``vfmadd231ps zmm`` per cycle, so bf16 dot products give half the FLOPs of fp32 FMA;
  ``benchmarks/micro/dot_throughput.cpp``, its figures in
  ``benchmarks/results/dot_throughput-latest.md``, both engines' decode in
  ``benchmarks/results/decode-history.md``): ``fp32``;
- AMD (Zen 4 / 5: ``vdpbf16ps zmm`` issues once per cycle, 64 FLOP, twice the 32 FLOP of a
  512-bit FMA on its 256-bit FMA pipes, per AMD's and uops.info's instruction tables; the bf16
  engine's Zen 4 runs are in ``benchmarks/results/decode-history.md``): ``bf16``;
- any other vendor: ``fp32`` (the engine that needs no bf16 dot-product throughput).

Level ``amx`` adds the AMX engine in front of that vector engine. ``MLA_BACKEND_NATIVE_ENGINE``
(one of :data:`ENGINES`) overrides the rule, for tests and measurements; a value the level cannot
run raises ``ValueError`` naming it.
"""

from __future__ import annotations

from ...config import current
from .isa import AARCH64_LEVELS, X86_LEVELS, cpuinfo_field

__all__ = [
    "ENGINES",
    "ENV_ENGINE",
    "attention_engine",
    "cpu_vendor",
    "engine_code",
    "level_engines",
    "select_engine",
]

#: engine name -> the op's bit set (1: AVX512-BF16 vector engine, 2: AMX engine)
ENGINES: dict[str, int] = {"fp32": 0, "bf16": 1, "amx+fp32": 2, "amx+bf16": 3}
ENV_ENGINE = "MLA_BACKEND_NATIVE_ENGINE"

#: CPU vendors whose vdpbf16ps outruns their fp32 FMA (``/proc/cpuinfo`` vendor_id)
_BF16_DOT_VENDORS = frozenset({"AuthenticAMD"})


def cpu_vendor() -> str:
    """``vendor_id`` of ``/proc/cpuinfo`` ('' where there is none)."""
    return cpuinfo_field("vendor_id") or ""


def level_engines(isa: str) -> tuple[str, ...]:
    """The engines level ``isa``'s build can run (its CPU permitting): the vector engines of
    ``avx512_bf16``, those plus AMX at ``amx``, the fp32 engine at every other level (x86 or
    aarch64)."""
    if isa not in X86_LEVELS and isa not in AARCH64_LEVELS:
        raise ValueError(
            f"ISA level {isa!r} is not supported; use one of {X86_LEVELS + AARCH64_LEVELS[1:]}"
        )
    if isa == "amx":
        return tuple(ENGINES)
    if isa == "avx512_bf16":
        return ("fp32", "bf16")
    return ("fp32",)


def select_engine(isa: str, vendor: str | None = None) -> tuple[str, str]:
    """(engine, why) of the native absorbed attention at level ``isa`` on this CPU (or on a CPU
    of ``vendor``): ``MLA_BACKEND_NATIVE_ENGINE`` when set (ValueError naming it if the level
    cannot run it), else the rule of this module."""
    runnable = level_engines(isa)
    forced = current().native_engine
    if forced:
        if forced not in runnable:
            raise ValueError(
                f"{ENV_ENGINE}={forced!r} is not supported at ISA level {isa!r}; use one of "
                f"{runnable}"
            )
        return forced, f"{ENV_ENGINE}={forced}"
    if len(runnable) == 1:
        return "fp32", f"the only engine of level {isa}"
    who = cpu_vendor() if vendor is None else vendor
    if who in _BF16_DOT_VENDORS:
        vec, why = "bf16", f"{who}: vdpbf16ps outruns fp32 FMA"
    else:
        vec, why = "fp32", f"{who or 'unknown vendor'}: fp32 FMA outruns vdpbf16ps"
    if isa == "amx":
        return f"amx+{vec}", f"AMX tiles for >= 16 query rows; vector engine: {why}"
    return vec, why


def attention_engine(isa: str, vendor: str | None = None) -> str:
    """The engine of :func:`select_engine` without the reason."""
    return select_engine(isa, vendor)[0]


def engine_code(engine: str) -> int:
    """The op's ``engine`` bit set of an engine name (:data:`ENGINES`)."""
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r} is not supported; use one of {tuple(ENGINES)}")
    return ENGINES[engine]
