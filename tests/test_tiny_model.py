"""Tests for the tiny DeepSeek-V2 checkpoint generator (mla_backend.testing.tiny_model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mla_backend.testing.tiny_model import (
    DSA_ARCHS,
    DSA_PRESETS,
    PRESETS,
    main,
    make_tiny_deepseek_v2,
    make_tiny_dsa,
    synthetic_words,
)

safetensors_torch = pytest.importorskip("safetensors.torch")


def _expected_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of DeepSeek-V2, written from the paper's formulas (not from tiny_model)."""
    h, n = cfg["hidden_size"], cfg["num_attention_heads"]
    r, rope = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    nope, v = cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    out = {
        "model.embed_tokens.weight": (cfg["vocab_size"], h),
        "model.norm.weight": (h,),
        "lm_head.weight": (cfg["vocab_size"], h),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "post_attention_layernorm.weight"] = (h,)
        if cfg["q_lora_rank"] is None:
            out[p + "self_attn.q_proj.weight"] = (n * (nope + rope), h)
        else:
            q = cfg["q_lora_rank"]
            out[p + "self_attn.q_a_proj.weight"] = (q, h)
            out[p + "self_attn.q_a_layernorm.weight"] = (q,)
            out[p + "self_attn.q_b_proj.weight"] = (n * (nope + rope), q)
        out[p + "self_attn.kv_a_proj_with_mqa.weight"] = (r + rope, h)
        out[p + "self_attn.kv_a_layernorm.weight"] = (r,)
        out[p + "self_attn.kv_b_proj.weight"] = (n * (nope + v), r)
        out[p + "self_attn.o_proj.weight"] = (h, n * v)
        if i < cfg["first_k_dense_replace"]:
            i_sz = cfg["intermediate_size"]
            for k, s in (
                ("gate_proj", (i_sz, h)),
                ("up_proj", (i_sz, h)),
                ("down_proj", (h, i_sz)),
            ):
                out[f"{p}mlp.{k}.weight"] = s
        else:
            m = cfg["moe_intermediate_size"]
            out[p + "mlp.gate.weight"] = (cfg["n_routed_experts"], h)
            for e in range(cfg["n_routed_experts"]):
                for k, s in (("gate_proj", (m, h)), ("up_proj", (m, h)), ("down_proj", (h, m))):
                    out[f"{p}mlp.experts.{e}.{k}.weight"] = s
            sm = m * cfg["n_shared_experts"]
            for k, s in (("gate_proj", (sm, h)), ("up_proj", (sm, h)), ("down_proj", (h, sm))):
                out[f"{p}mlp.shared_experts.{k}.weight"] = s
    return out


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_write_consistent_checkpoint(tmp_path: Path, preset: str) -> None:
    out = make_tiny_deepseek_v2(tmp_path / preset, **PRESETS[preset], dtype="float32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v2"
    assert cfg["architectures"] == ["DeepseekV2ForCausalLM"]
    assert cfg["vocab_size"] >= 10000
    w = safetensors_torch.load_file(str(out / "model.safetensors"))
    shapes = {k: tuple(t.shape) for k, t in w.items()}
    assert shapes == _expected_shapes(cfg)
    for k, t in w.items():
        assert t.dtype == torch.float32
        assert torch.isfinite(t).all(), k
        assert t.std() > 0, k  # nothing left at zero / constant


def test_deterministic_and_seed_dependent(tmp_path: Path) -> None:
    kw = dict(PRESETS["odd"])
    a = make_tiny_deepseek_v2(tmp_path / "a", seed=3, **kw)
    b = make_tiny_deepseek_v2(tmp_path / "b", seed=3, **kw)
    c = make_tiny_deepseek_v2(tmp_path / "c", seed=4, **kw)
    fa = (a / "model.safetensors").read_bytes()
    assert fa == (b / "model.safetensors").read_bytes()
    assert fa != (c / "model.safetensors").read_bytes()
    wa = safetensors_torch.load_file(str(a / "model.safetensors"))
    assert wa["model.embed_tokens.weight"].dtype == torch.bfloat16


def test_rejects_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vocab_size=100"):
        make_tiny_deepseek_v2(tmp_path, vocab_size=100)
    with pytest.raises(ValueError, match="qk_rope_head_dim=33"):
        make_tiny_deepseek_v2(tmp_path, qk_rope_head_dim=33)
    with pytest.raises(ValueError, match="dtype='int8'"):
        make_tiny_deepseek_v2(tmp_path, dtype="int8")


def test_synthetic_words_distinct_and_whitespace_free() -> None:
    words = synthetic_words(20000)
    assert len(set(words)) == 20000
    assert all(w.isalpha() and w.islower() for w in words)


def test_tokenizer_round_trip(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    out = make_tiny_deepseek_v2(tmp_path / "m", **PRESETS["odd"])
    tok = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    cfg = json.loads((out / "config.json").read_text())
    assert tok.get_vocab_size() == cfg["vocab_size"]
    ids = [5, 77, 9999, cfg["vocab_size"] - 1]
    text = tok.decode(ids)
    assert tok.encode(text).ids == ids
    assert tok.token_to_id("</s>") == cfg["eos_token_id"]
    assert tok.token_to_id("<s>") == cfg["bos_token_id"]


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path / "cli"), "--preset", "odd", "--num-layers", "1"]) == 0
    cfg = json.loads((tmp_path / "cli" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["kv_lora_rank"] == 96
    assert str(tmp_path / "cli") in capsys.readouterr().out


def test_transformers_loads_and_generates_varied_tokens(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    out = make_tiny_deepseek_v2(tmp_path / "m", **PRESETS["odd"], dtype="float32")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    # every stored weight is used by the model (no silently ignored names)
    missing = set(safetensors_torch.load_file(str(out / "model.safetensors"))) - set(
        model.state_dict()
    )
    assert not missing
    ids = torch.tensor([[11, 500, 42, 7000, 3000, 12]])
    gen = model.generate(ids, max_new_tokens=16, do_sample=False, min_new_tokens=16)
    new = gen[0, ids.shape[1] :].tolist()
    assert len(set(new)) >= 4, new  # not degenerate


#: the presets at a real model's attention dims (hundreds of MB in float32): under -m slow
FULL = [p for p in sorted(DSA_PRESETS) if p.endswith("_full")]


def test_full_dsa_presets_have_the_published_attention_dims() -> None:
    """DeepSeek-V3.2's config.json and GLM-5's (transformers' GlmMoeDsaConfig defaults):
    (heads, q_lora, r, rope, nope, v, index heads, index head dim, index_topk)."""
    published = {"v32_full": (128, 1536, 512, 64, 128, 128, 64, 128, 2048),
                 "glm5_full": (64, 2048, 512, 64, 192, 256, 32, 128, 2048)}  # fmt: skip
    keys = ("num_heads", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
            "v_head_dim", "index_n_heads", "index_head_dim", "index_topk")  # fmt: skip
    assert sorted(published) == FULL
    for name, dims in published.items():
        assert tuple(DSA_PRESETS[name][k] for k in keys) == dims, name


@pytest.mark.parametrize(
    "preset",
    [p if p not in FULL else pytest.param(p, marks=pytest.mark.slow) for p in sorted(DSA_PRESETS)],
)
def test_dsa_presets_add_the_indexer_to_the_v2_checkpoint(tmp_path: Path, preset: str) -> None:
    kw = dict(DSA_PRESETS[preset])
    kw.pop("index_topk", None)
    arch = kw.pop("arch")
    out = make_tiny_dsa(tmp_path / preset, arch=arch, index_topk=16, dtype="float32", seed=5,
                        **kw)  # fmt: skip
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == [DSA_ARCHS[arch][0]] and cfg["model_type"] == arch
    assert (cfg["index_topk"], cfg["index_n_heads"]) == (16, kw["index_n_heads"])
    assert cfg.get("indexer_rope_interleave", False) == DSA_ARCHS[arch][2]
    w = safetensors_torch.load_file(str(out / "model.safetensors"))
    pattern = cfg.get("index_topk_pattern", "F" * cfg["num_hidden_layers"])
    Hi, Di, h, ql = kw["index_n_heads"], kw["index_head_dim"], cfg["hidden_size"], kw["q_lora_rank"]
    want = _expected_shapes(cfg)  # the DeepSeek-V2 part, from the paper's formulas
    for i, kind in enumerate(pattern):
        if kind == "F":  # an "S" layer reuses the previous top-k and has no indexer
            x = f"model.layers.{i}.self_attn.indexer."
            want |= {x + "wq_b.weight": (Hi * Di, ql), x + "wk.weight": (Di, h),
                     x + "k_norm.weight": (Di,), x + "k_norm.bias": (Di,),
                     x + "weights_proj.weight": (Hi, h)}  # fmt: skip
    assert {k: tuple(t.shape) for k, t in w.items()} == want
    # the DeepSeek-V2 weights are make_tiny_deepseek_v2's with the same seed
    v2 = make_tiny_deepseek_v2(tmp_path / "v2", dtype="float32", seed=5, **{
        k: v for k, v in kw.items() if k not in ("index_n_heads", "index_head_dim",
                                                 "index_topk_pattern")})  # fmt: skip
    for k, t in safetensors_torch.load_file(str(v2 / "model.safetensors")).items():
        assert torch.equal(w[k], t), k


def test_dsa_rejects_bad_arguments(tmp_path: Path) -> None:
    kw = dict(DSA_PRESETS["v32"])
    kw.pop("arch")
    with pytest.raises(ValueError, match="arch='x'"):
        make_tiny_dsa(tmp_path, arch="x", **kw)
    with pytest.raises(ValueError, match="q_lora_rank"):
        make_tiny_dsa(tmp_path, **{**kw, "q_lora_rank": None})
    with pytest.raises(ValueError, match="index_topk=0"):
        make_tiny_dsa(tmp_path, index_topk=0, **kw)
    with pytest.raises(ValueError, match="index_topk_pattern='SF'"):
        make_tiny_dsa(tmp_path, **{**kw, "index_topk_pattern": "SF"})
