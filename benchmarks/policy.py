"""``python -m benchmarks policy``: checks the policy against measurement: for extends of N
new tokens onto P cached ones, time the absorbed path and the normal path side by side (full
paths, including the absorption bmms / the decompression) and report which one the cost model picks.

    python -m benchmarks policy [--heads 128,16] [--rounds 3] [--quick]

The two paths are timed interleaved (``harness.interleaved``: best of ``--rounds`` rounds, each
round times both), so a load change between them shows in both.
"""

from __future__ import annotations

import argparse
import functools

import torch

import mla_backend as mb

from . import harness
from .harness import interleaved, write_result
from .problems import paged_latents, random_weights

DT = torch.bfloat16


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks policy",
                                 description=__doc__.split("\n\n")[0])  # fmt: skip
    ap.add_argument("--heads", default="128,16")
    ap.add_argument("--prefix", default="0,1024,4096")
    ap.add_argument("--new", default="16,64,128,256,512,1024")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    prefixes = [0, 1024] if args.quick else [int(x) for x in args.prefix.split(",")]
    news = [16, 256] if args.quick else [int(x) for x in args.new.split(",")]
    policy = mb.Policy("cost")
    rows, agree, total = [], 0, 0
    for h in (int(x) for x in args.heads.split(",")):
        dims = mb.MLADims(h, 512, 128, 64, 128)
        w = random_weights(dims, DT)
        attn = mb.MLAAttention(dims, w)
        for P in prefixes:
            for N in news:
                cache, table = paged_latents(dims, [P + N], 64, DT)
                b = mb.MLABatch.build([P], [N], table, 64, mb.Phase.EXTEND)
                g = torch.Generator().manual_seed(0)
                qn = torch.randn(N, h, 128, generator=g).to(DT)
                qp = torch.randn(N, h, 64, generator=g).to(DT)
                pa = mb.plan(b, dims, mb.Policy("absorb"))
                pn = mb.plan(b, dims, mb.Policy("normal"))
                t = interleaved({"absorbed": functools.partial(attn, qn, qp, cache, pa),
                                 "normal": functools.partial(attn, qn, qp, cache, pn)},
                                args.rounds, 0.05)  # fmt: skip
                ta, tn = t["absorbed"], t["normal"]
                picked = mb.plan(b, dims, policy).mode
                faster = "absorbed" if ta <= tn else "normal"
                close = abs(ta - tn) / min(ta, tn) < 0.1  # within noise: either is right
                ok = picked == faster or close
                agree += ok
                total += 1
                rows.append([str(h), str(P), str(N), f"{ta * 1e3:.1f}", f"{tn * 1e3:.1f}",
                             faster, picked, "yes" if ok else "NO"])
                print(" ".join(rows[-1]), flush=True)
    header = ["H", "prefix P", "new N", "absorbed ms", "normal ms", "faster", "policy picks",
              "ok"]  # fmt: skip
    write_result(
        "policy",
        "Cost policy vs measurement: absorbed or normal path",
        ["bf16, page 64, shuffled pages, r=512 rope=64 nope=v=128; one request per step",
         f"policy agrees with the measurement in {agree}/{total} cases "
         "(a pick within 10% of the faster path counts as agreeing)"],
        harness.table(header, rows),
    )
    return 0
