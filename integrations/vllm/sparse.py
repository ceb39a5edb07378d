"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5) through ``MLA_ABSORB``: the sparse backend, its
impl and the lightning indexer's op, on top of :mod:`mla_backend.sparse`.

vLLM's DSA model code (``deepseek_v2.DeepseekV2MLAAttention`` with an ``Indexer``) runs per layer:
the indexer's projections, then ``SparseAttnIndexer`` (a ``CustomOp``: write the new tokens'
index keys, score every cached token, keep the top ``index_topk`` per query token in the model's
shared ``topk_indices_buffer``), then the MLA layer, whose impl reads that buffer. This module
supplies each engine-facing piece and calls the core for every computation:

* :class:`MLAAbsorbSparseBackend`: what the CPU platform hook returns for a sparse MLA layer
  when ``MLA_ABSORB`` is selected (``is_sparse()``); same metadata builder as the dense backend,
  whose plan then carries the indexer dims (``mb.plan(..., indexer=IndexerDims(...))``).
* :class:`MLAAbsorbSparseImpl`: per layer; its ``forward_mha`` takes every token of the step (as
  the dense impl) and runs the dense impl's step where the plan says the selection is every
  visible token (every context ``<= index_topk``), else the core's layer-level DSA call
  (:func:`mla_backend.sparse_layer.sparse_mla_attention`: each request on the route the plan
  carries, sparse absorbed or sparse MHA, over the buffer's indices, or dense).
* :class:`MLAAbsorbIndexer`: ``CustomOp.register_oot`` replacement of ``SparseAttnIndexer``
  (in-tree behaviour unless ``MLA_ABSORB`` is selected): :func:`mla_backend.sparse.
  write_index_keys` into vLLM's own ``DeepseekV32IndexerCache`` (its fp8 layout byte for byte:
  :meth:`mla_backend.index_cache.IndexCacheLayout.named`), then, unless the step is dense,
  :func:`mla_backend.sparse.indexer_topk` into ``topk_indices_buffer``. The index cache layer is
  served by :class:`MLAAbsorbIndexCacheBackend` (our builder: the step's plan, the cache
  group's block table and slot mapping) instead of vLLM's CUDA-oriented indexer builder.

Every hook into vLLM internals is in :mod:`mla_backend_integrations.vllm.compat`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from mla_backend_integrations._common import pad_rows
from mla_backend_integrations.vllm import BACKEND_NAME
from mla_backend_integrations.vllm.backend import (
    MLAAbsorbBackend,
    MLAAbsorbImpl,
    MLAAbsorbMetadata,
)

from mla_backend import sparse as mbs
from mla_backend import sparse_layer as mbs_layer
from mla_backend.fp8 import quantize_fp8_groups
from mla_backend.index_cache import IndexCacheLayout

logger = logging.getLogger("vllm.mla_absorb")

class MLAAbsorbSparseBackend(MLAAbsorbBackend):
    """Backend descriptor of DSA layers (``use_sparse``): MLA_ABSORB's, sparse."""

    @staticmethod
    def get_impl_cls() -> type[MLAAbsorbSparseImpl]:
        return MLAAbsorbSparseImpl

    @classmethod
    def is_sparse(cls) -> bool:
        return True


class MLAAbsorbIndexCacheBackend(MLAAbsorbBackend):
    """Backend of the indexer's key-cache layers (``DeepseekV32IndexerCache``) under MLA_ABSORB:
    our metadata builder (the step's plan with the indexer dims, this cache group's block table
    and slot mapping); any block size. Storage only: it has no impl."""

    @staticmethod
    def get_name() -> str:
        return f"{BACKEND_NAME}_INDEX_CACHE"

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []

    @classmethod
    def is_mla(cls) -> bool:
        return True


class MLAAbsorbSparseImpl(MLAAbsorbImpl):
    """Per-layer implementation of a DSA layer: the dense impl plus the sparse path.

    ``is_sparse`` stays False on purpose: vLLM's ``MLAAttention.forward_impl`` then hands every
    token to :meth:`forward_mha` (as for the dense impl) instead of routing them to its own
    sparse MQA path; the indices come from ``topk_indices_buffer`` (shared by every layer of the
    model; a layer without its own indexer reads the previous one's, as vLLM's skip-top-k
    layers do).
    """

    def __init__(
        self,
        *args: Any,
        indexer: object | None = None,
        topk_indices_buffer: torch.Tensor | None = None,
        index_group_builder: object | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if topk_indices_buffer is None:
            raise ValueError(
                f"attention backend {BACKEND_NAME}: a sparse MLA layer needs vLLM's "
                "topk_indices_buffer (the DSA model's shared top-k indices)"
            )
        self.topk_indices_buffer = topk_indices_buffer
        self.has_indexer = indexer is not None

    def record_logical_topk_ready(self) -> None:
        """vLLM's hook after the indexer ran (its index groups); nothing to record here."""

    def forward_mha(
        self,
        q: torch.Tensor,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: MLAAbsorbMetadata,
        k_scale: torch.Tensor,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
    ) -> None:
        """All tokens of the step: q [T, H, nope + rope] -> output [T, H * v] (in place).
        Dense where the plan says so (the selection is every visible token), else sparse."""
        plan = attn_metadata.plan
        if plan.choice.sparse_mode == "dense":
            super().forward_mha(
                q, kv_c_normed, k_pe, kv_c_and_k_pe_cache, attn_metadata, k_scale, output,
                output_scale,
            )  # fmt: skip
            return
        self._check_ready(output_scale)
        T = plan.num_tokens
        nope = self.dims.qk_nope_head_dim
        q = q.view(q.shape[0], self.num_heads, -1)
        rows = output.view(output.shape[0], -1)
        same = output.dtype == q.dtype and rows.shape[1] == self.num_heads * self.dims.v_head_dim
        o = mbs_layer.sparse_mla_attention(
            self.attn,
            q[:T, :, :nope],
            q[:T, :, nope:],
            self._cache_view(kv_c_and_k_pe_cache),
            plan,
            self.topk_indices_buffer[:T],
            self._kv_scale(k_scale),
            out=rows[:T].view(T, self.num_heads, self.dims.v_head_dim) if same else None,
        )
        pad_rows(o, output.shape[0], out=output)  # zeroes the padding rows only


def step_metadata(cache_layer_name: str) -> MLAAbsorbMetadata | None:
    """The metadata our builder made this step for an index-cache layer (the plan with the
    indexer dims, that cache group's slot mapping); None in a profiling / dummy run."""
    from vllm.forward_context import get_forward_context

    attn_metadata = get_forward_context().attn_metadata
    if not isinstance(attn_metadata, dict):
        return None
    md = attn_metadata.get(cache_layer_name)
    if md is None:
        return None
    if not isinstance(md, MLAAbsorbMetadata):
        raise RuntimeError(
            f"{BACKEND_NAME}: the index cache {cache_layer_name} got {type(md).__name__} "
            "metadata; expected the MLA_ABSORB index-cache backend's"
        )
    return md


def indexer_forward(
    layer: Any,
    q_quant: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    k: torch.Tensor | None,
    weights: torch.Tensor,
) -> torch.Tensor:
    """The ``SparseAttnIndexer`` step under MLA_ABSORB (``layer`` is the op): write the new
    tokens' keys (k [T, Di]) into the layer's index cache, then, unless every context is
    ``<= index_topk``, the top-k of q_quant [T, Hi, Di] (e4m3, its scales folded into
    weights [T, Hi] float32) into ``layer.topk_indices_buffer[:T]``. Returns the buffer."""
    buf = layer.topk_indices_buffer
    md = step_metadata(layer.k_cache.prefix)
    if md is None:
        return buf
    if isinstance(q_quant, tuple):
        raise ValueError(f"{BACKEND_NAME}: an fp4 indexer query/cache is not supported")
    plan = md.plan
    T = plan.num_tokens
    cache = layer.k_cache.kv_cache
    layout = layer.mla_absorb_index_layout
    if k is not None and not layer.skip_k_cache_insert and cache.numel():
        mbs.write_index_keys(cache, k[:T], md.slot_mapping[:T], layout)
    if plan.choice.sparse_mode == "dense":
        return buf
    topk = layer.topk_tokens
    mbs.indexer_topk(
        q_quant[:T], weights[:T].float(), cache, plan, topk, layout, out=buf[:T, :topk]
    )
    return buf


def round_index_query(
    x: torch.Tensor, group_size: int, eps: float, pow2_scale: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's ``per_token_group_quant_fp8`` for the indexer's query on CPU (row-major scales):
    :func:`mla_backend.fp8.quantize_fp8_groups`."""
    return quantize_fp8_groups(x, group_size, eps, pow2_scale)


def make_indexer_op(base: type) -> type:
    """The out-of-tree ``SparseAttnIndexer`` (``base``): in-tree behaviour, unless the current
    vLLM config selects MLA_ABSORB; then, per instance: the key-cache layer served by
    :class:`MLAAbsorbIndexCacheBackend`, the query rounding supplied on CPU, and
    :func:`indexer_forward` as its forward. An fp4 indexer cache or an index head dim the core's
    fp8 layout cannot hold raises here (model construction, at start-up) naming the value."""
    from mla_backend_integrations.vllm import compat, is_selected

    class MLAAbsorbIndexer(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            from vllm.config import get_current_vllm_config

            self.mla_absorb = is_selected(get_current_vllm_config())
            if not self.mla_absorb:
                return
            if self.use_fp4_cache:
                raise ValueError(
                    f"attention backend {BACKEND_NAME} does not support an fp4 indexer key "
                    "cache; supported: the fp8 cache (indexer_kv_dtype auto / fp8)"
                )
            self.mla_absorb_index_layout = IndexCacheLayout.named(
                "fp8", self.head_dim, self.quant_block_size, scale_fmt=self.scale_fmt
            )
            compat.serve_index_cache_with(self.k_cache, MLAAbsorbIndexCacheBackend)
            compat.supply_cpu_group_quant(round_index_query)
            self._forward_method = self._mla_absorb_forward

        def _mla_absorb_forward(
            self,
            hidden_states: torch.Tensor,
            q_quant: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
            k: torch.Tensor | None,
            weights: torch.Tensor,
        ) -> torch.Tensor:
            return indexer_forward(self, q_quant, k, weights)

    MLAAbsorbIndexer.__qualname__ = MLAAbsorbIndexer.__name__ = "MLAAbsorbIndexer"
    return MLAAbsorbIndexer
