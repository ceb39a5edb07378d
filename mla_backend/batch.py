"""Engine-neutral batch description: what every attention call needs to know about a step.

Both integrations translate their engine's metadata (vLLM's CommonAttentionMetadata, SGLang's
ForwardBatch) into one :class:`MLABatch`. Query tokens are packed in request order: request
``i`` owns rows ``cu_new[i]:cu_new[i+1]`` of every ``[T, ...]`` tensor. Its kv length is
``prefix_lens[i] + new_lens[i]`` and the paged cache already holds all of those tokens; new
token ``j`` of request ``i`` attends to kv positions ``< prefix_lens[i] + j + 1`` (causal).

The batch holds what the engine knows on the host; :func:`mla_backend.plan` turns it into the
step's plan (policy decision, kernel index tensors) once, and every layer reads the plan.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


class Phase(enum.Enum):
    """What kind of step the batch is (mirrors SGLang's ForwardMode families)."""

    DECODE = "decode"  # one new token per request
    EXTEND = "extend"  # prefill or chunked-prefill continuation (not speculative)
    TARGET_VERIFY = "target_verify"  # speculative verify: several draft tokens per request
    DRAFT_EXTEND = "draft_extend"  # speculative draft model extend
    MIXED = "mixed"  # decodes and extends together (vLLM's default batches)
    IDLE = "idle"  # no tokens (data-parallel padding)

    @property
    def speculative(self) -> bool:
        return self in (Phase.TARGET_VERIFY, Phase.DRAFT_EXTEND)


def _as_int_list(x: Sequence[int] | torch.Tensor, name: str) -> list[int]:
    if isinstance(x, torch.Tensor):
        if x.dim() != 1 or x.dtype.is_floating_point or x.dtype == torch.bool:
            raise ValueError(
                f"{name} must be a 1-D integer tensor, got {x.dtype} of shape {tuple(x.shape)}"
            )
        return [int(v) for v in x.tolist()]
    out = []
    for v in x:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{name} holds {v!r} ({type(v).__name__}); lengths are ints")
        out.append(v)
    return out


@dataclass
class MLABatch:
    """One step's requests over a paged latent cache.

    Attributes:
        prefix_lens: per request, tokens already cached before this step (python ints).
        new_lens: per request, query tokens in this step (python ints, may be 0 for a request
            that only exists for padding).
        block_table: [B, max_pages] int32/int64 physical page ids per logical page, on the
            device the attention runs on.
        page_size: tokens per page.
        phase: :class:`Phase` of the step.
        cu_new: [B + 1] python ints, prefix sum of ``new_lens``.
        block_table_host: optional host (CPU) copy of ``block_table`` that the engine already
            has; the plan validates page ids from it (never by copying device data back) and
            the torch path uses it to find consecutive pages. When ``block_table`` is on the
            CPU it is its own host copy: the plan reads the table the kernels read, and a
            ``block_table_host`` that differs from it is refused.
    """

    prefix_lens: list[int]
    new_lens: list[int]
    block_table: torch.Tensor
    page_size: int
    phase: Phase = Phase.MIXED
    cu_new: list[int] = field(default_factory=list)
    block_table_host: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        prefix_lens: Sequence[int] | torch.Tensor,
        new_lens: Sequence[int] | torch.Tensor,
        block_table: torch.Tensor,
        page_size: int,
        phase: Phase = Phase.MIXED,
        block_table_host: torch.Tensor | None = None,
    ) -> MLABatch:
        """Validate and build. Lengths may be python sequences or 1-D int tensors (copied to
        the host once here, so per-layer calls never synchronize; engines pass the host
        copies they already have)."""
        p = _as_int_list(prefix_lens, "prefix_lens")
        n = _as_int_list(new_lens, "new_lens")
        if len(p) != len(n):
            raise ValueError(f"prefix_lens has {len(p)} requests but new_lens has {len(n)}")
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size={page_size!r} is not supported: it must be an int >= 1")
        if not isinstance(phase, Phase):
            raise ValueError(f"phase={phase!r} is not a mla_backend.Phase")
        if any(v < 0 for v in p) or any(v < 0 for v in n):
            raise ValueError(f"negative lengths: prefix_lens={p}, new_lens={n}")
        if block_table.dim() != 2 or block_table.shape[0] < len(p):
            raise ValueError(
                f"block_table shape {tuple(block_table.shape)} does not fit {len(p)} requests: "
                "expected [num_reqs, max_pages]"
            )
        if block_table.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"block_table dtype {block_table.dtype} is not supported; use int32/64"
            )
        max_pages = block_table.shape[1]
        for i, (a, b) in enumerate(zip(p, n, strict=True)):
            need = -(-(a + b) // page_size)
            if need > max_pages:
                raise ValueError(
                    f"request {i} needs {need} pages for {a + b} tokens at page_size "
                    f"{page_size} but block_table has only {max_pages} columns"
                )
        if phase is Phase.DECODE and any(v != 1 for v in n):
            raise ValueError(f"a DECODE batch has exactly 1 new token per request, got {n}")
        if phase is Phase.IDLE and any(n):
            raise ValueError(f"an IDLE batch has no new tokens, got {n}")
        cu = [0]
        for v in n:
            cu.append(cu[-1] + v)
        if block_table_host is not None and (
            block_table_host.device.type != "cpu"
            or tuple(block_table_host.shape) != tuple(block_table.shape)
        ):
            raise ValueError(
                f"block_table_host must be a CPU copy of block_table {tuple(block_table.shape)}, "
                f"got {tuple(block_table_host.shape)} on {block_table_host.device}"
            )
        if (
            block_table_host is not None
            and block_table.device.type == "cpu"
            and block_table_host is not block_table
            and not torch.equal(block_table_host.long(), block_table.long())
        ):
            at = (block_table_host.long() != block_table.long()).nonzero()[0].tolist()
            raise ValueError(
                f"block_table_host differs from block_table (a CPU tensor, what the kernels "
                f"read) at {at}: {int(block_table_host[at[0], at[1]])} != "
                f"{int(block_table[at[0], at[1]])}"
            )
        return cls(p, n, block_table, page_size, phase, cu, block_table_host)

    @property
    def num_reqs(self) -> int:
        return len(self.new_lens)

    @property
    def num_tokens(self) -> int:
        return self.cu_new[-1]

    @property
    def kv_lens(self) -> list[int]:
        return [a + b for a, b in zip(self.prefix_lens, self.new_lens, strict=True)]

    @property
    def max_kv_len(self) -> int:
        return max(self.kv_lens, default=0)

    def positions(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """[T] int64 position of every query token (``prefix_lens[i] + j``)."""
        pos = [p + j for p, n in zip(self.prefix_lens, self.new_lens) for j in range(n)]
        return torch.tensor(pos, dtype=torch.long, device=device)

    def host_block_table(self) -> torch.Tensor | None:
        """The block table on the host: the table itself when it lives on the CPU (what the
        kernels read), else the engine's host copy, if it gave one."""
        if self.block_table.device.type == "cpu":
            return self.block_table
        return self.block_table_host
