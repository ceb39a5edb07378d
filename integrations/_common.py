"""Helpers both engine adapters share (imports torch only, never an engine)."""

from __future__ import annotations

import math

import torch


def pad_rows(o: torch.Tensor, rows: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The step's output padded to the engine's row count.

    Engines pad a step's token tensors (CUDA-graph / batch buckets); the core computes only
    the step's ``o.shape[0]`` tokens. Rows past them are zeros (never uninitialized memory).

    Args:
        o: [T, ...] the step's output.
        rows: the engine's row count (>= T).
        out: optional [rows, ...] buffer to fill in place (vLLM's ``output``); same trailing
            numel per row as ``o``.
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
    flat[:T].copy_(o.reshape(T, -1))
    if rows > T:
        flat[T:].zero_()
    return out
