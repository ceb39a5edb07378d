"""vLLM v1 attention backend ``MLA_ABSORB``: vLLM's MLA layer on top of the ``mla_backend`` core.

vLLM's ``MLAAttention`` layer projects the query, writes the latent cache through
``impl.do_kv_cache_update`` and hands the attention to ``impl.forward_mha`` (tokens the
metadata calls prefill) or ``impl.forward_mqa`` (tokens it calls decode, already absorbed).
This backend's metadata marks every token as "prefill", so ``forward_mha`` receives the
whole batch with the full query ``[T, H, nope + rope]``, and the core's
:class:`mla_backend.MLAAttention` computes it, routed by the step's plan: the metadata builder
makes one :class:`mla_backend.MLAPlan` per step (``mb.plan``: the policy's decision per
request, the kernels' index tensors), every layer reads it. Decode and short extends run the
absorbed path, long prefills the normal path. No query-length threshold and no batch
reordering by vLLM is involved. Under decode context parallel the builder makes the step's
DCP parts instead of one plan and ``forward_mha`` runs them (the core's
:mod:`mla_backend.context_parallel`, wired by :mod:`.dcp`: queries over this rank's shard of the
cache merged across the group through the LSE, or latent rows gathered).

Own metadata class (vLLM's ``MLACommonMetadata`` only accepts latent widths 320/512/576):
any dims the core accepts work. Any block size, chunked prefill and prefix caching, fp8
latent cache (``--kv-cache-dtype fp8``: per-tensor ``k_scale``; ``--kv-cache-dtype fp8_ds_mla``:
DeepSeek's tile-scaled layout, see :class:`mla_backend.cache_layout.CacheLayout`), multi-token
queries and ragged mixed batches.

``fp8_ds_mla`` sizing: vLLM's ``MLAAttention.get_kv_cache_spec`` fixes the per-token content
at 656 bytes (DeepSeek dims, bf16 rope) whatever the dims; :meth:`MLAAbsorbBackend.customize_spec`
replaces it with the core layout's ``bytes_per_token`` for the model's r, rope and dtype (656
at r 512, rope 64, bf16), so vLLM allocates ``uint8 [blocks, 1, block_size, width]`` and the
impl views it as the core's ``[pages, page_size, width]`` ds cache (no scale: ``kv_scale=None``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from mla_backend_integrations._common import engine_cache_view, pad_rows
from mla_backend_integrations.vllm import BACKEND_NAME, dcp
from mla_backend_integrations.vllm.compat import check_vllm_version
from mla_backend_integrations.vllm.dcp import check_context_parallel
from vllm.model_executor.layers.attention.mla_attention import QueryLenSupport
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MLAAttentionImpl,
    MultipleOf,
)

import mla_backend as mb
from mla_backend.cache_layout import ENGINE_NAMES, CacheLayout
from mla_backend.context_parallel import DCPStep, dcp_attention
from mla_backend.index_cache import IndexerDims
from mla_backend.selection import log_once, resolve

logger = logging.getLogger("vllm.mla_absorb")

#: ``--kv-cache-dtype`` values this backend accepts ("auto" = the model dtype; each names a
#: core cache layout, :meth:`CacheLayout.named`)
SUPPORTED_KV_CACHE_DTYPES = tuple(ENGINE_NAMES)
#: fp8_ds_mla layouts of the MLA layers built in this process, by r + rope (vLLM's spec
#: ``head_size``): what :meth:`MLAAbsorbBackend.customize_spec` sizes the cache with
_DS_MLA_LAYOUTS: dict[int, CacheLayout] = {}


class MLAAbsorbBackend(AttentionBackend):
    """Backend descriptor: MLA, any latent width, any block size, bf16/fp16/fp32."""

    accept_output_buffer: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[Any]] = list(SUPPORTED_KV_CACHE_DTYPES)

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[MLAAbsorbImpl]:
        return MLAAbsorbImpl

    @staticmethod
    def get_builder_cls() -> type[MLAAbsorbMetadataBuilder]:
        return MLAAbsorbMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[int | MultipleOf]:
        return [MultipleOf(1)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any kv_lora_rank + qk_rope_head_dim: checked by mla_backend.MLADims

    @classmethod
    def is_mla(cls) -> bool:
        return True

    @classmethod
    def customize_spec(cls, spec: Any) -> Any:
        """``fp8_ds_mla``: the per-token bytes of the core's layout for this model's dims and
        dtype (vLLM's MLA layer hard-codes 656, right only at r 512 + rope 64 in bf16).

        vLLM calls this with the layer's spec only (``head_size`` = r + rope, dtype uint8)
        and, on the CPU worker, outside any current-config context. The layout comes from
        the impls built in this process (:data:`_DS_MLA_LAYOUTS`, registered by each
        ``MLAAbsorbImpl`` when its layer is built and again when its weights are loaded, both
        before vLLM asks for the KV cache specs), else from the current vLLM config; with
        neither the spec is left as vLLM made it and the impl's width check raises at the
        first cache access."""
        spec = super().customize_spec(spec)
        if not CacheLayout.name_is_tile_scaled(getattr(spec, "cache_dtype_str", None) or ""):
            return spec
        layout = _DS_MLA_LAYOUTS.get(int(spec.head_size))
        if layout is None:
            from vllm.config import get_current_vllm_config_or_none

            mc = getattr(get_current_vllm_config_or_none(), "model_config", None)
            if mc is None:
                return spec
            hf = mc.hf_text_config
            layout = CacheLayout.ds_mla(int(hf.kv_lora_rank), int(hf.qk_rope_head_dim), mc.dtype)
            if layout.kv_lora_rank + layout.rope != spec.head_size:
                return spec
        return replace(spec, state_content_bytes=layout.bytes_per_token)

    @classmethod
    def supports_compute_capability(cls, capability: Any) -> bool:
        return True


@dataclass
class MLAAbsorbMetadata(AttentionMetadata):
    """Per-step metadata: the core's :class:`mla_backend.MLAPlan` (made once per step, read by
    every layer) plus the counters vLLM's ``MLAAttention.forward_impl`` reads (it sees zero
    "decode" tokens, so all tokens go to ``forward_mha``)."""

    plan: mb.MLAPlan | None
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor
    slot_mapping: torch.Tensor
    num_decodes: int = 0
    num_decode_tokens: int = 0
    num_prefills: int = 0
    causal: bool = True
    prefill: Any = None
    decode: Any = None
    dcp_step: DCPStep | None = None  # decode context parallel: the step (plan is None)


def batch_phase(new_lens: list[int], num_spec_tokens: int) -> mb.Phase:
    """Phase of a vLLM step for the core's policy (vLLM mixes decodes and prefills)."""
    if not new_lens:
        return mb.Phase.IDLE
    if all(n == 1 for n in new_lens):
        return mb.Phase.DECODE
    if num_spec_tokens > 0 and max(new_lens) <= num_spec_tokens + 1:
        return mb.Phase.TARGET_VERIFY
    if all(n > 1 for n in new_lens):
        return mb.Phase.EXTEND
    return mb.Phase.MIXED


class MLAAbsorbMetadataBuilder(AttentionMetadataBuilder[MLAAbsorbMetadata]):
    """Builds :class:`MLAAbsorbMetadata` from vLLM's ``CommonAttentionMetadata``."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER
    reorder_batch_threshold: int | None = None  # no reordering: the policy routes requests
    # any query lengths, mixed in one batch (speculative verify rows included); read by
    # vLLM's MLA backend test grid to run its spec-decode rows
    query_len_support: ClassVar[QueryLenSupport] = QueryLenSupport.VARLEN

    def __init__(
        self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.page_size = int(kv_cache_spec.block_size)
        spec = vllm_config.speculative_config
        self.num_spec_tokens = int(getattr(spec, "num_speculative_tokens", 0) or 0) if spec else 0
        # every MLA layer of the model shares these dims (heads on this rank)
        mc = vllm_config.model_config
        self.dims = mb.dims_from(
            mc.hf_text_config, num_heads=mc.get_num_attention_heads(vllm_config.parallel_config)
        )
        #: a DSA model's indexer dims (the plan then carries the sparse step), else None
        self.indexer = IndexerDims.from_config(mc.hf_text_config)
        self.device = torch.device(device)
        # the device's selection, resolved once: every step plans with its kernels and policy
        selected = resolve(self.device)
        self.kernels, self.policy = selected.kernels, selected.plan_policy
        self._modes_seen: set[str] = set()
        self.dcp_planner = dcp.planner_for(
            vllm_config, self.page_size, self.dims, self.policy, self.device, self.num_spec_tokens
        )

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> MLAAbsorbMetadata:
        """Per-request ``prefix_lens = seq_lens - query_lens`` and ``new_lens = query_lens``
        (host ints), the block table ``[num_reqs, max_pages]`` as is, and the step's plan.

        Host data comes from the copies vLLM already has: ``query_start_loc_cpu``,
        ``seq_lens_cpu`` where this vLLM has it (0.32 does not; its ``seq_lens`` lives on the
        CPU on this platform, on a GPU reading it is the step's one device-to-host copy), and
        the block table, which is a CPU tensor on the CPU platform (on a GPU no host copy is
        at hand, so the plan skips the host page-id check)."""
        m = common_attn_metadata
        n = m.num_reqs
        qsl = m.query_start_loc_cpu[: n + 1].tolist()  # host ints, one conversion each
        new_lens = [b - a for a, b in zip(qsl[:-1], qsl[1:], strict=True)]
        seq_host = getattr(m, "seq_lens_cpu", None)
        if seq_host is None:
            seq_host = m.seq_lens
        seq_lens = seq_host[:n].tolist()
        prefix_lens = [s - q for s, q in zip(seq_lens, new_lens, strict=True)]
        if self.dcp_planner is not None:
            return self._build_dcp(m, prefix_lens, new_lens)
        batch = mb.MLABatch.build(
            prefix_lens,
            new_lens,
            m.block_table_tensor[:n],
            self.page_size,
            batch_phase(new_lens, self.num_spec_tokens),
        )
        plan = mb.plan(
            batch, self.dims, self.policy, self.device, self.kernels, indexer=self.indexer
        )
        if plan.mode not in self._modes_seen:  # each path mode once at INFO, then DEBUG
            self._modes_seen.add(plan.mode)
            logger.info(
                "%s: first %s step (phase=%s, new_lens=%s, prefix_lens=%s)",
                BACKEND_NAME, plan.mode, batch.phase.value, new_lens[:8], prefix_lens[:8],
            )
        else:
            logger.debug("%s: %s step, phase=%s", BACKEND_NAME, plan.mode, batch.phase.value)
        return self._metadata(m, plan)

    @staticmethod
    def _metadata(
        m: CommonAttentionMetadata, plan: mb.MLAPlan | None, dcp_step: DCPStep | None = None
    ) -> MLAAbsorbMetadata:
        """The step's metadata: its plan (or DCP parts) and vLLM's counters."""
        return MLAAbsorbMetadata(
            plan=plan,
            num_reqs=m.num_reqs,
            num_actual_tokens=m.num_actual_tokens,
            max_query_len=m.max_query_len,
            max_seq_len=m.max_seq_len,
            query_start_loc=m.query_start_loc,
            slot_mapping=m.slot_mapping,
            num_prefills=m.num_reqs,
            dcp_step=dcp_step,
        )

    def _build_dcp(
        self, m: CommonAttentionMetadata, prefix_lens: list[int], new_lens: list[int]
    ) -> MLAAbsorbMetadata:
        """Under decode context parallel: the step's sharded and gathered parts
        (:class:`mla_backend.context_parallel.DCPPlanner`) instead of one plan."""
        assert self.dcp_planner is not None
        step = self.dcp_planner.build(
            prefix_lens, new_lens, m.block_table_tensor[: m.num_reqs],
            lambda lens: batch_phase(lens, self.num_spec_tokens),
        )  # fmt: skip
        if step.modes not in self._modes_seen:
            self._modes_seen.add(step.modes)
            logger.info(
                "%s: first DCP %s step (rank %d/%d, new_lens=%s, prefix_lens=%s)",
                BACKEND_NAME, step.modes, step.layout.rank, step.layout.world_size,
                new_lens[:8], prefix_lens[:8],
            )  # fmt: skip
        return self._metadata(m, None, step)


class MLAAbsorbImpl(MLAAttentionImpl[MLAAbsorbMetadata]):
    """Per-layer implementation: cache writes and attention through ``mla_backend``."""

    # decode context parallel: this impl merges the shards' partial results through their LSE
    # itself, in forward_mha (dcp.py), which vLLM's DCP check asks of a backend in these terms
    can_return_lse_for_decode: bool = True
    supports_dcp: bool = True
    supports_mtp_with_cp_non_trivial_interleave_size: bool = True

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None,
        attn_type: str,
        kv_sharing_target_layer_name: str | None,
        q_lora_rank: int | None = None,
        kv_lora_rank: int = 0,
        qk_nope_head_dim: int = 0,
        qk_rope_head_dim: int = 0,
        qk_head_dim: int = 0,
        v_head_dim: int = 0,
        kv_b_proj: Any = None,
        indexer: object | None = None,
        q_pad_num_heads: int | None = None,
        **extra: Any,
    ) -> None:
        check_vllm_version()
        unsupported = {
            "alibi_slopes": alibi_slopes,
            "sliding_window": sliding_window,
            "logits_soft_cap": logits_soft_cap,
            "kv_sharing_target_layer_name": kv_sharing_target_layer_name,
            "indexer (sparse MLA)": indexer,
            "topk_indices_buffer (sparse MLA)": extra.get("topk_indices_buffer"),
        }
        for name, value in unsupported.items():
            if value is not None:
                raise ValueError(
                    f"attention backend {BACKEND_NAME} does not support {name}={value}"
                )
        if attn_type != AttentionType.DECODER:
            raise ValueError(
                f"attention backend {BACKEND_NAME} does not support attn_type={attn_type}"
            )
        if kv_cache_dtype not in SUPPORTED_KV_CACHE_DTYPES:
            raise ValueError(
                f"attention backend {BACKEND_NAME} does not support kv_cache_dtype="
                f"{kv_cache_dtype!r}; supported: {', '.join(SUPPORTED_KV_CACHE_DTYPES)}"
            )
        if self.dcp_world_size > 1 or self.pcp_world_size > 1:  # every platform, not only CPU
            from vllm.config import get_current_vllm_config_or_none

            config = get_current_vllm_config_or_none()
            if config is not None:
                check_context_parallel(config)
        self._dcp_group: Any = dcp.vllm_dcp_group() if self.dcp_world_size > 1 else None
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.dims = mb.dims_from(
            dict(
                num_heads=num_heads,
                kv_lora_rank=kv_lora_rank,
                qk_nope_head_dim=qk_nope_head_dim,
                qk_rope_head_dim=qk_rope_head_dim,
                v_head_dim=v_head_dim,
                q_lora_rank=q_lora_rank,
            )
        )
        if head_size != self.dims.latent_dim:
            raise ValueError(
                f"head_size={head_size} != kv_lora_rank + qk_rope_head_dim = {self.dims.latent_dim}"
            )
        self.kv_b_proj = kv_b_proj
        # the layer's cache layout, named once (fp8_ds_mla stores k_pe in the model dtype: set
        # again from act_dtype in process_weights_after_loading; vLLM builds layers under the
        # model's default dtype)
        self._name_layout(torch.get_default_dtype())
        self.q_pad_num_heads = None
        self.supports_quant_query_input = False
        self.attn: mb.MLAAttention | None = None
        #: the selection's kernels, resolved once at weight loading (the cache writes use them)
        self.kernels: Any = None

    # -- weights ------------------------------------------------------------------------
    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        """``W_UK`` [H, nope, r] and ``W_UV`` [H, r, v] from ``kv_b_proj`` in ``act_dtype``
        (an fp8 weight is dequantized with the scale it carries), see
        :func:`mla_backend.weights_from_kv_b_proj`."""
        weights = mb.weights_from_kv_b_proj(self.kv_b_proj, self.dims, dtype=act_dtype)
        self._name_layout(act_dtype)
        # what runs, logged once per process and device
        self.kernels = log_once(logger, weights.W_UK.device).kernels
        self.attn = mb.MLAAttention(self.dims, weights, self.scale)

    def _name_layout(self, model_dtype: torch.dtype) -> None:
        """The core layout ``--kv-cache-dtype`` names for these dims and model dtype; a
        tile-scaled one is registered for :meth:`MLAAbsorbBackend.customize_spec`."""
        d = self.dims
        self.layout = CacheLayout.named(
            self.kv_cache_dtype, d.kv_lora_rank, d.qk_rope_head_dim, model_dtype
        )
        if self.layout.tile_scaled:
            _DS_MLA_LAYOUTS[d.latent_dim] = self.layout

    @property
    def ds_layout(self) -> CacheLayout | None:
        """The layout when it is ``fp8_ds_mla``, else None."""
        return self.layout if self.layout.tile_scaled else None

    # -- cache --------------------------------------------------------------------------
    def _cache_view(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """vLLM's cache tensor [pages, 1, page_size, width] as the core's [num_pages,
        page_size, width] in the layout's dtype (a width vLLM sized otherwise than the core's
        layout raises: it was sized without :meth:`MLAAbsorbBackend.customize_spec`)."""
        page_size = kv_cache.shape[-2] if kv_cache.dim() >= 3 else 1
        return engine_cache_view(kv_cache, self.layout, page_size, BACKEND_NAME)

    def _kv_scale(self, k_scale: torch.Tensor | float | None) -> torch.Tensor | None:
        if not self.layout.per_tensor_scale:
            return None
        if k_scale is None:
            return torch.ones((), dtype=torch.float32)
        return torch.as_tensor(k_scale, dtype=torch.float32).reshape(())

    def do_kv_cache_update(
        self,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_cache_dtype: str,
        k_scale: torch.Tensor,
    ) -> None:
        """Write c_kv [T, r] and k_pe [T, rope] (or [T, 1, rope]) to their slots."""
        if kv_cache.numel() == 0:
            return
        rope = self.dims.qk_rope_head_dim
        mb.write_latent(
            self._cache_view(kv_cache),
            kv_c_normed,
            k_pe.reshape(k_pe.shape[0], rope),
            slot_mapping.flatten(),
            self._kv_scale(k_scale),
            impl=self.kernels,
        )

    # -- attention ----------------------------------------------------------------------
    def _check_ready(self, output_scale: torch.Tensor | None) -> None:
        """Refuse a fused output quantization and a layer whose weights were not prepared."""
        if output_scale is not None:
            raise ValueError(f"attention backend {BACKEND_NAME} does not fuse output quantization")
        if self.attn is None:
            raise RuntimeError(f"{BACKEND_NAME}: process_weights_after_loading was not called")

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
        """All tokens of the step: q [T, H, nope + rope] -> output [T, H * v] (in place)."""
        self._check_ready(output_scale)
        nope = self.dims.qk_nope_head_dim
        q = q.view(q.shape[0], self.num_heads, -1)
        rows = output.view(output.shape[0], -1)

        def into(T: int) -> torch.Tensor | None:
            """The step's rows of vLLM's output as [T, H, v], where the core can write them in
            place (same dtype and row width), else None."""
            if output.dtype != q.dtype or rows.shape[1] != self.num_heads * self.dims.v_head_dim:
                return None
            return rows[:T].view(T, self.num_heads, self.dims.v_head_dim)

        if attn_metadata.dcp_step is not None:
            T = attn_metadata.dcp_step.num_tokens
            o = into(T)
            if o is None:
                o = q.new_empty(T, self.num_heads, self.dims.v_head_dim)
            dcp_attention(
                self.attn, attn_metadata.dcp_step, q[:T, :, :nope], q[:T, :, nope:],
                self._cache_view(kv_c_and_k_pe_cache), self._kv_scale(k_scale),
                self._dcp_group, o,
            )  # fmt: skip
            pad_rows(o, output.shape[0], out=output)  # zeroes the padding rows only
            return
        plan = attn_metadata.plan
        assert plan is not None
        T = plan.num_tokens
        o = self.attn(
            q[:T, :, :nope],
            q[:T, :, nope:],
            self._cache_view(kv_c_and_k_pe_cache),
            plan,
            self._kv_scale(k_scale),
            out=into(T),
        )
        pad_rows(o, output.shape[0], out=output)  # zeroes the padding rows only

    def forward_mqa(
        self,
        q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: MLAAbsorbMetadata,
        layer: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Never called: the metadata reports zero decode tokens (see module docstring)."""
        raise RuntimeError(
            f"{BACKEND_NAME}: forward_mqa is not used (all tokens go to forward_mha)"
        )
