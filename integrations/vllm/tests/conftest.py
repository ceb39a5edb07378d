"""Shared fixtures of the vLLM adapter tests: tiny DeepSeek-V2 checkpoints, the transformers
oracle, and one vLLM engine at a time (engines are expensive: ~30-120 s start-up here)."""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from mla_backend.testing.tiny_model import PRESETS, make_tiny_deepseek_v2

# Keep the engine small on this 2-core machine; use both cores.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")

#: the e2e models: name -> make_tiny_deepseek_v2 kwargs
E2E_MODELS: dict[str, dict[str, Any]] = {
    # DeepSeek-V2-Lite attention dims (16 heads, 512 + 64, nope 128, v 128), q_lora off
    "lite": dict(PRESETS["default"]),
    # non-DeepSeek dims (latent 96 + 32, v 40 != nope 48), 4 heads, q_lora on
    "odd": dict(PRESETS["odd"]),
    # 8 heads, latent 256 + 64, q_lora on, MoE layers (routed + shared experts)
    "moe": dict(PRESETS["moe"]),
}


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_models")
    return {
        name: make_tiny_deepseek_v2(root / name, dtype="float32", seed=i + 1, **kw)
        for i, (name, kw) in enumerate(E2E_MODELS.items())
    }


def fp8_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """Round to float8_e4m3fn and back (per-tensor scale 1.0, vLLM's default k_scale)."""
    return x.to(torch.float8_e4m3fn).to(x.dtype)


class HFOracle:
    """transformers' own ``DeepseekV2ForCausalLM`` (fp32, eager) on the same safetensors.

    ``fp8_latents=True``: the oracle of an fp8 latent cache. The cached latents (``c_kv``
    after ``kv_a_layernorm``, ``k_pe`` after RoPE) of every token are rounded to float8_e4m3fn
    before attention, through a forward hook and a wrapper around the model file's own
    ``apply_rotary_emb``; everything else is transformers' code unchanged.
    """

    def __init__(self, path: Path, fp8_latents: bool = False) -> None:
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path), dtype=torch.float32
        ).eval()
        self.fp8_latents = fp8_latents
        if fp8_latents:
            for layer in self.model.model.layers:
                layer.self_attn.kv_a_layernorm.register_forward_hook(
                    lambda _m, _i, out: fp8_roundtrip(out)
                )

    @contextlib.contextmanager
    def _rope_patch(self) -> Iterator[None]:
        if not self.fp8_latents:
            yield
            return
        from transformers.models.deepseek_v2 import modeling_deepseek_v2 as mod

        orig = mod.apply_rotary_emb

        def rounded(xq: torch.Tensor, xk: torch.Tensor, freqs: torch.Tensor) -> Any:
            q, k = orig(xq, xk, freqs)
            return q, fp8_roundtrip(k)

        mod.apply_rotary_emb = rounded
        try:
            yield
        finally:
            mod.apply_rotary_emb = orig

    @torch.no_grad()
    def greedy(self, prompt: list[int], max_new: int) -> list[int]:
        ids = torch.tensor([prompt])
        with self._rope_patch():
            out = self.model.generate(
                ids, max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False
            )
        return out[0, len(prompt) :].tolist()

    @torch.no_grad()
    def logprobs_along(self, prompt: list[int], tokens: list[int]) -> torch.Tensor:
        """[len(tokens), vocab] log-softmax of the next-token distribution before each of
        ``tokens`` (teacher forcing along the given continuation)."""
        ids = torch.tensor([prompt + tokens])
        with self._rope_patch():
            logits = self.model(ids).logits[0].float()
        return torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)


@pytest.fixture(scope="session")
def hf_oracles(model_dirs: dict[str, Path]) -> Iterator[dict[str, HFOracle]]:
    cache: dict[str, HFOracle] = {}

    class _Lazy(dict):
        def __missing__(self, key: str) -> HFOracle:
            cache[key] = HFOracle(model_dirs[key])
            self[key] = cache[key]
            return cache[key]

    yield _Lazy()


def make_llm(model: Path, **kwargs: Any) -> Any:
    """A vLLM ``LLM`` with MLA_ABSORB unless ``attention_backend`` says otherwise."""
    from vllm import LLM

    args: dict[str, Any] = dict(
        attention_backend="mla_absorb",
        dtype="float32",
        max_model_len=1024,
        skip_tokenizer_init=True,
        seed=0,
        enforce_eager=True,
    )
    args.update(kwargs)
    return LLM(str(model), **args)


def shutdown(llm: Any) -> None:
    """Stop the engine's processes before the next engine starts (one at a time)."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    del llm
    gc.collect()


def random_prompts(seed: int, lengths: list[int], vocab: int = 10240) -> list[list[int]]:
    """Prompts of random token ids (>= 4: no special token) of the given lengths."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (n,), generator=g).tolist() for n in lengths]


def generate_greedy(llm: Any, prompts: list[list[int]], max_new: int) -> list[Any]:
    """``max_new`` greedy tokens per prompt (EOS ignored), with each token's logprob."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(
        max_tokens=max_new, temperature=0.0, ignore_eos=True, logprobs=1, detokenize=False
    )
    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp)


def token_logprobs(out: Any) -> list[float]:
    """The logprob vLLM reported for each generated token of one request output."""
    comp = out.outputs[0]
    return [lp[t].logprob for t, lp in zip(comp.token_ids, comp.logprobs, strict=True)]
