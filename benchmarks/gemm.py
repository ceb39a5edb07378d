"""``python -m benchmarks gemm``: GEMM-shaped native kernels per ISA level against torch: the
absorption GEMMs ``q_nope · W_UK`` / ``o_lat · W_UV`` (``native.head_gemm``), the normal path's MHA
(``native.attention_with_lse``) and its decompression (``native.decompress``).

Each level's build runs the same data (``isa=`` of the op wrappers); torch runs ``torch.bmm``
in fp32 and bf16, its CPU flash SDPA and the ``torch.mm`` decompression. Times are the CPU time
of the calling thread with ``torch.set_num_threads(1)`` (``time.thread_time``, best of N): on a
shared machine a preempted run then costs nothing extra, so numbers are per core.

To stand in for a CPU without AVX-512 on an AVX-512 host, run with ``--isas avx2,scalar`` and
torch limited by ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`` (name the real CPU in any
result: torch's own oneDNN routing is only approximately that of a real AVX2 CPU).

    python -m benchmarks gemm [--isas amx,avx512_bf16,avx512,avx2]
        [--tokens 1,8,64,512] [--mha-lens 1024,4096] [--dec-len 4096] [--what gemm,mha,dec]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import time
from collections.abc import Callable

import torch

from mla_backend.ops import native
from mla_backend.ops import torch as torch_ops

from . import harness

H, NOPE, ROPE, R, V = 16, 128, 64, 512, 128


def cpu_ms(fn: Callable[[], object], reps: int, warm: int = 1) -> float:
    """Best thread CPU time of ``fn`` in ms."""
    for _ in range(warm):
        fn()
    best = float("inf")
    for _ in range(reps):
        t = time.thread_time()
        fn()
        best = min(best, time.thread_time() - t)
    return best * 1e3


def bench_gemm(isas: list[str], tokens: list[int], g: torch.Generator) -> None:
    W_UK = torch.randn(H, NOPE, R, generator=g).bfloat16()
    W_UV = torch.randn(H, R, V, generator=g).bfloat16()
    print("| GEMM | T | torch fp32 | torch bf16 | " + " | ".join(isas) + " |  (ms)")
    for name, W, K, N in (("q_nope·W_UK", W_UK, NOPE, R), ("o_lat·W_UV", W_UV, R, V)):
        packed = {lv: native.pack_heads(W, isa=lv) for lv in isas}
        Wf = W.float()
        for T in tokens:
            x = torch.randn(T, H, K, generator=g).bfloat16()
            xf = x.float()
            reps = 15 if T <= 64 else 5
            row = [
                cpu_ms(lambda xf=xf, Wf=Wf: torch.bmm(xf.transpose(0, 1), Wf), reps),
                cpu_ms(lambda x=x, W=W: torch.bmm(x.transpose(0, 1), W), reps),
            ]
            for lv in isas:
                pk = packed[lv]
                row.append(
                    cpu_ms(lambda lv=lv, x=x, N=N, pk=pk: native.head_gemm(x, pk, N, isa=lv), reps)
                )
            print(f"| {name} | {T} | " + " | ".join(f"{t:.3f}" for t in row) + " |", flush=True)


def bench_mha(isas: list[str], lens: list[int], g: torch.Generator) -> None:
    tk = torch_ops.Kernels()
    print(
        "| MHA causal H16 192/128 | L | torch SDPA bf16 | " + " | ".join(isas) + " |  (ms, GFLOP/s)"
    )
    for L in lens:
        q = torch.randn(H, L, NOPE + ROPE, generator=g).bfloat16()
        k = torch.randn(L, H, NOPE + ROPE, generator=g).bfloat16().transpose(0, 1)
        v = torch.randn(L, H, V, generator=g).bfloat16().transpose(0, 1)
        flop = 2 * H * (L * (L + 1) / 2) * (NOPE + ROPE + V)
        reps = 3 if L <= 1024 else 1
        row = [cpu_ms(lambda q=q, k=k, v=v: tk.attention_with_lse(q, k, v, True, 0.07), reps)]
        row += [
            cpu_ms(
                lambda lv=lv, q=q, k=k, v=v: native.attention_with_lse(q, k, v, True, 0.07, isa=lv),
                reps,
            )
            for lv in isas
        ]
        print(
            f"| | {L} | " + " | ".join(f"{t:.1f} ({flop / t / 1e6:.0f})" for t in row) + " |",
            flush=True,
        )


def bench_dec(isas: list[str], L: int, g: torch.Generator) -> None:
    tk = torch_ops.Kernels()
    W_UK = torch.randn(H, NOPE, R, generator=g).bfloat16()
    W_UV = torch.randn(H, R, V, generator=g).bfloat16()
    lat = torch.randn(L, R + ROPE, generator=g).bfloat16()
    latf, ukf, uvf = lat.float(), W_UK.float(), W_UV.float()
    flop = 2 * L * R * H * (NOPE + V)
    print(
        "| decompress H16 r512 | L | torch mm fp32 | torch mm bf16 | "
        + " | ".join(isas)
        + " |  (ms, GFLOP/s)"
    )
    row = [
        cpu_ms(lambda: tk.decompress(latf[:, :R], latf[:, R:], ukf, uvf), 3),
        cpu_ms(lambda: tk.decompress(lat[:, :R], lat[:, R:], W_UK, W_UV), 2),
    ]
    row += [
        cpu_ms(lambda lv=lv: native.decompress(lat[:, :R], lat[:, R:], W_UK, W_UV, isa=lv), 3)
        for lv in isas
    ]
    print(
        f"| | {L} | " + " | ".join(f"{t:.1f} ({flop / t / 1e6:.0f})" for t in row) + " |",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks gemm",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--isas", default=",".join(x for x in native.host_isas() if x != "scalar"))
    ap.add_argument("--tokens", default="1,8,64,512")
    ap.add_argument("--mha-lens", default="1024,4096")
    ap.add_argument("--dec-len", type=int, default=4096)
    ap.add_argument("--what", default="gemm,mha,dec")
    a = ap.parse_args(argv)
    isas = [x for x in a.isas.split(",") if x]
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    what = a.what.split(",")
    body = io.StringIO()
    with contextlib.redirect_stdout(body):
        if "gemm" in what:
            bench_gemm(isas, [int(t) for t in a.tokens.split(",")], g)
        if "mha" in what:
            bench_mha(isas, [int(t) for t in a.mha_lens.split(",")], g)
        if "dec" in what:
            bench_dec(isas, a.dec_len, g)
    harness.write_result(
        "gemm",
        "Native GEMM-shaped kernels per ISA level vs torch",
        ["1 thread, thread CPU time (best of N), H16 nope 128 rope 64 r 512 v 128"],
        body.getvalue(),
    )
    return 0
