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

The indexer's long-context ops (reached when a request's compressed context exceeds
``index_topk``) go through the core's indexer over rows (:mod:`mla_backend.indexer_rows`)::

    fused_indexer_q_rope_quant_cpu   the indexer query: RoPE (bf16-rounded), e4m3 per head with a
                                     power-of-two scale folded into the head weights
    fp8_paged_mqa_logits_cpu         each row's logits over its compressed keys in the fp8 index
                                     cache (the plan's indexer kernels: native at every level)
    topk_transform_512_cpu           each row's top-k (the core's rule), translated to cache slots

The non-attention ops (mHC, routers, the grouped output GEMM) are :mod:`.v4_model_ops`.
"""

from __future__ import annotations

import functools

import torch

import mla_backend as mb
from mla_backend import compressor as cz
from mla_backend.fp8 import quantize_fp8_groups
from mla_backend.index_cache import IndexCacheLayout
from mla_backend.indexer_rows import indexer_logits_rows, topk_rows
from mla_backend.ops import KernelImpl
from mla_backend.rope import rope_interleaved
from mla_backend.selection import get_impl
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
#: V4's fp8 index cache: per page the e4m3 keys, then one power-of-two float32 scale per key
INDEX_LAYOUT = IndexCacheLayout.named("fp8", INDEX_HEAD_DIM, scale_fmt="ue8m0")
#: the floor of the indexer query's amax before its scale (vLLM's fused_indexer_q_rope_quant)
INDEX_Q_AMAX_FLOOR = 1e-4


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


@functools.cache
def _cpu_kernels() -> KernelImpl:
    """The engine process's CPU kernels, resolved once: vLLM calls the attention op per layer
    with no per-step hook, and resolving reads the configuration's environment each time."""
    return get_impl(torch.device("cpu"))


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
    v4_attention_slots(q, sets, attn_sink[:H].float().contiguous(), scale, out=out,
                       impl=_cpu_kernels())  # fmt: skip


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
    cache = _index_pages(kv_cache_2d, kv_cache_block_size)
    mb.write_index_keys(cache, entries.to(torch.bfloat16), slots, layout=INDEX_LAYOUT)


def _index_pages(kv_cache_2d: torch.Tensor, block_size: int) -> torch.Tensor:
    """vLLM's 2-D index cache view (uint8 [pages, >= page bytes], any page stride) as the
    core's [pages, block_size, 132] (:data:`INDEX_LAYOUT`)."""
    width = INDEX_LAYOUT.width
    if kv_cache_2d.dim() != 2 or kv_cache_2d.shape[1] < block_size * width:
        raise ValueError(
            f"index cache {tuple(kv_cache_2d.shape)} does not hold pages of {block_size} keys "
            f"of {width} bytes"
        )
    return kv_cache_2d[:, : block_size * width].view(kv_cache_2d.shape[0], block_size, width)


def fused_indexer_q_rope_quant_cpu(
    positions: torch.Tensor,
    index_q: torch.Tensor,
    index_q_cos_sin_cache: torch.Tensor,
    index_q_fp8: torch.Tensor,
    index_weights: torch.Tensor,
    index_weights_softmax_scale: float,
    index_weights_head_scale: float,
    index_weights_out: torch.Tensor,
) -> None:
    """The indexer query of the long-context path: index_q [T, Hi, Di] float32 gets interleaved
    RoPE on its last ``rope`` values (``index_q_cos_sin_cache`` [P, rope]), those rounded to
    bf16, then each (token, head) row is stored in ``index_q_fp8`` [T, Hi, Di] e4m3 with the
    power-of-two scale ``2^ceil(log2(max(amax, 1e-4) / 448))``, which is folded into
    ``index_weights_out`` [T, Hi] float32 = index_weights x scale x softmax_scale x head_scale
    (vLLM's ``fused_indexer_q_rope_quant``, fp8 arm)."""
    rope = index_q_cos_sin_cache.shape[1]
    r = rope_interleaved(index_q.float(), index_q_cos_sin_cache, positions)
    r[..., -rope:] = r[..., -rope:].to(torch.bfloat16).float()
    q8, scale = quantize_fp8_groups(r, r.shape[-1], eps=INDEX_Q_AMAX_FLOOR, pow2_scale=True)
    index_q_fp8.copy_(q8)
    w = index_weights.float() * scale[..., 0]
    index_weights_out.copy_(w * index_weights_softmax_scale * index_weights_head_scale)


def fp8_paged_mqa_logits_cpu(
    q_fp8: torch.Tensor,
    kvcache_fp8: torch.Tensor,
    weight: torch.Tensor,
    seq_lens: torch.Tensor,
    page_table: torch.Tensor,
    block_size: int,
    max_seq_len: int,
) -> torch.Tensor:
    """Row b's indexer logits over its first ``seq_lens[b]`` compressed keys (through
    ``page_table[b]``, ``block_size`` keys a page of the fp8 index cache ``kvcache_fp8``):
    float32 [B, max_seq_len], ``sum_h weight[b, h] * relu(q_fp8[b, h] . k[t])``; -inf past a
    row's keys (vLLM leaves them unwritten; its top-k never reads them)."""
    cache = _index_pages(kvcache_fp8, block_size)
    return indexer_logits_rows(q_fp8, weight, cache, seq_lens, page_table, INDEX_LAYOUT,
                               max_seq_len)  # fmt: skip


def topk_transform_512_cpu(
    scores: torch.Tensor,
    seq_lens: torch.Tensor,
    page_tables: torch.Tensor,
    out_page_indices: torch.Tensor,
    page_size: int,
    out_raw_indices: torch.Tensor | None,
) -> None:
    """Row b's top-k keys (k = ``out_page_indices.shape[1]``, 512 in V4) of scores [B, S] over
    its first ``seq_lens[b]``: every key when they fit, else the k best by the core's rule (a
    tie to the lower key), a -inf or NaN score never picked (as vLLM's op); -1 padded.
    ``out_raw_indices`` [B, k] (optional) gets the keys, ``out_page_indices`` [B, k] their
    slots ``page_tables[b, key // page_size] * page_size + key % page_size``. The keys come in
    ascending order, vLLM's op orders them by score: its consumers read them as a set."""
    B, S = scores.shape
    K = out_page_indices.shape[1]
    raw = torch.full((B, K), -1, dtype=torch.int32, device=scores.device)
    if S:
        topk_rows(scores, seq_lens, K, out=raw)
        picked = scores.gather(1, raw.clamp(min=0).long())
        ranked = (seq_lens.long().clamp(max=S) > K)[:, None]  # rows whose keys do not all fit
        dropped = ranked & (torch.isnan(picked) | (picked == float("-inf")))
        raw = torch.where(dropped, -1, raw)
    key = raw.long().clamp(min=0)
    page = key // page_size
    inside = (raw >= 0) & (page < page_tables.shape[1])
    phys = page_tables.gather(1, page.clamp(max=page_tables.shape[1] - 1)).long()
    out_page_indices.copy_(torch.where(inside, phys * page_size + key % page_size, -1))
    if out_raw_indices is not None:
        out_raw_indices.copy_(raw)
