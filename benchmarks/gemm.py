"""``python -m benchmarks gemm``: GEMM-shaped native kernels per ISA level against torch: the
absorption GEMMs ``q_nope · W_UK`` / ``o_lat · W_UV`` (``native.head_gemm``) at decode shapes,
the normal path's MHA (``native.attention_with_lse``) and its decompression (``native.decompress``).

The head GEMM table (``--what gemm``) runs one child process per level with torch's kernels
capped at that level (``cpu_imitation.CAPS``: at avx2, torch's bmm as on an AVX2-only CPU):
torch's bmm in fp32 and bf16, the ``--base`` revision's head_gemm (built beside this tree's by
``benchmarks/native_base.py``) and this tree's, on the same data, every call on the next of
256 MiB of weight copies (weights from memory, as in a model's decode), next to the stream floor
(packed weight bytes / the single-core stream of ``benchmarks/micro/dot_throughput.cpp``) and
the FMA floor (FLOP / that level's one-core FMA peak). MHA and decompression run in this process
(torch uncapped). Times are the CPU time of the calling thread with ``torch.set_num_threads(1)``
(``time.thread_time``, best of N): on a shared machine a preempted run then costs nothing extra,
so numbers are per core. Name the real CPU in any result.

    python -m benchmarks gemm [--isas amx,avx512_bf16,avx512,avx2] [--tokens 1,4,8,16,32]
        [--heads 16,128] [--base main] [--rounds 3] [--mha-lens 1024,4096] [--dec-len 4096]
        [--what gemm,mha,dec]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import subprocess
import sys
import time
from collections.abc import Callable

import torch
from mla_backend_integrations._testing.cpu_imitation import CAPS

from mla_backend.ops import native
from mla_backend.ops import torch as torch_ops

from . import harness, roofline

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


ROTATE_BYTES = 256 << 20  # weight copies cycled through per shape: more than the caches hold


def _level_probe(micro: object, level: str) -> tuple[float, float]:
    """(single-core stream bytes/s, this level's FMA FLOP/s on one core) from
    ``roofline.micro_binary()`` (nan where it is missing or says nothing)."""
    if micro is None:
        return float("nan"), float("nan")
    peak = "avx512_bf16" if level == "amx" else level  # its vector peak (AMX tiles: none)
    args = [str(micro), "--threads", "1", "--stream", str(ROTATE_BYTES >> 20), "--peak", peak]
    out = subprocess.run(args, capture_output=True, text=True, timeout=300).stdout
    got = {p[0]: float(p[-1]) for p in (line.split() for line in out.splitlines()) if p}
    return got.get("stream", float("nan")), got.get("peak", float("nan")) or float("nan")


def bench_head_gemm_level(level: str, tokens: list[int], heads: list[int], base_ref: str,
                          rounds: int) -> None:  # fmt: skip
    """One level's rows of the decode table (printed): ``q_nope · W_UK`` and ``o_lat · W_UV`` at
    every H and T, torch's bmm (fp32 and bf16, in this process, capped as the parent set it),
    ``base_ref``'s build and this tree's, each call on the next of ``ROTATE_BYTES`` worth of
    weight copies (the weights come from memory, as in a model's decode, not from cache);
    per-call thread CPU time, best of ``rounds`` interleaved rounds; the stream floor (packed
    bytes / the best single-core stream of the run, sampled between rounds) and the FMA floor
    (FLOP / this level's one-core FMA peak)."""
    from .native_base import load_base_head_gemm

    torch.set_num_threads(1)
    base = load_base_head_gemm(base_ref, level) if base_ref else None
    micro = roofline.micro_binary()
    bw, peak = _level_probe(micro, level)
    g = torch.Generator().manual_seed(0)
    rows = []
    for H in heads:
        for name, K, N in (("q_nope·W_UK", NOPE, R), ("o_lat·W_UV", R, V)):
            W = torch.randn(H, K, N, generator=g).bfloat16()
            packed = native.pack_heads(W, isa=level)
            n = max(2, -(-ROTATE_BYTES // (packed.numel() * 2)))
            pk = [packed.clone() for _ in range(n)]
            wb = [W.clone() for _ in range(n)]
            wf = [W.float() for _ in range(n)]
            for T in tokens:
                # q_nope as an engine hands it: a view of q [T, H, nope + rope]
                xw = torch.randn(T, H, K + (ROPE if K == NOPE else 0), generator=g).bfloat16()
                x = xw[:, :, :K]
                xt, xft = x.transpose(0, 1), x.float().transpose(0, 1)
                fns: dict[str, Callable[[int], object]] = {
                    "torch fp32": lambda i, xft=xft, wf=wf: torch.bmm(xft, wf[i]),
                    "torch bf16": lambda i, xt=xt, wb=wb: torch.bmm(xt, wb[i]),
                    "new": lambda i, x=x, N=N, pk=pk: native.head_gemm(x, pk[i], N, isa=level),
                }
                if base is not None:
                    fns["base"] = lambda i, x=x, N=N, pk=pk: base(x, pk[i], N)
                best = dict.fromkeys(fns, float("inf"))
                for rnd in range(rounds):
                    for k, f in fns.items():
                        f(n - 1)
                        t0 = time.thread_time()
                        for i in range(n):
                            f(i)
                        best[k] = min(best[k], (time.thread_time() - t0) / n)
                    if rnd == 0:
                        got_bw, got_peak = _level_probe(micro, level)
                        bw, peak = max(bw, got_bw), max(peak, got_peak)
                floor = packed.numel() * 2 / bw
                fma = 2 * T * H * K * N / peak
                old = best.get("base", float("nan"))
                rows.append([level, name, str(H), str(T)]
                            + [f"{best[k] * 1e3:.3f}" for k in ("torch fp32", "torch bf16")]
                            + [f"{old * 1e3:.3f}", f"{best['new'] * 1e3:.3f}",
                               f"{old / best['new']:.2f}x", f"{floor * 1e3:.3f}",
                               f"{floor / best['new']:.0%}", f"{fma * 1e3:.3f}"])  # fmt: skip
    print(
        f"<!-- {level}: stream {bw / 1e9:.1f} GB/s, FMA peak {peak / 1e9:.0f} GFLOP/s, "
        f"load {os.getloadavg()[0]:.1f} -->"
    )
    for r in rows:
        print("\t".join(r), flush=True)


HEAD_GEMM_HEADER = ["level", "GEMM", "H", "T", "torch fp32", "torch bf16", "base", "new",
                    "new vs base", "stream floor", "new % floor", "FMA floor"]  # fmt: skip


def bench_gemm(isas: list[str], tokens: list[int], heads: list[int], base_ref: str,
               rounds: int) -> list[str]:  # fmt: skip
    """The decode table, one child process per level with torch's kernels capped at that level
    (``cpu_imitation.CAPS``); returns the notes (per level: probes and load)."""
    rows, notes = [], []
    for level in isas:
        args = [sys.executable, "-m", "benchmarks", "gemm", "--child-level", level,
                "--tokens", ",".join(map(str, tokens)), "--heads", ",".join(map(str, heads)),
                "--base", base_ref, "--rounds", str(rounds)]  # fmt: skip
        env = dict(os.environ, **CAPS[level])
        out = subprocess.run(args, env=env, capture_output=True, text=True, cwd=harness.ROOT)
        if out.returncode != 0:
            raise RuntimeError(f"gemm level {level} failed:\n{out.stderr[-3000:]}")
        for line in out.stdout.splitlines():
            if line.startswith("<!--"):
                notes.append(line.strip("<!- >"))
            elif "\t" in line:
                rows.append(line.split("\t"))
        print(f"{level} done", file=sys.stderr, flush=True)
    print(harness.table(HEAD_GEMM_HEADER, rows))
    return notes


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
    ap.add_argument("--tokens", default="1,4,8,16,32", help="T of the head GEMM table")
    ap.add_argument("--heads", default="16,128", help="H of the head GEMM table")
    ap.add_argument(
        "--base",
        default="main",
        help="git revision whose head_gemm is timed beside this tree's ('' for none)",
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mha-lens", default="1024,4096")
    ap.add_argument("--dec-len", type=int, default=4096)
    ap.add_argument("--what", default="gemm,mha,dec")
    ap.add_argument("--child-level", default="", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    isas = [x for x in a.isas.split(",") if x]
    tokens, heads = ([int(t) for t in v.split(",")] for v in (a.tokens, a.heads))
    if a.child_level:  # one level's head GEMM rows, torch capped by the parent
        bench_head_gemm_level(a.child_level, tokens, heads, a.base, a.rounds)
        return 0
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    what = a.what.split(",")
    body = io.StringIO()
    notes = ["1 thread, thread CPU time (best of N); nope 128 rope 64 r 512 v 128"]
    with contextlib.redirect_stdout(body):
        if "gemm" in what:
            print(f"## Absorption GEMMs at decode: base = `{a.base}`, new = this tree (ms)\n")
            level_notes = bench_gemm(isas, tokens, heads, a.base, a.rounds)
            notes += [
                "head GEMM table: one process per level, torch's kernels capped at that level "
                "(ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA / MKL_ENABLE_INSTRUCTIONS, "
                "`integrations/_testing/cpu_imitation.CAPS`: at avx2 torch runs as on an "
                "AVX2-only CPU); every call takes the next of 256 MiB of weight copies "
                "(weights from memory, as in a model's decode); per-call time, best of "
                f"{a.rounds} interleaved rounds; stream floor = packed weight bytes / the best "
                "single-core stream of the level's run (`benchmarks/micro/dot_throughput.cpp "
                "--stream 256 --threads 1`); FMA floor = 2 T H K N / that level's one-core FMA "
                "peak (`--peak`; amx: its avx512_bf16 vector peak, the tiles' is higher)",
            ] + level_notes
            print()
        if "mha" in what:
            bench_mha(isas, [int(t) for t in a.mha_lens.split(",")], g)
        if "dec" in what:
            bench_dec(isas, a.dec_len, g)
    harness.write_result(
        "gemm", "Native GEMM-shaped kernels per ISA level vs torch", notes, body.getvalue()
    )
    return 0
