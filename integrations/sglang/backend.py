"""``mla_absorb``: an SGLang attention backend whose attention math is all mla-backend's core.

SGLang's DeepSeek model (``DeepseekV2AttentionMLA``) owns the projections and calls the backend
through two ``RadixAttention`` layers that share one ``layer_id`` (and one latent cache):

- ``attn_mqa`` (absorbed path, ``AttnForwardMethod.MLA``): the model has already absorbed
  ``W_UK`` and applies ``W_UV`` itself. It passes either the concatenated convention
  ``q = [q_lat ; q_pe]`` [T, H*(r+rope)], ``k = [c_kv ; k_pe]`` [T, 1, r+rope], ``v = c_kv``,
  or (when the backend name is in ``FORWARD_ABSORB_CORE_ATTENTION_BACKENDS``) the separate
  convention ``q = q_lat`` [T, H, r], ``k = v = c_kv`` [T, 1, r], ``q_rope`` [T, H, rope],
  ``k_rope`` [T, 1, rope]. We write ``[c_kv ; k_pe]`` with ``mb.write_latent`` and return
  ``mb.absorbed_attention``'s ``o_lat`` as [T, H*r].
- ``attn_mha`` (normal path, ``AttnForwardMethod.MHA``): the model has written the new
  latents to the pool and passes the decompressed q [T, H, nope+rope] (and k, v of the new
  tokens, which we do not need). We run ``mb.MLAAttention`` over the cached latents of prefix
  + new tokens: the core decompresses (chunked for a long prefix, merged by LSE) and, for a
  batch the policy splits, serves its short extends absorbed. Returns [T, H*v].

Once per forward, ``init_forward_metadata`` makes the core's batch and its plan
(``mb.plan``: the policy's decision per request, made once); the forward-method handler
(``handler.py``) answers ``MHA`` iff ``plan.uses_normal``, every layer reads the same plan.
The pool's buffer ``[num_slots, 1, r+rope]`` is viewed as the core's paged
cache ``[num_slots // page_size, page_size, r+rope]``; fp8 (e4m3) pools store unscaled values
(SGLang's MLA pool writes without a scale), so ``kv_scale`` is None.

``fp8_ds_mla`` rows (DeepSeek's tile-scaled layout, :class:`mla_backend.cache_layout.CacheLayout`):
served when the pool holds them, i.e. an ``MLATokenToKVPool`` in its DSA fp8 mode
(``use_dsa=True`` with ``override_kv_cache_dim`` = the row width: 656 B at r 512, rope 64,
bf16; ``dsa_kv_cache_store_fp8``), whose rows are the same bytes: e4m3 c_kv, one float32
scale per 128 values, bf16 k_pe. Its uint8 storage is viewed as the core's uint8
``[pages, page_size, width]`` cache. SGLang 0.5.23 builds that pool only for DSA (NSA) models,
and on CPU refuses any fp8 KV cache for MLA models before a backend is built
(``KVCacheConfigurator.configure``: "CPU FP8 KV cache is only supported for MHA."), so this is
reachable below the server only (tests/test_ds_mla.py).

Unsupported settings raise ``ValueError`` at start-up (backend construction) naming the value.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from mla_backend_integrations._common import engine_cache_view, pad_rows
from mla_backend_integrations.sglang import BACKEND_NAME, compat
from mla_backend_integrations.sglang.batch import build_mla_batch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

import mla_backend as mb
from mla_backend import sparse as mbs
from mla_backend.cache_layout import CacheLayout
from mla_backend.index_cache import IndexCacheLayout, IndexerDims
from mla_backend.selection import log_once

logger = logging.getLogger("mla_backend.sglang")

SUPPORTED_KV_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)
_MODEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_ALLOWED_KWARGS = {"q_rope", "k_rope", "topk_indices"}


@dataclass
class MLAAbsorbMetadata:
    """Per-forward metadata: the core's plan of the step (policy decision included)."""

    plan: mb.MLAPlan


def _fail(msg: str) -> None:
    raise ValueError(f"--attention-backend {BACKEND_NAME}: {msg}")


class MLAAbsorbBackend(AttentionBackend):
    """SGLang ``AttentionBackend`` for DeepSeek MLA models, backed by ``mla_backend``."""

    def __init__(self, model_runner: Any) -> None:
        super().__init__()
        if not getattr(model_runner, "use_mla_backend", False):
            _fail(
                "the model does not use MLA (model_runner.use_mla_backend is False); "
                "mla_absorb serves DeepSeek-style MLA models only"
            )
        mc = model_runner.model_config
        self.device = torch.device(model_runner.device)
        self.page_size = int(getattr(model_runner, "page_size", 1) or 1)
        heads = (
            mc.get_num_attention_heads(compat.attention_tp_size(model_runner))
            if hasattr(mc, "get_num_attention_heads")
            else mc.num_attention_heads
        )
        # SGLang's ModelConfig carries the MLA fields itself; all layers share the dims
        self.dims = mb.dims_from(mc, num_heads=int(heads))
        self.num_heads = self.dims.num_heads
        self.kv_lora_rank = self.dims.kv_lora_rank
        self.qk_rope_head_dim = self.dims.qk_rope_head_dim
        self.qk_nope_head_dim = self.dims.qk_nope_head_dim
        self.v_head_dim = self.dims.v_head_dim
        self.kv_cache_dtype = model_runner.kv_cache_dtype
        self.data_type = getattr(model_runner, "dtype", None)
        if self.kv_cache_dtype not in SUPPORTED_KV_DTYPES:
            _fail(
                f"KV cache dtype {self.kv_cache_dtype} (--kv-cache-dtype "
                f"{getattr(model_runner, 'kv_cache_dtype_str', '?')}) is not supported; "
                "supported: auto (bf16/fp16/fp32) and fp8_e4m3"
            )
        if getattr(mc, "is_hybrid_swa", False) or getattr(model_runner, "is_hybrid_swa", False):
            _fail("sliding-window (hybrid SWA) models are not supported")
        self._check_runtime_options(model_runner)

        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        pool_cls = type(self.token_to_kv_pool).__name__
        #: a DSA model's indexer dims (None for dense MLA): the plans then carry them
        self.indexer_dims = IndexerDims.from_config(getattr(mc, "hf_config", None))
        self.index_layout: IndexCacheLayout | None = None
        if compat.is_dsa_pool(self.token_to_kv_pool):
            if self.indexer_dims is None:
                _fail(f"KV pool {pool_cls} for a model without index_topk (not a DSA model)")
            pool = self.token_to_kv_pool
            self.index_layout = IndexCacheLayout.named(
                "fp8", int(pool.index_head_dim), int(pool.quant_block_size), scale_fmt="ue8m0"
            )
        elif pool_cls != "MLATokenToKVPool":
            _fail(
                f"KV pool {pool_cls} is not supported; mla_absorb reads SGLang's plain "
                "MLATokenToKVPool and, for DSA models, DSATokenToKVPool (no NSA, FP4 or "
                "unified hybrid pools)"
            )
        elif self.indexer_dims is not None:
            _fail(f"a DSA model (index_topk {self.indexer_dims.topk}) on KV pool {pool_cls}")
        #: the layers' cache layout, named once here from the pool (DeepSeek's tile-scaled
        #: fp8 rows when it stores them, else its dtype) and read by every call
        model_dtype = self.data_type if self.data_type in _MODEL_DTYPES else torch.bfloat16
        r, rope = self.kv_lora_rank, self.qk_rope_head_dim
        if getattr(self.token_to_kv_pool, "dsa_kv_cache_store_fp8", False):
            self.layout = CacheLayout.ds_mla(r, rope, model_dtype)
        else:
            self.layout = CacheLayout.for_dtype(self.kv_cache_dtype, r, rope, model_dtype)
        try:
            self.layout.check_query_dtype(model_dtype)
        except ValueError as e:
            _fail(
                f"--kv-cache-dtype {getattr(model_runner, 'kv_cache_dtype_str', '?')} with "
                f"--dtype {self.data_type}: {e}"
            )
        pool_dim = getattr(self.token_to_kv_pool, "kv_cache_dim", None)
        if pool_dim != self.layout.width:
            _fail(
                f"pool rows of {pool_dim}; the core's {self.layout.kind} layout needs "
                f"{self.layout.width} (kv_lora_rank {r}, qk_rope_head_dim {rope}, k_pe in "
                f"{self.layout.rope_dtype})"
            )
        translator = getattr(model_runner, "kv_index_translator", None)
        if translator is not None:
            if getattr(translator, "reads_are_translated", False):
                _fail("a translating (unified) KV pool is not supported")
            self.kv_index_translator = translator
        # what runs, logged once per process and device; every step plans with its policy
        self.policy = log_once(logger, self.device).plan_policy
        self.forward_metadata: MLAAbsorbMetadata | None = None
        # layer_id -> DeepseekV2AttentionMLA (weakly), bound by the forward-method handler.
        self._owners: dict[int, weakref.ReferenceType] = {}
        self._cores: dict[int, mb.MLAAttention] = {}
        self._seen_paths: set[tuple[str, str, bool]] = set()
        logger.info(
            "mla_absorb: H=%d r=%d rope=%d nope=%d v=%d page_size=%d kv dtype=%s policy=%s",
            self.num_heads,
            self.kv_lora_rank,
            self.qk_rope_head_dim,
            self.qk_nope_head_dim,
            self.v_head_dim,
            self.page_size,
            self.kv_cache_dtype,
            self.policy,
        )

    # ------------------------------------------------------------------ start-up checks
    @staticmethod
    def _check_runtime_options(model_runner: Any) -> None:
        sa = getattr(model_runner, "server_args", None)
        if sa is None:
            return
        topk = getattr(sa, "speculative_eagle_topk", None)
        if getattr(sa, "speculative_algorithm", None) and topk not in (None, 0, 1):
            _fail(
                f"--speculative-eagle-topk {topk} is not supported: tree verification needs "
                "a custom mask; use topk 1 (a linear draft chain, causal)"
            )
        for name in ("dcp_size", "attn_cp_size"):
            v = getattr(sa, name, None)
            if isinstance(v, int) and v > 1:
                _fail(f"--{name.replace('_', '-')} {v} (context parallelism) is not supported")

    # ------------------------------------------------------------------ CUDA graphs
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """CUDA graphs are not supported (the core builds per-batch host metadata)."""
        _fail("CUDA graphs are not supported; pass --disable-cuda-graph")

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    def get_cpu_graph_seq_len_fill_value(self) -> int:
        """The sequence length of the padding requests SGLang adds on CPU (DP attention pads
        every rank's batch to one size for the gathered MLP): 1, as on GPUs."""
        return 1

    # ------------------------------------------------------------------ metadata
    def init_forward_metadata(self, forward_batch: Any) -> None:
        """Translate the ForwardBatch and plan the step once per forward; every layer (and
        the forward-method handler) reads the plan."""
        batch = build_mla_batch(forward_batch, self.req_to_token, self.page_size)
        plan = mb.plan(batch, self.dims, self.policy, device=self.device,
                       indexer=self.indexer_dims)  # fmt: skip
        self.forward_metadata = MLAAbsorbMetadata(plan=plan)

    def init_forward_metadata_out_graph(self, forward_batch: Any, in_capture: bool = False):
        self.init_forward_metadata(forward_batch)

    def _plan(self, forward_batch: Any) -> mb.MLAPlan:
        if self.forward_metadata is None:
            self.init_forward_metadata(forward_batch)
        return self.forward_metadata.plan

    def index_cache(self, layer_id: int) -> torch.Tensor:
        """A DSA layer's index keys in SGLang's ``DSATokenToKVPool`` as the core's fp8 index
        cache uint8 [num_pages, page_size, Di + 4 Di / 128] (no copy)."""
        if self.index_layout is None:
            _fail("the model has no DSA index cache (not a DSA model)")
        return compat.index_cache_view(
            self.token_to_kv_pool, layer_id, self.page_size, self.index_layout.width
        )

    def uses_sparse(self, plan: mb.MLAPlan) -> bool:
        """Whether the step sends a request on a sparse route (a DSA step with a context
        above ``index_topk``): SGLang passes the indexer's selection to the absorbed path
        only, so such a step runs absorbed."""
        return plan.sparse is not None and plan.choice.sparse_mode != "dense"

    @property
    def ds_layout(self) -> CacheLayout | None:
        """The layout when the pool stores ``fp8_ds_mla`` rows, else None."""
        return self.layout if self.layout.tile_scaled else None

    def paged_cache(self, layer_id: int) -> torch.Tensor:
        """The pool's buffer of ``layer_id`` ([slots, 1, width]) as the core's
        [num_pages, page_size, width] in the layout's dtype."""
        buf = self.token_to_kv_pool.get_key_buffer(layer_id)
        return engine_cache_view(buf, self.layout, self.page_size, BACKEND_NAME)

    # ------------------------------------------------------------------ weights (normal path)
    def bind_layer(self, attn_module: Any) -> None:
        """Remember the DeepSeek attention module of a layer (its absorbed weights)."""
        lid = attn_module.attn_mha.layer_id
        ref = self._owners.get(lid)
        if ref is None or ref() is not attn_module:
            self._owners[lid] = weakref.ref(attn_module)
            self._cores.pop(lid, None)

    def _weights(self, layer: Any) -> mb.AbsorbWeights:
        """The layer's ``W_UK`` / ``W_UV`` in the model's dtype: the model's own ``w_kc`` /
        ``w_vc`` (shared, not copied, when already in that dtype), else ``kv_b_proj``."""
        dtype = self.data_type if self.data_type in _MODEL_DTYPES else None
        ref = self._owners.get(layer.layer_id)
        owner = ref() if ref is not None else None
        if owner is not None and getattr(owner, "w_kc", None) is not None:
            if getattr(owner, "use_deep_gemm_bmm", False):
                _fail("block-scaled DeepGEMM absorption weights are not supported")
            return mb.weights_from_w_kc_w_vc(
                owner.w_kc, owner.w_vc, self.dims, w_scale=getattr(owner, "w_scale", None),
                dtype=dtype,
            )
        proj = getattr(layer, "kv_b_proj", None)
        if proj is None:
            _fail(
                f"layer {layer.layer_id}: no kv_b_proj weights for the normal (MHA) path; the "
                "mla_absorb forward-method handler binds them (is the plugin loaded?)"
            )
        return mb.weights_from_kv_b_proj(proj, self.dims, dtype=dtype)

    def _core(self, layer: Any) -> mb.MLAAttention:
        core = self._cores.get(layer.layer_id)
        if core is None:
            core = mb.MLAAttention(self.dims, self._weights(layer), layer.scaling)
            self._cores[layer.layer_id] = core
        return core

    def _note_path(self, kind: str, plan: mb.MLAPlan) -> None:
        """Log (INFO) the first step of each (path, phase, has-prefix) combination."""
        step = plan.step
        key = (kind, plan.phase.value, any(step.prefix_lens))
        if key not in self._seen_paths:
            self._seen_paths.add(key)
            logger.info(
                "mla_absorb path=%s phase=%s has_prefix=%s prefix_lens=%s new_lens=%s",
                kind,
                plan.phase.value,
                key[2],
                list(step.prefix_lens[:8]),
                list(step.new_lens[:8]),
            )

    # ------------------------------------------------------------------ forward
    @staticmethod
    def _is_mha_call(layer: Any) -> bool:
        # DeepseekV2AttentionMLA sets attn_mha.kv_b_proj; attn_mqa has one KV head.
        if hasattr(layer, "kv_b_proj"):
            return True
        return getattr(layer, "tp_k_head_num", 1) != 1

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        """Decode: absorbed MLA (see module docstring for shapes)."""
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, kwargs)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        """Extend / verify / draft-extend: absorbed (MLA) or normal (MHA) per the handler."""
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, kwargs)

    def _forward(self, q, k, v, layer, forward_batch, save_kv_cache, kwargs) -> torch.Tensor:
        extra = set(kwargs) - _ALLOWED_KWARGS
        extra = {name for name in extra if kwargs[name] is not None}
        if extra:
            _fail(f"unsupported attention arguments {sorted(extra)} (sparse/sink attention)")
        plan = self._plan(forward_batch)
        if self._is_mha_call(layer):
            if self.uses_sparse(plan):
                _fail("a DSA step with a sparse request reached the MHA path (no selection)")
            return self._forward_normal(q, layer, forward_batch, plan)
        return self._forward_absorbed(q, k, layer, forward_batch, plan, save_kv_cache, kwargs)

    def _forward_absorbed(self, q, k, layer, forward_batch, plan, save_kv_cache, kwargs):
        r, rope, H = self.kv_lora_rank, self.qk_rope_head_dim, layer.tp_q_head_num
        q_rope, k_rope = kwargs.get("q_rope"), kwargs.get("k_rope")
        T = q.shape[0]
        if q_rope is not None:  # separate convention
            q_lat = q.reshape(T, H, r)
            q_pe = q_rope.reshape(T, H, rope)
        else:  # concatenated [q_lat ; q_pe]
            qv = q.reshape(T, H, r + rope)
            q_lat, q_pe = qv[..., :r], qv[..., r:]
        kv_cache = self.paged_cache(layer.layer_id)
        if save_kv_cache and k is not None:
            if k_rope is not None:
                c_kv, k_pe = k.reshape(-1, r), k_rope.reshape(-1, rope)
            else:
                kk = k.reshape(-1, r + rope)
                c_kv, k_pe = kk[:, :r], kk[:, r:]
            mb.write_latent(kv_cache, c_kv, k_pe, forward_batch.out_cache_loc[: c_kv.shape[0]])
        n = plan.num_tokens
        if n > T:
            _fail(f"{T} query rows for a step of {n} tokens")
        if self.uses_sparse(plan):
            idx = kwargs.get("topk_indices")
            if idx is None:
                _fail(f"layer {layer.layer_id}: a sparse DSA step without topk_indices")
            o_lat, _ = mbs.sparse_absorbed_attention(
                q_lat[:n], q_pe[:n], kv_cache, plan, idx[:n], layer.scaling
            )
            self._note_path("sparse_absorbed", plan)
        else:
            o_lat, _ = mb.absorbed_attention(q_lat[:n], q_pe[:n], kv_cache, plan, layer.scaling)
            self._note_path("absorbed", plan)
        return pad_rows(o_lat, T).reshape(T, H * r)

    def _forward_normal(self, q, layer, forward_batch, plan):
        if getattr(forward_batch, "mha_return_lse", False):
            _fail(
                "chunked-KV MHA calls (returning LSE) are not used by mla_absorb: the core "
                "chunks long prefixes itself"
            )
        H, nope, rope = layer.tp_q_head_num, self.qk_nope_head_dim, self.qk_rope_head_dim
        T = q.shape[0]
        qv = q.reshape(T, H, nope + rope)
        n = plan.num_tokens
        if n > T:
            _fail(f"{T} query rows for a step of {n} tokens")
        core = self._core(layer)
        o = core(qv[:n, :, :nope], qv[:n, :, nope:], self.paged_cache(layer.layer_id), plan)
        self._note_path(f"normal-call:{plan.mode}", plan)
        return pad_rows(o, T).reshape(T, H * self.v_head_dim)
