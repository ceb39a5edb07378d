"""mla-backend: DeepSeek multi-head latent attention (MLA) as the DeepSeek-V2 paper intends.

Cache only the latent ``[c_kv ; k_pe]``; absorb ``W_UK`` into the query and apply ``W_UV`` after
attention for decode and short extends; decompress to plain MHA for long fresh prefills; choose
per request with a cost-model policy; DeepSeek Sparse Attention (the lightning indexer's top-k
and the sparse absorbed attention, :mod:`mla_backend.sparse`; the sparse MHA,
:mod:`mla_backend.sparse_normal`; a DSA layer's routed call, :mod:`mla_backend.sparse_layer`);
the attention over key sets they and DeepSeek-V4 are cases of (:mod:`mla_backend.keyset`).
Engine-agnostic: imports torch (and triton where installed), never vLLM or SGLang.
"""

from .attention import MLAAttention, absorbed_attention, normal_attention, write_latent
from .batch import MLABatch, Phase
from .dims import MLADims, dims_from, yarn_mscale, yarn_softmax_scale
from .fp8 import FP8_DTYPE, dequantize_fp8, fp8_bmm, quantize_fp8
from .index_cache import IndexCacheLayout, IndexerDims
from .keyset import KeyCache, keyset_attention
from .merge import merge_attention_shards, merge_attention_states
from .parts import PlanPart, WorkPartition
from .plan import MLAPlan, plan
from .policy import PathChoice, Policy
from .selection import Selection, resolve
from .sparse import indexer_logits, indexer_topk, sparse_absorbed_attention, write_index_keys
from .sparse_layer import sparse_mla_attention
from .sparse_normal import sparse_normal_attention
from .v4_layer import v4_attention, v4_dims
from .weights import (
    AbsorbWeights,
    absorb_q,
    apply_W_UV,
    split_kv_b_proj,
    weights_from_kv_b_proj,
    weights_from_w_kc_w_vc,
)

__version__ = "0.1.0"

__all__ = [
    "FP8_DTYPE",
    "AbsorbWeights",
    "IndexCacheLayout",
    "IndexerDims",
    "KeyCache",
    "MLAAttention",
    "MLABatch",
    "MLADims",
    "MLAPlan",
    "PathChoice",
    "Phase",
    "PlanPart",
    "Policy",
    "Selection",
    "absorb_q",
    "absorbed_attention",
    "apply_W_UV",
    "dequantize_fp8",
    "dims_from",
    "fp8_bmm",
    "indexer_logits",
    "indexer_topk",
    "keyset_attention",
    "merge_attention_shards",
    "merge_attention_states",
    "normal_attention",
    "plan",
    "quantize_fp8",
    "sparse_absorbed_attention",
    "sparse_mla_attention",
    "sparse_normal_attention",
    "resolve",
    "split_kv_b_proj",
    "v4_attention",
    "v4_dims",
    "WorkPartition",
    "weights_from_kv_b_proj",
    "weights_from_w_kc_w_vc",
    "write_index_keys",
    "write_latent",
    "yarn_mscale",
    "yarn_softmax_scale",
]
