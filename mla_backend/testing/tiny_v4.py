"""Generator of tiny DeepSeek-V4 checkpoints for tests: ``make_tiny_v4(path, ...)`` writes a model
folder with V4's attention dims (head_dim 512 with 64 RoPE'd values, index heads of 128, CSA ratio
4, HCA ratio 128, window 128) at a few heads and layers, a schedule of layer kinds (sliding /
CSA / HCA), small MoE layers (hash-routed first, then top-k) and hyper-connections.

The weights are drawn for transformers' ``DeepseekV4ForCausalLM`` (its module shapes; seeded,
then randomized so sinks, position biases and hash tables are not the library's zeros) and
written under DeepSeek's original names (``layers.{i}.attn.wq_a.weight``, ``embed.weight``,
``head.weight``, ``hc_head_fn``, ...), the names the released checkpoints use and both
transformers (through its conversion mapping) and vLLM's V4 loader read. ``config.json`` holds
transformers' fields and the legacy ones vLLM reads (``compress_ratios``, ``num_hash_layers``,
``qk_rope_head_dim``, ``topk_method``), without transformers' ``mlp_layer_types`` (vLLM 0.32's
config class rejects it; transformers rebuilds it from ``num_hash_layers``). The tokenizer and
generation config are :mod:`.tiny_model`'s. Imports transformers (the generator needs its module
shapes); no engine.
"""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .tiny_model import _write_model

__all__ = ["V4_KINDS", "make_tiny_v4"]

#: layer kind -> (transformers' layer type, compress ratio in vLLM's ``compress_ratios``)
V4_KINDS: dict[str, tuple[str, int]] = {
    "sliding": ("sliding_attention", 0),
    "csa": ("compressed_sparse_attention", 4),
    "hca": ("heavily_compressed_attention", 128),
}

# transformers' save names that differ from DeepSeek's original ones (its reverse conversion
# turns ``self_attn.kv_norm`` into ``attn.norm``; the released name, the one vLLM loads, is
# ``attn.kv_norm``, which transformers reads as well)
_ORIGINAL = (
    (re.compile(r"^model\.layers\.(\d+)\.attn\.norm\.weight$"), r"layers.\1.attn.kv_norm.weight"),
    (re.compile(r"^model\.embed_tokens\.weight$"), "embed.weight"),
    (re.compile(r"^model\.hc_head\.hc_(fn|base|scale)$"), r"hc_head_\1"),
    (re.compile(r"^model\."), ""),
)


def _original_name(name: str) -> str:
    for pattern, repl in _ORIGINAL:
        if pattern.search(name):
            return pattern.sub(repl, name)
    return name


def make_tiny_v4(
    path: str | Path,
    *,
    kinds: Sequence[str] = ("hca", "csa", "sliding", "csa"),
    num_heads: int = 4,
    hidden_size: int = 128,
    head_dim: int = 512,
    rope_dim: int = 64,
    q_lora_rank: int = 64,
    index_n_heads: int = 4,
    index_head_dim: int = 128,
    index_topk: int = 512,
    sliding_window: int = 128,
    o_groups: int = 2,
    o_lora_rank: int = 32,
    n_routed_experts: int = 4,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int = 64,
    num_hash_layers: int = 1,
    hc_mult: int = 2,
    vocab_size: int = 1024,
    max_position_embeddings: int = 8192,
    seed: int = 0,
    dtype: str = "bfloat16",
) -> Path:
    """Write a tiny random DeepSeek-V4 model folder at ``path`` (one layer per entry of
    ``kinds``: ``sliding`` / ``csa`` / ``hca``) and return it."""
    import torch
    import transformers
    from safetensors.torch import load_file

    bad = [k for k in kinds if k not in V4_KINDS]
    if bad or not kinds:
        raise ValueError(f"kinds={list(kinds)!r}: each one of {sorted(V4_KINDS)}, at least one")
    if num_hash_layers > len(kinds):
        raise ValueError(f"num_hash_layers={num_hash_layers} > {len(kinds)} layers")
    layer_types = [V4_KINDS[k][0] for k in kinds]
    ratios = [V4_KINDS[k][1] for k in kinds]
    cfg = transformers.DeepseekV4Config(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=len(kinds),
        num_attention_heads=num_heads, head_dim=head_dim, partial_rotary_factor=rope_dim / head_dim,
        q_lora_rank=q_lora_rank, index_n_heads=index_n_heads, index_head_dim=index_head_dim,
        index_topk=index_topk, layer_types=layer_types,
        mlp_layer_types=["hash_moe"] * num_hash_layers + ["moe"] * (len(kinds) - num_hash_layers),
        n_routed_experts=n_routed_experts, num_experts_per_tok=num_experts_per_tok,
        moe_intermediate_size=moe_intermediate_size, o_groups=o_groups, o_lora_rank=o_lora_rank,
        sliding_window=sliding_window, max_position_embeddings=max_position_embeddings,
        hc_mult=hc_mult, num_nextn_predict_layers=0, bos_token_id=1, eos_token_id=2,
        pad_token_id=3,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.DeepseekV4ForCausalLM(cfg).float().eval()
    gen = torch.Generator().manual_seed(seed + 7919)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("hc_scale") or name.endswith(".scale"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
            else:  # sinks, position biases, hc bases, router biases
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.randint(0, n_routed_experts, b.shape, generator=gen))
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)  # transformers' reverse conversion to DeepSeek's layout
        saved = load_file(str(Path(tmp) / "model.safetensors"))
        config = json.loads((Path(tmp) / "config.json").read_text())
    raw = {_original_name(k): t for k, t in saved.items()}
    config.update(
        compress_ratios=ratios, num_hash_layers=num_hash_layers, qk_rope_head_dim=rope_dim,
        max_position_embeddings=max_position_embeddings,
        # the released configs' router field: vLLM creates the routed layers' score-correction
        # bias (``ffn.gate.bias``) only under it; transformers always has the bias
        topk_method="noaux_tc",
    )  # fmt: skip
    # released configs carry num_hash_layers, not transformers' mlp_layer_types (rebuilt from
    # it), whose "hash_moe" / "moe" vLLM 0.32's own config class rejects
    config.pop("mlp_layer_types", None)
    config.pop("dtype", None)
    config["torch_dtype"] = dtype
    out = Path(path)
    return _write_model(out, _with_tokens(config), raw, getattr(torch, dtype))


def _with_tokens(config: dict[str, Any]) -> dict[str, Any]:
    """The config with the special-token ids :mod:`.tiny_model`'s tokenizer uses."""
    from .tiny_model import _BOS_ID, _EOS_ID, _PAD_ID

    return {**config, "bos_token_id": _BOS_ID, "eos_token_id": _EOS_ID, "pad_token_id": _PAD_ID}
