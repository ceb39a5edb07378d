"""``fp8_ds_mla`` rows (DeepSeek's tile-scaled fp8 layout) in SGLang, below the server.

SGLang 0.5.23 on CPU refuses an fp8 KV cache for MLA models before any attention backend is
built (``KVCacheConfigurator.configure``: "CPU FP8 KV cache is only supported for MHA."), and
an attention backend never chooses the pool: the configurator builds it. The one pool class
that holds DeepSeek's tile-scaled rows is ``MLATokenToKVPool`` in its DSA fp8 mode
(``use_dsa=True``, ``dtype=float8_e4m3fn``, ``override_kv_cache_dim`` = row bytes), built by
the configurator only for DSA (NSA, DeepSeek-V3.2) models. Its rows are the core's
``fp8_ds_mla`` bytes (e4m3 c_kv | one float32 scale per 128 values | bf16 k_pe: 656 B at
r 512, rope 64). Here such a pool is built directly, handed to ``mla_absorb`` through the
harness's mock runner, and the backend runs on real ``ForwardBatch`` / ``RadixAttention``
objects (shuffled pages) against the oracle on the dequantized latents:

- the absorbed path with the backend's own cache write (separate ``q_rope``/``k_rope``),
  EXTEND and DECODE, page sizes 1 and 16;
- the normal (MHA) path over the same pool. SGLang's own writer for these rows (the model's
  ``set_mla_kv_buffer`` -> ``quantize_k_cache_separate``) is a Triton kernel with no CPU
  backend here, so the latents are written with the core's writer (``mb.write_latent``).
"""

from __future__ import annotations

import pytest
import torch
from mla_backend_integrations.sglang.backend import MLAAbsorbBackend
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
from sglang.test.kits.attention_unittest.attention_methods import dense_attention as dh
from sglang.test.kits.attention_unittest.attention_methods import mla_attention as mh

import mla_backend as mb
from mla_backend.cache_layout import CacheLayout
from mla_backend.testing.cases import ds_mla_dequantized
from mla_backend.testing.reference import reference_mla_attention

H, R, ROPE, NOPE, V = 4, 512, 64, 32, 32
MAX_CTX = 128
DTYPE = torch.bfloat16


def _ds_pool(runner, page_size: int, width: int) -> MLATokenToKVPool:
    old = runner.token_to_kv_pool
    return MLATokenToKVPool(
        size=old.size, page_size=page_size, dtype=torch.float8_e4m3fn, kv_lora_rank=R,
        qk_rope_head_dim=ROPE, layer_num=1, device="cpu", enable_memory_saver=False,
        use_dsa=True, override_kv_cache_dim=width,
    )  # fmt: skip


class DsSetup:
    def __init__(self, mode, prefix, new, page_size, seed=0):
        self.prefix, self.new = list(prefix), list(new)
        g = torch.Generator().manual_seed(seed)
        case = mh.MLAAttentionCase(
            name=f"ds{seed}", backend="mla_absorb",
            forward_mode=ForwardMode.EXTEND if mode != ForwardMode.DECODE else mode,
            num_heads=H, page_size=page_size, prefix_lens=tuple(prefix),
            extend_lens=tuple(new) if mode != ForwardMode.DECODE else (),
        )  # fmt: skip
        cfg = mh.TinyMLAModelConfig(
            num_heads=H, kv_lora_rank=R, qk_rope_head_dim=ROPE, hidden_size=64,
            context_len=MAX_CTX,
        )  # fmt: skip
        cfg.qk_nope_head_dim, cfg.v_head_dim = NOPE, V
        self.runner = mh.MockMLAModelRunner(
            case=case, model_config=cfg, dtype=DTYPE, device="cpu", max_context_len=MAX_CTX,
            kv_lora_rank=R, qk_rope_head_dim=ROPE, fp8_kv_cache=True,
        )  # fmt: skip
        self.layout = CacheLayout.ds_mla(R, ROPE, DTYPE)
        self.runner.token_to_kv_pool = _ds_pool(self.runner, page_size, self.layout.width)
        self.loc_fn = dh.make_loc_fn(
            "shuffled_pages", batch_size=case.batch_size, seq_lens=case.seq_lens,
            prefix_lens=case.prefix_lens, page_size=page_size, max_context_len=MAX_CTX,
            seed=seed,
        )  # fmt: skip
        self.fb = mh._make_forward_batch(
            case, self.runner, max_context_len=MAX_CTX, device="cpu", loc_fn=self.loc_fn
        )
        self.backend = MLAAbsorbBackend(self.runner)
        L = [p + n for p, n in zip(prefix, new, strict=True)]
        # latents of widely varying magnitude per 128-tile (what per-tile scales are for)
        mag = torch.logspace(-2, 1, R // 128).repeat_interleave(128)
        self.c_kv = [(torch.randn(n, R, generator=g) * mag).to(DTYPE) for n in L]
        self.k_pe = [torch.randn(n, ROPE, generator=g).to(DTYPE) for n in L]
        T = sum(new)
        self.q_nope = torch.randn(T, H, NOPE, generator=g).to(DTYPE)
        self.q_pe = torch.randn(T, H, ROPE, generator=g).to(DTYPE)
        self.kv_b = (torch.randn(H * (NOPE + V), R, generator=g) * 0.05).to(DTYPE)
        self.scale = (NOPE + ROPE) ** -0.5

    def write_with_core(self, upto_prefix_only: bool) -> None:
        locs, ckv, kpe = [], [], []
        for i, (p, n) in enumerate(zip(self.prefix, self.new, strict=True)):
            end = p if upto_prefix_only else p + n
            locs += [self.loc_fn(i, pos) for pos in range(end)]
            ckv.append(self.c_kv[i][:end])
            kpe.append(self.k_pe[i][:end])
        if locs:
            mb.write_latent(
                self.backend.paged_cache(0), torch.cat(ckv), torch.cat(kpe), torch.tensor(locs)
            )

    def reference(self) -> torch.Tensor:
        """The oracle on the dequantized rows: per-token, per-128-tile scales computed in the
        test (``ds_mla_dequantized``), k_pe as stored (bf16)."""
        return reference_mla_attention(
            self.q_nope.float(), self.q_pe.float(),
            [ds_mla_dequantized(c) for c in self.c_kv], [k.float() for k in self.k_pe],
            self.kv_b.float(), NOPE, V, self.new, self.scale,
        )  # fmt: skip


def _assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """bf16 compute (queries, absorbed weights, probabilities) on latents spanning 1000x:
    max error within 2% of the output's largest magnitude."""
    err = (out.float() - ref).abs().max().item()
    bound = 2e-2 * ref.abs().max().item()
    assert err <= bound, f"max error {err:.3e} > {bound:.3e}"


def test_ds_pool_is_viewed_as_the_core_layout():
    s = DsSetup(ForwardMode.EXTEND, (0,), (3,), 16)
    assert s.layout.width == 656
    assert s.backend.ds_layout == s.layout
    cache = s.backend.paged_cache(0)
    assert cache.dtype == torch.uint8 and cache.shape[1:] == (16, 656)
    pool_buf = s.runner.token_to_kv_pool.kv_buffer[0]
    assert cache.data_ptr() == pool_buf.data_ptr()  # a view of the pool, no copy


@pytest.mark.parametrize(
    "mode,prefix,new",
    [
        (ForwardMode.EXTEND, (0, 5, 33), (6, 4, 2)),
        (ForwardMode.DECODE, (14, 15, 31), (1, 1, 1)),
    ],
    ids=["extend", "decode"],
)
@pytest.mark.parametrize("page_size", [1, 16])
def test_absorbed_path_writes_and_reads_ds_rows(mode, prefix, new, page_size):
    s = DsSetup(mode, prefix, new, page_size, seed=3 + page_size)
    layer = RadixAttention(
        num_heads=H, head_dim=R + ROPE, scaling=s.scale, num_kv_heads=1, layer_id=0,
        v_head_dim=R,
    )  # fmt: skip
    s.write_with_core(upto_prefix_only=True)
    w = mb.split_kv_b_proj(s.kv_b, mb.MLADims(H, R, NOPE, ROPE, V))
    q_lat = mb.absorb_q(s.q_nope, w)
    new_c = torch.cat([c[p:] for c, p in zip(s.c_kv, prefix, strict=True)])
    new_pe = torch.cat([k[p:] for k, p in zip(s.k_pe, prefix, strict=True)])
    locs = [
        s.loc_fn(i, p + j) for i, (p, n) in enumerate(zip(prefix, new, strict=True))
        for j in range(n)
    ]  # fmt: skip
    s.fb.out_cache_loc = torch.tensor(locs, dtype=torch.int64)
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=s.backend)):
        s.backend.init_forward_metadata(s.fb)
        o_lat = layer(
            q_lat, new_c[:, None, :], new_c[:, None, :], s.fb,
            q_rope=s.q_pe, k_rope=new_pe[:, None, :],
        )  # fmt: skip
    # the backend's write of the new tokens is the layout's packing, byte for byte
    rows = s.backend.paged_cache(0).reshape(-1, s.layout.width)[torch.tensor(locs)]
    assert torch.equal(rows, s.layout.pack(new_c, new_pe))
    out = mb.apply_W_UV(o_lat.view(-1, H, R), w)
    _assert_close(out, s.reference())


def test_normal_path_reads_ds_rows():
    s = DsSetup(ForwardMode.EXTEND, (0, 30), (20, 6), 16, seed=7)
    s.backend.policy = mb.Policy("normal")
    layer = RadixAttention(
        num_heads=H, head_dim=NOPE + ROPE, scaling=s.scale, num_kv_heads=H, layer_id=0,
        v_head_dim=V,
    )  # fmt: skip
    layer.kv_b_proj = type("P", (), {"weight": s.kv_b})()
    s.write_with_core(upto_prefix_only=False)
    q = torch.cat([s.q_nope, s.q_pe], -1)
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=s.backend)):
        s.backend.init_forward_metadata(s.fb)
        out = layer(q, q, q[..., :V], s.fb, save_kv_cache=False)
    _assert_close(out.view(-1, H, V), s.reference())


def test_ds_pool_of_another_width_is_refused():
    s = DsSetup(ForwardMode.EXTEND, (0,), (3,), 16)
    s.runner.token_to_kv_pool = _ds_pool(s.runner, 16, 640)
    with pytest.raises(ValueError, match="656"):
        MLAAbsorbBackend(s.runner)
