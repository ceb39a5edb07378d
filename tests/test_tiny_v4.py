"""The tiny DeepSeek-V4 checkpoints (mla_backend.testing.tiny_v4): DeepSeek's original weight
names (what vLLM's V4 loader maps), every stored tensor loaded by transformers' own
DeepseekV4ForCausalLM with nothing missing or left over and its values kept (sinks, position
biases, hash tables drawn, not the library's zeros), vLLM's legacy config fields, varied greedy
tokens over a prompt past the window and an HCA entry."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import torch as safetensors_torch

from mla_backend.testing.tiny_v4 import V4_KINDS, make_tiny_v4

transformers = pytest.importorskip("transformers")

#: top-level names of DeepSeek's V4 checkpoints besides ``layers.*`` (vLLM's mapper prefixes)
TOP = {"embed.weight", "head.weight", "norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale"}


def test_written_under_original_names_and_loaded_whole(tmp_path: Path) -> None:
    kinds = ("hca", "csa", "sliding")
    out = make_tiny_v4(tmp_path / "v4", kinds=kinds, dtype="float32", vocab_size=512)
    stored = safetensors_torch.load_file(str(out / "model.safetensors"))
    assert all(k.startswith("layers.") or k in TOP for k in stored), sorted(stored)[:8]
    assert {k for k in stored if not k.startswith("layers.")} == TOP
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["compress_ratios"] == [V4_KINDS[k][1] for k in kinds] == [128, 4, 0]
    assert cfg["layer_types"] == [V4_KINDS[k][0] for k in kinds]
    assert cfg["qk_rope_head_dim"] == 64 and cfg["head_dim"] == 512 and cfg["index_head_dim"] == 128
    # released-config router fields vLLM reads; transformers' mlp_layer_types (which vLLM 0.32's
    # config class rejects) left out, rebuilt by transformers from num_hash_layers
    assert cfg["topk_method"] == "noaux_tc" and "mlp_layer_types" not in cfg
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(out), dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    assert model.config.mlp_layer_types == ["hash_moe", "moe", "moe"]
    sd = model.state_dict()
    for i in range(len(kinds)):  # drawn values arrive (not re-initialized)
        # the attention's KV RMSNorm under the released name vLLM's loader reads
        torch.testing.assert_close(sd[f"model.layers.{i}.self_attn.kv_norm.weight"],
                                   stored[f"layers.{i}.attn.kv_norm.weight"])  # fmt: skip
        torch.testing.assert_close(sd[f"model.layers.{i}.self_attn.sinks"],
                                   stored[f"layers.{i}.attn.attn_sink"])  # fmt: skip
        assert stored[f"layers.{i}.attn.attn_sink"].abs().sum() > 0
    ape = stored["layers.1.attn.compressor.ape"]
    assert ape.abs().sum() > 0
    torch.testing.assert_close(sd["model.layers.1.self_attn.compressor.position_bias"], ape)
    assert stored["layers.0.ffn.gate.tid2eid"].dtype in (torch.int32, torch.int64)


def test_generates_varied_tokens_past_the_window(tmp_path: Path) -> None:
    out = make_tiny_v4(tmp_path / "v4", dtype="float32")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    ids = torch.randint(4, 1024, (1, 300), generator=torch.Generator().manual_seed(0))
    gen = model.generate(ids, max_new_tokens=12, do_sample=False, min_new_tokens=12)
    new = gen[0, ids.shape[1] :].tolist()
    assert len(set(new)) >= 4, new  # not degenerate


def test_bad_kinds_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'window'"):
        make_tiny_v4(tmp_path / "x", kinds=("csa", "window"))
    with pytest.raises(ValueError, match="num_hash_layers=3 > 2"):
        make_tiny_v4(tmp_path / "x", kinds=("csa", "hca"), num_hash_layers=3)
