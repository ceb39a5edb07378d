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

Checkpoints (``make_tiny_deepseek_v2``, seeds 31, 32, ...; c_kv = ``kv_a_layernorm``'s output):

* ``standard``: RMSNorm gains ~1 (|c_kv| <= ~5);
* ``stressed``: every ``kv_a_layernorm`` gain log-spaced over 0.05..20 in random channel
  order (the issue's example; |c_kv| up to ~80);
* ``wide_grouped``: gains log-spaced over 1e-3..1e3 ascending with the channel index
  (``kv_a_norm_order="sorted"``: each 128-value tile holds a quarter of the range) and every
  ``kv_b_proj`` column divided by its gain (``kv_a_norm_compensate``): the model computes
  what it computes with gains 1, but its cached c_kv spans ~1e-4..3.5e3, beyond e4m3's range
  at scale 1.0 on both sides (25% of the values below 2^-6, 4% above 448), and every channel
  matters as much to attention. This checkpoint is CONSTRUCTED to show what the tile format
  is for (channel-grouped magnitudes, no calibrated ``k_scale``); it says nothing about the
  gains of any real checkpoint;
* below the engine only (no vLLM, c_kv of the fp32 model): ``stressed_sorted`` (stressed's
  gains ascending) and ``wide_scattered`` (wide_grouped's in random channel order).

Why the tile scales rarely help (measured below the engine here and by
benchmarks/fp8_accuracy.py, which also feeds the quantized latents back into the fp32 model):
e4m3 rounds to 3 mantissa bits whatever the scale while a value stays in its normal range
(2^-6..448 times the scale): the per-value relative error of c_kv has median 0.022 in both
formats on standard, stressed and stressed_sorted, and under 0.6% of the values are off by
more than 25%. A tile scale only rescues values that per-tensor scale 1.0 flushes to
subnormals/zero or saturates, and only if the tile's values share a range: on wide_grouped
per-tensor fp8 loses 11.9% of the values (off by > 25%), ``fp8_ds_mla`` 0.01%; on
wide_scattered every tile spans the whole range, its scale is the row's (max / 448, ~5-8), and
``fp8_ds_mla`` loses 16.4% (more than per-tensor's 12.0%; mean log-prob error 1.1-1.3x
per-tensor's). Elsewhere its one advantage is k_pe kept in bf16 (per-tensor fp8 rounds k_pe
too: median 0.022): on standard/stressed mean error 7-16% lower, max error within rounding
luck of per-tensor's (ds max / fp8 max, fp32 model below the engine, seeds +0/+10/+20:
0.82-1.15x standard, 0.75-0.97x stressed, 0.75-1.47x stressed_sorted, 0.14-0.18x
wide_grouped, 1.00-1.74x wide_scattered).

The figures of the engine runs (the dated table, and the issue's targets met or not) are in
benchmarks/results/history.md ("Figures from docstrings").

Tests: the engine's KV bytes per token (1152/576/656); below the engine, equal median c_kv
error of both formats on the in-range checkpoints and the lost shares of wide_grouped and
wide_scattered; ``fp8_ds_mla`` max <= 0.5x per-tensor fp8's on wide_grouped (and <= 1.5x its
standard error); on every engine checkpoint ``fp8_ds_mla``'s mean error below per-tensor's and
its max <= 1.25x per-tensor's; every first greedy difference from the bf16 cache at a margin
below that cache's max error; the bf16 cache's error on standard <= 0.5. The numbers are
printed (``pytest -s``) and recorded in integrations/vllm/README.md.

One engine at a time; nine engines in all (about 8 minutes on the shared 2-core machine).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import HFOracle, make_llm, shutdown

from mla_backend.cache_layout import CacheLayout
from mla_backend.fp8 import FP8_DTYPE, FP8_MAX
from mla_backend.testing.tiny_model import PRESETS, make_tiny_deepseek_v2

# Under -m slow: CI (the wheel / sglang sessions) runs what is not marked slow, within its
# 60 minutes on 2 cores; `python3 -m nox -s vllm` runs these too.
pytestmark = pytest.mark.slow  # an engine run per cache format

CHECKPOINTS: dict[str, dict[str, Any]] = {
    "standard": dict(PRESETS["default"]),
    "stressed": dict(PRESETS["default"], kv_a_norm_span=(0.05, 20.0)),
    # constructed to show what the tile scales are for (see the module docstring)
    "wide_grouped": dict(
        PRESETS["default"],
        kv_a_norm_span=(1e-3, 1e3),
        kv_a_norm_order="sorted",
        kv_a_norm_compensate=True,
    ),
}
#: below the engine only (no vLLM): the same range as wide_grouped in random channel order
LATENT_ONLY: dict[str, dict[str, Any]] = {
    "stressed_sorted": dict(
        PRESETS["default"], kv_a_norm_span=(0.05, 20.0), kv_a_norm_order="sorted"
    ),
    "wide_scattered": dict(
        PRESETS["default"], kv_a_norm_span=(1e-3, 1e3), kv_a_norm_compensate=True
    ),
}
#: every checkpoint's seed (make_tiny_deepseek_v2's ``seed``): 31, 32, ... in this order
SEEDS = {name: 31 + i for i, name in enumerate([*CHECKPOINTS, *LATENT_ONLY])}
CACHES = ("auto", "fp8", "fp8_ds_mla")  # auto = the model's dtype
#: vLLM's model dtype; MLA_FP8_ACCURACY_DTYPE=float32 measures the cache formats alone
#: (auto = fp32 cache; fp8_ds_mla then keeps k_pe in fp32: 784 B per token and layer)
MODEL_DTYPE = os.environ.get("MLA_FP8_ACCURACY_DTYPE", "bfloat16")
PROMPT_LENS = [180, 40, 7, 95]
MAX_NEW = 12


def _prompts(seed: int = 21, vocab: int = 10240) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


# -- the two fp8 formats' values, with the core's quantizers (below the engine) -------------


def fp8_per_tensor(x: torch.Tensor) -> torch.Tensor:
    """The per-tensor fp8 cache's value of ``x`` (scale 1.0; the writer clamps to +-448)."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float().to(x.dtype)


def fp8_ds_mla_ckv(x: torch.Tensor) -> torch.Tensor:
    """``fp8_ds_mla``'s value of c_kv [..., r]: the core's ``CacheLayout.pack``/``unpack``
    (per token, tiles of 128 values, each with its own float32 scale)."""
    r = x.shape[-1]
    layout = CacheLayout.ds_mla(r, 0, torch.float32)
    flat = x.reshape(-1, r).float()
    return layout.unpack(layout.pack(flat, flat[:, :0]), torch.float32).view(x.shape).to(x.dtype)


@torch.no_grad()
def oracle_latents(oracle: HFOracle, prompts: list[list[int]]) -> torch.Tensor:
    """c_kv (``kv_a_layernorm``'s output) of every prompt token and layer: [tokens, r]."""
    got: list[torch.Tensor] = []
    hooks = [
        layer.self_attn.kv_a_layernorm.register_forward_hook(
            lambda _m, _i, out: got.append(out.reshape(-1, out.shape[-1]).detach())
        )
        for layer in oracle.model.model.layers
    ]
    try:
        for p in prompts:
            oracle.model(torch.tensor([p]))
    finally:
        for h in hooks:
            h.remove()
    return torch.cat(got).float()


def latent_errors(c_kv: torch.Tensor) -> dict[str, dict[str, float]]:
    """Per-value relative error ``|deq - x| / |x|`` of c_kv in each fp8 format: median, and
    the share "lost" (off by more than 25%: flushed towards zero or saturated)."""
    nz = c_kv != 0
    out = {}
    for fmt, quant in (("fp8", fp8_per_tensor), ("fp8_ds_mla", fp8_ds_mla_ckv)):
        rel = (quant(c_kv) - c_kv).abs()[nz] / c_kv.abs()[nz]
        out[fmt] = {"median": rel.median().item(), "lost": (rel > 0.25).float().mean().item()}
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp8_accuracy")
    return {
        name: make_tiny_deepseek_v2(root / name, dtype="float32", seed=SEEDS[name], **kw)
        for name, kw in {**CHECKPOINTS, **LATENT_ONLY}.items()
    }


@pytest.fixture(scope="module")
def latents(checkpoints: dict[str, Path]) -> dict[str, dict[str, dict[str, float]]]:
    """{checkpoint: {format: {"median", "lost"}}} on the transformers fp32 model's c_kv."""
    result = {}
    for name, path in checkpoints.items():
        result[name] = latent_errors(oracle_latents(HFOracle(path), _prompts()))
    print("\nc_kv per-value relative error |deq - x| / |x| (transformers fp32 latents)")
    print(f"{'checkpoint':>15} | {'format':>10} | {'median':>7} | lost (> 25%)")
    for name, per in result.items():
        for fmt, m in per.items():
            print(f"{name:>15} | {fmt:>10} | {m['median']:7.4f} | {m['lost']:.2%}")
    return result


# -- end to end through vLLM ----------------------------------------------------------------


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
    """vLLM outputs (greedy; log-probs of the prompt tokens, and the top 2 of every decode
    step with the generated token's) and the KV bytes per token and layer of the cache."""
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
            logprobs=2,
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


def _margins(out: Any) -> list[float]:
    """Top-1 minus top-2 log-prob (= logit margin) of every decode step."""
    res = []
    for lp in out.outputs[0].logprobs:
        top = sorted((v.logprob for v in lp.values()), reverse=True)
        res.append(top[0] - top[1])
    return res


@pytest.fixture(scope="module")
def measured(checkpoints: dict[str, Path]) -> dict[str, dict[str, Any]]:
    """{checkpoint: {cache: {"max", "mean", "err", "tokens", "margins", "bytes"}}}: three
    engines per checkpoint of CHECKPOINTS, one at a time."""
    prompts = _prompts()
    result: dict[str, dict[str, Any]] = {}
    for name in CHECKPOINTS:
        oracle = HFOracle(checkpoints[name])
        result[name] = {}
        for cache in CACHES:
            outs, nbytes = _run(checkpoints[name], cache, prompts)
            errs = [_errors(oracle, p, o) for p, o in zip(prompts, outs, strict=True)]
            err = torch.cat(errs)
            result[name][cache] = {
                "max": err.max().item(),
                "mean": err.mean().item(),
                "err": errs,
                "tokens": [list(o.outputs[0].token_ids) for o in outs],
                "margins": [_margins(o) for o in outs],
                "bytes": nbytes,
            }
        del oracle
    print(f"\nteacher-forced |log-prob error| vs transformers fp32 (vLLM {MODEL_DTYPE} model)")
    print(f"{'checkpoint':>12} | {'cache':>10} | {'KV B/token/layer':>16} | {'max':>9} | mean")
    for name, per_cache in result.items():
        for cache, m in per_cache.items():
            print(
                f"{name:>12} | {cache:>10} | {m['bytes']:16d} | {m['max']:9.3f} | {m['mean']:.3f}"
            )
        r = per_cache["fp8_ds_mla"]["max"] / per_cache["fp8"]["max"]
        print(f"{name:>12} | fp8_ds_mla max / fp8 max = {r:.2f}")
    print("greedy tokens vs the bf16 cache's (standard): first difference per prompt")
    print(greedy_report(result["standard"]))
    return result


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((k for k, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def greedy_report(per_cache: dict[str, Any]) -> str:
    """Per fp8 cache and prompt: the first generated position whose token differs from the
    bf16 cache's, the bf16 run's top-1/top-2 margin there and this cache's teacher-forced
    |log-prob error| at that position (the prefixes agree up to it); and the bf16 run's
    margins over every decode step."""
    ref = per_cache["auto"]
    margins = torch.tensor([x for ms in ref["margins"] for x in ms])
    lines = [
        f"  bf16-cache top-1/top-2 margins over all {margins.numel()} decode steps: "
        f"min {margins.min():.3f}, median {margins.median():.3f}, max {margins.max():.3f}; "
        + ", ".join(
            f"{(margins < per_cache[c]['max']).float().mean():.0%} below {c}'s max error"
            for c in ("fp8", "fp8_ds_mla")
        )
    ]
    for cache in ("fp8", "fp8_ds_mla"):
        m = per_cache[cache]
        for i, (a, b) in enumerate(zip(ref["tokens"], m["tokens"], strict=True)):
            j = first_difference(a, b)
            if j is None:
                lines.append(f"  {cache:>10} prompt {i}: all {len(a)} tokens equal")
                continue
            gen_err = m["err"][i][PROMPT_LENS[i] - 1 + j].item()
            lines.append(
                f"  {cache:>10} prompt {i}: first differs at token {j} "
                f"({sum(x != y for x, y in zip(a, b, strict=True))} of {len(a)} differ); "
                f"bf16-cache margin there {ref['margins'][i][j]:.3f}, "
                f"this cache's |log-prob error| there {gen_err:.3f}"
            )
    return "\n".join(lines)


_WIDTH = {"bfloat16": (1152, 576, 656), "float32": (2304, 576, 784)}


def test_kv_bytes_per_token_the_engine_allocates(measured) -> None:
    # bf16 model: bf16 cache 576 * 2; per-tensor fp8 576; fp8_ds_mla 512 + 4 * 4 + 64 * 2
    got = {c: m["bytes"] for c, m in measured["standard"].items()}
    assert got == dict(zip(CACHES, _WIDTH[MODEL_DTYPE], strict=True))


def test_latents_same_precision_in_range_tiles_keep_what_per_tensor_loses(latents) -> None:
    for name in ("standard", "stressed", "stressed_sorted"):
        fp8, ds = latents[name]["fp8"], latents[name]["fp8_ds_mla"]
        # in e4m3's normal range both formats round to 3 mantissa bits: same median error
        assert abs(ds["median"] - fp8["median"]) <= 0.15 * fp8["median"], name
        assert fp8["lost"] < 0.02 and ds["lost"] < 0.02, name
    # 1e-3..1e3 grouped by tile: per-tensor (scale 1) flushes the small channels and
    # saturates the large ones, every tile's own scale keeps them all
    assert latents["wide_grouped"]["fp8"]["lost"] > 0.08
    assert latents["wide_grouped"]["fp8_ds_mla"]["lost"] < 0.002
    # the same values scattered: each tile spans the whole range, so its scale is the row's
    # and its smallest values are flushed too
    assert latents["wide_scattered"]["fp8_ds_mla"]["lost"] > 0.1


def test_ds_mla_max_error_at_most_half_per_tensor_fp8s_where_tiles_help(measured) -> None:
    m = measured["wide_grouped"]
    assert m["fp8_ds_mla"]["max"] <= 0.5 * m["fp8"]["max"]
    # and no worse than on the standard checkpoint: the range no longer matters
    assert m["fp8_ds_mla"]["max"] <= 1.5 * measured["standard"]["fp8_ds_mla"]["max"]


@pytest.mark.parametrize("checkpoint", sorted(CHECKPOINTS))
def test_ds_mla_no_worse_than_per_tensor_fp8(measured, checkpoint) -> None:
    m = measured[checkpoint]
    # k_pe exact: less error on average; the max of ~360 rounding draws of the same
    # relative precision may come out either way (seeds 40-42 below the engine: 0.92-1.15x)
    assert m["fp8_ds_mla"]["mean"] < m["fp8"]["mean"]
    assert m["fp8_ds_mla"]["max"] <= 1.25 * m["fp8"]["max"]


def test_greedy_tokens_leave_the_bf16_caches_only_at_near_ties(measured) -> None:
    """The issue's target (greedy tokens equal to the bf16 cache's on the standard prompts)
    is not met by either fp8 cache (module docstring); what holds: every prompt's first
    difference is at a step where the bf16 cache's own top-1/top-2 margin is below that fp8
    cache's measured max log-prob error (a confident step flipping would fail this)."""
    per = measured["standard"]
    for cache in ("fp8", "fp8_ds_mla"):
        for i, (a, b) in enumerate(zip(per["auto"]["tokens"], per[cache]["tokens"], strict=True)):
            j = first_difference(a, b)
            if j is not None:
                assert per["auto"]["margins"][i][j] < per[cache]["max"], (cache, i, j)


def test_model_dtype_cache_error_on_the_standard_checkpoint(measured) -> None:
    # bf16 model + bf16 cache vs fp32 transformers: bf16 rounding everywhere (measured 0.29)
    bound = 0.5 if MODEL_DTYPE == "bfloat16" else 2e-3
    assert measured["standard"]["auto"]["max"] <= bound
