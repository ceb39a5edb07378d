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
