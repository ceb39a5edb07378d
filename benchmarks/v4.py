"""``python -m benchmarks v4``: DeepSeek-V4's attention decode per layer kind (sliding window,
CSA, HCA) through the core (``mb.v4_attention`` over the key-set primitive, native kernels at one
ISA level), with CSA's indexer over compressed keys (``mb.indexer_topk``, compress_ratio 4), each
judged against its in-run roofline (``benchmarks/roofline.py``); and the same decode through
vLLM's own V4 CPU ops side by side with ours of the same signatures.

Shapes: V4-Flash (64 heads) and V4-Pro (128 heads) attention, head_dim 512 (448 + 64 rope), one
bf16 row per key (the window cache; compressed entries in a second cache of the same format),
window 128, CSA: index_topk 512 of the L / 4 compressed entries, HCA: every one of the L / 128;
indexer 64 heads x 128 over vLLM's fp8 index cache (132 bytes per compressed key); batch 1, one
new token, pages of 64 shuffled. Per decode token: attention over K keys = 2 x H x K x (512 +
512) FLOPs and K x 1024 bytes; the indexer 2 x 64 x 128 FLOPs and 132 bytes per compressed key.

With ``--prefill``, the CSA indexer's logits over a prefill chunk's rows as vLLM's paged op
passes them (a row per token): the rows planned as one request, as ``indexer_logits_rows``
does, vs a one-token request per row.

vLLM's own V4 CPU ops (section ``vllm``; only in vLLM's AVX512-BF16 build: elsewhere the table
says why they are absent and the rest runs): ``flash_mla_with_kvcache_cpu`` vs ours of the same
signature (``mla_backend_integrations.vllm.v4_ops``, what ``--attention-backend mla_absorb``
runs), on the same tensors: a decode batch of T requests (``--vllm-tokens``) at context L, each
token's window slots its last 128 positions, CSA's 512 of its L / 4 compressed entries (a random
sorted selection), HCA's every one of its L / 128; both caches in V4's 584-byte fp8 page layout
(``mla_backend.v4_cache``, pages of 64 of ``v4_page_bytes(64)`` bytes, one pool shuffled), int64
slots, q bf16, a float32 sink; roof 2 x H x 1024 FLOPs and 584 bytes per key. The indexer at
decode over each request's L / 4 compressed keys (``fp8_paged_mqa_logits_cpu`` then
``topk_transform_512_cpu``, vLLM's vs ours, each pair on the same inputs; V4's index cache with
power-of-two scales), with the overlap of the two selections. Both in the core's interleaved
rounds of each shape (``--sections`` picks the tables: core, prefill, vllm).

Writes ``v4-latest.md`` (and the history).
"""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Callable
from types import ModuleType

import torch

import mla_backend as mb
from mla_backend.indexer_rows import indexer_logits_rows
from mla_backend.v4_cache import V4_TOKEN_BYTES, v4_page_bytes, write_v4_rows

from . import harness, roofline, vllm_ops

D, ROPE, WINDOW, PAGE = 512, 64, 128, 64
HI, DI, TOPK = 64, 128, 512
INDEX_BYTES = DI + 4
KINDS = {"sliding": 0, "csa": 4, "hca": 128}
SECTIONS = ("core", "prefill", "vllm")
#: vLLM's V4 CPU ops this benchmark times against ours
PEER_OPS = ("flash_mla_with_kvcache_cpu", "fp8_paged_mqa_logits_cpu", "topk_transform_512_cpu")

Fn = Callable[[], object]
#: a case of the vllm section: (its shape: (H, L, kind, T) or (L, T), seconds by function, checks)
PeerCase = tuple[tuple, dict[str, float], dict[str, float]]


def _paged(rows: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A bf16 cache of ``rows`` random unit-RMS rows in shuffled pages, and its [1, pages] table."""
    pages = max(1, -(-rows // PAGE))
    table = torch.randperm(pages, generator=gen).view(1, pages).int()
    cache = torch.randn(pages, PAGE, D, generator=gen).bfloat16()
    return cache, table


def _index_cache(reqs: int, n: int, layout: mb.IndexCacheLayout,
                 gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``reqs`` requests of ``n`` random indexer keys each in an fp8 index cache of ``layout``
    (pages of PAGE keys, one pool shuffled): (cache uint8 [pages, PAGE, width], page table int32
    [reqs, pages of a request])."""
    pages = -(-n // PAGE)
    table = torch.randperm(reqs * pages, generator=gen).view(reqs, pages).int()
    cache = torch.zeros(reqs * pages, PAGE, layout.width, dtype=torch.uint8)
    w = torch.arange(n)
    slots = (table[:, w // PAGE].long() * PAGE + w % PAGE).reshape(-1)
    mb.write_index_keys(cache, torch.randn(reqs * n, DI, generator=gen).bfloat16(), slots,
                        layout, impl="torch")  # fmt: skip
    return cache, table


def _v4_cache(reqs: int, first: int, last: int,
              gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Positions ``first`` .. ``last - 1`` of ``reqs`` requests as random rows in V4's fp8 page
    layout (pages of PAGE, ``v4_page_bytes(PAGE)`` bytes each, one pool shuffled, a spare page):
    (cache uint8 [pages, bytes], flat slots int64 [reqs, last - first])."""
    lo = first // PAGE
    per = max(1, -(-last // PAGE) - lo)
    pool = torch.randperm(reqs * per + 1, generator=gen)[: reqs * per].view(reqs, per)
    cache = torch.zeros(reqs * per + 1, v4_page_bytes(PAGE), dtype=torch.uint8)
    pos = torch.arange(first, last)
    slots = pool[:, pos // PAGE - lo] * PAGE + pos % PAGE
    rows = torch.randn(slots.numel(), D, generator=gen)
    write_v4_rows(cache, PAGE, slots.reshape(-1), rows)
    return cache, slots


def peer() -> tuple[ModuleType | None, str]:
    """Our V4 ops module where vLLM's V4 CPU ops are loaded in this process (through
    :func:`benchmarks.vllm_ops.vllm_ops`), and a line naming vLLM's version and kernel library;
    else None and why they are absent."""
    if vllm_ops.vllm_ops() is None:
        if importlib.util.find_spec("vllm") is None:
            return None, "vLLM is not installed in this environment"
        return None, "vLLM's CPU kernels do not load in this process"
    import vllm

    missing = [n for n in PEER_OPS if not hasattr(torch.ops._C, n)]
    if missing:
        lib = vllm_ops.library_note()
        return None, (f"vLLM {vllm.__version__} loaded without {', '.join(missing)} ({lib}; "
                      "they are built for AVX512-BF16 only)")  # fmt: skip
    from mla_backend_integrations.vllm import v4_ops

    return v4_ops, f"vLLM {vllm.__version__} ({vllm_ops.library_note()})"


def core_shape(H: int, L: int, kind: str, isa: str) -> tuple[dict[str, Fn], dict[str, int]]:
    """The core's decode of one shape: its functions ("attention", and "indexer" for CSA) and
    {"keys": keys attended, "entries": compressed entries}."""
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
    fns: dict[str, Fn] = {}
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
    return fns, {"keys": keys, "entries": L // ratio if ratio else 0}


def peer_attention(H: int, L: int, kind: str, T: int, ours: ModuleType,
                   gen: torch.Generator) -> tuple[dict[str, Fn], dict[str, float]]:  # fmt: skip
    """vLLM's ``flash_mla_with_kvcache_cpu`` and ours on the same decode batch of T requests at
    context L: {"vllm": fn, "ours": fn}, and {"keys": keys per token, "diff": the max abs
    difference of the two outputs}."""
    ratio = KINDS[kind]
    window = min(WINDOW, L)
    wcache, wslots = _v4_cache(T, L - window, L, gen)
    n = L // ratio if ratio else 0
    if n:
        ccache, cslots = _v4_cache(T, 0, n, gen)
        if kind == "csa":
            k = min(TOPK, n)
            sel = torch.stack([torch.randperm(n, generator=gen)[:k].sort().values
                               for _ in range(T)])  # fmt: skip
            cslots = cslots.gather(1, sel)
    else:
        ccache = torch.zeros(1, v4_page_bytes(PAGE), dtype=torch.uint8)
        cslots = torch.zeros(T, 0, dtype=torch.int64)
    q = torch.randn(T, H, D, generator=gen).bfloat16()
    sink = torch.randn(H, generator=gen)
    outs = {who: torch.empty(T, H, D, dtype=torch.bfloat16) for who in ("vllm", "ours")}
    ops = {"vllm": torch.ops._C.flash_mla_with_kvcache_cpu, "ours": ours.flash_mla_with_kvcache_cpu}
    args = (q, wcache, wslots, PAGE, ccache, cslots, PAGE, sink, D**-0.5)
    fns: dict[str, Fn] = {who: (lambda f=f, o=outs[who]: f(o, *args)) for who, f in ops.items()}
    for f in fns.values():
        f()
    diff = (outs["vllm"].float() - outs["ours"].float()).abs().max().item()
    return fns, {"keys": window + cslots.shape[1], "diff": diff}


def peer_indexer(L: int, T: int, ours: ModuleType,
                 gen: torch.Generator) -> tuple[dict[str, Fn], dict[str, float]]:  # fmt: skip
    """CSA's indexer at decode, T requests of L / 4 compressed keys each: vLLM's and our
    ``fp8_paged_mqa_logits_cpu`` on the same inputs ({"vllm logits", "ours logits"}), and
    their ``topk_transform_512_cpu`` on the same scores (vLLM's logits: {"vllm topk", "ours
    topk"}); {"keys": compressed keys per request, "overlap": the mean and "min overlap" the
    least share of a row's top-512 that the two pipelines (each its own logits, then its
    top-k) both pick, "logits": the max abs difference of the logits over the largest}."""
    n = L // KINDS["csa"]
    icache, table = _index_cache(T, n, ours.INDEX_LAYOUT, gen)
    kv = icache.view(icache.shape[0], -1)  # vLLM's 2-D view of the index cache
    q = (torch.randn(T, HI, DI, generator=gen) * 16).to(torch.float8_e4m3fn)
    weights = torch.randn(T, HI, generator=gen) / HI
    lens = torch.full((T,), n, dtype=torch.int32)
    logits = {
        "vllm": lambda: torch.ops._C.fp8_paged_mqa_logits_cpu(q, kv, weights, lens, table, PAGE, n),
        "ours": lambda: ours.fp8_paged_mqa_logits_cpu(q, kv, weights, lens, table, PAGE, n),
    }
    topk = {"vllm": torch.ops._C.topk_transform_512_cpu, "ours": ours.topk_transform_512_cpu}
    scores = {who: f() for who, f in logits.items()}
    keys = {}
    for who, f in topk.items():
        keys[who] = torch.empty(T, TOPK, dtype=torch.int32)
        f(scores[who], lens, table, torch.empty(T, TOPK, dtype=torch.int32), PAGE, keys[who])
    both = [len(set(a.tolist()) & set(b.tolist()) - {-1}) / max(1, len(set(a.tolist()) - {-1}))
            for a, b in zip(keys["vllm"], keys["ours"])]  # fmt: skip
    big = max(scores["vllm"].abs().max().item(), 1e-30)
    checks = {"keys": n, "overlap": sum(both) / T, "min overlap": min(both),
              "logits": (scores["vllm"] - scores["ours"]).abs().max().item() / big}  # fmt: skip
    page_out, raw_out = (torch.empty(T, TOPK, dtype=torch.int32) for _ in range(2))
    fns: dict[str, Fn] = {f"{who} logits": f for who, f in logits.items()}
    fns.update({f"{who} topk": (lambda f=f: f(scores["vllm"], lens, table, page_out, PAGE, raw_out))
                for who, f in topk.items()})  # fmt: skip
    return fns, checks


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
    icache, table = _index_cache(1, n, layout, g)
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

    fns: dict[str, Fn] = {
        "rows": lambda: indexer_logits_rows(q_I, weights, icache, lens, rows_table, layout, n,
                                            impl=kern),  # fmt: skip
        "one_each": one_each,
    }
    fns.update(roof.probes())
    times = harness.interleaved(fns, rounds, min_time, each_round=roof.sample)
    roof.take(times)
    return {"times": times, "flops": 2.0 * HI * DI * float(lens.sum()), "bytes": INDEX_BYTES * n}


def _peer_tables(
    attn: list[PeerCase], index: list[PeerCase], cell: Callable[[float, float, float], str]
) -> tuple[list[str], list[str]]:
    """The vllm section's notes and tables from its attention cases ((H, L, kind, T), times,
    checks) and indexer cases ((L, T), times, checks); ``cell`` formats a time with its roof
    share."""
    notes: list[str] = []
    bodies: list[str] = []
    if attn:
        notes.append(
            "vllm attention: torch.ops._C.flash_mla_with_kvcache_cpu (vLLM) vs "
            "mla_backend_integrations.vllm.v4_ops.flash_mla_with_kvcache_cpu (ours: what "
            "--attention-backend mla_absorb runs) on the same tensors: T requests of one "
            f"decode token at the context, window slots the last {WINDOW} positions, CSA "
            f"{TOPK} of the context / 4 compressed entries (a random sorted selection), HCA "
            f"every one of context / 128; both caches in V4's {V4_TOKEN_BYTES}-byte fp8 page "
            f"layout (pages of {PAGE}, {v4_page_bytes(PAGE)} bytes, one pool shuffled), slots "
            f"int64, q bf16, float32 sink, scale {D}^-0.5; roof 2 x H x {2 * D} FLOPs and "
            f"{V4_TOKEN_BYTES} bytes per key; vLLM / ours > 1: ours faster; max abs diff of "
            "the bf16 outputs"
        )
        rows = []
        for (H, L, kind, T), t, chk in attn:
            K = chk["keys"]
            flops, nbytes = 2.0 * H * K * 2 * D * T, float(V4_TOKEN_BYTES * K * T)
            rows.append([str(H), str(L), kind, str(T), str(K), cell(t["vllm"], flops, nbytes),
                         cell(t["ours"], flops, nbytes), f"{t['vllm'] / t['ours']:.2f}x",
                         f"{chk['diff']:.2g}"])  # fmt: skip
        bodies.append(harness.table(["H", "context", "layer", "tokens", "keys / token",
                                     "vLLM ms (roof)", "ours ms (roof)", "vLLM / ours",
                                     "max abs diff"], rows))  # fmt: skip
    if index:
        notes.append(
            "vllm indexer: CSA's at decode, T requests of context / 4 compressed keys each in "
            f"V4's fp8 index cache ({INDEX_BYTES} bytes a key, power-of-two scales: "
            "v4_ops.INDEX_LAYOUT, written by mb.write_index_keys; pages of "
            f"{PAGE} shuffled), {HI} heads x {DI}, q e4m3: fp8_paged_mqa_logits_cpu then "
            "topk_transform_512_cpu, torch.ops._C's (vLLM) vs v4_ops' (ours); each logits "
            "pair on the same inputs, each top-k pair on the same scores (vLLM's logits); "
            f"roof {2 * HI * DI} FLOPs and {INDEX_BYTES} bytes per key for logits + top-k; "
            "overlap: the mean (least) share of a row's top-512 that both pipelines pick, each "
            "from its own logits; logits diff: max abs difference over the largest logit"
        )
        rows = []
        for (L, T), t, chk in index:
            n = chk["keys"]
            flops, nbytes = 2.0 * HI * DI * n * T, float(INDEX_BYTES * n * T)
            total = {w: t[f"{w} logits"] + t[f"{w} topk"] for w in ("vllm", "ours")}
            both = [f"{_ms(t[f'{w} logits'])} + {_ms(t[f'{w} topk'])} = "
                    f"{cell(total[w], flops, nbytes)}" for w in ("vllm", "ours")]  # fmt: skip
            rows.append([str(L), str(T), str(n), *both,
                         f"{total['vllm'] / total['ours']:.2f}x",
                         f"{t['vllm logits'] / t['ours logits']:.2f}x / "
                         f"{t['vllm topk'] / t['ours topk']:.2f}x",
                         f"{chk['overlap']:.1%} ({chk['min overlap']:.1%})",
                         f"{chk['logits']:.1g}"])  # fmt: skip
        bodies.append(harness.table(["context", "tokens", "compressed keys",
                                     "vLLM ms logits + top-k (roof)",
                                     "ours ms logits + top-k (roof)", "vLLM / ours",
                                     "logits / top-k", "top-512 overlap", "logits diff"],
                                    rows))  # fmt: skip
    return notes, bodies


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _ms(t: float) -> str:
    return f"{t * 1e3:.3f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks v4",
                                 description=__doc__.split("\n\n")[0])  # fmt: skip
    ap.add_argument("--heads", default="64,128")
    ap.add_argument("--lens", default="8192,32768,131072")
    ap.add_argument("--kinds", default="sliding,csa,hca")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help="which tables: core (the core's decode per layer kind), prefill (the "
                         "CSA indexer's prefill rows), vllm (vLLM's own V4 CPU ops vs ours, "
                         "where present)")  # fmt: skip
    ap.add_argument("--prefill", default="1024,4096",
                    help="prefill chunk lengths for the CSA indexer's rows ('' for none)")
    ap.add_argument("--vllm-tokens", default="1",
                    help="decode batch sizes (requests of one token each) for the vllm "
                         "section ('' for none)")  # fmt: skip
    ap.add_argument("--isa", default=None, help="native ISA level (default: the selected one)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--min-time", type=float, default=0.05)
    args = ap.parse_args(argv)
    sections = [s for s in args.sections.split(",") if s]
    kinds = args.kinds.split(",")
    for what, got, known in (("--sections", sections, SECTIONS), ("--kinds", kinds, KINDS)):
        for x in got:
            if x not in known:
                raise SystemExit(f"{what}: {x!r} is not one of {', '.join(known)}")
    heads, lens = _ints(args.heads), _ints(args.lens)
    tokens = _ints(args.vllm_tokens) if "vllm" in sections else []
    torch.manual_seed(0)
    isa = args.isa or harness.selected_isa()
    roof = roofline.Roofline([isa])
    ours, peer_line = peer() if tokens else (None, "none asked for (--vllm-tokens '')")
    if ours is None:
        tokens = []
        if "vllm" in sections:
            print(f"vllm section not run: {peer_line}", flush=True)
    results = []
    attn: list[PeerCase] = []
    index: list[PeerCase] = []
    for H in (heads if "core" in sections or tokens else []):
        for L in lens:
            for kind in kinds:
                fns: dict[str, Fn] = {}
                info: dict[str, int] = {}
                if "core" in sections:
                    fns, info = core_shape(H, L, kind, isa)
                g = torch.Generator().manual_seed(H * 7 + L + KINDS[kind] + 1)
                cases = []
                for T in tokens:
                    a_fns, a_chk = peer_attention(H, L, kind, T, ours, g)
                    fns.update({f"{k} attention T{T}": f for k, f in a_fns.items()})
                    cases.append(("attention", (H, L, kind, T), a_chk))
                    if kind == "csa" and H == heads[0] and L >= 4:  # no H: once per L and T
                        i_fns, i_chk = peer_indexer(L, T, ours, g)
                        fns.update({f"{k} T{T}": f for k, f in i_fns.items()})
                        cases.append(("indexer", (L, T), i_chk))
                fns.update(roof.probes())
                times = harness.interleaved(fns, args.rounds, args.min_time,
                                            each_round=roof.sample)  # fmt: skip
                roof.take(times)
                if "core" in sections:
                    results.append(((H, L, kind), {"times": times, **info}))
                    ms = ", ".join(f"{k} {_ms(v)} ms" for k, v in times.items()
                                   if k in ("attention", "indexer"))  # fmt: skip
                    print(f"H{H} L{L} {kind}: {ms}", flush=True)
                for what, key, chk in cases:
                    T = key[-1]
                    if what == "attention":
                        t = {w: times[f"{w} attention T{T}"] for w in ("vllm", "ours")}
                        attn.append((key, t, chk))
                        print(f"H{H} L{L} {kind} T{T} attention: vLLM {_ms(t['vllm'])} ms, "
                              f"ours {_ms(t['ours'])} ms ({t['vllm'] / t['ours']:.2f}x), "
                              f"max diff {chk['diff']:.3g}", flush=True)  # fmt: skip
                    else:
                        t = {k: times[f"{k} T{T}"] for k in ("vllm logits", "ours logits",
                                                             "vllm topk", "ours topk")}  # fmt: skip
                        index.append((key, t, chk))
                        print(f"L{L} T{T} indexer: vLLM {_ms(t['vllm logits'])} + "
                              f"{_ms(t['vllm topk'])} ms, ours {_ms(t['ours logits'])} + "
                              f"{_ms(t['ours topk'])} ms, overlap {chk['overlap']:.1%}",
                              flush=True)  # fmt: skip
    prefills = []
    for T in (_ints(args.prefill) if "prefill" in sections else []):
        prefills.append((T, run_prefill(T, isa, args.rounds, args.min_time, roof)))
        t = prefills[-1][1]["times"]
        print(f"prefill {T}: rows {t['rows'] * 1e3:.1f} ms, one each "
              f"{t['one_each'] * 1e3:.1f} ms", flush=True)  # fmt: skip
    (ceil, ceil_src), (bw, bw_src) = roof.ceiling(isa), roof.bw()

    def cell(t: float, flops: float, nbytes: float) -> str:
        share = roofline.roof_fraction(flops, nbytes, t, ceil, bw)
        return f"{_ms(t)} ({roofline.roof_cell(share)})"

    notes = []
    if results:
        notes += [
            f"core: native kernels at ISA level {isa}; V4 attention: head_dim {D} ({D - ROPE} + "
            f"{ROPE} rope), one bf16 row per key, pages of {PAGE} shuffled, window {WINDOW}, "
            f"per-head sink, value = key, output RoPE undone; CSA: index_topk {TOPK} of context "
            f"/ 4 entries (a random selection for the attention), HCA: every one of context / "
            f"128; batch 1, one new token",
            f"core indexer: {HI} heads x {DI}, vLLM's fp8 index cache ({INDEX_BYTES} bytes per "
            "compressed key), q_I e4m3, top-512 over compressed keys (mb.indexer_topk, "
            "compress_ratio 4)",
        ]
    notes += [
        f"roof = share of min(ceiling, intensity x bw): core attention 2 x H x {2 * D} FLOPs "
        f"and {2 * D} bytes per key; indexer {2 * HI * DI} FLOPs and {INDEX_BYTES} bytes per "
        f"compressed key; ceiling {ceil / 1e12:.3f} TFLOP/s ({ceil_src}), bw {bw / 1e9:.1f} "
        f"GB/s ({bw_src}); best of {args.rounds} interleaved rounds of >= {args.min_time}s",
        "every probe's best over the run (samples): " + roof.summary(),
        roofline.ROOF_FLAG_NOTE,
    ]
    bodies = []
    if results:
        rows = []
        for (H, L, kind), res in results:
            t, K = res["times"], res["keys"]
            cells = [str(H), str(L), kind, str(K),
                     cell(t["attention"], 2.0 * H * K * 2 * D, 2.0 * D * K)]  # fmt: skip
            total = t["attention"]
            if "indexer" in t:
                n = res["entries"]
                cells.append(cell(t["indexer"], 2.0 * HI * DI * n, float(INDEX_BYTES * n)))
                total += t["indexer"]
            else:
                cells.append("-")
            cells.append(_ms(total))
            rows.append(cells)
        bodies.append(harness.table(["H", "context", "layer", "keys attended",
                                     "attention ms (roof)", "indexer ms (roof)",
                                     "attention + indexer ms"], rows))  # fmt: skip
    if "vllm" in sections:
        notes.append(f"vllm: {peer_line}'s own V4 CPU ops vs ours" if ours is not None
                     else f"vllm: vLLM's own V4 CPU ops not timed: {peer_line}")  # fmt: skip
    peer_notes, peer_bodies = _peer_tables(attn, index, cell)
    notes += peer_notes + [
        "targets (issue 34): >= 1.5x vLLM's own V4 CPU ops on AVX512-BF16; >= 60% of the "
        "in-run roofline at 32K+"
    ]
    bodies += peer_bodies
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
        bodies.append(harness.table(
            ["prefill tokens", "rows as one request ms (roof)", "a request per row ms (roof)",
             "speed-up"], prow))  # fmt: skip
    harness.write_result("v4", "DeepSeek-V4 attention decode per layer kind (core, native; "
                         "vs vLLM's V4 CPU ops)", notes, "\n\n".join(bodies))  # fmt: skip
    return 0
