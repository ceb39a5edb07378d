"""Tile sizes and the split-KV heuristic for the Triton MLA kernels.

Triton blocks must be powers of two and ``tl.dot`` needs every dimension >= 16 on GPUs, so
every real dimension (heads, new tokens, r, rope) is padded up to a power-of-two block and
masked inside the kernels. Nothing here touches a GPU; ``sm_count`` falls back to a constant
on devices without CUDA/ROCm properties (CPU under the Triton interpreter).

Work partition (decode and extend share it; FlashMLA's shape). A program takes a block of
query rows (``BLOCK_Q`` new tokens x ``BLOCK_H`` heads of one request, up to
``ROWS_PER_PROGRAM`` = 64 rows: the MMA's M) and walks a run of kv tiles of ``BLOCK_N`` rows.
The grid is ``num_head_blocks x num_parts``; the plan cuts every query block's kv tiles into
``num_parts`` pieces of equal cost (:mod:`mla_backend.ops.triton.schedule`), so long requests
get more splits than short ones and every program about the same work:

    num_parts = ceil(ctas_per_sm * sms / num_head_blocks)

(one wave of the programs resident per SM: :func:`ctas_per_sm` of the launch config, which the
ahead-of-time resource check pins to the compiled kernel's residency).

Each query block costs ``OVERHEAD_KV_ROWS`` kv rows extra (loading Q, writing a partial, the
merge); a piece is never shorter than ``MIN_KV_ROWS_PER_PART`` (fewer splits for small batches).
These constants are design targets, not tuned numbers: nobody on this project has run the
scheduled kernel on a GPU.
"""

from __future__ import annotations

import functools
import os

import torch

#: Programs per multiprocessor (per head block) when choosing the number of pieces.
PROGRAMS_PER_SM = 2
#: Fixed cost of one query block in the schedule, in kv rows (FlashMLA counts 5 blocks of 64).
OVERHEAD_KV_ROWS = 256
#: A piece of the schedule covers at least this many kv rows' worth of work.
MIN_KV_ROWS_PER_PART = 256
#: Registers of one multiprocessor, and one thread's allocation at the 255-register cap.
REGS_PER_SM = 65536
MAX_REGS_PER_THREAD_ALLOC = 256
#: Multiprocessor count assumed where the device has none to report (CPU, interpreter).
CPU_FALLBACK_SM_COUNT = 4
#: Smallest tile edge: ``tl.dot`` requires M, N, K >= 16 on NVIDIA/AMD GPUs.
MIN_DOT_DIM = 16
#: Query rows (tokens x heads) per program: 64, the M of Hopper's wgmma (FlashMLA's block).
ROWS_PER_PROGRAM = 64
#: heads from which the Triton implementation runs the Gluon kernel where it serves a call
#: (``Kernels(gluon=None)``; the H200 run's sweep: faster at 128 heads, slower at 16)
GLUON_MIN_HEADS = 64
#: Latent columns per chunk of the absorbed kernel: 128, the ``fp8_ds_mla`` scale tile. The
#: kernel computes the scores as a sum of per-chunk dots and keeps one P·V accumulator per
#: chunk (the ahead-of-time check showed the unchunked [rows, 512] dots spilling).
LATENT_CHUNK = 128
#: The kernel holds at most this many chunk accumulators.
MAX_CHUNKS = 4


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


def num_parts(num_head_blocks: int, sms: int, ctas: int = PROGRAMS_PER_SM) -> int:
    """Pieces of the plan's schedule (programs along the grid's split axis): one wave of
    ``ctas`` programs per multiprocessor.

    Args:
        num_head_blocks: programs along the head axis (>= 1).
        sms: multiprocessors of the device (see :func:`sm_count`).
        ctas: programs resident per multiprocessor (see :func:`ctas_per_sm`).
    """
    return max(1, -(-ctas * sms // max(num_head_blocks, 1)))


def ctas_per_sm(block_m: int, block_n: int, num_warps: int) -> int:
    """Programs of the attention kernel resident on one multiprocessor (NVIDIA: 64K registers,
    228 KB of shared memory). The kernel's 512-wide configs are register-bound at (or near)
    the 255-register cap, so the registers of ``num_warps`` warps at the cap decide: 2 at
    4 warps, 1 at 8 (FlashMLA's one CTA per SM at 64 rows). ``python -m benchmarks
    gpu-resources`` measures the real residency; its test pins this estimate to it for the
    default configs."""
    return max(1, REGS_PER_SM // (MAX_REGS_PER_THREAD_ALLOC * 32 * num_warps))


def attention_tiles(
    num_heads: int, max_new_len: int, rows: int = ROWS_PER_PROGRAM, pad: bool = False
) -> tuple[int, int]:
    """(BLOCK_Q, BLOCK_H): new tokens and heads per program, with BLOCK_Q * BLOCK_H >= 16.

    Heads come first (they share every KV load: MLA is MQA); spare rows (of ``rows``, a power
    of two) go to more new tokens of the same request so an extend re-reads the KV less often.
    ``pad``: the heads are padded so that every program has ``rows`` rows (masked ones
    included: Hopper's wgmma needs 64).
    """
    h = next_pow2(num_heads)
    block_q = min(next_pow2(max_new_len), max(1, rows // h))
    block_h = max(min(h, rows), MIN_DOT_DIM // block_q)
    if pad:
        block_h = max(block_h, rows // block_q)
    return block_q, block_h


def kv_block(block_r: int, block_m: int, kind: str = "plain", q_bytes: int = 2) -> int:
    """KV rows per inner-loop step: 64 (FlashMLA's tile) for bf16 / fp16 caches at every query
    block (the H200 run's tile sweep, ``benchmarks/results/gpu_sweep-latest.md``: 64 beat 32
    at 64 rows, spill-free on sm_90a); 32 for a wide fp8 or ``fp8_ds_mla`` latent (64 was
    faster there too, but its widened tile spills in the kv loop, which the resource check
    keeps out of every default); 16 for fp32 queries of a wide latent at 64 rows (at 32 they
    need more shared memory than sm_90a has). ``kind``: the cache layout's kind. The plan's
    schedule cuts at multiples of 64 rows, which 32 and 16 divide."""
    wide = block_r >= 256
    if wide and block_m >= ROWS_PER_PROGRAM and q_bytes >= 4:
        return 16
    if wide and kind != "plain":
        return 32
    return 64


def num_warps(block_m: int, block_r: int) -> int:
    """Warps per program: 8 for a [64, 512] fp32 accumulator (two warpgroups), else 4."""
    return 8 if block_m * block_r >= 64 * 256 else 4


def latent_chunks(block_r: int, chunk: int = LATENT_CHUNK, tile: int | None = None) -> int:
    """Column chunks (1, 2 or 4) of a ``block_r``-wide latent of ``chunk`` columns each (wider
    when more than :data:`MAX_CHUNKS` would be needed). ``tile``: the ``fp8_ds_mla`` scale
    tile, which a chunk may not straddle (so at most ``MAX_CHUNKS * tile`` columns)."""
    width = min(chunk, block_r)
    if tile is not None:
        width = min(width, tile)
    n = block_r // width
    if n > MAX_CHUNKS:
        if tile is not None:
            raise ValueError(
                f"an fp8_ds_mla latent of {block_r} columns needs {n} chunks of at most {tile}; "
                f"the Triton kernel holds at most {MAX_CHUNKS} (kv_lora_rank <= "
                f"{MAX_CHUNKS * tile})"
            )
        n = MAX_CHUNKS
    return n


def check_launch_knobs(chunk: int, num_warps: int | None, num_stages: int | None) -> None:
    """Raise ValueError naming the knob when a launch knob is out of its range."""
    if chunk < MIN_DOT_DIM or chunk & (chunk - 1):
        raise ValueError(f"chunk={chunk} must be a power of two >= {MIN_DOT_DIM}")
    if num_warps is not None and num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"num_warps={num_warps} must be one of 1, 2, 4, 8, 16")
    if num_stages is not None and not 1 <= num_stages <= 8:
        raise ValueError(f"num_stages={num_stages} must be in 1..8")
