"""``python -m benchmarks sparse-mha``: a DSA layer's options side by side per request shape,
native kernels at one ISA level: the lightning indexer's top-k, the sparse absorbed attention
(``q_nope · W_UK``, MQA over each token's selected latent rows, ``· W_UV``) and the sparse MHA
in both variants (:mod:`mla_backend.sparse_normal`: ``masked``, the context decompressed once
and a masked MHA skipping unselected tiles; ``gather``, each token's selected rows gathered and
decompressed), with the dense absorbed and normal paths as the yardstick; which one wins per
shape, and the cost model's pick.

    python -m benchmarks sparse-mha [--heads 8] [--topk 256] [--shapes 0+512,...] [--isa avx2]

Shapes are ``P+N`` (P cached, N new tokens; one request); the selection is the native
indexer's over random keys (vLLM's fp8 index cache). The defaults are scaled down (topk 256,
contexts up to 4K) so a run takes minutes on two cores. The ratios do not simply follow
context / topk: the sparse MHA pays the decompression of each row it reads, ``2 H r (nope +
v)`` FLOPs, about 120x the absorbed attention's per head and key, so it can win only where
``index_topk`` is large (DeepSeek's 2048: pass ``--topk 2048`` with prefills of a few
thousand tokens, ``--options`` to leave out the gathered variant, hopeless for prefills).
Writes ``sparse_mha-latest.md`` (and the history). :func:`measure` also serves
``python -m benchmarks policy --sparse``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

import mla_backend as mb
from mla_backend.sparse_normal import sparse_normal_attention

from . import harness
from .problems import paged_latents, random_weights
from .sparse import DI, PAGE, index_cache_for

DT = torch.bfloat16
#: the timed options: the indexer, the sparse routes, the dense paths
OPTIONS = ("indexer", "sparse_absorbed", "sparse_masked", "sparse_gather", "absorbed", "normal")


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``"0+512,2048+64"`` -> [(0, 512), (2048, 64)]."""
    return [(int(p), int(n)) for p, n in (s.split("+") for s in text.split(","))]


def measure(H: int, index_heads: int, topk: int, P: int, N: int, kern: mb.ops.KernelImpl,
            rounds: int, min_time: float,
            options: tuple[str, ...] = OPTIONS) -> dict[str, float]:  # fmt: skip
    """Best seconds per call of each of ``options`` (:data:`OPTIONS`) for one request of P
    cached and N new tokens at H heads (r 512, rope 64, nope 128, v 128, bf16, page 64,
    shuffled pages); the sparse routes exclude the indexer (timed on its own)."""
    dims = mb.MLADims(H, 512, 128, 64, 128)
    w = random_weights(dims, DT)
    attn = mb.MLAAttention(dims, w)
    cache, table = paged_latents(dims, [P + N], PAGE, DT)
    index_cache = index_cache_for(table, cache.shape[0], P + N)
    g = torch.Generator().manual_seed(1)
    qn = torch.randn(N, H, 128, generator=g).to(DT)
    qp = torch.randn(N, H, 64, generator=g).to(DT)
    q_I = (torch.randn(N, index_heads, DI, generator=g) * 16).to(torch.float8_e4m3fn)
    weights = torch.randn(N, index_heads, generator=g) / index_heads
    phase = mb.Phase.DECODE if N == 1 else mb.Phase.EXTEND
    batch = mb.MLABatch.build([P], [N], table, PAGE, phase, block_table_host=table)
    ix = mb.IndexerDims(index_heads, DI, topk)
    plan = mb.plan(batch, dims, mb.Policy("absorb"), impl=kern, indexer=ix)
    idx = mb.indexer_topk(q_I, weights, index_cache, plan, topk)
    pa = mb.plan(batch, dims, mb.Policy("absorb"), impl=kern)
    pn = mb.plan(batch, dims, mb.Policy("normal"), impl=kern)
    scale = dims.default_softmax_scale
    wk = attn._weights_for(kern)

    def sparse_absorbed() -> object:
        q_lat = kern.absorb_q(qn, wk)
        o_lat, _ = mb.sparse_absorbed_attention(q_lat, qp, cache, plan, idx, scale)
        return kern.apply_W_UV(o_lat, wk)

    def mha(variant: str) -> Callable[[], object]:
        return lambda: sparse_normal_attention(qn, qp, cache, plan, w, idx, scale,
                                               variant=variant)  # fmt: skip

    fns: dict[str, Callable[[], object]] = {
        "indexer": lambda: mb.indexer_topk(q_I, weights, index_cache, plan, topk),
        "sparse_absorbed": sparse_absorbed,
        "sparse_masked": mha("masked"),
        "sparse_gather": mha("gather"),
        "absorbed": lambda: attn(qn, qp, cache, pa),
        "normal": lambda: attn(qn, qp, cache, pn),
    }
    return harness.interleaved({k: f for k, f in fns.items() if k in options}, rounds, min_time)


def fastest(t: dict[str, float], fits: bool) -> str:
    """The fastest route of a measured shape (the sparse ones pay the indexer; the dense ones
    are options only where the context fits topk)."""
    routes = ("sparse_absorbed", "sparse_masked", "sparse_gather")
    routes += ("absorbed", "normal") if fits else ()
    return min((r for r in routes if r in t), key=lambda r: route_time(t, r))


def route_time(t: dict[str, float], route: str) -> float:
    """The measured seconds of a route (the indexer added to a sparse one; inf where the route
    was not timed)."""
    return t.get(route, float("inf")) + (t["indexer"] if route.startswith("sparse") else 0.0)


def ratio(t: dict[str, float], picked: str, best: str) -> str:
    """The picked route's time over the fastest's, or "not timed"."""
    if picked not in t:
        return "not timed"
    return f"{route_time(t, picked) / route_time(t, best):.2f}x"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks sparse-mha",
                                 description=__doc__.split("\n\n")[0])  # fmt: skip
    ap.add_argument("--heads", default="8")
    ap.add_argument("--index-heads", type=int, default=8)
    ap.add_argument("--topk", type=int, default=256)
    ap.add_argument("--shapes", default="0+512,0+1024,0+2048,1024+256,2048+64,4096+8,4096+1")
    ap.add_argument("--isa", default=None, help="native ISA level (default: the selected one)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--min-time", type=float, default=0.05)
    ap.add_argument("--options", default=",".join(OPTIONS),
                    help=f"what to time (the indexer always): {','.join(OPTIONS)}")
    args = ap.parse_args(argv)
    options = tuple(sorted({"indexer", *args.options.split(",")} & set(OPTIONS),
                           key=OPTIONS.index))  # fmt: skip
    torch.manual_seed(0)
    isa = args.isa or harness.selected_isa()
    kern = harness.native_kernels(isa)
    policy = mb.Policy("cost")
    rows = []
    wins: dict[str, int] = {}
    for H in (int(x) for x in args.heads.split(",")):
        dims = mb.MLADims(H, 512, 128, 64, 128)
        ix = mb.IndexerDims(args.index_heads, DI, args.topk)
        for P, N in parse_shapes(args.shapes):
            t = measure(H, args.index_heads, args.topk, P, N, kern, args.rounds, args.min_time,
                        options)  # fmt: skip
            fits = P + N <= args.topk
            best = fastest(t, fits)
            wins[best] = wins.get(best, 0) + 1
            b = mb.MLABatch.build([P], [N], torch.zeros(1, 1, dtype=torch.int32), P + N,
                                  mb.Phase.DECODE if N == 1 else mb.Phase.EXTEND)  # fmt: skip
            picked = mb.plan(b, dims, policy, impl=kern, indexer=ix).choice.routes[0]
            ms = {k: f"{t[k] * 1e3:.2f}" if k in t else "-" for k in OPTIONS}
            rows.append([str(H), f"{P}+{N}", ms["indexer"], ms["sparse_absorbed"],
                         ms["sparse_masked"], ms["sparse_gather"], ms["absorbed"], ms["normal"],
                         best, picked, ratio(t, picked, best)])
            print(" ".join(rows[-1]), flush=True)
    header = ["H", "P+N", "indexer ms", "sparse absorbed ms", "sparse MHA masked ms",
              "sparse MHA gather ms", "dense absorbed ms", "dense normal ms",
              "fastest (indexer incl.)", "policy picks", "picked / fastest"]  # fmt: skip
    notes = [
        f"native kernels at ISA level {isa} on {harness.describe_host()}; bf16, r 512 + rope 64, "
        f"nope 128, v 128, page {PAGE}, shuffled pages; indexer {args.index_heads} heads x {DI}, "
        f"vLLM's fp8 index cache, index_topk {args.topk}; one request per step; best of "
        f"{args.rounds} interleaved rounds of >= {args.min_time}s",
        "sparse routes exclude the indexer in their columns and include it in 'fastest'; the "
        "dense paths are options only where P+N <= topk (else they are a yardstick: a different "
        "attention); sparse MHA = mla_backend.sparse_normal (masked: context decompressed once, "
        "masked MHA skipping unselected 32x64 tiles; gather: topk rows decompressed per token)",
        "fastest per shape: " + ", ".join(f"{k} {v}" for k, v in sorted(wins.items())),
    ]
    harness.write_result("sparse_mha", "DSA: sparse absorbed vs sparse MHA (masked / gathered)",
                         notes, harness.table(header, rows))  # fmt: skip
    return 0
