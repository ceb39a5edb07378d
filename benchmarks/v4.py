"""``python -m benchmarks v4``: DeepSeek-V4's attention decode per layer kind (sliding window,
CSA, HCA) through the core (``mb.v4_attention`` over the key-set primitive, native kernels at one
ISA level), with CSA's indexer over compressed keys (``mb.indexer_topk``, compress_ratio 4), each
judged against its in-run roofline (``benchmarks/roofline.py``).

Shapes: V4-Flash (64 heads) and V4-Pro (128 heads) attention, head_dim 512 (448 + 64 rope), one
bf16 row per key (the window cache; compressed entries in a second cache of the same format),
window 128, CSA: index_topk 512 of the L / 4 compressed entries, HCA: every one of the L / 128;
indexer 64 heads x 128 over vLLM's fp8 index cache (132 bytes per compressed key); batch 1, one
new token, pages of 64 shuffled. Per decode token: attention over K keys = 2 x H x K x (512 +
512) FLOPs and K x 1024 bytes; the indexer 2 x 64 x 128 FLOPs and 132 bytes per compressed key.

With ``--prefill``, the CSA indexer's logits over a prefill chunk's rows as vLLM's paged op
passes them (a row per token): the rows planned as one request, as ``indexer_logits_rows``
does, vs a one-token request per row.

vLLM's own V4 CPU ops (``flash_mla_with_kvcache_cpu``, ``fp8_paged_mqa_logits_cpu``) are the
issue's peer; they exist only in vLLM's AVX512-BF16 build and read only the 584-byte fp8 row,
which the core does not write yet: the table says whether they are present and does not time
them. Writes ``v4-latest.md`` (and the history).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

import mla_backend as mb
from mla_backend.indexer_rows import indexer_logits_rows

from . import harness, roofline

D, ROPE, WINDOW, PAGE = 512, 64, 128, 64
HI, DI, TOPK = 64, 128, 512
INDEX_BYTES = DI + 4
KINDS = {"sliding": 0, "csa": 4, "hca": 128}


def _paged(rows: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A bf16 cache of ``rows`` random unit-RMS rows in shuffled pages, and its [1, pages] table."""
    pages = max(1, -(-rows // PAGE))
    table = torch.randperm(pages, generator=gen).view(1, pages).int()
    cache = torch.randn(pages, PAGE, D, generator=gen).bfloat16()
    return cache, table


def _vllm_ops() -> str:
    """Whether vLLM's V4 CPU attention ops are loaded in this process."""
    try:
        import vllm._custom_ops  # noqa: F401
    except Exception as e:  # not installed, or its extension does not load here
        return f"vLLM not importable ({type(e).__name__})"
    ops = [n for n in ("flash_mla_with_kvcache_cpu", "fp8_paged_mqa_logits_cpu")
           if hasattr(torch.ops._C, n)]  # fmt: skip
    return f"present: {', '.join(ops)}" if ops else "absent (vLLM's AVX512-BF16 build only)"


def run_shape(H: int, L: int, kind: str, isa: str, rounds: int, min_time: float,
              roof: roofline.Roofline) -> dict[str, object]:  # fmt: skip
    g = torch.Generator().manual_seed(H * 7 + L)
    ratio = KINDS[kind]
    cache, table = _paged(L, g)
    batch = mb.MLABatch.build([L - 1], [1], table, PAGE, mb.Phase.DECODE, block_table_host=table)
    kern = harness.native_kernels(isa)
    plan = mb.plan(batch, mb.v4_dims(H, D, ROPE), mb.Policy("absorb"), impl=kern, window=WINDOW)
    q = torch.randn(1, H, D, generator=g).bfloat16()
    sink = torch.randn(H, generator=g)
    pos = torch.tensor([L - 1])
    cos_sin = torch.randn(L, ROPE, generator=g)
    fns: dict[str, Callable[[], object]] = {}
    keys = min(WINDOW, L)
    compressed = indices = None
    if ratio:
        n = L // ratio
        ccache, ctable = _paged(n, g)
        compressed = mb.KeyCache(ccache, ctable, torch.tensor([n], dtype=torch.int32))
        if kind == "hca":
            indices = torch.arange(n, dtype=torch.int32).view(1, n)
            keys += n
        else:
            k = min(TOPK, n)
            indices = torch.randperm(n, generator=g)[:k].sort().values.int().view(1, k)
            keys += k
            layout = mb.IndexCacheLayout.named("fp8", DI)
            icache = torch.zeros(ctable.shape[1], PAGE, layout.width, dtype=torch.uint8)
            w = torch.arange(n)
            slots = ctable[0, w // PAGE].long() * PAGE + w % PAGE
            mb.write_index_keys(icache, torch.randn(n, DI, generator=g).bfloat16(), slots,
                                layout, impl="torch")  # fmt: skip
            ibatch = mb.MLABatch.build([L - 1], [1], ctable, PAGE * ratio, mb.Phase.DECODE,
                                       block_table_host=ctable)  # fmt: skip
            iplan = mb.plan(ibatch, mb.v4_dims(H, D, ROPE), mb.Policy("absorb"), impl=kern,
                            indexer=mb.IndexerDims(HI, DI, TOPK, compress_ratio=ratio))  # fmt: skip
            q_I = (torch.randn(1, HI, DI, generator=g) * 16).to(torch.float8_e4m3fn)
            weights = torch.randn(1, HI, generator=g) / HI
            fns["indexer"] = lambda: mb.indexer_topk(q_I, weights, icache, iplan, TOPK)
    fns["attention"] = lambda: mb.v4_attention(
        q, cache, plan, sink, cos_sin, pos, compressed=compressed, compressed_indices=indices
    )
    fns.update(roof.probes())
    times = harness.interleaved(fns, rounds, min_time, each_round=roof.sample)
    return {"times": times, "keys": keys, "entries": L // ratio if ratio else 0}


def run_prefill(T: int, isa: str, rounds: int, min_time: float,
                roof: roofline.Roofline) -> dict[str, object]:  # fmt: skip
    """The CSA indexer's logits over the rows of a T-token prefill chunk (onto a prefix of
    ratio - 1 tokens, so every row sees a key) as vLLM's ops pass them, one row per token with
    its request's page-table row and its count of compressed keys: ``indexer_logits_rows``
    (which plans the chunk's rows as one request) vs the same rows planned as one-token
    requests each."""
    g = torch.Generator().manual_seed(T)
    ratio = KINDS["csa"]
    pos = torch.arange(ratio - 1, ratio - 1 + T)
    lens = ((pos + 1) // ratio).int()
    n = int(lens[-1])
    layout = mb.IndexCacheLayout.named("fp8", DI, scale_fmt="ue8m0")
    pages = -(-n // PAGE)
    table = torch.randperm(pages, generator=g).view(1, pages).int()
    icache = torch.zeros(pages, PAGE, layout.width, dtype=torch.uint8)
    slots = table[0, torch.arange(n) // PAGE].long() * PAGE + torch.arange(n) % PAGE
    mb.write_index_keys(icache, torch.randn(n, DI, generator=g).bfloat16(), slots, layout,
                        impl="torch")  # fmt: skip
    rows_table = table.expand(T, -1).contiguous()
    q_I = (torch.randn(T, HI, DI, generator=g) * 16).to(torch.float8_e4m3fn)
    weights = torch.randn(T, HI, generator=g) / HI
    kern = harness.native_kernels(isa)

    def one_each() -> torch.Tensor:  # what indexer_logits_rows did before it grouped rows
        single = mb.MLABatch.build((lens - 1).tolist(), [1] * T, rows_table, PAGE,
                                   mb.Phase.DECODE, block_table_host=rows_table)  # fmt: skip
        step = mb.plan(single, mb.v4_dims(1), mb.Policy("absorb"), impl=kern,
                       indexer=mb.IndexerDims(HI, DI, 1))  # fmt: skip
        return mb.indexer_logits(q_I, weights, icache, step, layout)

    fns: dict[str, Callable[[], object]] = {
        "rows": lambda: indexer_logits_rows(q_I, weights, icache, lens, rows_table, layout, n,
                                            impl=kern),  # fmt: skip
        "one_each": one_each,
    }
    fns.update(roof.probes())
    times = harness.interleaved(fns, rounds, min_time, each_round=roof.sample)
    return {"times": times, "flops": 2.0 * HI * DI * float(lens.sum()), "bytes": INDEX_BYTES * n}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks v4",
                                 description=__doc__.split("\n\n")[0])  # fmt: skip
    ap.add_argument("--heads", default="64,128")
    ap.add_argument("--lens", default="8192,32768,131072")
    ap.add_argument("--kinds", default="sliding,csa,hca")
    ap.add_argument("--prefill", default="1024,4096",
                    help="prefill chunk lengths for the CSA indexer's rows ('' for none)")
    ap.add_argument("--isa", default=None, help="native ISA level (default: the selected one)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--min-time", type=float, default=0.05)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    isa = args.isa or harness.selected_isa()
    roof = roofline.Roofline([isa])
    results = []
    for H in (int(x) for x in args.heads.split(",")):
        for L in (int(x) for x in args.lens.split(",")):
            for kind in args.kinds.split(","):
                if kind not in KINDS:
                    raise SystemExit(f"--kinds: {kind!r} is not one of {', '.join(KINDS)}")
                res = run_shape(H, L, kind, isa, args.rounds, args.min_time, roof)
                results.append(((H, L, kind), res))
                ms = ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in res["times"].items()
                               if k in ("attention", "indexer"))  # fmt: skip
                print(f"H{H} L{L} {kind}: {ms}", flush=True)
    prefills = []
    for T in (int(x) for x in args.prefill.split(",") if x):
        prefills.append((T, run_prefill(T, isa, args.rounds, args.min_time, roof)))
        t = prefills[-1][1]["times"]
        print(f"prefill {T}: rows {t['rows'] * 1e3:.1f} ms, one each "
              f"{t['one_each'] * 1e3:.1f} ms", flush=True)  # fmt: skip
    (ceil, ceil_src), (bw, bw_src) = roof.ceiling(isa), roof.bw()
    header = ["H", "context", "layer", "keys attended", "attention ms (roof)",
              "indexer ms (roof)", "attention + indexer ms"]  # fmt: skip
    rows = []
    for (H, L, kind), res in results:
        t, K = res["times"], res["keys"]
        share = roofline.roof_fraction(2.0 * H * K * 2 * D, 2.0 * D * K, t["attention"], ceil, bw)
        cells = [str(H), str(L), kind, str(K),
                 f"{t['attention'] * 1e3:.3f} ({roofline.roof_cell(share)})"]  # fmt: skip
        total = t["attention"]
        if "indexer" in t:
            n = res["entries"]
            ishare = roofline.roof_fraction(2.0 * HI * DI * n, float(INDEX_BYTES * n),
                                            t["indexer"], ceil, bw)  # fmt: skip
            cells.append(f"{t['indexer'] * 1e3:.3f} ({roofline.roof_cell(ishare)})")
            total += t["indexer"]
        else:
            cells.append("-")
        cells.append(f"{total * 1e3:.3f}")
        rows.append(cells)
    notes = [
        f"native kernels at ISA level {isa}; V4 attention: head_dim {D} ({D - ROPE} + {ROPE} "
        f"rope), one bf16 row per key, pages of {PAGE} shuffled, window {WINDOW}, per-head sink, "
        f"value = key, output RoPE undone; CSA: index_topk {TOPK} of context / 4 entries (a "
        f"random selection for the attention), HCA: every one of context / 128; batch 1, one "
        f"new token; best of {args.rounds} interleaved rounds of >= {args.min_time}s",
        f"indexer: {HI} heads x {DI}, vLLM's fp8 index cache ({INDEX_BYTES} bytes per compressed "
        "key), q_I e4m3, top-512 over compressed keys (mb.indexer_topk, compress_ratio 4)",
        f"roof = share of min(ceiling, intensity x bw): attention 2 x H x {2 * D} FLOPs and "
        f"{2 * D} bytes per key; indexer {2 * HI * DI} FLOPs and {INDEX_BYTES} bytes per "
        f"compressed key; ceiling {ceil / 1e12:.3f} TFLOP/s ({ceil_src}), bw {bw / 1e9:.1f} GB/s "
        f"({bw_src})",
        "every probe's best over the run (samples): " + roof.summary(),
        roofline.ROOF_FLAG_NOTE,
        f"vLLM's V4 CPU ops in this process: {_vllm_ops()}; not timed (they read only the 584 B "
        "fp8 row, which the core does not write yet)",
        "targets (issue 34): >= 1.5x vLLM's own V4 CPU ops on AVX512-BF16; >= 60% of the in-run "
        "roofline at 32K+",
    ]
    body = harness.table(header, rows)
    if prefills:
        prow = []
        for T, res in prefills:
            t = res["times"]
            cells = [str(T)]
            for k in ("rows", "one_each"):
                share = roofline.roof_fraction(res["flops"], res["bytes"], t[k], ceil, bw)
                cells.append(f"{t[k] * 1e3:.1f} ({roofline.roof_cell(share)})")
            cells.append(f"{t['one_each'] / t['rows']:.2f}x")
            prow.append(cells)
        notes.append(
            "prefill: the CSA indexer's logits over a chunk's rows as vLLM's "
            "fp8_paged_mqa_logits passes them (one row per token: its page-table row and "
            "(pos + 1) // 4 keys; the chunk onto a 3-token prefix): mb.indexer_logits_rows, "
            "which plans the chunk's rows as one request, vs one one-token request per row (each "
            "call building its batch and plan, as indexer_logits_rows did); "
            f"roof: {2 * HI * DI} FLOPs per row and key, the keys read once"
        )
        body += "\n\n" + harness.table(
            ["prefill tokens", "rows as one request ms (roof)", "a request per row ms (roof)",
             "speed-up"], prow)  # fmt: skip
    harness.write_result("v4", "DeepSeek-V4 attention decode per layer kind (core, native)",
                         notes, body)  # fmt: skip
    return 0
