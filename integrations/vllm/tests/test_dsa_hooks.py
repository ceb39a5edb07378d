"""The DSA hooks into vLLM, without an engine: the out-of-tree ``SparseAttnIndexer`` (in-tree
dispatch unless MLA_ABSORB is selected; start-up errors naming the value) and the CPU query
rounding supplied to ``deepseek_v2`` (vLLM's own fails on CPU tensors; ours rounds as vLLM's
``per_token_group_quant_fp8`` is defined, checked against dsa_reference's rule)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from mla_backend_integrations._testing.dsa_reference import round_query
from mla_backend_integrations.vllm import compat, plugin


def _op(selected: bool, head_dim: int = 128, **kw: Any) -> Any:
    """A ``SparseAttnIndexer`` built as the DSA model code builds it, under a config that does
    or does not select MLA_ABSORB."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer

    plugin.register()
    cfg = VllmConfig()
    if selected:
        cfg.attention_config.backend = plugin.register_backend_enum()
    cache = SimpleNamespace(prefix="model.layers.0.self_attn.indexer.k_cache")
    buf = torch.empty(8, 16, dtype=torch.int32)
    with set_current_vllm_config(cfg):
        return SparseAttnIndexer(cache, 128, "ue8m0", 16, head_dim, 1024, 1024, buf, **kw)


def test_indexer_op_is_ours_only_when_mla_absorb_is_selected() -> None:
    from mla_backend_integrations.vllm.sparse import MLAAbsorbIndexCacheBackend

    other = _op(selected=False)
    assert type(other).__name__ == "MLAAbsorbIndexer" and not other.mla_absorb
    # vLLM's own dispatch (forward_native or forward_cpu, per custom_ops), not ours
    assert other._forward_method.__func__.__qualname__.startswith("SparseAttnIndexer.forward_")
    assert "get_attn_backend" not in vars(other.k_cache)

    ours = _op(selected=True)
    assert ours.mla_absorb and ours._forward_method == ours._mla_absorb_forward
    assert ours.k_cache.get_attn_backend() is MLAAbsorbIndexCacheBackend
    assert ours.mla_absorb_index_layout.bytes_per_token == 132  # vLLM's 128 + 4
    assert type(ours).name == "sparse_attn_indexer"  # custom_ops keep their in-tree meaning


@pytest.mark.parametrize(
    ("kw", "named"),
    [
        (dict(use_fp4_cache=True), "fp4"),
        (dict(head_dim=64), "index_head_dim 64"),
    ],
)
def test_indexer_op_refuses_what_it_cannot_serve(kw: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        _op(selected=True, **kw)


def test_cpu_query_rounding_is_supplied_and_rounds_as_vllm() -> None:
    from mla_backend_integrations.vllm.sparse import round_index_query
    from vllm.model_executor.layers.quantization.utils import fp8_utils
    from vllm.model_executor.models import deepseek_v2

    g = torch.Generator().manual_seed(0)
    q = torch.randn(6, 4, 128, generator=g) * torch.logspace(-3, 2, 6)[:, None, None]
    q = q.view(-1, 128)
    with pytest.raises(Exception, match="triton"):  # the upstream bug this hook works around
        fp8_utils.per_token_group_quant_fp8(q, 128, column_major_scales=False, use_ue8m0=True)
    compat.supply_cpu_group_quant(round_index_query)
    compat.supply_cpu_group_quant(round_index_query)  # idempotent
    fn = deepseek_v2.per_token_group_quant_fp8
    assert fn._mla_backend_cpu and fn is not fp8_utils.per_token_group_quant_fp8
    q8, scale = fn(q, 128, column_major_scales=False, use_ue8m0=True)
    assert q8.dtype == torch.float8_e4m3fn and scale.shape == (q.shape[0], 1)
    assert torch.equal(torch.exp2(torch.log2(scale).round()), scale)  # powers of two
    assert torch.equal(q8.float() * scale, round_query(q))
    with pytest.raises(Exception, match="triton"):  # anything else is vLLM's own function
        fn(q, 128, column_major_scales=True, use_ue8m0=True)
