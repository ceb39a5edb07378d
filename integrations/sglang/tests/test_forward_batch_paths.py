"""The paths SGLang's harness does not drive, through real SGLang objects, vs the core's oracle.

Real ``ReqToTokenPool`` / ``MLATokenToKVPool`` / ``ForwardBatch`` / ``RadixAttention`` (pages
shuffled within each request, as the harness does), non-DeepSeek dims (nope != r, v != nope),
and ``mla_backend.testing.reference.reference_mla_attention`` (plain fp32 decompressed MHA from the
paper's formulas) as the oracle:

- normal (MHA) path: ``attn_mha`` calls for fresh prefills and for extends onto a cached
  prefix, the prefix decompressed in several chunks (chunked-prefix path);
- absorbed path with the separate ``q_rope`` / ``k_rope`` convention and the backend's own
  cache write (``save_kv_cache=True``), for EXTEND, DECODE, TARGET_VERIFY and DRAFT_EXTEND_V2;
- the forward-method handler's answers, and start-up failures naming the unsupported value.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from mla_backend_integrations.sglang.backend import MLAAbsorbBackend
from mla_backend_integrations.sglang.handler import handle_attention_mla_absorb
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import (
    AttnForwardMethod,
)
from sglang.test.kits.attention_unittest.attention_methods import dense_attention as dh
from sglang.test.kits.attention_unittest.attention_methods import mla_attention as mh

import mla_backend as mb
import mla_backend.normal as mb_normal
from mla_backend.testing.reference import reference_mla_attention

H, R, ROPE, NOPE, V = 4, 40, 16, 24, 20
MAX_CTX = 256


class Setup:
    """Pools, ForwardBatch and backend of one case; latents of every token known."""

    def __init__(self, mode, prefix, new, page_size, dtype, kv_fp8=False, seed=0):
        self.prefix, self.new, self.dtype = list(prefix), list(new), dtype
        g = torch.Generator().manual_seed(seed)
        case = mh.MLAAttentionCase(
            name=f"c{seed}",
            backend="mla_absorb",
            forward_mode=ForwardMode.EXTEND if mode != ForwardMode.DECODE else mode,
            num_heads=H,
            page_size=page_size,
            prefix_lens=tuple(prefix),
            extend_lens=tuple(new) if mode != ForwardMode.DECODE else (),
        )
        cfg = mh.TinyMLAModelConfig(
            num_heads=H, kv_lora_rank=R, qk_rope_head_dim=ROPE, hidden_size=64,
            context_len=MAX_CTX,
        )  # fmt: skip
        cfg.qk_nope_head_dim, cfg.v_head_dim = NOPE, V
        self.runner = mh.MockMLAModelRunner(
            case=case, model_config=cfg, dtype=dtype, device="cpu", max_context_len=MAX_CTX,
            kv_lora_rank=R, qk_rope_head_dim=ROPE, fp8_kv_cache=kv_fp8,
        )  # fmt: skip
        loc_fn = dh.make_loc_fn(
            "shuffled_pages", batch_size=case.batch_size, seq_lens=case.seq_lens,
            prefix_lens=case.prefix_lens, page_size=page_size, max_context_len=MAX_CTX,
            seed=seed,
        )  # fmt: skip
        self.fb = mh._make_forward_batch(
            case, self.runner, max_context_len=MAX_CTX, device="cpu", loc_fn=loc_fn
        )
        if mode == ForwardMode.TARGET_VERIFY:
            # SGLang's verify batch: seq_lens = cached tokens, drafts are the query rows
            self.fb.forward_mode = mode
            self.fb.seq_lens = torch.tensor(prefix, dtype=torch.int32)
            self.fb.seq_lens_cpu = self.fb.seq_lens.clone()
            self.fb.spec_info = SimpleNamespace(num_tokens_per_req=new[0], custom_mask=None)
        elif mode == ForwardMode.DRAFT_EXTEND_V2:
            self.fb.forward_mode = mode
        self.backend = MLAAbsorbBackend(self.runner)
        self.loc_fn = loc_fn
        L = [p + n for p, n in zip(prefix, new, strict=True)]
        self.c_kv = [torch.randn(n, R, generator=g).to(dtype) for n in L]
        self.k_pe = [torch.randn(n, ROPE, generator=g).to(dtype) for n in L]
        T = sum(new)
        self.q_nope = torch.randn(T, H, NOPE, generator=g).to(dtype)
        self.q_pe = torch.randn(T, H, ROPE, generator=g).to(dtype)
        self.kv_b = (torch.randn(H * (NOPE + V), R, generator=g) * 0.2).to(dtype)
        self.scale = (NOPE + ROPE) ** -0.5
        self.pool = self.runner.token_to_kv_pool
        self.kv_dtype = self.runner.kv_cache_dtype

    def write(self, layer, upto_prefix_only: bool) -> None:
        """Write latents with SGLang's own pool API (the model's write in the MHA path)."""
        locs, rows = [], []
        for i, (p, n) in enumerate(zip(self.prefix, self.new, strict=True)):
            end = p if upto_prefix_only else p + n
            for pos in range(end):
                locs.append(self.loc_fn(i, pos))
            rows.append(torch.cat([self.c_kv[i][:end], self.k_pe[i][:end]], -1))
        if locs:
            cache_k = torch.cat(rows)[:, None, :]
            self.pool.set_kv_buffer(layer, torch.tensor(locs), cache_k, None)

    def reference(self) -> torch.Tensor:
        """The oracle on what the pool stores (fp8 pools: the dequantized latents)."""

        def stored(x):
            return x.to(self.kv_dtype).to(torch.float32)

        return reference_mla_attention(
            self.q_nope.float(), self.q_pe.float(),
            [stored(c) for c in self.c_kv], [stored(k) for k in self.k_pe],
            self.kv_b.float(), NOPE, V, self.new, self.scale,
        )  # fmt: skip


def _mha_layer(kv_b: torch.Tensor) -> RadixAttention:
    layer = RadixAttention(
        num_heads=H, head_dim=NOPE + ROPE, scaling=(NOPE + ROPE) ** -0.5, num_kv_heads=H,
        layer_id=0, v_head_dim=V,
    )  # fmt: skip
    layer.kv_b_proj = SimpleNamespace(weight=kv_b)  # what DeepseekV2AttentionMLA attaches
    return layer


def _mqa_layer() -> RadixAttention:
    return RadixAttention(
        num_heads=H, head_dim=R + ROPE, scaling=(NOPE + ROPE) ** -0.5, num_kv_heads=1,
        layer_id=0, v_head_dim=R,
    )  # fmt: skip


def _tol(dtype):
    return dict(atol=2e-2, rtol=2e-2) if dtype != torch.float32 else dict(atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "prefix,new", [((0, 0, 0), (17, 1, 40)), ((40, 0, 100), (9, 23, 30))], ids=["fresh", "cached"]
)
def test_normal_path_vs_oracle(prefix, new, dtype, page_size, monkeypatch):
    s = Setup(ForwardMode.EXTEND, prefix, new, page_size, dtype, seed=page_size + len(prefix))
    s.backend.policy = mb.Policy("normal")
    merges = []
    real_merge = mb_normal.merge_attention_states

    def counting_merge(*a, **k):
        merges.append(1)
        return real_merge(*a, **k)

    # small chunks, so a 100-token prefix is decompressed in 7 chunks merged by LSE
    monkeypatch.setattr(mb_normal, "merge_attention_states", counting_merge)
    real_init = mb.MLAAttention.__init__

    def init_small_chunks(self, *args, **kwargs):
        kwargs["chunk_tokens"] = 16
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(mb.MLAAttention, "__init__", init_small_chunks)
    layer = _mha_layer(s.kv_b)
    s.write(layer, upto_prefix_only=False)
    q = torch.cat([s.q_nope, s.q_pe], -1)
    kv_dummy = torch.zeros(q.shape[0], H, NOPE + ROPE, dtype=dtype)
    v_dummy = torch.zeros(q.shape[0], H, V, dtype=dtype)
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=s.backend)):
        s.backend.init_forward_metadata(s.fb)
        out = layer(q, kv_dummy, v_dummy, s.fb, save_kv_cache=False)
    assert out.shape == (q.shape[0], H * V)
    torch.testing.assert_close(out.view(-1, H, V).float(), s.reference(), **_tol(dtype))
    expected_chunks = sum(-(-p // 16) for p in prefix)
    assert len(merges) == expected_chunks


def test_normal_path_fp8_pool():
    s = Setup(ForwardMode.EXTEND, (0, 30), (20, 6), 16, torch.bfloat16, kv_fp8=True, seed=7)
    s.backend.policy = mb.Policy("normal")
    layer = _mha_layer(s.kv_b)
    s.write(layer, upto_prefix_only=False)
    q = torch.cat([s.q_nope, s.q_pe], -1)
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=s.backend)):
        s.backend.init_forward_metadata(s.fb)
        out = layer(q, q, q[..., :V], s.fb, save_kv_cache=False)
    torch.testing.assert_close(out.view(-1, H, V).float(), s.reference(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize(
    "mode,prefix,new",
    [
        (ForwardMode.EXTEND, (0, 5, 33), (6, 4, 2)),
        (ForwardMode.DECODE, (14, 15, 31), (1, 1, 1)),
        (ForwardMode.TARGET_VERIFY, (10, 20), (4, 4)),
        (ForwardMode.DRAFT_EXTEND_V2, (12, 3), (3, 3)),
    ],
    ids=["extend", "decode", "target_verify", "draft_extend"],
)
@pytest.mark.parametrize("page_size", [1, 16])
def test_absorbed_split_convention_vs_oracle(mode, prefix, new, page_size):
    """``q_rope``/``k_rope`` passed separately; the backend writes the new latents itself."""
    dtype = torch.float32
    s = Setup(mode, prefix, new, page_size, dtype, seed=3 + page_size)
    layer = _mqa_layer()
    s.write(layer, upto_prefix_only=True)
    w = mb.split_kv_b_proj(s.kv_b, mb.MLADims(H, R, NOPE, ROPE, V))
    q_lat = mb.absorb_q(s.q_nope, w)
    new_c = torch.cat([c[p:] for c, p in zip(s.c_kv, prefix, strict=True)])
    new_pe = torch.cat([k[p:] for k, p in zip(s.k_pe, prefix, strict=True)])
    locs = [
        s.loc_fn(i, p + j)
        for i, (p, n) in enumerate(zip(prefix, new, strict=True))
        for j in range(n)
    ]
    s.fb.out_cache_loc = torch.tensor(locs, dtype=torch.int64)
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=s.backend)):
        s.backend.init_forward_metadata(s.fb)
        kv_lens = s.backend.forward_metadata.plan.step.kv_lens
        assert list(kv_lens) == [p + n for p, n in zip(prefix, new)]
        o_lat = layer(
            q_lat, new_c[:, None, :], new_c[:, None, :], s.fb,
            q_rope=s.q_pe, k_rope=new_pe[:, None, :],
        )  # fmt: skip
    out = mb.apply_W_UV(o_lat.view(-1, H, R), w)
    torch.testing.assert_close(out.float(), s.reference(), atol=1e-4, rtol=1e-4)


class _Attn:
    """What the handler sees of DeepseekV2AttentionMLA (weak-referenceable like a module)."""


def _attn_stub(kv_b):
    w = kv_b.view(H, NOPE + V, R)
    attn = _Attn()
    attn.attn_mha = SimpleNamespace(layer_id=0)
    attn.w_kc = w[:, :NOPE, :]  # [H, nope, r] as SGLang's loader leaves it
    attn.w_vc = w[:, NOPE:, :].transpose(1, 2)  # [H, r, v]
    attn.use_deep_gemm_bmm = False
    return attn


@pytest.mark.parametrize(
    "mode,prefix,new,expected",
    [
        (ForwardMode.EXTEND, (0, 0), (30, 5), AttnForwardMethod.MHA),  # fresh prefill
        (ForwardMode.EXTEND, (10, 0), (3, 5), AttnForwardMethod.MLA),  # short cached prefix
        (ForwardMode.EXTEND, (60, 0), (3, 5), AttnForwardMethod.MHA),  # >= threshold: chunked
        (ForwardMode.DECODE, (10, 70), (1, 1), AttnForwardMethod.MLA),
        (ForwardMode.TARGET_VERIFY, (0, 0), (4, 4), AttnForwardMethod.MLA),
    ],
)
def test_handler_follows_core_policy(mode, prefix, new, expected):
    s = Setup(mode, prefix, new, 1, torch.float32, seed=11)
    s.backend.policy = mb.Policy("sglang", chunked_prefix_threshold=48)
    with forward_context(ForwardContext(attn_backend=s.backend)):
        s.backend.init_forward_metadata(s.fb)
        assert handle_attention_mla_absorb(_attn_stub(s.kv_b), s.fb) == expected


def test_weights_from_bound_module_match_kv_b_proj():
    """The normal path's weights come from the model's w_kc/w_vc once the handler binds it."""
    s = Setup(ForwardMode.EXTEND, (0,), (8,), 1, torch.float32, seed=5)
    attn = _attn_stub(s.kv_b)  # the model keeps its modules alive; the backend refs weakly
    s.backend.bind_layer(attn)
    got = s.backend._weights(_mqa_layer())
    w = s.kv_b.view(H, NOPE + V, R)
    torch.testing.assert_close(got.W_UK, w[:, :NOPE])
    torch.testing.assert_close(got.W_UV, w[:, NOPE:].transpose(1, 2))
    # contiguous and in the model's dtype: the model's tensors are used as they are (no copy)
    attn.w_kc, attn.w_vc = attn.w_kc.contiguous(), attn.w_vc.contiguous()
    shared = s.backend._weights(_mqa_layer())
    assert shared.W_UK.data_ptr() == attn.w_kc.data_ptr()
    assert shared.W_UV.data_ptr() == attn.w_vc.data_ptr()


def _runner(**over):
    base = mh.MockMLAModelRunner(
        case=mh.make_mla_cases("mla_absorb")[0],
        model_config=mh.TinyMLAModelConfig(
            num_heads=H, kv_lora_rank=R, qk_rope_head_dim=ROPE, hidden_size=64, context_len=64
        ),
        dtype=torch.bfloat16, device="cpu", max_context_len=64, kv_lora_rank=R,
        qk_rope_head_dim=ROPE,
    )  # fmt: skip
    for k, v in over.items():
        setattr(base, k, v)
    return base


def test_startup_rejects_unsupported_kv_dtype():
    with pytest.raises(ValueError, match="float8_e5m2"):
        MLAAbsorbBackend(_runner(kv_cache_dtype=torch.float8_e5m2, kv_cache_dtype_str="fp8_e5m2"))


def test_startup_rejects_a_plain_cache_of_another_dtype():
    """--dtype float32 with --kv-cache-dtype bfloat16: the attention reads a plain cache in the
    model's dtype, so start-up refuses it naming both (it failed at the first forward)."""
    with pytest.raises(ValueError, match="bfloat16 latent cache with torch.float32 queries"):
        MLAAbsorbBackend(_runner(dtype=torch.float32, kv_cache_dtype=torch.bfloat16,
                                 kv_cache_dtype_str="bfloat16"))  # fmt: skip
    MLAAbsorbBackend(_runner(dtype=torch.float32, kv_cache_dtype=torch.float32))
    MLAAbsorbBackend(_runner(dtype=torch.float32, kv_cache_dtype=torch.float8_e4m3fn))


def test_startup_rejects_non_mla_model():
    with pytest.raises(ValueError, match="does not use MLA"):
        MLAAbsorbBackend(_runner(use_mla_backend=False))


def test_startup_rejects_tree_speculation():
    sa = SimpleNamespace(speculative_algorithm="EAGLE", speculative_eagle_topk=4)
    with pytest.raises(ValueError, match="speculative-eagle-topk 4"):
        MLAAbsorbBackend._check_runtime_options(SimpleNamespace(server_args=sa))


def test_cuda_graphs_fail_with_a_clear_message():
    backend = MLAAbsorbBackend(_runner())
    with pytest.raises(ValueError, match="--disable-cuda-graph"):
        backend.init_cuda_graph_state(8, 64)
