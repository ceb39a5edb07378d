"""Tile sizes and the split-KV heuristic for the Triton MLA kernels.

Triton blocks must be powers of two and ``tl.dot`` needs every dimension >= 16 on GPUs, so
every real dimension (heads, new tokens, r, rope) is padded up to a power-of-two block and
masked inside the kernels. Nothing here touches a GPU; ``sm_count`` falls back to a constant
on devices without CUDA/ROCm properties (CPU under the Triton interpreter).

Split-KV heuristic (decode and extend share it). A program handles one block of query rows
(``BLOCK_Q`` new tokens x ``BLOCK_H`` heads of one request) over one KV split, so the grid has
``num_q_blocks * num_head_blocks * num_splits`` programs. We pick the smallest ``num_splits``
that gives about ``WAVES`` programs per multiprocessor, but never make a split shorter than
``MIN_KV_PER_SPLIT`` tokens of the longest request (short splits cost more in the merge and in
partial-output traffic than they gain in parallelism) and never more than ``MAX_SPLITS``:

    num_splits = clamp(min(ceil(WAVES * sms / base_programs),
                           ceil(max_kv_len / MIN_KV_PER_SPLIT)), 1, MAX_SPLITS)

Requests shorter than the longest one get empty trailing splits; those write LSE = -inf and
a zero partial output, which the merge weighs as zero. These constants are design targets,
not tuned numbers: nobody on this project has run the kernels on a GPU.
"""

from __future__ import annotations

import functools
import os

import torch

#: Target programs per multiprocessor when choosing the split count.
WAVES = 2
#: A split never covers fewer kv tokens than this (of the longest request).
MIN_KV_PER_SPLIT = 256
#: Upper bound on splits (bounds the partial-output buffer: T * H * splits * r floats).
MAX_SPLITS = 64
#: Multiprocessor count assumed where the device has none to report (CPU, interpreter).
CPU_FALLBACK_SM_COUNT = 4
#: Smallest tile edge: ``tl.dot`` requires M, N, K >= 16 on NVIDIA/AMD GPUs.
MIN_DOT_DIM = 16
#: Query rows (tokens x heads) per program; 16 keeps a [16, 512] fp32 accumulator in registers.
ROWS_PER_PROGRAM = 16


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def next_pow2(x: int) -> int:
    """Smallest power of two >= max(x, 1)."""
    x = max(int(x), 1)
    return 1 << (x - 1).bit_length()


def dim_block(d: int) -> int:
    """Power-of-two tile for a feature dimension ``d`` (>= 16, so tl.dot accepts it)."""
    return max(MIN_DOT_DIM, next_pow2(d))


@functools.lru_cache(maxsize=16)
def _cuda_sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def sm_count(device: torch.device) -> int:
    """Multiprocessors (CUDA SMs / ROCm CUs) of ``device``; a constant on CPU."""
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _cuda_sm_count(index)
    return CPU_FALLBACK_SM_COUNT


def choose_num_splits(base_programs: int, max_kv_len: int, sms: int) -> int:
    """Split count for a grid of ``base_programs`` (q blocks x head blocks) programs per split.

    Args:
        base_programs: programs in the grid before splitting KV (>= 1).
        max_kv_len: longest request's kv length in the batch.
        sms: multiprocessors of the device (see :func:`sm_count`).
    Returns:
        An int in [1, MAX_SPLITS].
    """
    if max_kv_len <= 0 or base_programs <= 0:
        return 1
    want = -(-(WAVES * sms) // base_programs)
    by_len = -(-max_kv_len // MIN_KV_PER_SPLIT)
    return max(1, min(want, by_len, MAX_SPLITS))


def attention_tiles(num_heads: int, max_new_len: int) -> tuple[int, int]:
    """(BLOCK_Q, BLOCK_H): new tokens and heads per program, with BLOCK_Q * BLOCK_H >= 16.

    Heads come first (they share every KV load: MLA is MQA); spare rows go to more new tokens
    of the same request so an extend re-reads the KV less often.
    """
    h = next_pow2(num_heads)
    block_q = min(next_pow2(max_new_len), max(1, ROWS_PER_PROGRAM // h))
    block_h = max(min(h, ROWS_PER_PROGRAM), MIN_DOT_DIM // block_q)
    return block_q, block_h


def kv_block(block_r: int) -> int:
    """KV rows per inner-loop step (smaller for wide latents to bound register use)."""
    return 16 if block_r >= 256 else 32
