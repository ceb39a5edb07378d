"""``python -m benchmarks sparse``: DeepSeek Sparse Attention decode (the lightning indexer's
top-k + the sparse absorbed attention over topk latent rows) against our dense absorbed decode,
native kernels at one ISA level, with the indexer judged against its in-run roofline.

DeepSeek-V3.2 shapes: r 512 + rope 64 bf16 latent cache, page 64, shuffled pages; indexer 64
heads x 128, vLLM's fp8 index cache (e4m3 keys + a float32 scale each, 132 bytes per token), q_I
as vLLM passes it (e4m3 values, its scale folded into the weights); index_topk 2048; one new token
per request. Per shape: dense = ``mb.absorbed_attention``; indexer = ``mb.indexer_topk``; sparse
= ``mb.sparse_absorbed_attention`` over the indexer's selection; all timed in the same
interleaved rounds as the roofline probes (``benchmarks/roofline.py``). The indexer's roof =
share of min(the level's compute ceiling, intensity x bandwidth) with 2 x 64 x 128 FLOPs and 132
bytes per cached token per query token. Targets (issue 27): the sparse attention flat in kv
beyond topk; the indexer >= 60% of its roof; indexer + sparse >= 5x dense at 64K, 128 heads.
``--prefill``: the indexer's top-k over a fresh prompt (each token's causal keys) at 8 and 64
index heads, with the same roof. Writes ``sparse-latest.md`` (and the history).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

import mla_backend as mb

from . import harness, roofline
from .problems import paged_latents

R, ROPE, PAGE, HI, DI = 512, 64, 64, 64, 128
INDEX_BYTES = DI + 4


def index_cache_for(table: torch.Tensor, num_pages: int, kv: int, seed: int = 0) -> torch.Tensor:
    """vLLM's fp8 index cache holding ``kv`` random keys per request of ``table``."""
    g = torch.Generator().manual_seed(seed)
    layout = mb.IndexCacheLayout.named("fp8", DI)
    cache = torch.zeros(num_pages, PAGE, layout.width, dtype=torch.uint8)
    for i in range(table.shape[0]):
        keys = torch.randn(kv, DI, generator=g).bfloat16()
        pos = torch.arange(kv)
        slots = table[i, pos // PAGE].long() * PAGE + pos % PAGE
        mb.write_index_keys(cache, keys, slots, layout, impl="torch")
    return cache


def run_shape(H: int, B: int, L: int, topk: int, isa: str, rounds: int, min_time: float,
              roof: roofline.Roofline) -> dict[str, object]:  # fmt: skip
    dims = mb.MLADims(H, R, 128, ROPE, 128)
    scale = 1.0 / (192**0.5)
    cache, table = paged_latents(dims, [L] * B, PAGE, torch.bfloat16)
    index_cache = index_cache_for(table, cache.shape[0], L)
    g = torch.Generator().manual_seed(1)
    q_lat = torch.randn(B, H, R, generator=g).bfloat16()
    q_pe = torch.randn(B, H, ROPE, generator=g).bfloat16()
    q_I = (torch.randn(B, HI, DI, generator=g) * 16).to(torch.float8_e4m3fn)
    weights = torch.randn(B, HI, generator=g) / HI
    batch = mb.MLABatch.build([L - 1] * B, [1] * B, table, PAGE, mb.Phase.DECODE,
                              block_table_host=table)  # fmt: skip
    kern = harness.native_kernels(isa)
    plan = mb.plan(batch, dims, mb.Policy("absorb"), impl=kern,
                   indexer=mb.IndexerDims(HI, DI, topk))  # fmt: skip
    idx = mb.indexer_topk(q_I, weights, index_cache, plan, topk)
    # the selection itself, checked against the torch path's before timing
    p_t = mb.plan(batch, dims, mb.Policy("absorb"), impl="torch",
                  indexer=mb.IndexerDims(HI, DI, topk))  # fmt: skip
    if B * L <= 65536:
        ref = mb.indexer_topk(q_I, weights, index_cache, p_t, topk)
        same = (idx == ref).float().mean().item()
        assert same > 0.99, f"native and torch selections agree on only {same:.3f}"
    fns: dict[str, Callable[[], object]] = {
        "dense": lambda: mb.absorbed_attention(q_lat, q_pe, cache, plan, scale),
        "indexer": lambda: mb.indexer_topk(q_I, weights, index_cache, plan, topk),
        "sparse": lambda: mb.sparse_absorbed_attention(q_lat, q_pe, cache, plan, idx, scale),
    }
    fns.update(roof.probes())
    times = harness.interleaved(fns, rounds, min_time, each_round=roof.sample)
    return {"times": times, "probes": roof.take(times)}


def run_prefill(T: int, index_heads: int, topk: int, isa: str, rounds: int, min_time: float,
                roof: roofline.Roofline) -> dict[str, object]:  # fmt: skip
    """The indexer's top-k of a fresh T-token prefill (each token over its causal keys) with
    ``index_heads`` heads, timed with the roofline probes."""
    g = torch.Generator().manual_seed(T + index_heads)
    pages = -(-T // PAGE)
    table = torch.randperm(pages, generator=g).view(1, pages).int()
    index_cache = index_cache_for(table, pages, T)
    q_I = (torch.randn(T, index_heads, DI, generator=g) * 16).to(torch.float8_e4m3fn)
    weights = torch.randn(T, index_heads, generator=g) / index_heads
    batch = mb.MLABatch.build([0], [T], table, PAGE, mb.Phase.EXTEND, block_table_host=table)
    plan = mb.plan(batch, mb.MLADims(1, R, 128, ROPE, 128), mb.Policy("absorb"),
                   impl=harness.native_kernels(isa),
                   indexer=mb.IndexerDims(index_heads, DI, topk))  # fmt: skip
    fns: dict[str, Callable[[], object]] = {
        "indexer": lambda: mb.indexer_topk(q_I, weights, index_cache, plan, topk)
    }
    fns.update(roof.probes())
    times = harness.interleaved(fns, rounds, min_time, each_round=roof.sample)
    return {"times": times, "flops": 2.0 * index_heads * DI * T * (T + 1) / 2,
            "bytes": float(INDEX_BYTES * T)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks sparse",
                                 description=__doc__.split("\n\n")[0])  # fmt: skip
    ap.add_argument("--heads", default="16,128")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--lens", default="4096,16384,65536")
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--prefill", default="4096",
                    help="fresh prefill lengths for the prefill indexer's table ('' for none)")
    ap.add_argument("--prefill-index-heads", default="8,64",
                    help="index heads of the prefill table (8: the tiny models; 64: V3.2's)")
    ap.add_argument("--isa", default=None, help="native ISA level (default: the selected one)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--min-time", type=float, default=0.1)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch / kernel threads (default: torch's); 1 keeps the ratios steady "
                    "on a shared, loaded machine (no thread waits on a descheduled peer)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    isa = args.isa or harness.selected_isa()
    roof = roofline.Roofline([isa])
    results = []
    for H in (int(x) for x in args.heads.split(",")):
        for B in (int(x) for x in args.batches.split(",")):
            for L in (int(x) for x in args.lens.split(",")):
                res = run_shape(H, B, L, args.topk, isa, args.rounds, args.min_time, roof)
                results.append(((H, B, L), res))
                t = res["times"]
                ms = ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in t.items())
                print(f"H{H} B{B} L{L}: {ms}", flush=True)
    prefills = []
    for T in (int(x) for x in args.prefill.split(",") if x):
        for Hi in (int(x) for x in args.prefill_index_heads.split(",") if x):
            res = run_prefill(T, Hi, args.topk, isa, args.rounds, args.min_time, roof)
            prefills.append(((T, Hi), res))
            print(f"prefill T{T} Hi{Hi}: indexer {res['times']['indexer'] * 1e3:.1f} ms",
                  flush=True)  # fmt: skip
    (ceil, ceil_src), (bw, bw_src) = roof.ceiling(isa), roof.bw()
    header = ["H", "batch", "kv", "dense ms", "indexer ms (roof)", "sparse ms",
              "indexer + sparse ms", "dense / (indexer + sparse)", "shape's GEMM TF/s",
              "shape's bw GB/s"]  # fmt: skip
    rows = []
    for (H, B, L), res in results:
        t, sp = res["times"], res["probes"]
        f, nb = 2.0 * HI * DI * L * B, float(INDEX_BYTES * L * B)
        share = roofline.roof_fraction(f, nb, t["indexer"], ceil, bw)
        both = t["indexer"] + t["sparse"]
        rows.append([
            str(H), str(B), str(L), f"{t['dense'] * 1e3:.3f}",
            f"{t['indexer'] * 1e3:.3f} ({roofline.roof_cell(share)})", f"{t['sparse'] * 1e3:.3f}",
            f"{both * 1e3:.3f}", f"{t['dense'] / both:.2f}x", f"{sp.peak / 1e12:.3f} {sp.which}",
            f"{sp.bw / 1e9:.1f}",
        ])  # fmt: skip
    notes = [
        f"native kernels at ISA level {isa}; bf16 latent cache, page {PAGE}, shuffled pages, "
        f"r {R} + rope {ROPE}; indexer {HI} heads x {DI}, vLLM's fp8 index cache "
        f"({INDEX_BYTES} bytes per token), q_I e4m3; index_topk {args.topk}; one new token per "
        f"request; best of {args.rounds} interleaved rounds of >= {args.min_time}s",
        "dense = mb.absorbed_attention (our dense absorbed decode); indexer = mb.indexer_topk "
        "(logits GEMM + relu-weighted head sum + streaming top-k); sparse = "
        "mb.sparse_absorbed_attention over the indexer's selection",
        f"indexer roof = share of min(ceiling, intensity x bw) with {2 * HI * DI} FLOPs and "
        f"{INDEX_BYTES} bytes per cached token per query token; ceiling {ceil / 1e12:.3f} "
        f"TFLOP/s ({ceil_src}: the better of torch's GEMM capped at {isa} and our FMA loop at "
        f"it), bw {bw / 1e9:.1f} GB/s ({bw_src})",
        "every probe's best over the run (samples): " + roof.summary(),
        roofline.ROOF_FLAG_NOTE,
        "targets: sparse flat in kv beyond topk; indexer >= 60% of its roof; "
        "dense / (indexer + sparse) >= 5x at kv 65536, 128 heads",
    ]
    body = harness.table(header, rows)
    if prefills:
        prow = []
        for (T, Hi), res in prefills:
            t = res["times"]["indexer"]
            share = roofline.roof_fraction(res["flops"], res["bytes"], t, ceil, bw)
            prow.append([str(T), str(Hi), f"{t * 1e3:.1f} ({roofline.roof_cell(share)})",
                         f"{res['flops'] / t / 1e9:.1f}"])  # fmt: skip
        notes.append(
            f"prefill: mb.indexer_topk (top-{args.topk}) of one fresh prompt, every token over "
            f"its causal keys: 2 x Hi x {DI} FLOPs per token and visible key, the keys read once"
        )
        body += "\n\n" + harness.table(
            ["prefill tokens", "index heads", "indexer ms (roof)", "GFLOP/s"], prow
        )
    harness.write_result("sparse", "DSA decode: indexer + sparse attention vs dense absorbed",
                         notes, body)  # fmt: skip
    return 0
