"""Measures this machine's roofline in the current process: bf16 GEMM peak and the read
bandwidth a matmul sees streaming a large operand (the two numbers absorbed decode is judged
against). Shared by the operator benchmarks."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def best_time(fn: Callable[[], object], repeat: int = 5, min_time: float = 0.05) -> float:
    """Best-of-``repeat`` seconds per call (each repeat runs ``fn`` enough to last min_time)."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        n, t0 = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            dt = time.perf_counter() - t0
            if dt >= min_time:
                break
        best = min(best, dt / n)
    return best


def peak_bf16_flops(n: int = 2048) -> float:
    a = torch.randn(n, n, dtype=torch.bfloat16)
    b = torch.randn(n, n, dtype=torch.bfloat16)
    return 2 * n**3 / best_time(lambda: torch.mm(a, b), repeat=3)


def read_bandwidth(mbytes: int = 512) -> float:
    """Bytes/s of a skinny matmul streaming a [L, 576] bf16 matrix much larger than cache."""
    rows = mbytes * (1 << 20) // (576 * 2)
    big = torch.randn(rows, 576, dtype=torch.bfloat16)
    x = torch.randn(16, 576, dtype=torch.bfloat16)
    return big.numel() * 2 / best_time(lambda: torch.mm(x, big.t()), repeat=3)


if __name__ == "__main__":
    torch.manual_seed(0)
    print(f"bf16 GEMM peak: {peak_bf16_flops() / 1e12:.3f} TFLOP/s")
    print(f"matmul read bandwidth: {read_bandwidth() / 1e9:.2f} GB/s")
