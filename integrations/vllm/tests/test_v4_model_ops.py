"""The eager stand-ins of DeepSeek-V4's non-attention ``_C`` kernels
(:mod:`mla_backend_integrations.vllm.v4_model_ops`), registered under ``torch.ops._C`` as the
project registers them and called through vLLM's own callers, against independent references:

* the hyper-connections (mHC): vLLM's CPU decoder layer (``_forward_unfused_post_pre``: its
  ``hc_pre`` / ``hc_post`` through the ``MHCPreOp`` / ``MHCPostOp`` custom ops) and its
  ``HCHeadOp`` against transformers' ``DeepseekV4DecoderLayer`` / ``DeepseekV4HyperConnection``
  / ``DeepseekV4HyperHead`` on the same weights (fp32; the sub-layers stubbed by one function on
  both sides), and against vLLM's eager ``mhc_pre_torch`` / ``mhc_post_torch`` (bf16);
* the routers: vLLM's ``_sqrtsoftplus_bias_topk`` against transformers' ``DeepseekV4TopKRouter``
  (exact ties included) and ``DeepseekV4HashRouter``;
* the grouped GEMM: vLLM's ``wo_a`` packing and ``_o_proj`` against a plain einsum and
  transformers' ``DeepseekV4GroupedLinear`` + ``o_b_proj``; the fp8-scaled, strided form vLLM's
  AMX MLA uses against an einsum;
* bad arguments: ``ValueError`` naming the value.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from mla_backend_integrations.vllm import v4_model_ops as ops

tf = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")


@pytest.fixture(scope="module", autouse=True)
def c_ops() -> Iterator[list[str]]:
    """This module's functions as the CPU kernels of ``torch.ops._C``'s ops: defined (from
    :data:`SCHEMAS`) where vLLM's library lacks them, as the project registers them; where an op
    exists already (an AVX512-BF16 build, or the project's registration earlier in the session)
    our function overrides its CPU kernel for this module's tests. Removed afterwards."""
    import vllm._custom_ops  # noqa: F401  (loads the platform's _C library first)

    lib = torch.library.Library("_C", "FRAGMENT")
    defined = []
    for name, schema in ops.SCHEMAS.items():
        if not hasattr(torch.ops._C, name):
            lib.define(schema)
            defined.append(name)
        lib.impl(name, getattr(ops, name), "CPU")
    yield defined
    lib._destroy()


@pytest.fixture(scope="module")
def vllm_mhc() -> SimpleNamespace:
    """vLLM's mHC custom ops as its CPU model builds them (dispatching to ``forward_cpu``)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers import mhc

    with set_current_vllm_config(VllmConfig()):
        return SimpleNamespace(pre=mhc.MHCPreOp(), post=mhc.MHCPostOp(), head=mhc.HCHeadOp())


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _config(**kw: Any) -> Any:
    """A one-layer transformers DeepSeek-V4 config (sliding attention, tiny dims)."""
    import transformers

    base = dict(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, head_dim=64,
        partial_rotary_factor=0.5, q_lora_rank=16, layer_types=["sliding_attention"],
        mlp_layer_types=["moe"], n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, o_groups=1, o_lora_rank=16, num_nextn_predict_layers=0,
    )  # fmt: skip
    base.update(kw)
    return transformers.DeepseekV4Config(**base)


def _fill_hc(module: torch.nn.Module, names: tuple[str, str, str], gen: torch.Generator) -> None:
    """Random mHC weights (fn, base, scale) of a size that makes every gate non-trivial."""
    fn, base, scale = (getattr(module, n) for n in names)
    with torch.no_grad():
        fn.copy_(torch.randn(fn.shape, generator=gen) * fn.shape[1] ** -0.5)
        base.copy_(0.5 * torch.randn(base.shape, generator=gen))
        scale.copy_(1 + 0.3 * torch.randn(scale.shape, generator=gen))


def _hc_weights(hc: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return hc.fn.detach(), hc.scale.detach(), hc.base.detach()


# ------------------------------------------------------------------ mHC vs transformers

#: (hc_mult, hidden, batch, seq, sinkhorn iterations, hc_eps, rms_norm_eps); the large
#: epsilons make a dropped or misplaced one show
HC_GRID = [
    (2, 128, 1, 5, 20, 0.05, 0.3),  # the tiny V4 checkpoint's hc_mult / hidden
    (4, 64, 2, 3, 20, 1e-6, 1e-6),  # DeepSeek-V4's hc_mult, iterations and epsilons
    (4, 96, 1, 1, 1, 0.02, 1e-6),  # one token, one column normalisation only
    (3, 40, 3, 2, 3, 1e-6, 0.5),
]
HC_ARGS = ("hc_mult", "hidden", "batch", "seq", "iters", "hc_eps", "rms_eps")


@pytest.mark.parametrize(HC_ARGS, HC_GRID)
def test_hc_pre_matches_transformers_hyper_connection(
    vllm_mhc: SimpleNamespace, hc_mult: int, hidden: int, batch: int, seq: int, iters: int,
    hc_eps: float, rms_eps: float,
) -> None:  # fmt: skip
    cfg = _config(
        hidden_size=hidden, hc_mult=hc_mult, hc_sinkhorn_iters=iters, hc_eps=hc_eps,
        rms_norm_eps=rms_eps,
    )  # fmt: skip
    gen = _gen(hc_mult * 1000 + hidden + iters)
    hc = tf.DeepseekV4HyperConnection(cfg)
    _fill_hc(hc, ("fn", "base", "scale"), gen)
    x = torch.randn(batch, seq, hc_mult, hidden, generator=gen)
    with torch.no_grad():
        post, comb, collapsed = hc(x)
        fn, scale, base = _hc_weights(hc)
        # as vLLM's CPU model feeds it: the step's tokens flattened, [T, hc_mult, hidden]
        v_post, v_comb, v_in = vllm_mhc.pre(
            residual=x.reshape(-1, hc_mult, hidden), fn=fn, hc_scale=scale, hc_base=base,
            rms_eps=cfg.rms_norm_eps, hc_pre_eps=cfg.hc_eps, hc_sinkhorn_eps=cfg.hc_eps,
            hc_post_mult_value=2.0, sinkhorn_repeat=iters,
        )  # fmt: skip
    t = batch * seq
    assert v_post.shape == (t, hc_mult, 1) and v_post.dtype == torch.float32
    assert v_comb.shape == (t, hc_mult, hc_mult) and v_comb.dtype == torch.float32
    assert v_in.shape == (t, hidden) and v_in.dtype == x.dtype
    torch.testing.assert_close(v_post.reshape(post.shape), post, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(v_comb.reshape(comb.shape), comb, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(v_in.reshape(collapsed.shape), collapsed, rtol=1e-5, atol=1e-5)
    if iters >= 20 and hc_eps < 1e-3:  # Sinkhorn converged: doubly stochastic
        ones = torch.ones(t, hc_mult)
        torch.testing.assert_close(v_comb.sum(-2), ones, rtol=0, atol=1e-3)
        torch.testing.assert_close(v_comb.sum(-1), ones, rtol=0, atol=1e-3)


@pytest.mark.parametrize(HC_ARGS, HC_GRID)
def test_decoder_layer_streams_match_transformers(
    vllm_mhc: SimpleNamespace, hc_mult: int, hidden: int, batch: int, seq: int, iters: int,
    hc_eps: float, rms_eps: float,
) -> None:  # fmt: skip
    """One whole decoder layer's stream bookkeeping: vLLM's CPU ``DeepseekV4DecoderLayer.
    _forward_unfused_post_pre`` (hc_pre, norm, attention, hc_post, hc_pre, norm, MoE, hc_post)
    against transformers' ``DeepseekV4DecoderLayer.forward``, with the same norms and both
    sub-layers replaced by one fixed function on both sides."""
    from vllm.models.deepseek_v4.cpu.model import DeepseekV4DecoderLayer

    cfg = _config(
        hidden_size=hidden, hc_mult=hc_mult, hc_sinkhorn_iters=iters, hc_eps=hc_eps,
        rms_norm_eps=rms_eps,
    )  # fmt: skip
    gen = _gen(hc_mult * 7 + hidden + iters)
    layer = tf.DeepseekV4DecoderLayer(cfg, 0).eval()
    for name in ("attn_hc", "ffn_hc"):
        _fill_hc(getattr(layer, name), ("fn", "base", "scale"), gen)
    w_attn = torch.randn(hidden, hidden, generator=gen) * hidden**-0.5
    w_ffn = torch.randn(hidden, hidden, generator=gen) * hidden**-0.5

    def attn(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ w_attn.t())

    def ffn(x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x @ w_ffn.t()) * 0.5

    class Attn(torch.nn.Module):
        def forward(self, x: torch.Tensor, **_: Any) -> tuple[torch.Tensor, None]:
            return attn(x), None

    class Mlp(torch.nn.Module):
        def forward(self, x: torch.Tensor, input_ids: Any = None) -> torch.Tensor:
            return ffn(x)

    layer.self_attn, layer.mlp = Attn(), Mlp()
    v = SimpleNamespace(
        mhc_pre=vllm_mhc.pre, mhc_post=vllm_mhc.post, rms_norm_eps=cfg.rms_norm_eps,
        hc_eps=cfg.hc_eps, hc_post_alpha=2.0, hc_sinkhorn_iters=iters,
        attn_norm=layer.input_layernorm, ffn_norm=layer.post_attention_layernorm,
        attn=lambda positions, x, _: attn(x), ffn=lambda x, input_ids: ffn(x),
    )  # fmt: skip
    v.hc_attn_fn, v.hc_attn_scale, v.hc_attn_base = _hc_weights(layer.attn_hc)
    v.hc_ffn_fn, v.hc_ffn_scale, v.hc_ffn_base = _hc_weights(layer.ffn_hc)
    v.hc_pre = functools.partial(DeepseekV4DecoderLayer.hc_pre, v)
    v.hc_post = functools.partial(DeepseekV4DecoderLayer.hc_post, v)

    x = torch.randn(batch, seq, hc_mult, hidden, generator=gen)
    with torch.no_grad():
        want = layer(x)
        t = batch * seq
        got, *_ = DeepseekV4DecoderLayer._forward_unfused_post_pre(
            v, x.reshape(t, hc_mult, hidden), torch.arange(t), None
        )
    assert got.shape == (t, hc_mult, hidden) and got.dtype == torch.float32
    torch.testing.assert_close(got.reshape(want.shape), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("hc_mult", "hidden", "tokens"), [(2, 128, 6), (4, 64, 3), (3, 48, 1)])
def test_hc_head_matches_transformers_hyper_head(
    vllm_mhc: SimpleNamespace, hc_mult: int, hidden: int, tokens: int, dtype: torch.dtype
) -> None:
    """vLLM's model calls ``hc_head_op(h, fn, scale, base, rms_norm_eps, hc_eps)``; its wrapper
    swaps the two epsilons into the kernel's ``(hc_eps, norm_eps)``. Distinct epsilons here, so
    a swap would show."""
    cfg = _config(hidden_size=hidden, hc_mult=hc_mult, rms_norm_eps=0.5, hc_eps=0.02)
    gen = _gen(hc_mult * 31 + hidden + tokens)
    head = tf.DeepseekV4HyperHead(cfg)
    _fill_hc(head, ("hc_fn", "hc_base", "hc_scale"), gen)
    x = (0.3 * torch.randn(tokens, hc_mult, hidden, generator=gen)).to(dtype)
    with torch.no_grad():
        want = head(x.unsqueeze(0)).squeeze(0)
        got = vllm_mhc.head(
            x, head.hc_fn.detach(), head.hc_scale.detach(), head.hc_base.detach(),
            cfg.rms_norm_eps, cfg.hc_eps,
        )  # fmt: skip
        swapped = ops.hc_head_fused_cpu(
            x, head.hc_fn.detach(), head.hc_scale.detach(), head.hc_base.detach(),
            cfg.rms_norm_eps, cfg.hc_eps,
        )  # fmt: skip
    assert got.shape == (tokens, hidden) and got.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else {}
    torch.testing.assert_close(got, want, **tol)
    assert not torch.allclose(swapped.float(), want.float(), rtol=1e-3, atol=1e-4)


# ------------------------------------------------------------------ mHC vs vLLM's eager refs


@pytest.mark.parametrize(("outer", "hc_mult", "hidden", "iters"), [
    ((5,), 4, 64, 20), ((2, 3), 2, 128, 20), ((1,), 4, 32, 2),
])  # fmt: skip
def test_mhc_pre_post_match_vllm_eager_references(
    vllm_mhc: SimpleNamespace, outer: tuple[int, ...], hc_mult: int, hidden: int, iters: int
) -> None:
    """bf16 streams, as vLLM's ``mhc_pre_torch`` asserts; any leading shape (the wrappers
    flatten it to tokens and restore it)."""
    from vllm.model_executor.kernels.mhc.torch import mhc_post_torch, mhc_pre_torch

    gen = _gen(hc_mult * 13 + hidden + iters + len(outer))
    mix = (2 + hc_mult) * hc_mult
    fn = torch.randn(mix, hc_mult * hidden, generator=gen) * (hc_mult * hidden) ** -0.5
    scale = 1 + 0.3 * torch.randn(3, generator=gen)
    base = 0.5 * torch.randn(mix, generator=gen)
    residual = torch.randn(*outer, hc_mult, hidden, generator=gen).to(torch.bfloat16)
    layer_out = torch.randn(*outer, hidden, generator=gen).to(torch.bfloat16)
    args = (residual, fn, scale, base, 1e-6, 1e-6, 1e-6, 2.0, iters)
    want = mhc_pre_torch(*args)
    got = vllm_mhc.pre(*args)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[2], want[2])  # bf16: at most a rounding apart
    post_want = mhc_post_torch(layer_out, residual, want[0], want[1])
    post_got = vllm_mhc.post(layer_out, residual, want[0], want[1])
    assert post_got.shape == post_want.shape and post_got.dtype == torch.bfloat16
    torch.testing.assert_close(post_got, post_want)


# ------------------------------------------------------------------ routers


def _bias_topk(logits: torch.Tensor, top_k: int, bias: torch.Tensor, rsf: float) -> Any:
    from vllm.model_executor.layers.fused_moe.router.cpu_router import _sqrtsoftplus_bias_topk

    return _sqrtsoftplus_bias_topk(logits, top_k, True, bias, rsf, None, None)


def _by_id(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = ids.long().argsort(dim=-1)
    return weights.gather(1, order), ids.long().gather(1, order)


@pytest.mark.parametrize(("experts", "top_k", "rsf", "tokens"), [
    (4, 2, 1.5, 9),  # the tiny V4 checkpoint's router
    (64, 6, 2.5, 17),
    (256, 8, 1.0, 5),  # DeepSeek-V4-Flash's
    (16, 16, 1.0, 3),  # every expert
])  # fmt: skip
def test_biased_topk_matches_transformers_router(
    experts: int, top_k: int, rsf: float, tokens: int
) -> None:
    cfg = _config(
        hidden_size=48, n_routed_experts=experts, num_experts_per_tok=top_k,
        routed_scaling_factor=rsf,
    )  # fmt: skip
    gen = _gen(experts + top_k + tokens)
    router = tf.DeepseekV4TopKRouter(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen) * 48**-0.5)
        router.e_score_correction_bias.copy_(0.3 * torch.randn(experts, generator=gen))
        logits, want_w, want_ids = router(torch.randn(tokens, 48, generator=gen))
        got_w, got_ids = _bias_topk(logits, top_k, router.e_score_correction_bias, rsf)
    assert got_w.dtype == torch.float32 and got_ids.dtype == torch.int32
    assert got_w.shape == got_ids.shape == (tokens, top_k)
    want_w, want_ids = _by_id(want_w, want_ids)
    gw, gi = _by_id(got_w, got_ids)
    assert torch.equal(gi, want_ids)
    torch.testing.assert_close(gw, want_w, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got_w.sum(-1), torch.full((tokens,), rsf), rtol=1e-5, atol=0)
    # listed by descending bias-corrected score, as the kernel's partial sort lists them
    biased = torch.nn.functional.softplus(logits).sqrt() + router.e_score_correction_bias
    assert (biased.gather(1, got_ids.long()).diff(dim=-1) <= 0).all()


@pytest.mark.parametrize("biased", [False, True])
def test_biased_topk_ties_resolve_as_transformers(biased: bool) -> None:
    """Logits (and biases) from a handful of values: most rows tie across the top-k boundary.
    Both sides take ``torch.topk(sorted=False)`` of bitwise equal scores, so the selected
    experts agree on every row; each selected expert scores at least every unselected one."""
    experts, top_k, tokens = 16, 4, 64
    cfg = _config(n_routed_experts=experts, num_experts_per_tok=top_k)
    gen = _gen(7 + biased)
    router = tf.DeepseekV4TopKRouter(cfg)
    logits = torch.randint(-2, 3, (tokens, experts), generator=gen).float() / 2
    bias = torch.randint(0, 2, (experts,), generator=gen).float() / 4 if biased else None
    with torch.no_grad():
        router.weight.copy_(torch.eye(experts, cfg.hidden_size))
        router.e_score_correction_bias.copy_(bias if biased else torch.zeros(experts))
        hidden = torch.zeros(tokens, cfg.hidden_size)
        hidden[:, :experts] = logits
        t_logits, want_w, want_ids = router(hidden)
        assert torch.equal(t_logits, logits)
        got_w, got_ids = _bias_topk(logits, top_k, router.e_score_correction_bias, 1.5)
    scores = torch.nn.functional.softplus(logits).sqrt() + router.e_score_correction_bias
    straddling = sum(
        int((row == row[i].min()).sum() > (row[i] == row[i].min()).sum())
        for row, i in zip(scores, got_ids.long())
    )
    assert straddling > tokens // 4  # the case is a real tie case
    gw, gi = _by_id(got_w, got_ids)
    ww, wi = _by_id(want_w, want_ids)
    assert torch.equal(gi, wi)
    torch.testing.assert_close(gw, ww, rtol=1e-6, atol=1e-7)
    chosen = torch.zeros(tokens, experts, dtype=torch.bool).scatter(1, got_ids.long(), True)
    lowest_chosen = scores.masked_fill(~chosen, float("inf")).amin(-1)
    highest_left = scores.masked_fill(chosen, float("-inf")).amax(-1)
    assert (lowest_chosen >= highest_left).all()


@pytest.mark.parametrize("distinct", [True, False])
@pytest.mark.parametrize(("experts", "top_k", "rsf"), [(4, 2, 1.5), (256, 6, 2.5), (64, 8, 1.0)])
def test_hash_topk_matches_transformers_hash_router(
    experts: int, top_k: int, rsf: float, distinct: bool
) -> None:
    """The table's experts in its order, weighted by the renormalised scores; ``distinct``:
    rows of distinct experts (released tables), else random ids with repeats (the tiny
    checkpoint's table)."""
    from vllm.model_executor.layers.fused_moe.router.cpu_router import _sqrtsoftplus_bias_topk

    vocab, tokens = 40, 11
    cfg = _config(
        vocab_size=vocab, hidden_size=48, n_routed_experts=experts, num_experts_per_tok=top_k,
        routed_scaling_factor=rsf, mlp_layer_types=["hash_moe"],
    )  # fmt: skip
    gen = _gen(experts * 3 + top_k + distinct)
    router = tf.DeepseekV4HashRouter(cfg)
    if distinct:
        table = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(vocab)])
    else:
        table = torch.randint(0, experts, (vocab, top_k), generator=gen)
    input_ids = torch.randint(0, vocab, (1, tokens), generator=gen)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen) * 48**-0.5)
        router.tid2eid.copy_(table)
        hidden = torch.randn(1, tokens, 48, generator=gen)
        logits, want_w, want_ids = router(hidden, input_ids)
        # vLLM's CPU model keeps the table int32 and passes the step's token ids flat
        got_w, got_ids = _sqrtsoftplus_bias_topk(
            logits, top_k, True, None, rsf, input_ids.reshape(-1), table.to(torch.int32)
        )
    assert got_w.dtype == torch.float32 and got_ids.dtype == torch.int32
    assert torch.equal(got_ids.long(), want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------ grouped GEMM (wo_a)


def _attention_stub(heads: int, head_dim: int, groups: int, rank: int, w_a: torch.Tensor) -> Any:
    """What ``DeepseekV4CPUAttention._o_proj`` and its ``wo_a`` packing read of ``self``."""
    layer = SimpleNamespace(
        weight=w_a, quant_method=SimpleNamespace(process_weights_after_loading=lambda m: None)
    )
    return SimpleNamespace(
        wo_a=layer, n_local_heads=heads, n_local_groups=groups, head_dim=head_dim,
        o_lora_rank=rank, rotary_emb=SimpleNamespace(cos_sin_cache=torch.empty(0)),
    )  # fmt: skip


@pytest.mark.parametrize(("tokens", "heads", "head_dim", "groups", "rank", "hidden"), [
    (3, 4, 512, 2, 32, 128),  # the tiny V4 checkpoint's attention output dims
    (5, 8, 64, 4, 48, 40),  # o_lora_rank not a multiple of 32 (the AVX512 kernel's tile)
    (1, 2, 128, 1, 64, 32),
])  # fmt: skip
def test_o_proj_grouped_gemm(
    monkeypatch: pytest.MonkeyPatch,
    tokens: int, heads: int, head_dim: int, groups: int, rank: int, hidden: int,
) -> None:  # fmt: skip
    """vLLM packs ``wo_a`` (``convert_weight_packed`` of the ``[groups, rank, k]`` view) when the
    weights load and runs ``_o_proj``'s ``bmm_cpu``: ``z[t, g] = o[t, g-th head group] @
    wo_a[g]^T`` (bf16), then ``wo_b``. Against an einsum and against transformers'
    ``DeepseekV4GroupedLinear`` + ``o_b_proj``. The query derotation before the GEMM
    (``inverse_gptj_rope_o_proj_cpu``, an attention op) is the identity here."""
    from vllm.models.deepseek_v4.cpu import cpu_sparse

    gen = _gen(tokens + heads + head_dim + groups + rank)
    k = heads // groups * head_dim
    o_a = tf.DeepseekV4GroupedLinear(k, groups * rank, groups)
    o_b = torch.nn.Linear(groups * rank, hidden, bias=False)
    with torch.no_grad():
        # bf16-exact values: _o_proj runs the GEMM in bf16
        o_a.weight.copy_((torch.randn(groups * rank, k, generator=gen) * k**-0.5).bfloat16())
        o_b.weight.copy_(
            torch.randn(hidden, groups * rank, generator=gen) * (groups * rank) ** -0.5
        )
    o = torch.randn(tokens, heads, head_dim, generator=gen).bfloat16().float()

    attn = _attention_stub(heads, head_dim, groups, rank, o_a.weight.detach().clone())
    cpu_sparse.DeepseekV4CPUAttention._wrap_wo_a_process_weights_after_loading(attn)
    attn.wo_a.quant_method.process_weights_after_loading(attn.wo_a)
    packed = attn._wo_a_packed
    assert packed.shape == (groups, rank, k) and packed.dtype == torch.bfloat16
    assert attn.wo_a.weight.numel() == 0  # vLLM frees the raw weight after packing

    monkeypatch.setattr(
        cpu_sparse, "get_forward_context", lambda: SimpleNamespace(attn_metadata={})
    )
    monkeypatch.setattr(
        cpu_sparse.ops, "inverse_gptj_rope_o_proj_cpu", lambda o, pos, cache, dim: o.float()
    )
    positions = torch.arange(tokens)
    with torch.no_grad():
        attn.wo_b = lambda z: z
        z = cpu_sparse.DeepseekV4CPUAttention._o_proj(attn, o, positions)
        attn.wo_b = o_b
        out = cpu_sparse.DeepseekV4CPUAttention._o_proj(attn, o, positions)
        w = o_a.weight.detach().reshape(groups, rank, k)
        z_ref = torch.einsum("tgk,grk->tgr", o.reshape(tokens, groups, k), w)
        want = o_b(o_a(o.reshape(tokens, 1, groups, k)).flatten(2)).reshape(tokens, hidden)
    assert z.shape == (tokens, groups * rank)
    # one bf16 rounding of an fp32-accumulated product
    torch.testing.assert_close(z.reshape(tokens, groups, rank), z_ref, rtol=2**-8, atol=1e-6)
    torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))


@pytest.mark.parametrize("is_vnni", [True, False])
def test_bmm_fp8_weight_into_strided_out(is_vnni: bool) -> None:
    """vLLM's AMX MLA form: ``out`` and ``mat1`` transposed views ``[heads, tokens, .]``, an fp8
    ``[heads, L, P]`` weight with a 0-dim dequantization scale."""
    from vllm import _custom_ops as vops

    gen = _gen(11 + is_vnni)
    tokens, heads, p, lat = 5, 3, 16, 24
    q = torch.randn(tokens, heads, p, generator=gen).bfloat16()
    w = (torch.randn(heads, lat, p, generator=gen) * 100).to(torch.float8_e4m3fn)
    scale = torch.tensor(0.01)
    mat2 = torch.ops._C.convert_weight_packed(w) if is_vnni else w
    out = torch.full((tokens, heads, lat), float("nan"), dtype=torch.bfloat16)
    vops.bmm_cpu(out.transpose(0, 1), q.transpose(0, 1), mat2, is_vnni, scale)
    want = torch.einsum("thp,hlp->thl", q.float(), w.float() * 0.01)
    torch.testing.assert_close(out.float(), want, rtol=2**-8, atol=1e-3)


def test_convert_weight_packed_is_a_plain_copy() -> None:
    for shape in [(6, 4), (2, 6, 4)]:
        w = torch.randn(shape).bfloat16()
        packed = torch.ops._C.convert_weight_packed(w.transpose(-1, -2).contiguous().mT)
        assert torch.equal(packed, w) and packed.is_contiguous()
        assert packed.data_ptr() != w.data_ptr()


# ------------------------------------------------------------------ bad arguments


def _bad_calls() -> list[tuple[str, Callable[[], Any], str]]:
    x = torch.zeros(2, 4, 8)
    fn, scale3, base = torch.zeros(24, 32), torch.ones(3), torch.zeros(24)
    head_fn, scale1, head_base = torch.zeros(4, 32), torch.ones(1), torch.zeros(4)
    logits, bias = torch.zeros(3, 8), torch.zeros(8)
    table = torch.zeros(3, 2, dtype=torch.int32)

    def topk(**kw: Any) -> Callable[[], Any]:
        a = dict(hidden_states=logits, gating_output=logits, correction_bias=bias, topk=2,
                 renormalize=True, scoring_func="sqrtsoftplus", num_fused_shared_experts=0,
                 routed_scaling_factor=1.0, apply_routed_scaling_factor_on_output=True)  # fmt: skip
        a.update(kw)
        return lambda: ops.biased_topk_cpu(*a.values())

    def hashed(**kw: Any) -> Callable[[], Any]:
        a = dict(gating_output=logits, tid2eid=table, topk=2, scoring_func="sqrtsoftplus",
                 num_fused_shared_experts=0, num_experts=8, routed_scaling_factor=1.0)  # fmt: skip
        a.update(kw)
        return lambda: ops.hash_topk_cpu(*a.values())

    def pre(**kw: Any) -> Callable[[], Any]:
        a = dict(x=x, hc_fn=fn, hc_scale=scale3, hc_base=base, hc_mult=4, sinkhorn_iters=20,
                 rms_eps=1e-6, hc_eps=1e-6)  # fmt: skip
        a.update(kw)
        return lambda: ops.hc_pre_fused_cpu(*a.values())

    def bmm(out: Any, mat1: Any, mat2: Any, scale: Any = None) -> Callable[[], Any]:
        return lambda: ops.bmm_cpu(out, mat1, mat2, True, scale)

    m1, m2, o = torch.zeros(2, 3, 4), torch.zeros(2, 5, 4), torch.zeros(2, 3, 5)
    return [
        ("scoring sigmoid", topk(scoring_func="sigmoid"), "scoring_func='sigmoid'"),
        ("fused shared", topk(num_fused_shared_experts=1), "num_fused_shared_experts=1"),
        ("topk > experts", topk(topk=9), "topk=9"),
        ("bias size", topk(correction_bias=torch.zeros(7)), r"correction_bias shape \(7,\)"),
        ("token count", topk(hidden_states=torch.zeros(4, 8)), "hidden_states has 4 tokens"),
        ("scale None", topk(routed_scaling_factor=None), "routed_scaling_factor=None"),
        ("hash scoring", hashed(scoring_func="softmax"), "scoring_func='softmax'"),
        ("hash shared", hashed(num_fused_shared_experts=2), "num_fused_shared_experts=2"),
        ("hash experts", hashed(num_experts=6), "num_experts=6"),
        ("hash int64", hashed(tid2eid=table.long()), "tid2eid dtype torch.int64"),
        ("hash cols", hashed(topk=3), r"tid2eid shape \(3, 2\)"),
        ("hash id range", hashed(tid2eid=table + 8), r"expert ids in \[8, 8\]"),
        ("hc_mult", pre(hc_mult=2), "hc_mult=2"),
        ("sinkhorn 0", pre(sinkhorn_iters=0), "sinkhorn_iters=0"),
        ("hc_fn", pre(hc_fn=torch.zeros(24, 31)), r"hc_fn shape \(24, 31\)"),
        ("hc_scale", pre(hc_scale=torch.ones(2)), r"hc_scale must hold 3 values, got \(2,\)"),
        ("pre x 2-D", pre(x=torch.zeros(2, 32)), r"x must be \[T, hc_mult, hidden\]"),
        ("pre x int", pre(x=x.int()), "x dtype torch.int32"),
        (
            "post dtype",
            lambda: ops.hc_post_fused_cpu(
                torch.zeros(2, 8), x.bfloat16(), torch.zeros(2, 4), torch.zeros(2, 4, 4)
            ),
            "residual dtype torch.bfloat16",
        ),
        (
            "post comb",
            lambda: ops.hc_post_fused_cpu(
                torch.zeros(2, 8), x, torch.zeros(2, 4), torch.zeros(2, 4, 3)
            ),
            r"comb shape \(2, 4, 3\)",
        ),
        (
            "head scale",
            lambda: ops.hc_head_fused_cpu(x, head_fn, scale3, head_base, 1e-6, 1e-6),
            r"hc_scale must hold 1 value, got \(3,\)",
        ),
        (
            "head fn",
            lambda: ops.hc_head_fused_cpu(x, fn, scale1, head_base, 1e-6, 1e-6),
            r"hc_fn shape \(24, 32\)",
        ),
        ("bmm K", bmm(o, m1, torch.zeros(2, 5, 3)), r"mat2 shape \(2, 5, 3\)"),
        ("bmm out", bmm(torch.zeros(2, 5, 3), m1, m2), r"out shape \(2, 5, 3\)"),
        ("bmm dtype", bmm(o.bfloat16(), m1, m2), "out dtype torch.bfloat16"),
        ("bmm fp8 no scale", bmm(o, m1, m2.to(torch.float8_e4m3fn)), "needs a scale"),
        ("bmm scale", bmm(o, m1, m2, torch.ones(2)), r"scale must hold one .* \(2,\)"),
        ("pack 1-D", lambda: ops.convert_weight_packed(torch.zeros(4)), r"shape \(4,\)"),
    ]


@pytest.mark.parametrize(("call", "named"), [c[1:] for c in _bad_calls()],
                         ids=[c[0] for c in _bad_calls()])  # fmt: skip
def test_bad_arguments_raise_value_error_naming_the_value(call: Any, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        call()


def test_value_error_passes_through_the_registered_op() -> None:
    with pytest.raises(ValueError, match="scoring_func='sigmoid'"):
        torch.ops._C.hash_topk_cpu(
            torch.zeros(3, 8), torch.zeros(3, 2, dtype=torch.int32), 2, "sigmoid", 0, 8, 1.0
        )


def test_schemas_name_the_module_functions() -> None:
    for name, schema in ops.SCHEMAS.items():
        assert schema.startswith(name + "(") and callable(getattr(ops, name))
        assert getattr(torch.ops._C, name).default._schema.name == "_C::" + name
