"""Where each token of a cache write goes and whose row it writes, in plain torch, without
reading the slot mapping on the host (both torch writers: the latent cache's and the index
keys'). The rule every implementation keeps: a slot named by several tokens of one write holds
the row of the **last** of them, whole (the native writer skips the earlier ones); padding
(slot < 0) writes nothing."""

from __future__ import annotations

from typing import NamedTuple

import torch


class WriteTargets(NamedTuple):
    """``target`` [T] int64: the row each token's scatter writes; ``source`` [T] int64: the
    token whose encoded row it writes there; ``any_valid`` [1] bool: whether any slot is >= 0
    (when none is, every token targets ``n_rows - 1`` and must write that row's current
    content back)."""

    target: torch.Tensor
    source: torch.Tensor
    any_valid: torch.Tensor


def write_targets(slots: torch.Tensor, n_rows: int) -> WriteTargets:
    """The scatter of slots [T] int64 (in range: checked at the entry point) onto a cache of
    ``n_rows`` rows such that duplicate indices write identical rows.

    Padding tokens are redirected to the largest slot of the step; every token of a target
    writes the row of the last non-padding token naming it. All on the slots' device, no
    host read (one stable sort of T keys)."""
    T = slots.shape[0]
    valid = slots >= 0
    smax = slots.max().view(1)  # < 0 only if every slot is padding
    any_valid = smax >= 0
    redirect = torch.where(any_valid, smax, n_rows - 1)
    target = torch.where(valid, slots, redirect)
    # within a target, padding sorts first and the rest in token order: each group's last
    # sorted element is its last non-padding token (a padding one only if all are padding)
    order = torch.sort(target * 2 + valid.long(), stable=True).indices
    sorted_target = target.index_select(0, order)
    pos = torch.arange(T, device=slots.device)
    is_end = torch.ones(T, dtype=torch.bool, device=slots.device)
    is_end[:-1] = sorted_target[1:] != sorted_target[:-1]
    # for each sorted position, the position of its group's end: the first end at or after it
    end = torch.where(is_end, pos, T).flip(0).cummin(0).values.flip(0)
    source = torch.empty_like(order).scatter_(0, order, order.index_select(0, end))
    return WriteTargets(target, source, any_valid)
