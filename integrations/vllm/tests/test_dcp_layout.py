"""The core's decode-context-parallel shard layout (:mod:`mla_backend.context_parallel`) against
vLLM's own arithmetic: each rank's share of a request's kv tokens (``get_dcp_local_seq_lens``).
The rest of the layout and the DCP step are the core's tests (tests/test_context_parallel.py)."""

from __future__ import annotations

import torch

from mla_backend.context_parallel import ShardLayout


def test_shard_lengths_match_vllm() -> None:
    """:meth:`ShardLayout.local_len` against vLLM's own ``get_dcp_local_seq_lens``."""
    from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens

    seq = torch.arange(0, 300)
    for world, inter in [(2, 1), (2, 16), (3, 4), (4, 2), (8, 64)]:
        want = get_dcp_local_seq_lens(seq, world, None, inter)  # [n, world]
        for rank in range(world):
            lay = ShardLayout(world, rank, inter, 64)
            got = torch.tensor([lay.local_len(int(n)) for n in seq])
            assert torch.equal(got, want[:, rank].to(torch.long)), (world, inter, rank)
