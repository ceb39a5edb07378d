"""Decode context parallel (DCP) for ``MLA_ABSORB`` in vLLM: the option check, this process's
DCP group and the metadata builder's planner. The shard layout, the per-step planner and the
per-layer attention are the core's (:mod:`mla_backend.context_parallel`).

vLLM's MLA layer does the DCP work only for the tokens a backend's metadata calls "decode" (it
all-gathers the absorbed query, calls ``forward_mqa`` and merges the outputs with a Triton
kernel that has no CPU build). This backend routes every token to ``forward_mha`` (see
``backend.py``), so it does the DCP work itself through the core, on every platform: the
metadata builder makes the step's :class:`~mla_backend.context_parallel.DCPStep` once
(:func:`planner_for`), ``forward_mha`` runs
:func:`~mla_backend.context_parallel.dcp_attention` per layer with vLLM's DCP group.
"""

from __future__ import annotations

from typing import Any

import torch
from mla_backend_integrations.vllm import BACKEND_NAME

import mla_backend as mb
from mla_backend.context_parallel import DCPGroup, DCPPlanner, ShardLayout, check_shard_layout


def check_context_parallel(vllm_config: Any) -> None:
    """Decode context parallel is served (any size vLLM accepts, interleave sizes dividing the
    block size); prefill context parallel and DCP's replicated query projection are not."""
    parallel = vllm_config.parallel_config
    pcp = getattr(parallel, "prefill_context_parallel_size", 1)
    if pcp > 1:
        raise ValueError(
            f"attention backend {BACKEND_NAME} does not support prefill_context_parallel_size="
            f"{pcp}; supported: 1 (decode_context_parallel_size > 1 is supported)"
        )
    dcp_size = getattr(parallel, "decode_context_parallel_size", 1)
    if dcp_size <= 1:
        return
    if getattr(parallel, "dcp_q_replicate", None):
        raise ValueError(
            f"attention backend {BACKEND_NAME} does not support dcp_q_replicate=True with "
            f"decode_context_parallel_size={dcp_size}: it gathers the absorbed query itself; "
            "leave dcp_q_replicate unset or False"
        )
    block_size = vllm_config.cache_config.block_size
    if block_size is not None:
        check_shard_layout(dcp_size, parallel.cp_kv_cache_interleave_size, int(block_size))


def vllm_dcp_group() -> DCPGroup:
    """This process's DCP group (vLLM's ``GroupCoordinator``)."""
    from vllm.distributed import get_dcp_group

    return get_dcp_group()


def planner_for(
    vllm_config: Any, page_size: int, dims: mb.MLADims, policy: mb.Policy, device: torch.device,
    num_spec_tokens: int,
) -> DCPPlanner | None:  # fmt: skip
    """The :class:`DCPPlanner` of a metadata builder under DCP (this process's rank in the
    DCP group), else None."""
    parallel = getattr(vllm_config, "parallel_config", None)
    world = int(getattr(parallel, "decode_context_parallel_size", 1) or 1)
    if world <= 1:
        return None
    interleave = int(getattr(parallel, "cp_kv_cache_interleave_size", 1) or 1)
    layout = ShardLayout(world, int(vllm_dcp_group().rank_in_group), interleave, page_size)
    return DCPPlanner(layout, dims, policy, device, 1 + num_spec_tokens)
