"""The DSA workarounds below the server (``compat.DSA_*``): the CUDA capability answered only
inside SGLang's argument hook on the CPU platform, ``--kv-cache-dtype auto`` kept for
``mla_absorb`` there, and the core's view of ``DSATokenToKVPool``'s index-key pages checked
against SGLang's own pure-torch reader of that layout (``IndexKeyCache.move``)."""

from __future__ import annotations

import types

import pytest
import torch
from mla_backend_integrations.sglang import BACKEND_NAME, compat

from mla_backend import sparse as mbs
from mla_backend.index_cache import IndexCacheLayout


def _fake_hook(seen: list) -> types.SimpleNamespace:
    def handle_model_specific_adjustments(server_args):
        seen.append(torch.cuda.get_device_capability())
        return mod._dsa_kv_cache_dtype_default(server_args)

    def _dsa_kv_cache_dtype_default(view):
        return {"kv_cache_dtype": "bfloat16"}  # upstream's answer for auto below SM100

    mod = types.SimpleNamespace(
        handle_model_specific_adjustments=handle_model_specific_adjustments,
        _dsa_kv_cache_dtype_default=_dsa_kv_cache_dtype_default,
    )
    return mod


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU platform without CUDA")
def test_capability_answered_inside_the_hook_only(monkeypatch):
    monkeypatch.setattr("sglang.srt.utils.common.is_cpu", lambda: True)  # SGLang's CPU platform
    seen: list = []
    mod = _fake_hook(seen)
    compat.answer_cpu_capability(mod, BACKEND_NAME)
    compat.answer_cpu_capability(mod, BACKEND_NAME)  # idempotent
    view = types.SimpleNamespace(attention_backend=BACKEND_NAME, kv_cache_dtype="auto")
    assert mod.handle_model_specific_adjustments(view) == {}  # auto kept: the model's dtype
    assert seen == [compat.NO_CUDA_CAPABILITY]
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.get_device_capability()  # torch's own again after the hook
    other = types.SimpleNamespace(attention_backend="torch_native", kv_cache_dtype="auto")
    assert mod.handle_model_specific_adjustments(other) == {"kv_cache_dtype": "bfloat16"}
    explicit = types.SimpleNamespace(attention_backend=BACKEND_NAME, kv_cache_dtype="bfloat16")
    assert mod.handle_model_specific_adjustments(explicit) == {"kv_cache_dtype": "bfloat16"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU platform without CUDA")
def test_not_the_cpu_platform_keeps_upstream(monkeypatch):
    monkeypatch.setattr("sglang.srt.utils.common.is_cpu", lambda: False)
    mod = _fake_hook([])
    compat.answer_cpu_capability(mod, BACKEND_NAME)
    view = types.SimpleNamespace(attention_backend=BACKEND_NAME, kv_cache_dtype="auto")
    with pytest.raises((AssertionError, RuntimeError)):
        mod.handle_model_specific_adjustments(view)


def _dsa_pool(page_size: int = 64, pages: int = 4):
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

    return DSATokenToKVPool(
        size=page_size * pages, page_size=page_size, kv_lora_rank=512, dtype=torch.float32,
        qk_rope_head_dim=64, layer_num=2, device="cpu", index_head_dim=128,
        enable_memory_saver=False, kv_cache_dim=576, index_buf_size=page_size * pages,
    )  # fmt: skip


def test_index_cache_view_is_sglang_index_page_layout():
    """Keys written through the core's view, moved by SGLang's own IndexKeyCache.move (pure
    torch: a page's keys, then its scales), read back through the view at the targets."""
    pool = _dsa_pool()
    assert compat.is_dsa_pool(pool)
    lay = IndexCacheLayout.named("fp8", 128, 128, scale_fmt="ue8m0")
    view = compat.index_cache_view(pool, 1, 64, lay.width)
    assert view.data_ptr() == pool.index_key_cache.buffer[1].data_ptr()  # no copy
    g = torch.Generator().manual_seed(0)
    k = torch.randn(6, 128, generator=g) * torch.logspace(-2, 2, 6)[:, None]
    src = torch.tensor([0, 5, 63, 64, 130, 255])
    mbs.write_index_keys(view, k, src, lay)
    tgt = torch.tensor([70, 1, 200, 129, 3, 190])
    pool.index_key_cache.move(tgt, src)
    values, scales = lay.page_views(view)
    flat_v = values.reshape(-1, 128)
    flat_s = scales.reshape(-1, scales.shape[-1])
    got = lay.decode(flat_v[tgt], flat_s[tgt])
    want = lay.decode(*lay.quantize(k))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.allclose(got, k, rtol=0.07, atol=0)  # e4m3: 3 mantissa bits


def test_index_cache_view_refuses_other_page_shapes():
    pool = _dsa_pool()
    with pytest.raises(ValueError, match="the core's fp8 layout needs page_size"):
        compat.index_cache_view(pool, 0, 64, 128)  # a plain (unscaled) width
    pool.index_kpool = 2
    with pytest.raises(ValueError, match="index_kpool 2"):
        compat.index_cache_view(pool, 0, 64, 132)


def test_indexer_forward_native_is_ours_after_registration():
    from mla_backend_integrations.sglang.sparse import indexer_forward
    from sglang.srt.layers.attention.dsa.dsa_indexer import Indexer

    compat.serve_indexer_on_cpu(Indexer, indexer_forward)  # idempotent (the plugin did it)
    assert getattr(Indexer.forward_native, "_mla_absorb_cpu", False)
