"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5) under ``mla_absorb``: the CPU forward of
SGLang's DSA ``Indexer`` op, on top of :mod:`mla_backend.sparse`.

SGLang's DSA model (``DeepseekV2AttentionMLA`` with ``use_dsa``) calls, per layer that owns an
indexer, ``self.indexer(x=hidden_states, q_lora=..., positions=..., forward_batch=...,
layer_id=..., return_indices=...)`` and hands what it returns to ``attn_mqa`` as
``topk_indices`` (absorbed path; the MHA path calls it only to fill the index keys). On the CPU
platform that op has no forward (``compat.DSA_INDEXER_CPU``); :func:`indexer_forward` is the one
the plugin installs. It runs SGLang's own projections and weights (``wq_b`` on the query latent,
``wk`` + ``k_norm`` on the hidden states, the op's ``rotary_emb`` on the first
``rope_head_dim`` values, ``weights_proj``'s weight (bf16 in SGLang whatever the model dtype)
for the head gates, in float32 as SGLang's CUDA path computes them) and the core for the rest:

* the new tokens' keys into the layer's index-key pages of SGLang's ``DSATokenToKVPool``
  (:func:`mla_backend.sparse.write_index_keys`, the pool's fp8 layout: e4m3 keys then float32
  scales per 64-token page, power-of-two (``ue8m0``) scales as SGLang's ``act_quant`` with
  ``scale_fmt="ue8m0"``, amax floor 1e-4);
* unless the step's plan is dense (every context ``<= index_topk``: the selection is every
  visible token and the backend runs the dense paths), the causal top-k
  (:func:`mla_backend.sparse.indexer_topk`) of the query rounded as SGLang's ``act_quant``
  rounds it (e4m3 per 128 values, ``ue8m0`` scale, amax floor 1e-4), its scale folded into the
  head gates: ``weights = weights_proj(x) * Hi^-0.5 * q_scale * Di^-0.5``. Returns [T, topk]
  int32 logical positions within each request (-1 padded), which the backend reads back.

SGLang rotates q_I and k_I with a Walsh-Hadamard transform before rounding them (a CUDA JIT
kernel, ``rotate_activation``); this forward does not. The rotation is orthogonal, so the
unrounded scores are the same; only which values the fp8 rounding sees differs (as in vLLM's
and transformers' indexers, which do not rotate either).
"""

from __future__ import annotations

from typing import Any

import torch
from mla_backend_integrations._common import pad_rows

from mla_backend import sparse as mbs
from mla_backend.fp8 import quantize_fp8_groups

#: SGLang's ``act_quant`` (Triton) floors each group's amax here before the scale
ACT_QUANT_AMAX_FLOOR = 1e-4


def _backend(forward_batch: Any) -> Any:
    from mla_backend_integrations.sglang.handler import our_backend

    return our_backend(forward_batch)


def indexer_forward(
    op: Any,
    upstream: Any,
    x: torch.Tensor,
    q_lora: torch.Tensor,
    positions: torch.Tensor,
    forward_batch: Any,
    layer_id: int,
    return_indices: bool = True,
    use_cuda_graph: bool = True,
) -> torch.Tensor | None:
    """SGLang's DSA ``Indexer`` on CPU under ``mla_absorb`` (``op`` is the Indexer module).

    Args:
        x: hidden states [T, hidden] (the model dtype); q_lora: [T, q_lora_rank], the query
            latent after ``q_a_layernorm``; positions: [T] int64.
        forward_batch: SGLang's ``ForwardBatch`` (its backend must be ``mla_absorb``: with any
            other backend ``upstream``, SGLang's own ``forward_native``, runs and raises).
        layer_id: the layer (its index-key pages).
        return_indices: False: only write the keys (SGLang's MHA path).
    Returns:
        [T, index_topk] int32 positions (module docstring), or None when the step is dense or
        ``return_indices`` is False.
    """
    backend = _backend(forward_batch)
    if backend is None:
        return upstream(op, x, q_lora, positions, forward_batch, layer_id, return_indices)
    if isinstance(x, tuple):
        raise ValueError(
            "mla_absorb: a pre-quantized (fp8, scale) hidden-state input to the DSA indexer is "
            "not supported; supported: the hidden states as a tensor"
        )
    plan = backend._plan(forward_batch)
    n = plan.num_tokens
    T = x.shape[0]
    if n == 0:
        return None
    Hi, Di, rope = op.n_heads, op.head_dim, op.rope_head_dim
    with torch.no_grad():
        key = op.k_norm(op.wk(x[:n])[0])
        k_rot, k_pass = key.split([rope, Di - rope], dim=-1)
        query = op.wq_b(q_lora[:n])[0].view(n, Hi, Di)
        q_rot, q_pass = query.split([rope, Di - rope], dim=-1)
        q_rot, k_rot = op.rotary_emb(
            positions[:n], q_rot.contiguous(), k_rot.reshape(n, 1, rope).contiguous()
        )
        query = torch.cat([q_rot.view(n, Hi, rope), q_pass], dim=-1)
        key = torch.cat([k_rot.view(n, rope), k_pass], dim=-1)
        index_cache = backend.index_cache(layer_id)
        slots = forward_batch.out_cache_loc[:n]
        mbs.write_index_keys(index_cache, key.contiguous(), slots, backend.index_layout)
        if not return_indices or plan.choice.sparse_mode == "dense":
            return None
        q_fp8, q_scale = quantize_fp8_groups(
            query, op.block_size, ACT_QUANT_AMAX_FLOOR, op.scale_fmt is not None
        )
        if Di != op.block_size:
            raise ValueError(
                f"mla_absorb: index_head_dim {Di} with quant block {op.block_size} is not "
                "supported: the query's fp8 scale is folded into one gate per head (Di == block)"
            )
        # weights_proj's weight is bf16 whatever the model dtype (SGLang's params_dtype); its
        # CUDA path multiplies in float32 (torch.mm(..., out_dtype=float32)); so here
        w = op.weights_proj.weight
        gates = torch.nn.functional.linear(x[:n].float(), w.float()) * Hi**-0.5
        weights = gates * q_scale.view(n, Hi) * op.softmax_scale
        idx = mbs.indexer_topk(
            q_fp8, weights, index_cache, plan, op.index_topk, backend.index_layout
        )
    return pad_rows(idx, T) if T > n else idx
