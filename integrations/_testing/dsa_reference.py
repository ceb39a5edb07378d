"""The end-to-end references of the DSA tests: transformers' own ``DeepseekV32ForCausalLM`` /
``GlmMoeDsaForCausalLM`` (fp32, eager) on the same safetensors, optionally with the lightning
indexer's query and keys rounded to fp8 exactly as vLLM's model code rounds them.

Why the rounding: transformers' indexer scores unquantized q_I / k_I ("a precision
optimization" it skips), vLLM's ``deepseek_v2.Indexer`` rounds both to e4m3 before scoring.
When ``index_topk`` is below the context the selection depends on those scores, and the
rounding alone moves the top-k sets (mla-notes.md: greedy tokens change on longer prompts), so
an unquantized reference cannot tell a correct serving path from a wrong one there. With
``fp8_indexer=True`` every indexer layer runs :func:`rounded_indexer_forward`: transformers'
computation, with

* the query rounded as vLLM's ``per_token_group_quant_fp8(q, 128, use_ue8m0=True)``: per group
  of 128 values ``scale = 2^ceil(log2(max(amax, 1e-10) / 448))``, ``q = e4m3(q / scale) *
  scale`` (saturating at +-448);
* every key rounded as vLLM's ``indexer_k_quant_and_cache`` stores it: per block of 128
  ``scale = 2^ceil(log2(max(amax, 1e-4) / 448))``, ``k = e4m3(k / scale) * scale``.

Both rules are written here from vLLM's definitions (not taken from the code under test).
SGLang's indexer (``act_quant`` with ``scale_fmt="ue8m0"``, which the SGLang adapter's CPU
forward follows) rounds q and k by the key rule (amax floor 1e-4 for both): the same values
unless a query group's amax is below 1e-4. Shared by the vLLM and SGLang end-to-end tests. The
scores are then transformers' formula in fp32: ``sum_h weights_proj(h)[h] * Hi^-0.5 *
relu(q_h . k_t * Di^-0.5)``, causal, the ``min(index_topk, T)`` best with the core's documented
tie rule (equal scores: the lower position first; transformers' ``topk`` leaves ties
unspecified, and with few index heads exact ties are common: every head's ``relu`` at 0).

Latent cache rounding (``latent_cache``): the oracle of an fp8 latent cache rounds the cached
rows of every token (``c_kv`` = ``kv_a_layernorm``'s output, ``k_pe`` after RoPE) where the
model reads them back, in each attention module's ``expand_kv`` (the one place transformers'
DSA attention turns the latents into keys and values), as the named cache stores them:

* ``"fp8"`` / ``"fp8_e4m3"``: both c_kv and k_pe to float8_e4m3fn at per-tensor scale 1.0
  (vLLM's default ``k_scale``: the checkpoints carry none), as the dense fp8 tests' oracle
  does (e4m3 at scale 1.0, as the dense tests' ``conftest.fp8_roundtrip``);
* ``"fp8_ds_mla"``: DeepSeek's tile-scaled layout as vLLM's ``concat_and_cache_ds_mla``
  stores it: per token, every tile of 128 c_kv values gets ``scale = max(amax / 448,
  FLT_MIN)`` (float32, not a power of two), ``c_kv = e4m3(clamp(c_kv / scale, -448, 448)) *
  scale``; k_pe is stored unquantized in the model dtype (fp32 here: exact).

Both rules are written here from vLLM's definitions, not taken from the core's writers.

Decoding: :meth:`DSAOracle.greedy` runs one full forward per generated token, without a cache:
transformers' cached decode of ``GlmMoeDsaForCausalLM`` disagrees with its own full forward
(greedy tokens from ``generate`` are not the argmax of a teacher-forced pass, with or without
the rounding), while the full forward is causal and self-consistent.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import MethodType
from typing import Any

import torch
import torch.nn.functional as F

FP8_MAX = 448.0
QUANT_BLOCK = 128


def _round_groups(x: torch.Tensor, floor: float, pow2: bool = True) -> torch.Tensor:
    """x [..., D] (D a multiple of 128) rounded to e4m3 per group of 128 values, scale
    ``max(amax, floor) / 448``, rounded up to a power of two when ``pow2`` (fp32 back)."""
    shape = x.shape
    g = x.float().reshape(*shape[:-1], shape[-1] // QUANT_BLOCK, QUANT_BLOCK)
    scale = g.abs().amax(-1, keepdim=True).clamp(min=floor) / FP8_MAX
    if pow2:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (g / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    return (q * scale).reshape(shape)


def round_query(q: torch.Tensor) -> torch.Tensor:
    """vLLM's rounding of the indexer query (``per_token_group_quant_fp8``, eps 1e-10)."""
    return _round_groups(q, 1e-10).to(q.dtype)


def round_key(k: torch.Tensor) -> torch.Tensor:
    """vLLM's rounding of an indexer key in its cache (``indexer_k_quant_and_cache``)."""
    return _round_groups(k, 1e-4).to(k.dtype)


def round_ds_mla_ckv(c_kv: torch.Tensor) -> torch.Tensor:
    """c_kv [..., r] as ``fp8_ds_mla`` stores it (module docstring: per token and tile of 128,
    ``scale = max(amax / 448, FLT_MIN)``), in c_kv's dtype."""
    floor = torch.finfo(torch.float32).tiny * FP8_MAX  # scale >= FLT_MIN
    return _round_groups(c_kv, floor, pow2=False).to(c_kv.dtype)


def round_per_tensor_fp8(x: torch.Tensor) -> torch.Tensor:
    """x as the per-tensor fp8 cache stores it (scale 1.0: e4m3 and back, as the dense fp8
    tests' ``conftest.fp8_roundtrip``)."""
    return x.to(torch.float8_e4m3fn).to(x.dtype)


#: ``--kv-cache-dtype`` -> (rounding of c_kv, rounding of k_pe) of the cached latents
LATENT_ROUNDING: dict[str, tuple[Any, Any]] = {
    "auto": (None, None),
    "fp8": (round_per_tensor_fp8, round_per_tensor_fp8),
    "fp8_e4m3": (round_per_tensor_fp8, round_per_tensor_fp8),
    "fp8_ds_mla": (round_ds_mla_ckv, None),
}


def round_cached_latents(attn: Any, latent_cache: str) -> None:
    """Wrap ``attn.expand_kv`` (c_kv [B, 1, S, r], k_pe [B, 1, S, rope] -> keys, values) so
    that it reads the latents as the ``latent_cache`` cache stores them."""
    if latent_cache not in LATENT_ROUNDING:
        raise ValueError(f"latent_cache={latent_cache!r}; supported: {', '.join(LATENT_ROUNDING)}")
    round_ckv, round_kpe = LATENT_ROUNDING[latent_cache]
    if round_ckv is None and round_kpe is None:
        return
    orig = attn.expand_kv

    def expand_kv(c_kv: torch.Tensor, k_pe: torch.Tensor) -> Any:
        c_kv = round_ckv(c_kv) if round_ckv is not None else c_kv
        k_pe = round_kpe(k_pe) if round_kpe is not None else k_pe
        return orig(c_kv, k_pe)

    attn.expand_kv = expand_kv


@torch.no_grad()
def rounded_indexer_forward(
    self: Any,
    hidden_states: torch.Tensor,
    q_resid: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    past_key_values: Any = None,
) -> torch.Tensor:
    """transformers' ``DeepseekV32Indexer.forward`` / ``GlmMoeDsaIndexer.forward`` with vLLM's
    fp8 rounding of q_I and k_I (module docstring); ``self`` is the indexer module."""
    mod = sys.modules[type(self).__module__]
    rope = (
        mod.apply_rotary_pos_emb_interleave
        if getattr(self.config, "indexer_rope_interleave", False)
        else mod.apply_rotary_pos_emb
    )
    B, S, _ = hidden_states.shape
    cos, sin = position_embeddings
    q = self.wq_b(q_resid).view(B, S, self.n_heads, self.head_dim)
    rd = self.qk_rope_head_dim
    q_rot, q_pass = torch.split(q, [rd, self.head_dim - rd], dim=-1)
    k = self.k_norm(self.wk(hidden_states)).unsqueeze(2)
    k_rot, k_pass = torch.split(k, [rd, self.head_dim - rd], dim=-1)
    q_rot, k_rot = rope(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = round_query(torch.cat([q_rot, q_pass], dim=-1))
    k = round_key(torch.cat([k_rot, k_pass], dim=-1).squeeze(2))
    if past_key_values is not None:
        k = past_key_values.update_indexer(k, self.layer_idx)
    scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)))
    scores = scores * self.softmax_scale
    weights = self.weights_proj(hidden_states.to(self.weights_proj.weight.dtype)).float()
    index_scores = torch.matmul((weights * self.n_heads**-0.5).unsqueeze(-2), scores).squeeze(-2)
    if attention_mask.dtype == torch.bool:
        index_scores = index_scores.masked_fill(~attention_mask, float("-inf"))
    else:
        index_scores = index_scores + attention_mask
    topk = min(self.index_topk, index_scores.shape[-1])
    # the documented tie rule (a tie goes to the lower position): a stable descending sort
    order = torch.sort(index_scores, dim=-1, descending=True, stable=True).indices
    return order[..., :topk].to(torch.int32)


class DSAOracle:
    """transformers' DSA model (fp32, eager) on a checkpoint folder; ``fp8_indexer=True``: the
    indexers round q_I / k_I as vLLM does (module docstring); ``index_topk``: overrides the
    checkpoint's (e.g. above every context: the dense model, for negative controls);
    ``latent_cache``: the ``--kv-cache-dtype`` whose rounding of the cached c_kv / k_pe the
    attention reads (``auto``: none; module docstring)."""

    def __init__(
        self,
        path: Path,
        fp8_indexer: bool = False,
        index_topk: int | None = None,
        latent_cache: str = "auto",
    ) -> None:
        import transformers

        # the model classes by name: vLLM registers its own config class for "deepseek_v32"
        # with transformers' Auto* mappings (DeepseekV3Config, no indexer) once an engine is
        # built in the process, so AutoModelForCausalLM would then load a dense DeepSeek-V3
        config = json.loads((Path(path) / "config.json").read_text())
        cls = getattr(transformers, config["architectures"][0])
        cfg = getattr(transformers, cls.__name__.replace("ForCausalLM", "Config"))
        self.model = cls.from_pretrained(
            str(path),
            config=cfg.from_pretrained(str(path)),
            dtype=torch.float32,
            attn_implementation="eager",
        ).eval()
        self.fp8_indexer = fp8_indexer
        self.indexers = [
            layer.self_attn.indexer
            for layer in self.model.model.layers
            if getattr(layer.self_attn, "indexer", None) is not None
        ]
        if not self.indexers:
            raise RuntimeError(f"{type(self.model).__name__} at {path} has no indexer layers")
        for ix in self.indexers:
            if index_topk is not None:
                ix.index_topk = index_topk
        if fp8_indexer:
            for ix in self.indexers:
                ix.forward = MethodType(rounded_indexer_forward, ix)
        for layer in self.model.model.layers:
            round_cached_latents(layer.self_attn, latent_cache)

    @torch.no_grad()
    def greedy(self, prompt: list[int], max_new: int) -> list[int]:
        """``max_new`` greedy tokens, one full forward (no cache) per token."""
        ids = list(prompt)
        for _ in range(max_new):
            logits = self.model(torch.tensor([ids]), use_cache=False).logits[0, -1]
            ids.append(int(logits.argmax()))
        return ids[len(prompt) :]

    @torch.no_grad()
    def logprobs_along(self, prompt: list[int], tokens: list[int]) -> torch.Tensor:
        """[len(tokens), vocab] log-softmax before each of ``tokens`` (teacher forcing)."""
        logits = self.model(torch.tensor([prompt + tokens]), use_cache=False).logits[0].float()
        return torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
