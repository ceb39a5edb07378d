"""End to end, DeepSeek-V4: a tiny random V4 checkpoint (``mla_backend.testing.tiny_v4``: layers
HCA, CSA, sliding, CSA; 4 heads of 512 with 64 RoPE'd values, window 128, MoE with a hash layer,
hyper-connections) served by vLLM 0.32 on this CPU with ``attention_backend="mla_absorb"``
(fp32): vLLM's own model-driven V4 path, with the CPU ops this vLLM build lacks supplied by the
adapter (attention, caches and compressors through the core: ``v4_ops``; mHC, routers and the
grouped output GEMM: ``v4_model_ops``). On a CPU whose vLLM build has its own V4 ops (AVX512-BF16)
those run instead and this module tests vLLM's path.

Reference: transformers' fp32 ``DeepseekV4ForCausalLM`` on the same safetensors, with what vLLM's
V4 cache does to the rows it stores: every cached row (a window row after ``kv_norm``, a
compressed entry after the compressor's norm) has its 448 non-RoPE values rounded to bf16 and then
to V4's fp8 (e4m3 in tiles of 64 with power-of-two scales, written here from vLLM's definition)
and its 64 RoPE values to bf16. The rounding is applied before RoPE (RoPE leaves the first 448
values alone; on the last 64 the bf16 rounding then happens before, not after, the rotation: a
bf16-level difference, inside ``LOGPROB_ATOL``). Checked: greedy tokens identical and each
generated token's logprob within ``LOGPROB_ATOL`` of the reference's teacher-forced one, over
prompts below the window, past it, past an HCA entry (128 tokens) and past CSA's top-k (every
compressed entry is selected at these lengths: ``index_topk`` 512). Negative control: the
reference without the fp8 rounding disagrees beyond that tolerance (the rounding is what the
check measures, so the test can fail).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import generate_greedy, make_llm, random_prompts, shutdown, token_logprobs

from mla_backend.testing.tiny_v4 import make_tiny_v4

transformers = pytest.importorskip("transformers")

#: the reference's remaining difference: the RoPE values' bf16 rounding happens before the
#: rotation there, after it in vLLM's cache (measured here: <= 0.021 over these prompts)
LOGPROB_ATOL = 3e-2
MAX_NEW = 8
VOCAB = 1024
NOPE, TILE, FP8_MAX = 448, 64, 448.0


def v4_cache_rounding(x: torch.Tensor) -> torch.Tensor:
    """What vLLM's V4 cache keeps of rows x [..., 512]: bf16, then the first 448 values in e4m3
    tiles of 64 with a power-of-two scale 2^ceil(log2(max(amax, 1e-4) / 448)) (vLLM's
    ``quantize_and_insert_k_kernel``), the last 64 in bf16."""
    b = x.to(torch.bfloat16).float()
    nope = b[..., :NOPE].reshape(*b.shape[:-1], NOPE // TILE, TILE)
    amax = nope.abs().amax(-1, keepdim=True).clamp(min=1e-4)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
    q = (nope / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale
    return torch.cat([q.reshape(*b.shape[:-1], NOPE), b[..., NOPE:]], -1).to(x.dtype)


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(x.dtype)


class V4Oracle:
    """transformers' fp32 V4 on the same weights, with its grouped output projection in bf16 as
    vLLM's CPU layer computes it; ``fp8_cache``: the cached rows rounded as vLLM's V4 cache
    rounds them (forward hooks on the attention's and the compressors' ``kv_norm``; the
    indexer's keys are not rounded: at these lengths every compressed entry is selected)."""

    def __init__(self, path: Path, fp8_cache: bool = True) -> None:
        # transformers' own classes: importing vLLM registers its DeepseekV4Config for the
        # model type, which transformers' model cannot read
        config = transformers.DeepseekV4Config.from_pretrained(str(path))
        self.model = transformers.DeepseekV4ForCausalLM.from_pretrained(
            str(path), config=config, dtype=torch.float32
        ).eval()
        if fp8_cache:
            for name, module in self.model.named_modules():
                if name.endswith("self_attn.kv_norm") or name.endswith(
                    "self_attn.compressor.kv_norm"
                ):
                    module.register_forward_hook(lambda _m, _i, out: v4_cache_rounding(out))
        # vLLM's CPU V4 layer runs the grouped output projection (wo_a) in bf16 whatever the
        # model dtype (cpu_sparse.py _o_proj: bf16 weight copy, bf16 input and output)
        for layer in self.model.model.layers:
            o_a = layer.self_attn.o_a_proj
            o_a.weight.data = _bf16(o_a.weight.data)
            o_a.register_forward_pre_hook(lambda _m, args: (_bf16(args[0]),))
            o_a.register_forward_hook(lambda _m, _i, out: _bf16(out))

    @torch.no_grad()
    def greedy(self, prompt: list[int], n: int) -> list[int]:
        out = self.model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                                  do_sample=False)  # fmt: skip
        return out[0, len(prompt) :].tolist()

    @torch.no_grad()
    def logprobs_along(self, prompt: list[int], tokens: list[int]) -> torch.Tensor:
        """[len(tokens)] teacher-forced log-prob of each of ``tokens`` after the prompt."""
        logits = self.model(torch.tensor([prompt + tokens]), use_cache=True).logits[0].float()
        lp = torch.log_softmax(logits[len(prompt) - 1 : -1], -1)
        return lp[torch.arange(len(tokens)), torch.tensor(tokens)]


@pytest.fixture(scope="module")
def v4_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_v4(tmp_path_factory.mktemp("tiny_v4") / "v4", dtype="float32",
                        vocab_size=VOCAB, seed=3)  # fmt: skip


@pytest.fixture(scope="module")
def served(v4_model: Path) -> Iterator[tuple[list[list[int]], list[Any]]]:
    prompts = random_prompts(7, [5, 100, 150, 300], vocab=VOCAB)
    llm = make_llm(v4_model, max_model_len=1024, max_num_seqs=4)
    try:
        outs = generate_greedy(llm, prompts, MAX_NEW)
    finally:
        shutdown(llm)
    yield prompts, outs


def test_greedy_and_logprobs_match_transformers_with_the_fp8_cache(
    v4_model: Path, served: tuple[list[list[int]], list[Any]]
) -> None:
    oracle = V4Oracle(v4_model)
    prompts, outs = served
    for prompt, out in zip(prompts, outs, strict=True):
        got = list(out.outputs[0].token_ids)
        ref = oracle.logprobs_along(prompt, got)
        diff = (torch.tensor(token_logprobs(out)) - ref).abs().max().item()
        assert diff <= LOGPROB_ATOL, f"prompt len {len(prompt)}: logprob diff {diff}"
        want = oracle.greedy(prompt, len(got))
        assert got == want, f"prompt len {len(prompt)}: vLLM {got} != reference {want}"


def test_negative_control_without_the_fp8_rounding(
    v4_model: Path, served: tuple[list[list[int]], list[Any]]
) -> None:
    oracle = V4Oracle(v4_model, fp8_cache=False)
    prompts, outs = served
    worst = 0.0
    for prompt, out in zip(prompts, outs, strict=True):
        got = list(out.outputs[0].token_ids)
        ref = oracle.logprobs_along(prompt, got)
        worst = max(worst, (torch.tensor(token_logprobs(out)) - ref).abs().max().item())
    assert worst > LOGPROB_ATOL, f"without the cache's rounding the reference still agrees: {worst}"
