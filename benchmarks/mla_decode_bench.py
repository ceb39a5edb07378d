"""Operator benchmark: one MLA layer's decode step, decompressed cache (CD, plain matmuls as
in the paper's comparison) vs absorbed with move elision over the paged latent cache, at
DeepSeek-V2 (H=128) and DeepSeek-V2-Lite (H=16) attention dims, batch 1 and 32.

Also reports the absorbed attention core's fraction of this machine's roofline
min(peak bf16 FLOP/s, intensity x read bandwidth), both measured in the same run.

    python benchmarks/mla_decode_bench.py [--lens 1024,2048,4096,8192,16384] [--quick]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import paged_latents, random_weights, write_table  # noqa: E402
from roofline import best_time, peak_bf16_flops, read_bandwidth  # noqa: E402

import mla_backend as mb  # noqa: E402
from mla_backend.ops import impl_name  # noqa: E402
from mla_backend.testing.decompressed import DecompressedCache, cd_attention  # noqa: E402

DT = torch.bfloat16


def run(heads: int, batch: int, L: int, peak: float, bw: float, cd_budget: float,
        page_size: int, impls: list[str]) -> list[str]:
    dims = mb.MLADims(heads, 512, 128, 64, 128)
    w = random_weights(dims, DT)
    scale = dims.default_softmax_scale
    g = torch.Generator().manual_seed(1)
    q_nope = torch.randn(batch, heads, 128, generator=g).to(DT)
    q_pe = torch.randn(batch, heads, 64, generator=g).to(DT)
    cache, table = paged_latents(dims, [L] * batch, page_size, DT)
    b = mb.MLABatch.build([L - 1] * batch, [1] * batch, table, page_size, mb.Phase.DECODE)
    plans = {i: mb.plan(b, dims, mb.Policy("absorb"), impl=i) for i in impls}
    attn = mb.MLAAttention(dims, w, scale)
    q_lat = mb.absorb_q(q_nope, w)
    t_cores = {}
    for i in impls:  # interleaved with the full layer of the first impl
        t_cores[i] = best_time(
            lambda: mb.absorbed_attention(q_lat, q_pe, cache, plans[i], scale), repeat=3
        )
    t_abs = best_time(lambda: attn(q_nope, q_pe, cache, plans[impls[0]]), repeat=3)
    cd_bytes = batch * L * dims.decompressed_bytes_per_token(2)
    if cd_bytes <= cd_budget:
        cd = DecompressedCache(heads, 192, 128, L, batch, DT)
        cd.k.normal_()
        cd.v.normal_()
        cd.lens = [L] * batch
        q = torch.cat([q_nope, q_pe], -1)
        t_cd = best_time(lambda: cd_attention(q, cd, [1] * batch, scale), repeat=3)
        del cd
        cd_ms, speedup = f"{t_cd * 1e3:.2f}", f"{t_cd / t_abs:.2f}x"
    else:
        cd_ms, speedup = f"skip ({cd_bytes / 2**30:.0f} GiB)", "-"
    flops = 2 * heads * L * (2 * 512 + 64) * batch
    nbytes = L * 576 * 2 * batch
    roof = max(flops / peak, nbytes / bw)
    row = [str(heads), str(batch), str(L), cd_ms, f"{t_abs * 1e3:.2f}", speedup]
    for i in impls:
        t_core = t_cores[i]
        row += [f"{t_core * 1e3:.2f}", f"{flops / t_core / 1e9:.0f}", f"{roof / t_core:.0%}"]
    if len(impls) > 1:
        row.append(f"{t_cores[impls[1]] / t_cores[impls[0]]:.2f}x")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lens", default="1024,2048,4096,8192,16384")
    ap.add_argument("--heads", default="128,16")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--cd-budget-gib", type=float, default=6.0,
                    help="skip CD shapes whose decompressed cache exceeds this")
    ap.add_argument("--quick", action="store_true", help="4K only, for a smoke run")
    ap.add_argument("--impls", default="native,torch",
                    help="kernel implementations to time side by side (first = full layer)")
    args = ap.parse_args()
    torch.manual_seed(0)
    lens = [4096] if args.quick else [int(x) for x in args.lens.split(",")]
    # an implementation that cannot run here (native without a compiler) falls back to torch
    impls = [i for i in args.impls.split(",") if impl_name(torch.device("cpu"), i) == i]
    peak, bw = peak_bf16_flops(), read_bandwidth()
    rows = []
    for h in (int(x) for x in args.heads.split(",")):
        for bsz in (int(x) for x in args.batches.split(",")):
            for L in lens:
                rows.append(run(h, bsz, L, peak, bw, args.cd_budget_gib * 2**30,
                                args.page_size, impls))
                print(" ".join(rows[-1]), flush=True)
    write_table(
        "mla_decode",
        ["H", "batch", "kv len", "CD ms", "absorbed ms", "speedup"]
        + [f"{i} {c}" for i in impls for c in ("core ms", "GFLOP/s", "roofline")]
        + ([f"{impls[0]} vs {impls[1]}"] if len(impls) > 1 else []),
        rows,
        [f"bf16; page size {args.page_size}, shuffled pages; r=512, rope=64, nope=v=128",
         f"measured peak bf16 GEMM {peak / 1e12:.3f} TFLOP/s, matmul read bandwidth "
         f"{bw / 1e9:.2f} GB/s",
         "KV bytes/token/layer: latent 1152 (bf16); CD H*(192+128)*2 = 81920 at H=128, "
         "10240 at H=16",
         f"absorbed = absorb_q + attention + W_UV ({impls[0]} kernels); core = attention "
         "only, per kernel implementation (roofline: min(peak, intensity x bandwidth) / "
         "achieved time)"],
    )


if __name__ == "__main__":
    main()
