"""Helpers both engine adapters share (imports torch only, never an engine): output padding,
the engine cache view, engine version lookup and the version-guarded :class:`Workaround` (with
the table of an adapter's workarounds that docs/engines.md shows)."""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from mla_backend.cache_layout import CacheLayout


def pad_rows(o: torch.Tensor, rows: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The step's output padded to the engine's row count.

    Engines pad a step's token tensors (CUDA-graph / batch buckets); the core computes only
    the step's ``o.shape[0]`` tokens. Rows past them are zeros (never uninitialized memory).

    Args:
        o: [T, ...] the step's output.
        rows: the engine's row count (>= T).
        out: optional [rows, ...] buffer to fill in place (vLLM's ``output``); same trailing
            numel per row as ``o``. When ``o`` is already a view of its first T rows (the core
            wrote there through ``out=``), only the padding rows are written.
    Returns:
        ``out`` when given, else ``o`` itself when no padding is needed, else a new tensor.
    """
    T = o.shape[0]
    if rows < T:
        raise ValueError(f"{rows} output rows for a step of {T} tokens")
    if out is None:
        if rows == T:
            return o
        out = o.new_empty((rows, *o.shape[1:]))
    flat = out.view(out.shape[0], -1)
    if flat.shape[0] != rows or flat.shape[1] != math.prod(o.shape[1:]):
        raise ValueError(
            f"output buffer {tuple(out.shape)} does not hold {rows} rows of {tuple(o.shape[1:])}"
        )
    if flat[:T].data_ptr() != o.data_ptr() or o.dtype != flat.dtype:  # else written in place
        flat[:T].copy_(o.reshape(T, -1))
    if rows > T:
        flat[T:].zero_()
    return out


def engine_cache_view(
    buf: torch.Tensor, layout: CacheLayout, page_size: int, engine: str
) -> torch.Tensor:
    """An engine's latent cache of one layer as the core's paged cache.

    Args:
        buf: the engine's tensor, one row per token slot: vLLM's [pages, 1, page_size, W] or
            [pages, page_size, W], SGLang's [slots, 1, W]. A cache of a 1-byte layout may
            come as uint8 or float8 storage: it is bit-viewed as ``layout.dtype``.
        layout: the layer's cache layout (the adapter names it once, at start-up).
        page_size: tokens per page.
        engine: the backend's name, for errors.
    Returns:
        [num_pages, page_size, layout.width] in ``layout.dtype`` (a view, no copy).
    Raises:
        ValueError: rows of another width than the layout's, or slots not a whole number of
            pages.
    """
    if buf.dtype != layout.dtype and buf.dtype.itemsize == layout.dtype.itemsize == 1:
        buf = buf.view(layout.dtype)
    width = buf.shape[-1]
    if width != layout.width:
        unit = "bytes" if layout.dtype.itemsize == 1 else "values"
        raise ValueError(
            f"{engine}: {layout.kind} cache rows of {width} {unit}, the core's layout needs "
            f"{layout.width} (r {layout.kv_lora_rank}, rope {layout.rope} in "
            f"{layout.rope_dtype})"
        )
    slots = math.prod(buf.shape[:-1])
    if slots % page_size:
        raise ValueError(f"{engine}: pool size {slots} is not a multiple of page size {page_size}")
    return buf.view(slots // page_size, page_size, width)


def parse_version(version: str) -> tuple[int, ...]:
    """Leading integer fields of a version string (``0.32.0+cpu`` -> (0, 32, 0)); () if none."""
    out: list[int] = []
    for part in version.split("+")[0].split("."):
        digits = ""
        for ch in part:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        out.append(int(digits))
        if digits != part:
            break
    return tuple(out)


@functools.cache
def distribution_version(name: str) -> str:
    """The installed version of the distribution ``name`` (its metadata: the package is not
    imported); ``"0"`` when it is not installed (no :class:`Workaround` range holds it)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "0"


@dataclass(frozen=True)
class Workaround:
    """One engine workaround: the engine versions it applies to, the upstream behaviour it
    works around and what the adapter does instead (one sentence each). :meth:`applies`
    guards it: outside ``[lo, hi)`` it is skipped and that is logged once (WARNING) on
    ``logger_name``.

    Attributes:
        name: its name (the table's and the skip message's).
        versions: ``(lo, hi)``: it applies to versions ``>= lo`` and ``< hi``.
        upstream: the engine's behaviour it works around.
        version_of: returns the installed engine version (no engine import where avoidable).
        logger_name: where a skip is logged.
        remedy: what the adapter does instead, naming the function that does it.
    """

    name: str
    versions: tuple[tuple[int, ...], tuple[int, ...]]
    upstream: str
    version_of: Callable[[], str]
    logger_name: str
    remedy: str

    def applies(self, version: str | None = None) -> bool:
        version = self.version_of() if version is None else version
        lo, hi = self.versions
        v = parse_version(version)
        if v and lo <= v < hi:
            return True
        if self.name not in _SKIPPED:
            _SKIPPED.add(self.name)
            logging.getLogger(self.logger_name).warning(
                "workaround %r (for versions %s) is skipped on version %s; upstream: %s",
                self.name, self.range_text(), version, self.upstream,
            )  # fmt: skip
        return False

    def range_text(self) -> str:
        """``>= lo, < hi`` in dotted versions."""
        lo, hi = self.versions
        return f">= {'.'.join(map(str, lo))}, < {'.'.join(map(str, hi))}"


_SKIPPED: set[str] = set()


def workaround_table(workarounds: Sequence[Workaround], engine: str) -> str:
    """The markdown table of an adapter's workarounds (its ``compat.WORKAROUNDS``), the one
    docs/engines.md shows: name, the ``engine`` versions it applies to, the upstream behaviour
    and what the adapter does instead."""
    head = ("workaround", f"applies to {engine}", f"what {engine} does", "what the adapter does")
    rows = ["| " + " | ".join(head) + " |", "|---|---|---|---|"]
    for w in workarounds:
        cells = (f"`{w.name}`", w.range_text(), w.upstream, w.remedy)
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows)
