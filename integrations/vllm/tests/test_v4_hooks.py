"""DeepSeek-V4's metadata without Triton (``compat.patch_v4_cpu_metadata``): the torch versions
of vLLM's token-to-request map and compressed slot mapping against a per-token loop written here
from the Triton kernels' text (vllm/v1/attention/ops/metadata.py, ``_token_request_mapping_kernel``;
vllm/v1/attention/backends/mla/compressor_utils.py, ``CompressedSlotMappingKernel``): ragged
batches, padding tokens past the mapped ones, PAD slots, decode context parallel's local
positions; and the op registration: an op this build lacks is defined, one it has is left alone
unless ours are to serve every op."""

from __future__ import annotations

import random

import pytest
import torch
from mla_backend_integrations.vllm import compat


def _batch(rng: random.Random, B: int) -> tuple[torch.Tensor, torch.Tensor]:
    q = [rng.choice([0, 1, 1, 3, 4, 9]) for _ in range(B)]
    cached = [rng.randint(0, 40) for _ in range(B)]
    qsl = torch.tensor([0] + list(torch.tensor(q).cumsum(0).tolist()), dtype=torch.int32)
    seq = torch.tensor([c + n for c, n in zip(cached, q, strict=True)], dtype=torch.int32)
    return qsl, seq


@pytest.mark.parametrize("seed", range(6))
def test_token_to_request_map(seed: int) -> None:
    rng = random.Random(seed)
    qsl, _ = _batch(rng, rng.randint(1, 6))
    mapped = int(qsl[-1])
    total = mapped + rng.randint(0, 3)  # padded tokens past the mapped ones
    out = torch.full((total + 2,), -7, dtype=torch.int32)
    got = compat._token_to_req_indices(qsl, out, mapped, total)
    want = []
    for t in range(total):
        r = 0
        if t < mapped:
            r = max(i for i in range(len(qsl) - 1) if int(qsl[i]) <= t)
        want.append(r)
    assert got.tolist() == want and out[total:].tolist() == [-7, -7]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(("ratio", "dcp", "inter"), [(4, 1, 1), (128, 1, 1), (4, 2, 8)])
def test_compressed_slot_mapping(seed: int, ratio: int, dcp: int, inter: int) -> None:
    rng = random.Random(seed)
    B = rng.randint(1, 5)
    qsl, seq = _batch(rng, B)
    T = int(qsl[-1])
    block_size, cols = 2, 40
    table = torch.randperm(B * cols, generator=torch.Generator().manual_seed(seed)).view(B, cols)
    slot_mapping = torch.tensor([rng.choice([-1, 5, 6]) for _ in range(T)], dtype=torch.int64)
    out = torch.full((T + 3,), -1, dtype=torch.int64)
    compat._compressed_slot_mapping(out, slot_mapping, qsl, seq, table.int(), block_size, ratio,
                                    dcp, inter)  # fmt: skip
    want = [-1] * (T + 3)
    for b in range(B):
        qs, qe = int(qsl[b]), int(qsl[b + 1])
        for i in range(qe - qs):
            pos = int(seq[b]) - (qe - qs) + i
            if (pos + 1) % ratio or int(slot_mapping[qs + i]) == -1:
                continue
            local = pos // (inter * dcp) * inter + pos % inter
            c = local // ratio
            want[qs + i] = int(table[b, c // block_size]) * block_size + c % block_size
    assert out.tolist() == want


def test_ops_supplied_only_where_absent_unless_serving_all() -> None:
    pytest.importorskip("vllm")
    name = "mla_backend_test_v4_probe_op"
    calls: list[str] = []
    ops = {name: (f"{name}(Tensor x) -> Tensor", lambda x: calls.append("ours") or x + 1)}
    assert compat.supply_v4_cpu_ops(ops) == [name]  # absent: defined
    assert torch.ops._C.mla_backend_test_v4_probe_op(torch.zeros(1)).item() == 1.0
    assert compat.supply_v4_cpu_ops(ops, override=True) == []  # ours already
    existing = "rms_norm"  # an op every vLLM CPU build has
    assert hasattr(torch.ops._C, existing)
    before = compat.supply_v4_cpu_ops({existing: ("unused", lambda *a: None)})
    assert before == []  # present: left alone


@pytest.mark.parametrize("seed", range(4))
def test_prepare_uniform_decode(seed: int) -> None:
    """``PrepareUniformDecodeKernel``: program i, request i // max_decode_len."""
    rng = random.Random(seed)
    B, n_dec = rng.randint(1, 4), rng.choice([1, 2, 3])
    seq = torch.tensor([rng.randint(0, 30) for _ in range(B)], dtype=torch.int32)
    table = torch.randint(0, 99, (B, 5), dtype=torch.int32)
    n = B * n_dec
    dsl = torch.full((n + 2,), -7, dtype=torch.int32)
    ebt = torch.full((n + 2, 5), -7, dtype=torch.int32)
    dl = torch.full((n + 2,), -7, dtype=torch.int32)
    compat._prepare_uniform_decode(seq, dsl, table, ebt, dl, n, n_dec)
    for i in range(n):
        r, j = i // n_dec, i % n_dec
        assert int(dsl[i]) == max(int(seq[r]) - n_dec + j + 1, 0)
        assert ebt[i].tolist() == table[r].tolist() and int(dl[i]) == 1
    assert dsl[n:].tolist() == [-7, -7] and dl[n:].tolist() == [-7, -7]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(("ratio", "dcp", "rank", "inter"), [(4, 1, 0, 1), (1, 1, 0, 1),
                                                             (4, 2, 1, 1), (4, 2, 0, 8)])
def test_build_prefill_chunk_metadata(seed: int, ratio: int, dcp: int, rank: int,
                                      inter: int) -> None:  # fmt: skip
    """``BuildPrefillChunkMetadataKernel``: program b over its query tokens inside the query
    slice, then its compressed keys."""
    rng = random.Random(seed)
    B = rng.randint(1, 4)
    qsl, seq = _batch(rng, B)
    T = int(qsl[-1])
    comp = seq // ratio
    cu = torch.zeros(B + 1, dtype=torch.int32)
    cu[1:] = comp.cumsum(0)
    row_start = cu.clone() if dcp == 1 else torch.tensor(
        [0] + sorted(rng.sample(range(1, 60), B)), dtype=torch.int32
    )  # fmt: skip
    qs0 = rng.randint(0, max(T - 1, 0))
    qs1 = rng.randint(qs0, T)
    ks = torch.full((qs1 - qs0 + 1,), -7, dtype=torch.int32)
    ke = ks.clone()
    t2s = torch.full((int(cu[-1]) + 1,), -7, dtype=torch.int32)
    compat._build_prefill_chunk_metadata(qsl, seq, cu, row_start, t2s, ks, ke, qs0, qs1, rank,
                                         dcp, inter, num_reqs=B, COMPRESS_RATIO=ratio)  # fmt: skip
    want_ks, want_ke, want_t2s = [-7] * len(ks), [-7] * len(ke), [-7] * len(t2s)
    for b in range(B):
        qs, qe = int(qsl[b]), int(qsl[b + 1])
        start_pos = int(seq[b]) - (qe - qs)
        for off in range(qe - qs):
            pos = qs + off
            if not qs0 <= pos < qs1:
                continue
            n = (start_pos + 1 + off) // ratio
            if dcp > 1:
                base = n // inter // dcp * inter
                n = base + min(max(n - base * dcp - rank * inter, 0), inter)
            want_ks[pos - qs0] = int(row_start[b])
            want_ke[pos - qs0] = int(row_start[b]) + n
        for c in range(int(comp[b])):
            want_t2s[int(cu[b]) + c] = b
    assert ks.tolist() == want_ks and ke.tolist() == want_ke and t2s.tolist() == want_t2s


def test_v4_ops_mode_replaces_vllms_kernels_only_where_they_cannot_run_the_model() -> None:
    """With mla_absorb, ours replace vLLM's own V4 CPU kernels for the attention and the
    indexer logits (faster, benchmarks v4); every op only where vLLM's kernels refuse the model
    (not bf16, routed experts outside 64-384, top-k outside 6-9)."""
    from types import SimpleNamespace as NS

    from mla_backend_integrations.vllm.plugin import V4_FASTER_OPS, supply_v4, v4_ops_mode

    def cfg(dtype: torch.dtype, experts: int, per_token: int) -> NS:
        return NS(dtype=dtype, hf_text_config=NS(n_routed_experts=experts,
                                                 num_experts_per_tok=per_token))  # fmt: skip

    assert v4_ops_mode(cfg(torch.bfloat16, 256, 8)) == "faster"
    assert v4_ops_mode(cfg(torch.bfloat16, 384, 6)) == "faster"
    for bad in (cfg(torch.float32, 256, 8), cfg(torch.float16, 256, 8), cfg(torch.bfloat16, 4, 2),
                cfg(torch.bfloat16, 512, 8), cfg(torch.bfloat16, 256, 10)):  # fmt: skip
        assert v4_ops_mode(bad) == "all"
    assert set(V4_FASTER_OPS) == {"flash_mla_with_kvcache_cpu", "fp8_paged_mqa_logits_cpu"}
    with pytest.raises(ValueError, match="MLA_BACKEND_V4_OPS='some'"):
        supply_v4("some")
