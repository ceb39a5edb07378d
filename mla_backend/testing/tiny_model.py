"""Generator of tiny DeepSeek-V2-architecture checkpoints for tests, demos and benchmarks.

``make_tiny_deepseek_v2(path, ...)`` writes a Hugging Face style model folder:

* ``config.json``: a ``DeepseekV2Config`` (``model_type: deepseek_v2``,
  ``architectures: ["DeepseekV2ForCausalLM"]``) that vLLM, SGLang and transformers load;
* ``model.safetensors``: random weights under the original DeepSeek parameter names
  (``model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight``, experts unfused, ...), drawn
  with a fixed seed and scaled (``init_std``) so greedy generations are varied, not degenerate;
* ``tokenizer.json`` / ``tokenizer_config.json``: a WordLevel tokenizer (whitespace
  pre-tokenizer, one synthetic word per id, ``vocab_size`` entries) in the ``tokenizers``
  library's JSON format, so engine benchmarks that need a tokenizer work;
* ``generation_config.json``.

Only ``torch``, ``safetensors`` and ``json`` are used (imported lazily); no engine, no
transformers. CLI: ``python -m mla_backend.testing.tiny_model OUT_DIR [--preset default|odd|moe]``.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "DSA_ARCHS",
    "DSA_PRESETS",
    "PRESETS",
    "YARN_ROPE_SCALING",
    "main",
    "make_tiny_deepseek_v2",
    "make_tiny_dsa",
    "synthetic_words",
]

#: Named argument sets for :func:`make_tiny_deepseek_v2`.
PRESETS: dict[str, dict[str, Any]] = {
    # DeepSeek-V2-Lite attention dims: 16 heads, latent 512 + rope 64, nope 128, v 128.
    "default": dict(
        num_heads=16,
        hidden_size=256,
        num_layers=2,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        q_lora_rank=None,
        moe=False,
    ),
    # Non-DeepSeek dims: latent 96 + rope 32 (128 total, outside vLLM's 320/512/576),
    # v_head_dim != nope, q_lora on.
    "odd": dict(
        num_heads=4,
        hidden_size=128,
        num_layers=2,
        kv_lora_rank=96,
        qk_rope_head_dim=32,
        qk_nope_head_dim=48,
        v_head_dim=40,
        q_lora_rank=64,
        moe=False,
    ),
    # MoE layers (first layer dense, the others routed + shared experts), q_lora on.
    "moe": dict(
        num_heads=8,
        hidden_size=192,
        num_layers=3,
        kv_lora_rank=256,
        qk_rope_head_dim=64,
        qk_nope_head_dim=64,
        v_head_dim=64,
        q_lora_rank=96,
        moe=True,
    ),
}

#: DeepSeek's yarn ``rope_scaling`` for the tiny model (SGLang's CPU rope path asserts one).
YARN_ROPE_SCALING: dict[str, Any] = {
    "type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}

_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")
_UNK_ID, _BOS_ID, _EOS_ID, _PAD_ID = 0, 1, 2, 3
_ONSETS = (
    "b",
    "c",
    "d",
    "f",
    "g",
    "h",
    "j",
    "k",
    "l",
    "m",
    "n",
    "p",
    "r",
    "s",
    "t",
    "v",
    "w",
    "z",
    "br",
    "ch",
    "dr",
    "fl",
    "gr",
    "kl",
    "pr",
    "sh",
    "st",
    "th",
    "tr",
)
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "ou")


def synthetic_words(n: int) -> list[str]:
    """``n`` distinct lower-case pseudo-words (deterministic; special tokens excluded)."""
    syllables = [o + v for o in _ONSETS for v in _VOWELS]  # 232 syllables
    words: list[str] = []
    length = 1
    while len(words) < n:
        # all words of `length` syllables, in a fixed order
        idx = [0] * length
        while len(words) < n:
            words.append("".join(syllables[i] for i in idx))
            k = length - 1
            while k >= 0:
                idx[k] += 1
                if idx[k] < len(syllables):
                    break
                idx[k] = 0
                k -= 1
            if k < 0:
                break
        length += 1
    return words


def _tokenizer_json(vocab_size: int) -> dict[str, Any]:
    """A ``tokenizers`` WordLevel tokenizer description with exactly ``vocab_size`` ids."""
    words = list(_SPECIAL_TOKENS) + synthetic_words(vocab_size - len(_SPECIAL_TOKENS))
    vocab = {w: i for i, w in enumerate(words)}
    added = [
        {
            "id": i,
            "content": t,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, t in enumerate(_SPECIAL_TOKENS)
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    }


def _config(
    *,
    num_heads: int,
    hidden_size: int,
    num_layers: int,
    kv_lora_rank: int,
    qk_rope_head_dim: int,
    qk_nope_head_dim: int,
    v_head_dim: int,
    q_lora_rank: int | None,
    moe: bool,
    vocab_size: int,
    intermediate_size: int,
    moe_intermediate_size: int,
    n_routed_experts: int,
    num_experts_per_tok: int,
    n_shared_experts: int,
    max_position_embeddings: int,
    rope_theta: float,
    rope_scaling: dict[str, Any] | None,
    init_std: float,
    dtype: str,
) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_heads,
        "kv_lora_rank": kv_lora_rank,
        "q_lora_rank": q_lora_rank,
        "qk_rope_head_dim": qk_rope_head_dim,
        "qk_nope_head_dim": qk_nope_head_dim,
        "v_head_dim": v_head_dim,
        "head_dim": qk_rope_head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "initializer_range": init_std,
        "rms_norm_eps": 1e-6,
        "use_cache": True,
        "pad_token_id": _PAD_ID,
        "bos_token_id": _BOS_ID,
        "eos_token_id": _EOS_ID,
        "tie_word_embeddings": False,
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "torch_dtype": dtype,
        # MoE fields are always present (DeepSeek configs carry them, transformers requires
        # ints); layers >= first_k_dense_replace are MoE, so a dense model sets it to
        # num_layers.
        "moe_intermediate_size": moe_intermediate_size,
        "n_routed_experts": n_routed_experts,
        "n_shared_experts": n_shared_experts,
        "num_experts_per_tok": num_experts_per_tok,
        "first_k_dense_replace": 1 if moe else num_layers,
        "moe_layer_freq": 1,
        "routed_scaling_factor": 1.0,
        "topk_method": "greedy",
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": False,
        "scoring_func": "softmax",
        "aux_loss_alpha": 0.0,
        "seq_aux": False,
    }
    return cfg


def _weights(cfg: dict[str, Any], seed: int, init_std: float) -> dict[str, Any]:
    """Random weights (fp32) under DeepSeek's original parameter names."""
    import torch

    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float = init_std) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * std

    def norm_weight(n: int) -> torch.Tensor:
        # RMSNorm gains near 1 (not exactly 1 so a missing norm would be noticed)
        return 1.0 + normal(n, std=0.1)

    hid, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    r, rope = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    nope, v = cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    qk = nope + rope
    inter, moe_inter = cfg["intermediate_size"], cfg["moe_intermediate_size"]
    w: dict[str, torch.Tensor] = {}
    w["model.embed_tokens.weight"] = normal(cfg["vocab_size"], hid, std=1.0)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm_weight(hid)
        w[p + "post_attention_layernorm.weight"] = norm_weight(hid)
        a = p + "self_attn."
        if cfg["q_lora_rank"] is None:
            w[a + "q_proj.weight"] = normal(heads * qk, hid)
        else:
            ql = cfg["q_lora_rank"]
            w[a + "q_a_proj.weight"] = normal(ql, hid)
            w[a + "q_a_layernorm.weight"] = norm_weight(ql)
            w[a + "q_b_proj.weight"] = normal(heads * qk, ql)
        w[a + "kv_a_proj_with_mqa.weight"] = normal(r + rope, hid)
        w[a + "kv_a_layernorm.weight"] = norm_weight(r)
        w[a + "kv_b_proj.weight"] = normal(heads * (nope + v), r)
        w[a + "o_proj.weight"] = normal(hid, heads * v)
        m = p + "mlp."
        is_moe = i >= cfg["first_k_dense_replace"]
        if not is_moe:
            w[m + "gate_proj.weight"] = normal(inter, hid)
            w[m + "up_proj.weight"] = normal(inter, hid)
            w[m + "down_proj.weight"] = normal(hid, inter)
        else:
            w[m + "gate.weight"] = normal(cfg["n_routed_experts"], hid)
            for e in range(cfg["n_routed_experts"]):
                x = f"{m}experts.{e}."
                w[x + "gate_proj.weight"] = normal(moe_inter, hid)
                w[x + "up_proj.weight"] = normal(moe_inter, hid)
                w[x + "down_proj.weight"] = normal(hid, moe_inter)
            sh = moe_inter * cfg["n_shared_experts"]
            w[m + "shared_experts.gate_proj.weight"] = normal(sh, hid)
            w[m + "shared_experts.up_proj.weight"] = normal(sh, hid)
            w[m + "shared_experts.down_proj.weight"] = normal(hid, sh)
    w["model.norm.weight"] = norm_weight(hid)
    # lm_head scaled by 1/sqrt(hidden) so logits stay O(1-5): varied, non-degenerate argmax
    w["lm_head.weight"] = normal(cfg["vocab_size"], hid, std=4.0 / math.sqrt(hid))
    return w


def make_tiny_deepseek_v2(
    path: str | Path,
    *,
    num_heads: int = 16,
    hidden_size: int = 256,
    num_layers: int = 2,
    kv_lora_rank: int = 512,
    qk_rope_head_dim: int = 64,
    qk_nope_head_dim: int = 128,
    v_head_dim: int = 128,
    q_lora_rank: int | None = None,
    moe: bool = False,
    vocab_size: int = 10240,
    intermediate_size: int | None = None,
    moe_intermediate_size: int | None = None,
    n_routed_experts: int = 8,
    num_experts_per_tok: int = 2,
    n_shared_experts: int = 1,
    max_position_embeddings: int = 16384,
    rope_theta: float = 10000.0,
    rope_scaling: dict[str, Any] | None = None,
    seed: int = 0,
    init_std: float = 0.08,
    dtype: str = "bfloat16",
    kv_a_norm_span: tuple[float, float] | None = None,
    kv_a_norm_order: str = "random",
    kv_a_norm_compensate: bool = False,
) -> Path:
    """Write a tiny random DeepSeek-V2 model folder at ``path`` and return it.

    The weights are drawn in fp32 from N(0, init_std^2) (embeddings N(0, 1), lm_head
    N(0, 16/hidden), RMSNorm gains 1 + N(0, 0.01)) with ``torch.Generator`` seeded by
    ``seed``, then stored as ``dtype`` ("bfloat16", "float16" or "float32"), so the same
    arguments always give byte-identical files. ``vocab_size`` must be >= 10000 so
    ``vllm bench latency`` (prompt ids < 10000) fits. ``rope_scaling`` is copied into the
    config as is (e.g. a yarn dict). ``moe=True`` makes layer 0 dense and every later layer
    a routed-MoE layer with ``n_routed_experts`` experts (top ``num_experts_per_tok``,
    softmax gating) plus ``n_shared_experts`` shared experts.

    ``kv_a_norm_span=(lo, hi)``: every layer's ``kv_a_layernorm`` gain is ``r`` values
    log-spaced from ``lo`` to ``hi``, in a random channel order (seeded), instead of ~1:
    cached latents whose magnitudes vary by ``hi / lo`` across channels (stresses a
    per-tensor fp8 cache). Weights other than those gains are unchanged.

    ``kv_a_norm_order`` (with ``kv_a_norm_span``): ``"random"`` (the default, above) or
    ``"sorted"``: the gains ascend with the channel index, so the latent's consecutive
    channels (``fp8_ds_mla``'s tiles of 128) each hold one slice of the range, as when a
    checkpoint's gains are grouped by magnitude rather than spread uniformly.
    ``kv_a_norm_compensate=True`` (with ``kv_a_norm_span``) also divides column ``i`` of every
    ``kv_b_proj`` by gain ``i``: the model computes exactly what it computes with all those
    gains 1 (up to rounding), but the cached latent channels span ``hi / lo`` in magnitude
    and every channel matters to attention as much as any other (without compensation the
    small channels barely contribute, so losing them costs little). The defaults leave the
    files byte-identical to those written before these options existed.
    """
    import torch

    if vocab_size < 10000:
        raise ValueError(f"vocab_size={vocab_size} must be >= 10000 (vllm bench latency ids)")
    for name, val in (
        ("num_heads", num_heads),
        ("hidden_size", hidden_size),
        ("num_layers", num_layers),
        ("kv_lora_rank", kv_lora_rank),
        ("qk_nope_head_dim", qk_nope_head_dim),
        ("v_head_dim", v_head_dim),
    ):
        if val <= 0:
            raise ValueError(f"{name}={val} must be positive")
    if qk_rope_head_dim <= 0 or qk_rope_head_dim % 2:
        raise ValueError(f"qk_rope_head_dim={qk_rope_head_dim} must be positive and even")
    if q_lora_rank is not None and q_lora_rank <= 0:
        raise ValueError(f"q_lora_rank={q_lora_rank} must be positive or None")
    torch_dtype = {
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
        "float32": torch.float32,
    }.get(dtype)
    if torch_dtype is None:
        raise ValueError(f"dtype={dtype!r} must be bfloat16, float16 or float32")

    cfg = _config(
        num_heads=num_heads,
        hidden_size=hidden_size,
        num_layers=num_layers,
        kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=qk_rope_head_dim,
        qk_nope_head_dim=qk_nope_head_dim,
        v_head_dim=v_head_dim,
        q_lora_rank=q_lora_rank,
        moe=moe,
        vocab_size=vocab_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        moe_intermediate_size=moe_intermediate_size or max(hidden_size // 2, 16),
        n_routed_experts=n_routed_experts,
        num_experts_per_tok=num_experts_per_tok,
        n_shared_experts=n_shared_experts,
        max_position_embeddings=max_position_embeddings,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        init_std=init_std,
        dtype=dtype,
    )
    raw = _weights(cfg, seed, init_std)
    if kv_a_norm_span is not None:
        lo, hi = (float(x) for x in kv_a_norm_span)
        if not 0 < lo <= hi:
            raise ValueError(f"kv_a_norm_span={kv_a_norm_span} must satisfy 0 < lo <= hi")
        if kv_a_norm_order not in ("random", "sorted"):
            raise ValueError(f"kv_a_norm_order={kv_a_norm_order!r} must be random or sorted")
        gen = torch.Generator().manual_seed(seed + 7919)
        for i in range(num_layers):
            gains = torch.logspace(math.log10(lo), math.log10(hi), kv_lora_rank)
            if kv_a_norm_order == "random":
                gains = gains[torch.randperm(kv_lora_rank, generator=gen)]
            a = f"model.layers.{i}.self_attn."
            raw[a + "kv_a_layernorm.weight"] = gains
            if kv_a_norm_compensate:
                raw[a + "kv_b_proj.weight"] = raw[a + "kv_b_proj.weight"] / gains
    elif kv_a_norm_order != "random" or kv_a_norm_compensate:
        raise ValueError("kv_a_norm_order / kv_a_norm_compensate need kv_a_norm_span")
    return _write_model(Path(path), cfg, raw, torch_dtype)


def _write_model(out: Path, cfg: dict[str, Any], raw: dict[str, Any], torch_dtype: Any) -> Path:
    """Write ``config.json``, ``model.safetensors`` (``raw`` cast to ``torch_dtype``), the
    tokenizer and ``generation_config.json`` into ``out``; return it."""
    from safetensors.torch import save_file

    vocab_size = cfg["vocab_size"]
    max_position_embeddings = cfg["max_position_embeddings"]
    weights = {k: (t.to(torch_dtype) if t.is_floating_point() else t).contiguous()
               for k, t in raw.items()}  # fmt: skip (index tables stay integers)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "tokenizer.json").write_text(json.dumps(_tokenizer_json(vocab_size)) + "\n")
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "model_max_length": max_position_embeddings,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    gen_cfg = {"bos_token_id": _BOS_ID, "eos_token_id": _EOS_ID, "pad_token_id": _PAD_ID}
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
    return out


#: DSA architectures :func:`make_tiny_dsa` writes: name -> (architecture, model_type, indexer
#: RoPE interleaved). GLM-5's checkpoints set ``indexer_rope_interleave`` (transformers'
#: ``GlmMoeDsaIndexer`` rotates interleaved pairs; DeepSeek-V3.2's indexer rotates halves).
DSA_ARCHS: dict[str, tuple[str, str, bool]] = {
    "deepseek_v32": ("DeepseekV32ForCausalLM", "deepseek_v32", False),
    "glm_moe_dsa": ("GlmMoeDsaForCausalLM", "glm_moe_dsa", True),
}

#: Named argument sets for :func:`make_tiny_dsa` (attention shapes of the released models,
#: scaled down in heads and hidden size; dense MLPs).
DSA_PRESETS: dict[str, dict[str, Any]] = {
    # DeepSeek-V3.2 attention dims: latent 512 + rope 64, nope 128, v 128, q_lora on;
    # indexer head dim 128 (the released one), fewer indexer heads.
    "v32": dict(
        arch="deepseek_v32",
        num_heads=8,
        hidden_size=256,
        num_layers=2,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        q_lora_rank=96,
        index_n_heads=8,
        index_head_dim=128,
    ),
    # GLM-5 attention dims: nope 192, v 256 (!= nope), latent 512 + 64, interleaved indexer
    # RoPE; the third layer reuses the second's top-k ("S" in index_topk_pattern).
    "glm5": dict(
        arch="glm_moe_dsa",
        num_heads=4,
        hidden_size=256,
        num_layers=3,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=192,
        v_head_dim=256,
        q_lora_rank=128,
        index_n_heads=4,
        index_head_dim=128,
        index_topk_pattern="FFS",
    ),
    # DeepSeek-V3.2's own attention dims (its config.json): 128 heads, q_lora 1536, latent
    # 512 + rope 64, nope 128, v 128, 64 index heads x 128, index_topk 2048; few layers, a small
    # hidden size, MLP and vocabulary (the attention costs as in the real model).
    "v32_full": dict(
        arch="deepseek_v32",
        num_heads=128,
        hidden_size=512,
        num_layers=2,
        intermediate_size=512,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        q_lora_rank=1536,
        index_n_heads=64,
        index_head_dim=128,
        index_topk=2048,
    ),
    # GLM-5's attention dims (transformers 5.19's GlmMoeDsaConfig defaults, zai-org/GLM-5): 64
    # heads, q_lora 2048, latent 512 + rope 64, nope 192, v 256, 32 index heads x 128,
    # index_topk 2048; every layer runs its indexer (the config's default schedule at 3
    # layers); few layers, small hidden size, MLP and vocabulary.
    "glm5_full": dict(
        arch="glm_moe_dsa",
        num_heads=64,
        hidden_size=512,
        num_layers=3,
        intermediate_size=512,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=192,
        v_head_dim=256,
        q_lora_rank=2048,
        index_n_heads=32,
        index_head_dim=128,
        index_topk=2048,
    ),
}


def make_tiny_dsa(
    path: str | Path,
    *,
    arch: str = "deepseek_v32",
    index_topk: int = 2048,
    index_n_heads: int = 8,
    index_head_dim: int = 128,
    index_topk_pattern: str | None = None,
    seed: int = 0,
    init_std: float = 0.08,
    dtype: str = "bfloat16",
    **v2_kwargs: Any,
) -> Path:
    """Write a tiny random DeepSeek Sparse Attention model folder (DeepSeek-V3.2 or GLM-5
    architecture) at ``path`` and return it.

    The DeepSeek-V2 part (MLA, MLP, embeddings, tokenizer) is :func:`make_tiny_deepseek_v2`'s
    with the same ``seed`` and ``v2_kwargs`` (``q_lora_rank`` is required: DSA's indexer reads
    the query latent); on top, per layer that runs an indexer, the lightning indexer's weights
    under DeepSeek's names (``self_attn.indexer.wq_b`` [Hi * Di, q_lora_rank], ``wk`` [Di,
    hidden], ``k_norm`` (LayerNorm weight and bias, [Di]), ``weights_proj`` [Hi, hidden]) drawn
    from a second generator seeded ``seed + 104729``, and the config fields ``index_topk``,
    ``index_n_heads`` (Hi), ``index_head_dim`` (Di), ``rope_parameters`` and, for
    ``arch="glm_moe_dsa"``, ``indexer_rope_interleave: true``. ``index_topk_pattern``
    (e.g. ``"FFS"``): per layer "F" runs its indexer, "S" reuses the previous layer's top-k
    (GLM-5's IndexCache sharing; written as vLLM's ``index_topk_pattern`` and transformers'
    ``indexer_types``). No engine, no transformers is imported.
    """
    import torch
    from safetensors.torch import load_file

    if arch not in DSA_ARCHS:
        raise ValueError(f"arch={arch!r} is not supported; supported: {sorted(DSA_ARCHS)}")
    if v2_kwargs.get("q_lora_rank") is None:
        raise ValueError("a DSA model needs q_lora_rank (the indexer's query reads q_lora)")
    rope = v2_kwargs.get("qk_rope_head_dim", 64)
    if index_topk < 1 or index_n_heads < 1 or index_head_dim < rope:
        raise ValueError(
            f"index_topk={index_topk}, index_n_heads={index_n_heads} must be >= 1 and "
            f"index_head_dim={index_head_dim} >= qk_rope_head_dim={rope}"
        )
    out = make_tiny_deepseek_v2(path, seed=seed, init_std=init_std, dtype=dtype, **v2_kwargs)
    cfg = json.loads((out / "config.json").read_text())
    raw = {k: t.float() for k, t in load_file(str(out / "model.safetensors")).items()}
    layers = cfg["num_hidden_layers"]
    pattern = index_topk_pattern or "F" * layers
    if len(pattern) != layers or set(pattern) - {"F", "S"} or pattern[0] != "F":
        raise ValueError(
            f"index_topk_pattern={index_topk_pattern!r} must be {layers} letters F/S starting "
            "with F"
        )
    architecture, model_type, interleaved = DSA_ARCHS[arch]
    cfg.update(
        architectures=[architecture],
        model_type=model_type,
        index_topk=index_topk,
        index_n_heads=index_n_heads,
        index_head_dim=index_head_dim,
        rope_parameters={"rope_type": "default", "rope_theta": cfg["rope_theta"]},
    )
    if cfg.get("rope_scaling"):
        raise ValueError("make_tiny_dsa writes default RoPE only (rope_scaling must be None)")
    if interleaved:
        cfg["indexer_rope_interleave"] = True
    if index_topk_pattern is not None:
        cfg["index_topk_pattern"] = pattern
        cfg["indexer_types"] = ["full" if c == "F" else "shared" for c in pattern]
    gen = torch.Generator().manual_seed(seed + 104729)
    hid, ql = cfg["hidden_size"], cfg["q_lora_rank"]
    for i, kind in enumerate(pattern):
        if kind != "F":
            continue
        x = f"model.layers.{i}.self_attn.indexer."
        raw[x + "wq_b.weight"] = torch.randn(index_n_heads * index_head_dim, ql, generator=gen)
        raw[x + "wq_b.weight"] *= init_std
        raw[x + "wk.weight"] = torch.randn(index_head_dim, hid, generator=gen) * init_std
        raw[x + "k_norm.weight"] = 1.0 + 0.1 * torch.randn(index_head_dim, generator=gen)
        raw[x + "k_norm.bias"] = 0.1 * torch.randn(index_head_dim, generator=gen)
        raw[x + "weights_proj.weight"] = torch.randn(index_n_heads, hid, generator=gen) * init_std
    return _write_model(out, cfg, raw, getattr(torch, dtype))


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: ``python -m mla_backend.testing.tiny_model OUT_DIR [--preset NAME] [--seed N]``."""
    ap = argparse.ArgumentParser(
        prog="python -m mla_backend.testing.tiny_model",
        description="Write a tiny random DeepSeek-V2 model folder.",
    )
    ap.add_argument("out_dir")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="default")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument("--vocab-size", type=int, default=10240)
    args = ap.parse_args(argv)
    kwargs = dict(PRESETS[args.preset])
    if args.num_layers is not None:
        kwargs["num_layers"] = args.num_layers
    out = make_tiny_deepseek_v2(
        args.out_dir, seed=args.seed, dtype=args.dtype, vocab_size=args.vocab_size, **kwargs
    )
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
