"""vLLM 0.32's DeepSeek-V4 CPU ops of attention, caches and compressors, computed by the core:
what ``vllm/models/deepseek_v4/cpu`` calls as ``torch.ops._C.*`` and only vLLM's AVX512-BF16
extension defines. On the CPUs whose vLLM build lacks them (AVX2, AVX-512 without BF16) the
adapter registers these under the same names and schemas
(:func:`mla_backend_integrations.vllm.compat.supply_v4_cpu_ops`), so vLLM's own V4 model code
runs with the core's kernels underneath::

    fused_qnorm_rope_kv_insert_cpu   q: per-head RMSNorm (no weight) + RoPE; kv row: RoPE, bf16,
                                     V4 fp8 page layout at its window slot (mla_backend.v4_cache)
    flash_mla_with_kvcache_cpu       one softmax over the window + compressed rows of each token
                                     and the sink (mla_backend.v4_layer.v4_attention_slots: the
                                     key-set primitive)
    inverse_gptj_rope_o_proj_cpu     the output's RoPE undone (mla_backend.rope)
    save_partial_states_cpu          compressor state rows (mla_backend.compressor.save_states)
    compress_norm_rope_store_cpu     entries pooled from their windows (compress_slots), into
                                     the compressed cache in the V4 fp8 layout
    compress_norm_rope_store_indexer_cpu   the same for the indexer's 128-wide keys (the core's
                                     fp8 index cache writer, power-of-two scales)

The indexer's long-context ops (``fp8_paged_mqa_logits_cpu``, ``topk_transform_512_cpu``,
``fused_indexer_q_rope_quant_cpu``: only reached when a request's compressed context exceeds
``index_topk``) are not served yet: they raise, and start-up refuses a ``max_model_len`` that
could reach them (:func:`mla_backend_integrations.vllm.plugin.validate_v4_config`). The
non-attention ops (mHC, routers, the grouped output GEMM) are :mod:`.v4_model_ops`.
"""

from __future__ import annotations

import torch

import mla_backend as mb
from mla_backend import compressor as cz
from mla_backend.index_cache import IndexCacheLayout
from mla_backend.rope import rope_interleaved
from mla_backend.v4_cache import V4_HEAD_DIM, write_v4_rows
from mla_backend.v4_layer import v4_attention_slots

#: op name -> schema (vLLM 0.32's AVX512-BF16 extension, verbatim)
SCHEMAS: dict[str, str] = {
    "fused_qnorm_rope_kv_insert_cpu": (
        "fused_qnorm_rope_kv_insert_cpu(Tensor q, Tensor kv, Tensor positions, "
        "Tensor(a!) swa_kv_cache_2d, Tensor slot_mapping, Tensor cos_sin_cache, "
        "int q_head_padded, float eps, int cache_block_size) -> Tensor"
    ),
    "flash_mla_with_kvcache_cpu": (
        "flash_mla_with_kvcache_cpu(Tensor(a!) out, Tensor q, Tensor window_cache_2d, "
        "Tensor window_slots, int window_block_size, Tensor compressed_cache_2d, "
        "Tensor compressed_slots, int compressed_block_size, Tensor attn_sink, "
        "float scale) -> ()"
    ),
    "inverse_gptj_rope_o_proj_cpu": (
        "inverse_gptj_rope_o_proj_cpu(Tensor o, Tensor positions, Tensor cos_sin_cache, "
        "int rope_dim) -> Tensor"
    ),
    "save_partial_states_cpu": (
        "save_partial_states_cpu(Tensor kv, Tensor score, Tensor ape, Tensor positions, "
        "Tensor(a!) state_cache, Tensor slot_mapping) -> ()"
    ),
    "compress_norm_rope_store_cpu": (
        "compress_norm_rope_store_cpu(Tensor state_cache, Tensor gather_slots, "
        "Tensor positions, Tensor kv_slot_mapping, Tensor rms_norm_weight, float rms_norm_eps, "
        "Tensor cos_sin_cache, Tensor(a!) kv_cache_2d, int kv_cache_block_size, "
        "int compress_ratio) -> ()"
    ),
    "compress_norm_rope_store_indexer_cpu": (
        "compress_norm_rope_store_indexer_cpu(Tensor state_cache, Tensor gather_slots, "
        "Tensor positions, Tensor kv_slot_mapping, Tensor rms_norm_weight, "
        "float rms_norm_eps, Tensor cos_sin_cache, Tensor(a!) kv_cache_2d, "
        "int kv_cache_block_size, int compress_ratio) -> ()"
    ),
    "fp8_paged_mqa_logits_cpu": (
        "fp8_paged_mqa_logits_cpu(Tensor q_fp8, Tensor kvcache_fp8, Tensor weight, "
        "Tensor seq_lens, Tensor page_table, int block_size, int max_seq_len) -> Tensor"
    ),
    "topk_transform_512_cpu": (
        "topk_transform_512_cpu(Tensor scores, Tensor seq_lens, Tensor page_tables, "
        "Tensor(a!) out_page_indices, int page_size, Tensor(b!)? out_raw_indices) -> ()"
    ),
    "fused_indexer_q_rope_quant_cpu": (
        "fused_indexer_q_rope_quant_cpu(Tensor positions, Tensor index_q, "
        "Tensor index_q_cos_sin_cache, Tensor(a!) index_q_fp8, Tensor index_weights, "
        "float index_weights_softmax_scale, float index_weights_head_scale, "
        "Tensor(b!) index_weights_out) -> ()"
    ),
}

#: the indexer key width of DeepSeek-V4 (its compressor's head_dim on the indexer path)
INDEX_HEAD_DIM = 128


def fused_qnorm_rope_kv_insert_cpu(
    q: torch.Tensor,
    kv: torch.Tensor,
    positions: torch.Tensor,
    swa_kv_cache_2d: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_head_padded: int,
    eps: float,
    cache_block_size: int,
) -> torch.Tensor:
    """q [T, H, 512]: per-head RMSNorm without weight, then interleaved RoPE of its last
    ``rope`` values (``cos_sin_cache`` [P, rope]) -> [T, q_head_padded, 512] of q's dtype (pad
    heads 0). kv [>= n, 512]: RoPE, then the first n = ``slot_mapping.shape[0]`` rows written at
    their window slots (-1 = skip) in V4's fp8 page layout (bf16-rounded first, as vLLM)."""
    T, H, D = q.shape
    qf = q.float()
    qf = qf * torch.rsqrt(qf.square().mean(-1, keepdim=True) + eps)
    out = q.new_zeros((T, q_head_padded, D))
    out[:, :H] = rope_interleaved(qf, cos_sin_cache, positions).to(q.dtype)
    n = slot_mapping.shape[0]
    rows = rope_interleaved(kv[:n].float(), cos_sin_cache, positions[:n])
    write_v4_rows(swa_kv_cache_2d, cache_block_size, slot_mapping, rows)
    return out


def flash_mla_with_kvcache_cpu(
    out: torch.Tensor,
    q: torch.Tensor,
    window_cache_2d: torch.Tensor,
    window_slots: torch.Tensor,
    window_block_size: int,
    compressed_cache_2d: torch.Tensor,
    compressed_slots: torch.Tensor,
    compressed_block_size: int,
    attn_sink: torch.Tensor,
    scale: float,
) -> None:
    """out [T, H, 512] = V4 attention of q [T, H, 512] over each token's window rows and
    compressed rows (flat slots [T, k], -1 = none; both caches in V4's fp8 page layout) and
    the per-head sink ``attn_sink`` [>= H]; the row is key and value."""
    H = q.shape[1]
    sets = [(window_cache_2d, window_slots, window_block_size)]
    if compressed_slots.shape[-1]:
        sets.append((compressed_cache_2d, compressed_slots, compressed_block_size))
    v4_attention_slots(q, sets, attn_sink[:H].float().contiguous(), scale, out=out)


def inverse_gptj_rope_o_proj_cpu(
    o: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, rope_dim: int
) -> torch.Tensor:
    """o [T, H, D] with its last ``rope_dim`` values rotated back by each token's position ->
    float32 [T, H, D]."""
    if rope_dim != cos_sin_cache.shape[1]:
        raise ValueError(
            f"rope_dim={rope_dim} does not match cos_sin_cache {tuple(cos_sin_cache.shape)}"
        )
    return rope_interleaved(o.float(), cos_sin_cache, positions, inverse=True)


def _spec(state_cache: torch.Tensor, head_dim: int, ratio: int, rope: int, eps: float):
    coff = state_cache.shape[-1] // (2 * head_dim)
    if coff not in (1, 2) or state_cache.shape[-1] != 2 * coff * head_dim:
        raise ValueError(
            f"compressor state width {state_cache.shape[-1]} is not 2 x coff x head_dim "
            f"({head_dim}, coff 1 or 2)"
        )
    return cz.CompressorSpec(ratio, head_dim, overlap=coff == 2, rope_dim=rope, eps=eps)


def save_partial_states_cpu(
    kv: torch.Tensor,
    score: torch.Tensor,
    ape: torch.Tensor,
    positions: torch.Tensor,
    state_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """State rows ``[C ; Z + B[p % m]]`` (float32) of the first ``slot_mapping.shape[0]``
    tokens at their slots (-1 = skip); kv / score [T, coff * d], ape [m, coff * d]."""
    n = slot_mapping.shape[0]
    width = kv.shape[1]  # coff * d: the state row is [C ; Z + B], one series per half
    spec = cz.CompressorSpec(ape.shape[0], width, overlap=False, rope_dim=0)
    cz.save_states(kv[:n], score[:n], ape, positions[:n], state_cache, slot_mapping, spec)


def _entries(
    state_cache: torch.Tensor,
    gather_slots: torch.Tensor,
    positions: torch.Tensor,
    kv_slot_mapping: torch.Tensor,
    rms_norm_weight: torch.Tensor,
    eps: float,
    cos_sin_cache: torch.Tensor,
    ratio: int,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat slots, [E, head_dim] float32 entries) of the tokens that complete an entry
    (position p with (p + 1) % ratio == 0 and a compressed slot)."""
    n = kv_slot_mapping.shape[0]
    pos = positions[:n].long()
    done = ((pos + 1) % ratio == 0) & (kv_slot_mapping >= 0)
    spec = _spec(state_cache, head_dim, ratio, cos_sin_cache.shape[1], eps)
    entry_pos = pos[done] + 1 - ratio
    entries = cz.compress_slots(state_cache, gather_slots[:n][done], entry_pos, spec,
                                rms_norm_weight, cos_sin_cache)  # fmt: skip
    return kv_slot_mapping[done], entries


def compress_norm_rope_store_cpu(
    state_cache: torch.Tensor,
    gather_slots: torch.Tensor,
    positions: torch.Tensor,
    kv_slot_mapping: torch.Tensor,
    rms_norm_weight: torch.Tensor,
    rms_norm_eps: float,
    cos_sin_cache: torch.Tensor,
    kv_cache_2d: torch.Tensor,
    kv_cache_block_size: int,
    compress_ratio: int,
) -> None:
    """The attention compressor's entries that this step's tokens complete, written at their
    compressed slots in V4's fp8 page layout (``gather_slots`` [T, coff * ratio]: each token's
    window of state slots, position order, -1 before the sequence)."""
    slots, entries = _entries(state_cache, gather_slots, positions, kv_slot_mapping,
                              rms_norm_weight, rms_norm_eps, cos_sin_cache, compress_ratio,
                              V4_HEAD_DIM)  # fmt: skip
    write_v4_rows(kv_cache_2d, kv_cache_block_size, slots, entries)


def compress_norm_rope_store_indexer_cpu(
    state_cache: torch.Tensor,
    gather_slots: torch.Tensor,
    positions: torch.Tensor,
    kv_slot_mapping: torch.Tensor,
    rms_norm_weight: torch.Tensor,
    rms_norm_eps: float,
    cos_sin_cache: torch.Tensor,
    kv_cache_2d: torch.Tensor,
    kv_cache_block_size: int,
    compress_ratio: int,
) -> None:
    """The same for the indexer's compressor: 128-wide keys into the fp8 index cache (e4m3
    keys then float32 power-of-two scales per page: the core's index-cache layout)."""
    slots, entries = _entries(state_cache, gather_slots, positions, kv_slot_mapping,
                              rms_norm_weight, rms_norm_eps, cos_sin_cache, compress_ratio,
                              INDEX_HEAD_DIM)  # fmt: skip
    layout = IndexCacheLayout.named("fp8", INDEX_HEAD_DIM, scale_fmt="ue8m0")
    nb, bs = kv_cache_2d.shape[0], kv_cache_block_size
    cache = kv_cache_2d[:, : bs * layout.width].view(nb, bs, layout.width)
    mb.write_index_keys(cache, entries.to(torch.bfloat16), slots, layout=layout)


def _long_context(name: str):
    def op(*args: object, **kwargs: object) -> None:
        raise NotImplementedError(
            f"mla_backend: vLLM's DeepSeek-V4 CPU op {name} (the indexer over a compressed "
            "context longer than index_topk) is not served on this CPU yet; keep "
            "max_model_len <= compress_ratio x index_topk"
        )

    op.__name__ = name
    return op


fp8_paged_mqa_logits_cpu = _long_context("fp8_paged_mqa_logits_cpu")
topk_transform_512_cpu = _long_context("topk_transform_512_cpu")
fused_indexer_q_rope_quant_cpu = _long_context("fused_indexer_q_rope_quant_cpu")
