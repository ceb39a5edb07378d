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

A 4100-token prompt takes the indexer's long-context path (1025 compressed entries, the top 512
selected per token: vLLM's ``fp8_paged_mqa_logits_cpu`` / ``topk_transform_512_cpu`` and its
indexer metadata, served by the adapter). Its selections (recorded from the engine, run in this
process) overlap the reference's, whose indexer rounds its query and keys as vLLM's fp8 indexer
does, by at least ``MIN_OVERLAP`` on average per CSA layer, in prefill and in decode: not
exactly, since e4m3's 3-bit mantissa turns the model's small upstream differences into score
differences of about 1% that reorder entries near the boundary, and the ReLU'd scores tie at
exactly 0 (ours go to the lower entry, ``torch.topk``'s order is unspecified); a wrong
selection overlaps by about half (the negative control: the first 512 entries). Its
teacher-forced log-probs are within ``LONG_ATOL`` (greedy tokens are not compared there: those
boundary entries move the logits by up to ~0.1), and the reference that selects every
compressed entry disagrees beyond it.
"""

from __future__ import annotations

import statistics
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
#: the long prompt's log-prob bound (measured over two prompts here: 0.028 and 0.109; the
#: reference selecting every compressed entry: 0.31 and 1.09)
LONG_ATOL = 0.25
LONG_PROMPT = 4100
#: the least mean share of a token's 512 selected entries the reference also selects, over
#: the prefill's rows and over the decode steps, per CSA layer (measured here: 0.987 and
#: 0.975 at the worst layer; single rows go down to 0.68 where many entries crowd near 0)
MIN_OVERLAP = 0.95
INDEX_TOPK = 512
MAX_NEW = 8
VOCAB = 1024
NOPE, TILE, FP8_MAX = 448, 64, 448.0


def v4_cache_rounding(x: torch.Tensor) -> torch.Tensor:
    """What vLLM's V4 cache keeps of rows x [..., 512]: bf16, then the first 448 values in e4m3
    tiles of 64 with a power-of-two scale 2^ceil(log2(max(amax, 1e-4) / 448)) (vLLM's
    ``quantize_and_insert_k_kernel``), the last 64 in bf16."""
    b = x.to(torch.bfloat16).float()
    q = _e4m3_pow2(b[..., :NOPE].reshape(*b.shape[:-1], NOPE // TILE, TILE))
    return torch.cat([q.reshape(*b.shape[:-1], NOPE), b[..., NOPE:]], -1).to(x.dtype)


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(x.dtype)


def _e4m3_pow2(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] in e4m3 with one power-of-two scale 2^ceil(log2(max(amax, 1e-4) / 448))
    per row, back in x's dtype."""
    amax = x.float().abs().amax(-1, keepdim=True).clamp(min=1e-4)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale
    return q.to(x.dtype)


def fp8_indexer_rounding(q: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """What vLLM's fp8 indexer scores (its long-context path): the RoPE'd query [..., 128] with
    its RoPE values in bf16, then e4m3 per head (``fused_indexer_q_rope_quant``, fp8 arm); the
    compressed keys [..., 128] in bf16, then e4m3 per key (the index cache)."""
    q = q.clone()
    q[..., -64:] = _bf16(q[..., -64:])
    return _e4m3_pow2(q), _e4m3_pow2(_bf16(keys))


class V4Oracle:
    """transformers' fp32 V4 on the same weights, with its grouped output projection in bf16 as
    vLLM's CPU layer computes it; ``fp8_cache``: the cached rows rounded as vLLM's V4 cache
    rounds them (forward hooks on the attention's and the compressors' ``kv_norm``);
    ``fp8_indexer``: the indexer's query and keys rounded as vLLM's fp8 indexer rounds them
    (:func:`fp8_indexer_rounding`, a hook on its scorer); ``select_all``: every visible
    compressed entry selected (a negative control of the selection)."""

    def __init__(self, path: Path, fp8_cache: bool = True, fp8_indexer: bool = True,
                 select_all: bool = False) -> None:  # fmt: skip
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
        for name, module in self.model.named_modules():
            if fp8_indexer and name.endswith("indexer.scorer"):
                module.register_forward_pre_hook(
                    lambda _m, args: (*fp8_indexer_rounding(args[0], args[1]), *args[2:])
                )
            if select_all and name.endswith("compressor.indexer"):
                module.index_topk = 1 << 30
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


#: the indexer's selections the engine made: (key counts [B], selected keys [B, 512]) per call
Selections = list[tuple[torch.Tensor, torch.Tensor]]
#: prompts, vLLM's outputs, the long prompt's selections
Served = tuple[list[list[int]], list[Any], Selections]


@pytest.fixture(scope="module")
def served_all(v4_model: Path) -> Iterator[Served]:
    """The short prompts, then the long one alone (its indexer calls recorded), served by one
    engine in this process."""
    from mla_backend_integrations.vllm import v4_ops

    prompts = random_prompts(7, [5, 100, 150, 300], vocab=VOCAB)
    long_prompt = random_prompts(11, [LONG_PROMPT], vocab=VOCAB)
    picks: Selections = []
    topk_rows = v4_ops.topk_rows

    def recorded(scores: torch.Tensor, key_lens: torch.Tensor, topk: int, out: Any = None) -> Any:
        res = topk_rows(scores, key_lens, topk, out)
        picks.append((key_lens.clone(), res.clone()))
        return res

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        mp.setattr(v4_ops, "topk_rows", recorded)
        llm = make_llm(v4_model, max_model_len=LONG_PROMPT + 64, max_num_seqs=4)
        try:
            outs = generate_greedy(llm, prompts, MAX_NEW)
            picks.clear()
            outs += generate_greedy(llm, long_prompt, MAX_NEW)
        finally:
            shutdown(llm)
    yield prompts + long_prompt, outs, picks


@pytest.fixture(scope="module")
def served(served_all: Served) -> tuple[list[list[int]], list[Any]]:
    """The prompts whose compressed contexts fit ``index_topk``."""
    prompts, outs, _ = served_all
    return prompts[:-1], outs[:-1]


def _long_diff(v4_model: Path, served_all: Served,
               **kw: Any) -> float:  # fmt: skip
    prompts, outs, _ = served_all
    got = list(outs[-1].outputs[0].token_ids)
    ref = V4Oracle(v4_model, **kw).logprobs_along(prompts[-1], got)
    return (torch.tensor(token_logprobs(outs[-1])) - ref).abs().max().item()


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


def test_long_context_logprobs_match_the_fp8_indexer_reference(
    v4_model: Path, served_all: Served
) -> None:
    diff = _long_diff(v4_model, served_all)
    assert diff <= LONG_ATOL, f"prompt len {LONG_PROMPT}: logprob diff {diff}"


def test_long_context_negative_control_selecting_everything(
    v4_model: Path, served_all: Served
) -> None:
    diff = _long_diff(v4_model, served_all, select_all=True)
    assert diff > LONG_ATOL, f"the reference selecting every entry still agrees: {diff}"


def _overlap(got: torch.Tensor, want: torch.Tensor) -> float:
    g = {int(x) for x in got if x >= 0}
    return len(g & {int(x) for x in want if x >= 0}) / INDEX_TOPK


def test_long_context_selections_match_the_fp8_indexer_reference(
    v4_model: Path, served_all: Served
) -> None:
    """Per CSA layer: the prefill's rows past ``index_topk`` entries, and the decode steps'
    tokens, select on average (nearly) the reference's entries; the first 512 entries do not."""
    prompts, outs, picks = served_all
    oracle = V4Oracle(v4_model)
    ref: dict[str, torch.Tensor] = {}

    def keep(name: str) -> Any:
        def hook(_m: Any, _i: Any, out: torch.Tensor) -> None:
            ref[name] = out[0]  # [S, 512] the selected entries of each position

        return hook

    for name, module in oracle.model.named_modules():
        if name.endswith("compressor.indexer"):
            module.register_forward_hook(keep(name))
    tokens = list(outs[-1].outputs[0].token_ids)
    with torch.no_grad():
        oracle.model(torch.tensor([prompts[-1] + tokens]), use_cache=True)
    layers = sorted(ref)
    assert len(layers) == 2 and len(picks) == len(layers) * MAX_NEW  # one call per layer, step
    long_rows = range(INDEX_TOPK * 4, LONG_PROMPT)  # positions seeing more than 512 entries
    for i, layer in enumerate(layers):
        want = ref[layer]
        key_lens, sel = picks[i]  # the prefill: row = position
        assert all(int(key_lens[p]) == (p + 1) // 4 for p in long_rows)
        prefill = [_overlap(sel[p], want[p]) for p in long_rows]
        decode = []
        for step in range(1, MAX_NEW):  # decode step s: one row, position LONG_PROMPT - 1 + s
            key_lens, sel = picks[step * len(layers) + i]
            p = LONG_PROMPT - 1 + step
            assert key_lens.tolist() == [(p + 1) // 4]
            decode.append(_overlap(sel[0], want[p]))
        for shares in (prefill, decode):
            assert statistics.mean(shares) >= MIN_OVERLAP, (layer, statistics.mean(shares))
        control = [_overlap(torch.arange(INDEX_TOPK), want[p]) for p in long_rows]
        assert statistics.mean(control) < MIN_OVERLAP, statistics.mean(control)
