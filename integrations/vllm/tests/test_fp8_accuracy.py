"""Accuracy of the latent cache formats, measured end to end through vLLM: teacher-forced
log-probs of tiny DeepSeek-V2 models (DeepSeek-V2-Lite attention dims: 16 heads, r 512,
rope 64) with MLA_ABSORB, against transformers' ``DeepseekV2ForCausalLM`` in fp32 on the same
safetensors, for three caches on the same prompts:

* ``auto`` = bf16: the latent cache in the model dtype, bf16;
* ``fp8``: float8_e4m3fn with one per-tensor scale (vLLM's default ``k_scale`` 1.0: the
  checkpoints carry no calibrated scale);
* ``fp8_ds_mla``: DeepSeek's tile-scaled layout (128-value tiles of c_kv with their own
  float32 scale per token, k_pe unquantized in the model dtype).

The model runs in bf16 in vLLM (``dtype="bfloat16"``; checkpoints stored in fp32, which the
oracle runs as is): the core keeps a cache in the query dtype or fp8, so a bf16 cache needs
a bf16 model, and ``fp8_ds_mla`` keeps k_pe in the model dtype, so its 656 B row (DeepSeek's
format) is the bf16 model's. Every error below therefore includes bf16 compute (the
``auto`` row is that floor), not the cache format alone.

Log-probs compared: every prompt token after the first (``prompt_logprobs``: the prefill
reads the latents back from the cache) and every greedy token (``logprobs``: decode steps),
each against the oracle's log-softmax along the same sequence (teacher forcing).

Checkpoints: ``standard`` (RMSNorm gains ~1) and ``stressed`` (every ``kv_a_layernorm`` gain
log-spaced over 0.05..20 in random channel order: cached latents spanning 400x in magnitude).

Targets (issue 10): ``fp8_ds_mla``'s max |log-prob error| at most half of per-tensor fp8's,
and greedy tokens equal to the bf16 cache's on the standard prompts. The measured numbers are
printed (``pytest -s``) and recorded in integrations/vllm/README.md.

One engine at a time; six engines in all (about 4-8 minutes on the shared 2-core machine).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import HFOracle, make_llm, shutdown

from mla_backend.testing.tiny_model import PRESETS, make_tiny_deepseek_v2

CHECKPOINTS: dict[str, dict[str, Any]] = {
    "standard": dict(PRESETS["default"]),
    "stressed": dict(PRESETS["default"], kv_a_norm_span=(0.05, 20.0)),
}
CACHES = ("auto", "fp8", "fp8_ds_mla")  # auto = the model's dtype
#: vLLM's model dtype; MLA_FP8_ACCURACY_DTYPE=float32 measures the cache formats alone
#: (auto = fp32 cache; fp8_ds_mla then keeps k_pe in fp32: 784 B per token and layer)
MODEL_DTYPE = os.environ.get("MLA_FP8_ACCURACY_DTYPE", "bfloat16")
PROMPT_LENS = [180, 40, 7, 95]
MAX_NEW = 12


def _prompts(seed: int = 21, vocab: int = 10240) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def kv_bytes_per_token_layer(llm: Any) -> int:
    """The KV bytes per token and layer the engine allocated: the CPU worker fills
    ``VLLM_CPU_KVCACHE_SPACE`` GiB with ``num_gpu_blocks`` blocks of ``block_size`` tokens
    in every layer (the spec's page size, after the backend's ``customize_spec``); checked
    to be the unique width that gives exactly that block count."""
    cfg = llm.llm_engine.vllm_config
    space = int(float(os.environ["VLLM_CPU_KVCACHE_SPACE"]) * 2**30)
    tokens_layers = cfg.cache_config.block_size * cfg.model_config.get_num_layers(
        cfg.parallel_config
    )
    blocks = cfg.cache_config.num_gpu_blocks
    width = round(space / (blocks * tokens_layers))
    assert space // (width * tokens_layers) == blocks, (space, blocks, width)
    return width


def _run(model: Path, cache: str, prompts: list[list[int]]) -> tuple[list[Any], int]:
    """vLLM outputs (greedy, log-probs of prompt and generated tokens) and the KV bytes per
    token and layer of the engine's cache."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = make_llm(
        model,
        dtype=MODEL_DTYPE,
        kv_cache_dtype=cache,
        enable_prefix_caching=False,  # every prompt is prefilled from scratch, per cache
        max_num_batched_tokens=256,
        block_size=32,
    )
    try:
        assert str(llm.llm_engine.vllm_config.cache_config.cache_dtype) == cache
        nbytes = kv_bytes_per_token_layer(llm)
        sp = SamplingParams(
            max_tokens=MAX_NEW,
            temperature=0.0,
            ignore_eos=True,
            logprobs=0,
            prompt_logprobs=0,
            detokenize=False,
        )
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp)
    finally:
        shutdown(llm)
    return outs, nbytes


def _errors(oracle: HFOracle, prompt: list[int], out: Any) -> torch.Tensor:
    """|vLLM log-prob - transformers fp32 log-prob| of every prompt token after the first and
    every generated token, teacher-forced along prompt + vLLM's own continuation."""
    gen = list(out.outputs[0].token_ids)
    seq = prompt + gen
    with torch.no_grad():
        logits = oracle.model(torch.tensor([seq])).logits[0].float()
    ref = torch.log_softmax(logits[:-1], dim=-1)[torch.arange(len(seq) - 1), torch.tensor(seq[1:])]
    got = [out.prompt_logprobs[i][t].logprob for i, t in enumerate(prompt) if i > 0]
    got += [lp[t].logprob for t, lp in zip(gen, out.outputs[0].logprobs, strict=True)]
    return (torch.tensor(got, dtype=torch.float64) - ref.double()).abs()


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """{checkpoint: {cache: {"max", "mean", "tokens", "bytes"}}} (six engines, one at a time)."""
    root = tmp_path_factory.mktemp("fp8_accuracy")
    prompts = _prompts()
    result: dict[str, dict[str, Any]] = {}
    for i, (name, kw) in enumerate(CHECKPOINTS.items()):
        model = make_tiny_deepseek_v2(root / name, dtype="float32", seed=31 + i, **kw)
        oracle = HFOracle(model)
        result[name] = {}
        for cache in CACHES:
            outs, nbytes = _run(model, cache, prompts)
            err = torch.cat([_errors(oracle, p, o) for p, o in zip(prompts, outs, strict=True)])
            result[name][cache] = {
                "max": err.max().item(),
                "mean": err.mean().item(),
                "tokens": [list(o.outputs[0].token_ids) for o in outs],
                "bytes": nbytes,
            }
        del oracle
    print(f"\nteacher-forced |log-prob error| vs transformers fp32 (vLLM {MODEL_DTYPE} model)")
    print(f"{'checkpoint':>10} | {'cache':>10} | {'KV B/token/layer':>16} | {'max':>9} | mean")
    for name, per_cache in result.items():
        for cache, m in per_cache.items():
            print(
                f"{name:>10} | {cache:>10} | {m['bytes']:16d} | {m['max']:9.2e} | {m['mean']:.2e}"
            )
    return result


# Measured (bf16 model, 2026-11-22, 4 prompts of 180/40/7/95 tokens + 12 greedy tokens each):
#   checkpoint  cache       B/token/layer  max     mean
#   standard    auto (bf16) 1152           0.293   0.061
#   standard    fp8          576           1.16    0.251
#   standard    fp8_ds_mla   656           0.953   0.239
#   stressed    auto (bf16) 1152           1.78    0.182
#   stressed    fp8          576           4.58    0.726
#   stressed    fp8_ds_mla   656           4.22    0.641
# fp8_ds_mla is better than per-tensor fp8 on every figure, but not by 2x on the max: the
# bf16 model's own error (the auto row) is of the same order, and greedy continuations of
# these random tiny models flip on near-ties. The two targets (max error <= 0.5x
# per-tensor fp8's; greedy tokens equal to the bf16 cache's) are NOT met with these numbers;
# what holds is asserted.
# With an fp32 model (MLA_FP8_ACCURACY_DTYPE=float32: the cache format alone):
#   standard  auto (fp32) 2304 4.6e-5 / 6.9e-6; fp8 576 0.961 / 0.232; fp8_ds_mla 784 0.937 / 0.218
#   stressed  auto (fp32) 2304 1.2e-4 / 1.8e-5; fp8 576 3.92 / 0.707;  fp8_ds_mla 784 3.41 / 0.601
# so the fp8 error is e4m3's 3-bit mantissa on c_kv, which per-tile scales do not reduce.
_WIDTH = {"bfloat16": (1152, 576, 656), "float32": (2304, 576, 784)}


def test_kv_bytes_per_token_the_engine_allocates(measured) -> None:
    # bf16 model: bf16 cache 576 * 2; per-tensor fp8 576; fp8_ds_mla 512 + 4 * 4 + 64 * 2
    got = {c: m["bytes"] for c, m in measured["standard"].items()}
    assert got == dict(zip(CACHES, _WIDTH[MODEL_DTYPE], strict=True))


@pytest.mark.parametrize("checkpoint", sorted(CHECKPOINTS))
def test_ds_mla_is_more_accurate_than_per_tensor_fp8(measured, checkpoint) -> None:
    m = measured[checkpoint]
    assert m["fp8_ds_mla"]["max"] < m["fp8"]["max"]
    assert m["fp8_ds_mla"]["mean"] < m["fp8"]["mean"]


def test_model_dtype_cache_error_on_the_standard_checkpoint(measured) -> None:
    # bf16 model + bf16 cache vs fp32 transformers: bf16 rounding everywhere (measured 0.29)
    bound = 0.5 if MODEL_DTYPE == "bfloat16" else 2e-3
    assert measured["standard"]["auto"]["max"] <= bound
