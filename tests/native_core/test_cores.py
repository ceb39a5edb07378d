"""The native kernels' torch-free cores through one driver (``tests/native_core/driver.cpp``,
:mod:`mla_backend.testing.core_driver`), on every target: each x86-64 ISA level this CPU runs,
natively and built with ``-fsanitize=address,undefined -fno-sanitize-recover=all`` (zero
reports), and each aarch64 level cross-compiled and run under ``qemu-aarch64 -cpu max`` (SVE
levels at vector lengths 128, 256 and 512 bits, checked from inside the process).

One grid of cases, written once, checked against the fp64 oracle with the tolerances of the
torch-level native tests (:mod:`mla_backend.testing.native_checks`): absorbed attention
(decode / extend / mixed ragged batches, empty requests, odd dims, 1..128 heads, pages of
1 / 16 / 64 rows shuffled with NaN in never-written rows and garbage past each request's pages,
strided q, kv splits, 2 threads, every cache layout: bf16 / fp16 / fp32 / per-tensor fp8 /
fp8_ds_mla, out and LSE), the cache-row writers (bit for bit against the torch writer), the
head GEMMs over packed weights, the decompression, the MHA (float64) and the vector layer's
bf16 widening (every bit pattern, every tail length, bit for bit). Out-of-range page ids,
lengths, cu_seqlens and slots must be refused with a message naming the value and its range
(under the sanitizers: without being read). SVE targets, whose instructions qemu emulates one
by one, run the grid's lighter cases (:data:`SVE_MAX_COST`) plus kv splits on every layout
and 128 heads.

Run by ``python3 -m nox -s cores`` (which installs the cross tools where it can); a target is
skipped only when its tools are missing, naming them.
"""

from __future__ import annotations

import itertools
import math
import platform
import random
import re
import struct
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import mla_backend as mb
from mla_backend.cache_layout import CacheLayout
from mla_backend.ops.native import build, host_isas
from mla_backend.testing import core_driver as cd
from mla_backend.testing.cases import make_case, make_dsa_case, make_keyset_case
from mla_backend.testing.dsa_checks import check_logits, check_sparse, check_topk, logit_bound
from mla_backend.testing.keyset_checks import check_keyset
from mla_backend.testing.native_checks import (
    ATTENTION_DTYPES,
    check_absorbed,
    check_bf16_gemm,
    check_mha,
)
from mla_backend.testing.reference import (
    reference_indexer_logits,
    reference_keyset_attention,
    reference_topk,
)

FP8, DS = torch.float8_e4m3fn, torch.uint8
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
DT_CODE = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
DTYPES = ATTENTION_DTYPES
SHAPES = [(16, 4), (40, 6), (32, 0), (200, 32), (33, 0), (512, 64)]
MIXED = ([0, 5, 37, 0, 64, 3], [1, 1, 4, 9, 1, 0])  # extends, decodes, an empty request
TIMEOUT = {"native": 300, "emulated": 600}  # seconds per driver run (all cases)
# qemu emulates SVE instruction by instruction (~10x its NEON or scalar code): SVE targets run
# the cases of at most this many multiply-adds, plus kv splits on every layout, 128 heads and
# a larger case of each GEMM core
SVE_MAX_COST = 300_000
SVE_ALSO = re.compile(
    r"att-splits3-|att-heads128-page(16|64)-bfloat16|mha-H3-65x65|mha-H4-100x30|head-gemm-T13-"
    r"|decompress-L300-|sparse-splits-|sparse-heads128-|idx-topk-uint8-float8"
)


@dataclass
class Spec:
    """One case: its fields and the check of its outputs."""

    name: str
    fields: dict[str, cd.Field]
    check: Callable[[dict[str, bytes]], None]


def _cost(f: dict[str, cd.Field]) -> int:
    """A case's multiply-adds, roughly (what its emulated run time scales with)."""
    g = {k: v for k, v in f.items() if isinstance(v, int)}
    if f["op"] == "attention":
        cu, kvl = f["cu"].tolist(), f["kvl"].tolist()  # type: ignore[union-attr]
        rows = sum((cu[i + 1] - cu[i]) * max(kvl[i], 0) for i in range(len(kvl)))
        return rows * g["H"] * (g["r"] + g["rope"])
    if f["op"] == "head_gemm":
        return g["T"] * g["H"] * g["K"] * g["N"]
    if f["op"] == "decompress":
        return g["L"] * g["H"] * g["r"] * (g["nope"] + g["vdim"])
    if f["op"] == "mha":
        return g["H"] * g["Lq"] * max(g["Lk"], 1) * (g["D"] + g["Dv"])
    if f["op"] == "indexer":
        kvl = f["kvl"].tolist()  # type: ignore[union-attr]
        return g["T"] * max(kvl, default=0) * g["Hi"] * g["Di"]
    if f["op"] == "sparse":
        return g["T"] * g["K"] * g["H"] * (g["r"] + g["rope"])
    if f["op"] == "keyset":
        kvl = f["kvl"].tolist()  # type: ignore[union-attr]
        keys = max(kvl, default=0) + g["K"] + g["K2"]
        return g["T"] * keys * g["H"] * (g["r"] + g["rope"])
    return 0


def _refused(*parts: str) -> Callable[[dict[str, bytes]], None]:
    def check(out: dict[str, bytes]) -> None:
        assert "error" in out, "not refused"
        msg = out["error"].decode()
        for p in parts:
            assert p in msg, f"refusal {msg!r} lacks {p!r}"
        assert set(out) == {"error"}, "a refused call wrote outputs"

    return check


# ---- absorbed attention -----------------------------------------------------------------------
def _attention(
    name: str,
    H: int,
    r: int,
    rope: int,
    prefix: list[int],
    new: list[int],
    page: int,
    qdt: torch.dtype,
    cdt: torch.dtype,
    *,
    seed: int = 0,
    splits: int = 0,
    threads: int = 1,
    garbage: bool = False,
    strided: bool = False,
    max_page_id: bool = False,
    mutate: Callable[[dict[str, cd.Field]], None] | None = None,
    refusal: tuple[str, ...] = (),
) -> Spec:
    case = make_case(
        mb.MLADims(H, r, 8, rope, 8),
        prefix,
        new,
        page,
        dtype=qdt,
        cache_dtype=cdt,
        seed=seed,
        impl="torch",
    )
    g = torch.Generator().manual_seed(seed + 1000)
    T, D = sum(new), r + rope
    pad_h, pad_d = (2, 5) if strided else (0, 0)
    q = torch.randn(T, H + pad_h, D + pad_d, generator=g).to(qdt)
    q_lat, q_pe = q[:, :H, :r], q[:, :H, r:D]
    bt = case.batch.block_table.to(torch.int32).clone()
    used = [-(-(p + n) // page) for p, n in zip(prefix, new)]
    if garbage:  # entries past a request's pages may hold anything
        for i, u in enumerate(used):
            bt[i, u:] = 10**6 + i
    scale = 1.0 / math.sqrt(D)
    kvs = float(case.kv_scale) if case.kv_scale is not None else 1.0
    mode = 2 if cdt == DS else (1 if cdt == FP8 else 0)
    top = max(int(bt[i, :u].max()) for i, u in enumerate(used) if u > 0)
    fields: dict[str, cd.Field] = dict(
        op="attention", qdt=DT_CODE[qdt], mode=mode, H=H, r=r, rope=rope, B=len(prefix), T=T,
        page_size=page, num_pages=case.kv_cache.shape[0], bt_rows=bt.shape[0],
        bt_width=bt.shape[1], q_s0=q.stride(0), q_s1=q.stride(1), q=q, cache=case.kv_cache,
        bt=bt, cu=torch.tensor(case.batch.cu_new, dtype=torch.int32),
        kvl=torch.tensor(case.batch.kv_lens, dtype=torch.int32), scale=scale, kv_scale=kvs,
        splits=splits, max_page_id=top if max_page_id else -1, threads=threads,
    )  # fmt: skip
    if mutate is not None:
        mutate(fields)
        return Spec(name, fields, _refused(*refusal))

    memo: dict[str, object] = {}  # the references, computed once for all targets

    def check(out: dict[str, bytes]) -> None:
        assert "error" not in out, out.get("error", b"").decode()
        o = cd.tensor(out["out"], qdt, (T, H, r))
        lse = cd.tensor(out["lse"], torch.float32, (T, H))
        check_absorbed(case, q_lat, q_pe, scale, o, lse, qdt, memo)

    return Spec(name, fields, check)


def _dt(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def _attention_specs() -> list[Spec]:
    mk = _attention
    specs = []
    # every layout x odd dims (partial fp8_ds_mla tiles, odd r, no rope), a mixed ragged batch
    for (r, rope), (qdt, cdt) in itertools.product(SHAPES, DTYPES):
        name = f"att-mixed-r{r}-rope{rope}-{_dt(qdt)}-{_dt(cdt)}"
        specs.append(mk(name, 16, r, rope, *MIXED, 16, qdt, cdt, seed=r + rope))
    # heads x pages
    four = [(BF16, BF16), (F32, F32), (BF16, DS), (F32, FP8)]
    for H, page, (qdt, cdt) in itertools.product((1, 3, 9, 16, 63, 128), (1, 16, 64), four):
        name = f"att-heads{H}-page{page}-{_dt(qdt)}-{_dt(cdt)}"
        prefix, new = [3, 70, 0, 130], [1, 2, 5, 1]
        specs.append(mk(name, H, 40, 8, prefix, new, page, qdt, cdt, seed=H * 7 + page))
    # kv splits, 2 threads, garbage past each request's pages, strided q
    for splits, (qdt, cdt) in itertools.product((0, 1, 3, 7, 100), four[:3] + [(F16, DS)]):
        name = f"att-splits{splits}-{_dt(qdt)}-{_dt(cdt)}"
        prefix, new = [700, 0, 300, 1000], [1, 20, 6, 3]
        specs.append(mk(name, 9, 64, 16, prefix, new, 16, qdt, cdt, seed=splits, splits=splits,
                        garbage=True, strided=True, threads=1 + splits % 2))  # fmt: skip
    # decode-only under the plan's max_page_id bound; extend-only
    for qdt, cdt in DTYPES:
        name = f"att-decode-maxpage-{_dt(qdt)}-{_dt(cdt)}"
        specs.append(mk(name, 16, 96, 32, [1, 63, 64, 200], [1, 1, 1, 1], 64, qdt, cdt, seed=5,
                        max_page_id=True, threads=2))  # fmt: skip
        name = f"att-extend-{_dt(qdt)}-{_dt(cdt)}"
        specs.append(mk(name, 4, 48, 16, [0, 17, 64], [33, 15, 70], 16, qdt, cdt, seed=6))
    # a seeded random sample of the rest (as test_native's hypothesis test draws them)
    rng = random.Random(19)
    for k in range(40):
        H, r = rng.randint(1, 20), rng.choice([1, 7, 64, 80, 96, 127, 128, 129, 257])
        rope, page = rng.choice([0, 2, 6, 16, 34]), rng.choice([1, 2, 3, 16, 64])
        reqs = [(rng.randint(0, 150), rng.randint(0, 6)) for _ in range(rng.randint(1, 4))]
        prefix = [max(p, 1 - n) for p, n in reqs]  # (make_case needs a token per request)
        new = [n for _, n in reqs]
        new[0] = new[0] or 1
        qdt, cdt = rng.choice(DTYPES)
        specs.append(mk(f"att-random{k}", H, r, rope, prefix, new, page, qdt, cdt, seed=k,
                        splits=rng.choice([0, 1, 2, 5]), garbage=k % 2 == 0,
                        strided=k % 3 == 0))  # fmt: skip
    return specs + _refusal_specs()


def _refusal_specs() -> list[Spec]:
    """Out-of-range indices: refused with the value and its allowed range, nothing read."""
    base = ([5, 40, 0], [1, 3, 2], 16)  # pages used: 1, 3, 1 of a 4-wide block table

    def bt_entry(i: int, p: int, value: int) -> Callable[[dict[str, cd.Field]], None]:
        def f(fl: dict[str, cd.Field]) -> None:
            bt = fl["bt"].clone()  # type: ignore[union-attr]
            bt[i, p] = value if value >= -1 else int(fl["num_pages"])  # type: ignore[call-overload]
            fl["bt"] = bt

        return f

    def tensor_entry(key: str, i: int, value: int) -> Callable[[dict[str, cd.Field]], None]:
        def f(fl: dict[str, cd.Field]) -> None:
            t = fl[key].clone()  # type: ignore[union-attr]
            t[i] = value
            fl[key] = t

        return f

    def scalar(key: str, value: int) -> Callable[[dict[str, cd.Field]], None]:
        def f(fl: dict[str, cd.Field]) -> None:
            fl[key] = value if value >= 0 else int(fl["num_pages"])  # type: ignore[call-overload]

        return f

    cases = [
        (
            "page-id-num-pages",
            bt_entry(1, 2, -2),
            ("block_table[1, 2] = ", "is not a page of the cache (0 .. "),
        ),
        ("page-id-negative", bt_entry(0, 0, -1), ("block_table[0, 0] = -1 is not a page",)),
        ("page-id-huge", bt_entry(2, 0, 2**31 - 1), ("block_table[2, 0] = 2147483647",)),
        (
            "kv-len-past-table",
            tensor_entry("kvl", 1, 4 * 16 + 1),
            ("kv_lens[1] = 65 needs more than the 4 pages x 16",),
        ),
        (
            "kv-len-below-new",
            tensor_entry("kvl", 2, 1),
            ("kv_lens[2] = 1 is smaller than its 2 new tokens",),
        ),
        (
            "cu-decreasing",
            tensor_entry("cu", 1, 5),
            ("cu_seqlens_q must be non-decreasing: request 1 has -1",),
        ),
        ("cu-start", tensor_entry("cu", 0, 1), ("cu_seqlens_q[0] = 1 must be 0",)),
        (
            "cu-end",
            scalar("T", 5),
            ("cu_seqlens_q[-1] = 6 must equal the number of query tokens T = 5",),
        ),
        ("bt-rows", scalar("bt_rows", 2), ("block_table has 2 rows for 3 requests",)),
        ("max-page-id", scalar("max_page_id", -1), ("(max_page_id) but the cache has",)),
        ("page-size-zero", scalar("page_size", 0), ("page_size 0 must be >= 1",)),
    ]
    specs = []
    for name, mutate, parts in cases:
        for qdt, cdt in [(torch.bfloat16, torch.bfloat16), (torch.float32, DS)]:
            specs.append(
                _attention(
                    f"refuse-{name}-{_dt(cdt)}",
                    4,
                    32,
                    8,
                    *base,
                    qdt,
                    cdt,
                    seed=1,
                    mutate=mutate,
                    refusal=parts,
                )
            )
    return specs


# ---- DSA: the lightning indexer and the sparse attention --------------------------------------
IDX_Q = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2, FP8: 3}
IDX_KIND = {torch.uint8: 0, torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}
DSA_RAGGED = ([0, 9, 70, 3, 130], [5, 1, 6, 0, 2])


def _indexer(name: str, Hi: int, Di: int, prefix: list[int], new: list[int], page: int,
             index_dtype: torch.dtype, q_dtype: torch.dtype, topk: int, *, seed: int = 0,
             threads: int = 1, distinct: int = 0, bad_page: bool = False,
             streaming: bool = False) -> Spec:  # fmt: skip
    """The indexer core on a DSA case: top-k (topk > 0) or the logits (topk = 0); ``streaming``:
    every item's top-k through the streaming buffer (buf_logits 0), not the histogram select."""
    d = make_dsa_case(mb.MLADims(2, 16, 8, 4, 8), mb.IndexerDims(Hi, Di, max(topk, 1)),
                      prefix, new, page, dtype=torch.bfloat16, index_dtype=index_dtype,
                      q_dtype=q_dtype, seed=seed, impl="torch", distinct_keys=distinct)  # fmt: skip
    bt = d.case.batch.block_table.to(torch.int32).clone()
    if bad_page:
        bt[1, 0] = d.index_cache.shape[0]
    T, W = sum(new), max(p + n for p, n in zip(prefix, new))
    lay = mb.IndexCacheLayout.of(d.index_cache, Di)
    fields: dict[str, cd.Field] = dict(
        op="indexer", T=T, Hi=Hi, Di=Di, B=len(prefix), page_size=page,
        num_pages=d.index_cache.shape[0], bt_rows=bt.shape[0], bt_width=bt.shape[1],
        q=d.q_I.view(torch.uint8) if q_dtype == FP8 else d.q_I, q_dt=IDX_Q[q_dtype],
        q_s0=d.q_I.stride(0), q_s1=d.q_I.stride(1), w=d.weights, cache=d.index_cache,
        kind=IDX_KIND[index_dtype], qbs=lay.quant_block_size, bt=bt,
        cu=torch.tensor(d.case.batch.cu_new, dtype=torch.int32),
        kvl=torch.tensor(d.case.batch.kv_lens, dtype=torch.int32), max_page_id=-1, topk=topk,
        width=W, threads=threads, buf_logits=0 if streaming else 1 << 18,
    )  # fmt: skip
    if bad_page:
        return Spec(name, fields, _refused("block_table[1, 0] = ", "is not a page of the cache"))
    exact = q_dtype in (torch.bfloat16, FP8) and index_dtype in (torch.uint8, torch.bfloat16)

    def check(out: dict[str, bytes]) -> None:
        assert "error" not in out, out.get("error", b"").decode()
        ref = reference_indexer_logits(d.q_I, d.weights, d.keys, d.case.batch.new_lens)
        tol = logit_bound(d, not exact)
        if topk == 0:
            check_logits(cd.tensor(out["logits"], torch.float32, (T, W)), ref, tol)
            return
        idx = cd.tensor(out["out"], torch.int32, (T, topk))
        if distinct:
            assert torch.equal(idx.long(), reference_topk(ref, topk))
        else:
            check_topk(idx, ref, topk, tol)

    return Spec(name, fields, check)


def _sparse(name: str, H: int, prefix: list[int], new: list[int], page: int, qdt: torch.dtype,
            cdt: torch.dtype, K: int, *, seed: int = 0, threads: int = 1,
            bad: int | None = None, bad_req: int | None = None) -> Spec:  # fmt: skip
    """The sparse attention core: index lists from the oracle's top-k of a DSA case, -1
    padded and shuffled per token (``bad``: one entry past its request; ``bad_req``: token 0
    said to belong to that request, not its own)."""
    r, rope = 40, 8
    d = make_dsa_case(mb.MLADims(H, r, 8, rope, 8), mb.IndexerDims(4, 32, K), prefix, new,
                      page, dtype=qdt, cache_dtype=cdt, seed=seed, impl="torch")  # fmt: skip
    ref = reference_indexer_logits(d.q_I, d.weights, d.keys, d.case.batch.new_lens)
    idx = reference_topk(ref, K)
    g = torch.Generator().manual_seed(seed)
    for t in range(idx.shape[0]):
        idx[t] = idx[t, torch.randperm(K, generator=g)]
    idx = idx.to(torch.int32)
    if bad is not None:
        idx[0, 0] = bad
    T = idx.shape[0]
    q = torch.randn(T, H, r + rope, generator=g).to(qdt)
    scale = 1.0 / math.sqrt(r + rope)
    kvs = float(d.case.kv_scale) if d.case.kv_scale is not None else 1.0
    bt = d.case.batch.block_table.to(torch.int32)
    tok_req = [i for i, n in enumerate(new) for _ in range(n)]
    if bad_req is not None:
        tok_req[0] = bad_req
    fields: dict[str, cd.Field] = dict(
        op="sparse", qdt=DT_CODE[qdt], mode=2 if cdt == DS else (1 if cdt == FP8 else 0), H=H,
        r=r, rope=rope, B=len(prefix), T=T, page_size=page, num_pages=d.case.kv_cache.shape[0],
        bt_rows=bt.shape[0], bt_width=bt.shape[1], q_s0=q.stride(0), q_s1=q.stride(1), q=q,
        cache=d.case.kv_cache, bt=bt, cu=torch.tensor(d.case.batch.cu_new, dtype=torch.int32),
        kvl=torch.tensor(d.case.batch.kv_lens, dtype=torch.int32), scale=scale, kv_scale=kvs,
        splits=0, max_page_id=-1, threads=threads, K=K, idx=idx,
        tok_req=torch.tensor(tok_req, dtype=torch.int32),
    )  # fmt: skip
    if bad is not None:
        return Spec(name, fields, _refused("index out of range: indices[0, 0] = "))
    if bad_req is not None:
        return Spec(name, fields, _refused(f"token 0 is not a query token of request {bad_req}"))

    def check(out: dict[str, bytes]) -> None:
        assert "error" not in out, out.get("error", b"").decode()
        o = cd.tensor(out["out"], qdt, (T, H, r))
        lse = cd.tensor(out["lse"], torch.float32, (T, H))
        check_sparse(d, o, lse, q[..., :r], q[..., r:], idx, scale, qdt)

    return Spec(name, fields, check)


def _dsa_specs() -> list[Spec]:
    specs = []
    kinds = [(torch.uint8, torch.bfloat16), (torch.uint8, FP8), (torch.bfloat16, torch.bfloat16),
             (torch.float32, torch.float32), (torch.float16, torch.float16)]  # fmt: skip
    for k, ((idt, qdt), page) in enumerate(itertools.product(kinds, (1, 16, 64))):
        specs.append(_indexer(f"idx-topk-{_dt(idt)}-{_dt(qdt)}-page{page}", 8, 64, *DSA_RAGGED,
                              page, idt, qdt, 7, seed=k, threads=1 + k % 2))  # fmt: skip
    specs.append(_indexer("idx-logits-fp8", 5, 64, *DSA_RAGGED, 16, torch.uint8, FP8, 0))
    specs.append(_indexer("idx-logits-f32", 3, 48, *DSA_RAGGED, 1, torch.float32, torch.float32,
                          0))  # fmt: skip
    specs.append(_indexer("idx-ties-bf16", 8, 32, *DSA_RAGGED, 16, torch.bfloat16,
                          torch.bfloat16, 10, distinct=3))  # fmt: skip
    specs.append(_indexer("idx-splits-decode", 64, 128, [2500, 1800], [1, 1], 16, torch.uint8,
                          FP8, 300, threads=2))  # fmt: skip
    for k, (idt, qdt) in enumerate(kinds[:3]):  # the streaming top-k (items too big to buffer)
        specs.append(_indexer(f"idx-stream-{_dt(idt)}-{_dt(qdt)}", 8, 64, *DSA_RAGGED, 16, idt, qdt,
                              7, seed=40 + k, threads=1 + k % 2, streaming=True))  # fmt: skip
    specs.append(_indexer("idx-stream-ties-bf16", 8, 32, *DSA_RAGGED, 16, torch.bfloat16,
                          torch.bfloat16, 10, distinct=3, streaming=True))  # fmt: skip
    specs.append(_indexer("idx-stream-splits-decode", 64, 128, [2500, 1800], [1, 1], 16,
                          torch.uint8, FP8, 300, threads=2, streaming=True))  # fmt: skip
    for streaming in (False, True):  # buffers cut many times (topk 5), exact ties
        specs.append(_indexer(f"idx-long-ties-{'stream' if streaming else 'hist'}", 8, 32,
                              [700, 20], [3, 300], 16, torch.bfloat16, torch.bfloat16, 5,
                              distinct=3, threads=2, streaming=streaming))  # fmt: skip
    specs.append(_indexer("refuse-idx-page", 4, 32, *DSA_RAGGED, 16, torch.uint8,
                          torch.bfloat16, 4, bad_page=True))  # fmt: skip
    for k, (qdt, cdt) in enumerate(DTYPES):
        specs.append(_sparse(f"sparse-{_dt(qdt)}-{_dt(cdt)}", 5, *DSA_RAGGED, 16, qdt, cdt, 12,
                             seed=k, threads=1 + k % 2))  # fmt: skip
    specs.append(_sparse("sparse-heads128-bf16", 128, [40, 300], [2, 1], 64, BF16, BF16, 64))
    specs.append(_sparse("sparse-splits-fp8", 16, [900], [1], 1, BF16, FP8, 600, threads=2))
    specs.append(_sparse("refuse-sparse-index", 4, *DSA_RAGGED, 16, F32, F32, 6, bad=10**6))
    # token_req naming a request without query tokens: its block-table row is unchecked
    specs.append(_sparse("refuse-sparse-token-req", 4, *DSA_RAGGED, 16, F32, F32, 6, bad_req=3))
    return specs


# ---- attention over key sets ------------------------------------------------------------------
def _keyset(name: str, H: int, r: int, rope: int, prefix: list[int], new: list[int], page: int,
            page2: int, lens2: list[int], qdt: torch.dtype, cdt: torch.dtype, *,
            window: int | None = None, K: int = 0, K2: int = 0, sink: bool = False,
            value_is_key: bool = False, splits: int = 0, threads: int = 1, seed: int = 0,
            bad: str = "") -> Spec:  # fmt: skip
    """The key-set attention core: a window of the main cache, -1-padded index lists into it
    and into a second cache (its own pages), sinks; ``value_is_key``: the whole row is the
    value (the core sees r + rope values and no rope part). ``bad``: "window" (a window of 0)
    or "page2" (a second-cache page id past its pages)."""
    d = make_keyset_case(mb.MLADims(H, r, 8, rope, 8), prefix, new, page, lens2, page2, qdt, cdt,
                         seed)  # fmt: skip
    g = torch.Generator().manual_seed(seed + 5)
    T, B, D = sum(new), len(prefix), r + rope
    kvl = d.case.batch.kv_lens

    def lists(k: int, lens: list[int]) -> torch.Tensor:
        out = torch.full((T, k), -1, dtype=torch.int32)
        req = [i for i, n in enumerate(new) for _ in range(n)]
        for t, i in enumerate(req):
            if lens[i] and k:
                out[t] = torch.randint(0, lens[i], (k,), generator=g, dtype=torch.int32)
        out[torch.rand(T, k, generator=g) < 0.3] = -1
        return out

    idx, idx2 = lists(K, kvl), lists(K2, lens2)
    sinks = torch.tensor([[0.5, 30.0, float("-inf"), -2.0][h % 4] for h in range(H)])
    q = torch.cat([d.q_lat, d.q_pe], -1).contiguous()
    scale = 1.0 / math.sqrt(D)
    kvs = float(d.case.kv_scale) if d.case.kv_scale is not None else 1.0
    bt, bt2 = d.case.batch.block_table.to(torch.int32), d.extra.block_table.clone()
    windows = [window] * B if window is not None else [1] * B
    if bad == "window":
        windows[-1] = 0
    if bad == "page2":
        bt2[1, 0] = d.extra.kv_cache.shape[0]
    rr, rp = (D, 0) if value_is_key else (r, rope)
    fields: dict[str, cd.Field] = dict(
        op="keyset", qdt=DT_CODE[qdt], mode=2 if cdt == DS else (1 if cdt == FP8 else 0), H=H,
        r=rr, rope=rp, B=B, T=T, page_size=page, num_pages=d.case.kv_cache.shape[0],
        bt_rows=bt.shape[0], bt_width=bt.shape[1], q_s0=q.stride(0), q_s1=q.stride(1), q=q,
        cache=d.case.kv_cache, bt=bt, cu=torch.tensor(d.case.batch.cu_new, dtype=torch.int32),
        kvl=torch.tensor(kvl, dtype=torch.int32), scale=scale, kv_scale=kvs, splits=splits,
        max_page_id=-1, threads=threads, range=1, has_window=int(window is not None or bad != ""),
        window=torch.tensor(windows, dtype=torch.int32), K=K, idx=idx, K2=K2, idx2=idx2,
        cache2=d.extra.kv_cache, page_size2=page2, num_pages2=d.extra.kv_cache.shape[0],
        bt2_rows=bt2.shape[0], bt2_width=bt2.shape[1], bt2=bt2, len2=d.extra.lens,
        has_sink=int(sink), sink=sinks,
    )  # fmt: skip
    if bad == "window":
        return Spec(name, fields, _refused(f"window[{B - 1}] = 0 must be >= 1"))
    if bad == "page2":
        return Spec(name, fields, _refused("second block_table[1, 0] = "))
    dv = D if value_is_key else r

    def check(out: dict[str, bytes]) -> None:
        assert "error" not in out, out.get("error", b"").decode()
        o = cd.tensor(out["out"], qdt, (T, H, dv))
        lse = cd.tensor(out["lse"], torch.float32, (T, H))
        ref_o, ref_lse = reference_keyset_attention(
            q.float(), d.rows, list(new), scale, windows=windows if window is not None else None,
            indices=idx if K else None, rows2=d.rows2, extra_indices=idx2 if K2 else None,
            sink=sinks if sink else None, value_width=dv,
        )  # fmt: skip
        check_keyset(o, lse, ref_o, ref_lse, qdt)

    return Spec(name, fields, check)


def _keyset_specs() -> list[Spec]:
    ragged, lens2 = ([0, 9, 70, 3, 130], [5, 1, 6, 0, 2]), [2, 3, 17, 0, 33]
    specs = []
    for k, (qdt, cdt) in enumerate(DTYPES):
        specs.append(_keyset(f"keyset-{_dt(qdt)}-{_dt(cdt)}", 5, 40, 8, *ragged, 16, 4, lens2,
                             qdt, cdt, window=4, K=3, K2=6, sink=True, seed=k,
                             threads=1 + k % 2))  # fmt: skip
    specs.append(_keyset("keyset-dense-sink-splits", 4, 40, 8, *ragged, 1, 64, lens2, F32, F32,
                         sink=True, splits=3))  # fmt: skip
    specs.append(_keyset("keyset-window1-page64", 4, 40, 8, *ragged, 64, 1, lens2, BF16, BF16,
                         window=1, K2=4, sink=True, splits=2, threads=2))  # fmt: skip
    specs.append(_keyset("keyset-v4-value-is-key", 3, 448, 64, [0, 40], [3, 1], 16, 16, [1, 10],
                         BF16, BF16, window=8, K2=4, sink=True, value_is_key=True))  # fmt: skip
    specs.append(_keyset("refuse-keyset-window", 4, 40, 8, *ragged, 16, 16, lens2, F32, F32,
                         bad="window"))  # fmt: skip
    specs.append(_keyset("refuse-keyset-page2", 4, 40, 8, *ragged, 16, 16, lens2, F32, F32,
                         K2=2, bad="page2"))  # fmt: skip
    return specs


# ---- cache-row writers ------------------------------------------------------------------------
def _write(
    name: str,
    cdt: torch.dtype,
    src: torch.dtype,
    r: int,
    rope: int,
    *,
    seed: int = 0,
    bad_slot: bool = False,
) -> Spec:
    g = torch.Generator().manual_seed(seed)
    T, ps, pages = 50, 16, 8
    c = torch.randn(T, r, generator=g) * torch.logspace(-6, 6, T)[:, None]
    c[0, : min(8, r)] = torch.tensor([1e6, -1e6, 1e-6, -1e-6, 0.0, -0.0, 8.96, 3.3e-4])[: min(8, r)]
    c[1] = 0.0
    c[2, r // 2] = float("nan") if cdt == DS else 1.0
    c, k = c.to(src), (torch.randn(T, rope, generator=g) * 10).to(src)
    slots = torch.randperm(pages * ps, generator=g)[:T]
    slots[::7] = -1
    if bad_slot:
        slots[3] = pages * ps
    scale = torch.tensor(0.02) if cdt == FP8 else None
    if cdt == DS:
        lay = CacheLayout.ds_mla(r, rope, src)
        cache = torch.randint(0, 256, (pages, ps, lay.width), generator=g, dtype=torch.uint8)
        mode, cache_dt = 2, 0
    else:
        cache = torch.full((pages, ps, r + rope), 1.0).to(cdt)
        mode, cache_dt = (1, 0) if cdt == FP8 else (0, DT_CODE[cdt])
    fields: dict[str, cd.Field] = dict(
        op="write", mode=mode, cache_dt=cache_dt, rope_dt=DT_CODE[src], r=r, rope=rope, T=T,
        page_size=ps, num_pages=pages, cache=cache, c_kv=c.float(), k_pe=k.float(), slots=slots,
        kv_scale=float(scale) if scale is not None else 1.0, threads=2 if seed % 2 else 1,
    )  # fmt: skip
    if bad_slot:
        return Spec(
            name,
            fields,
            _refused(f"slot_mapping[3] = {pages * ps} is outside the cache ({pages * ps} slots)"),
        )
    keep = slots >= 0
    expect = cache.clone()
    flat = expect.view(-1, expect.shape[-1])
    if cdt == DS:
        flat[slots[keep]] = lay.pack(c, k)[keep]
    elif cdt == FP8:
        flat[slots[keep]] = (torch.cat([c, k], -1).float() / scale).clamp(-448, 448).to(FP8)[keep]
    else:
        flat[slots[keep]] = torch.cat([c, k], -1).to(cdt)[keep]

    # e4m3 bytes [.., :fp8_cols) of a row: NaN's sign is the CPU's default NaN's (x86 sets it,
    # aarch64 does not: inf / inf there is +NaN), so 0x7f and 0xff are the same value
    fp8_cols = r if cdt == DS else (r + rope if cdt == FP8 else 0)

    def check(out: dict[str, bytes]) -> None:
        assert "error" not in out, out.get("error", b"").decode()
        got = cd.tensor(out["cache"], torch.uint8, (pages * ps, -1))
        want = cd.tensor(cd.encode(expect), torch.uint8, (pages * ps, -1))
        nan = (got[:, :fp8_cols] & 0x7F == 0x7F) & (want[:, :fp8_cols] & 0x7F == 0x7F)
        got[:, :fp8_cols][nan] = want[:, :fp8_cols][nan]
        bad = int((got != want).sum())
        assert bad == 0, f"{bad} cache bytes differ from the torch writer's"

    return Spec(name, fields, check)


def _write_specs() -> list[Spec]:
    specs = []
    for cdt in (FP8, torch.bfloat16, torch.float16, torch.float32):
        for src in (torch.float32, torch.bfloat16):
            specs.append(
                _write(
                    f"write-{_dt(cdt)}-from-{_dt(src)}",
                    cdt,
                    src,
                    40,
                    6,
                    seed=1,
                )
            )
    for r, rope in ((512, 64), (200, 32), (96, 0), (33, 6), (1, 2)):
        for src in (torch.bfloat16, torch.float16, torch.float32):
            specs.append(
                _write(
                    f"write-ds-r{r}-rope{rope}-{_dt(src)}",
                    DS,
                    src,
                    r,
                    rope,
                    seed=r + rope,
                )
            )
    specs.append(_write("refuse-write-slot", torch.bfloat16, torch.float32, 16, 4, bad_slot=True))
    return specs


# ---- GEMM cores -------------------------------------------------------------------------------
def _bf16(g: torch.Generator, *shape: int, s: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * s).to(torch.bfloat16)


def _head_gemm(T: int, H: int, K: int, N: int, seed: int) -> Spec:
    g = torch.Generator().manual_seed(seed)
    w = _bf16(g, H, K, N)
    xb = _bf16(g, T, H, K + 7)  # strided, as an engine hands q_nope
    x = xb[:, :, :K]
    fields: dict[str, cd.Field] = dict(
        op="head_gemm", T=T, H=H, K=K, N=N, x=xb, x_s0=xb.stride(0), x_s1=xb.stride(1), w=w,
        threads=1 + seed % 2,
    )  # fmt: skip

    def check(out: dict[str, bytes]) -> None:
        y = cd.tensor(out["y"], torch.bfloat16, (T, H, N))
        ref = torch.einsum("thk,hkn->thn", x.double(), w.double())
        mag = torch.einsum("thk,hkn->thn", x.double().abs(), w.double().abs())
        check_bf16_gemm(y, ref, mag, f"T{T} H{H} K{K} N{N}")
        cols = build.HEAD_GEMM_COLS  # and the packed layout, element by element
        nb, kp = -(-N // cols), -(-K // 2)
        p = cd.tensor(out["packed"], torch.bfloat16, (H, nb, kp, cols, 2))
        wpad = torch.zeros(H, 2 * kp, nb * cols, dtype=torch.bfloat16)
        wpad[:, :K, :N] = w
        expect = wpad.view(H, kp, 2, nb, cols).permute(0, 3, 1, 4, 2)
        assert torch.equal(p.view(torch.int16), expect.contiguous().view(torch.int16))

    return Spec(f"head-gemm-T{T}-H{H}-K{K}-N{N}", fields, check)


def _decompress(
    L: int,
    H: int,
    r: int,
    nope: int,
    rope: int,
    vd: int,
    seed: int,
    uv_t: bool = False,
) -> Spec:
    g = torch.Generator().manual_seed(seed)
    latent = _bf16(g, L, r + rope)
    W_UK = _bf16(g, H, nope, r)
    W_UV = _bf16(g, H, vd, r).transpose(1, 2) if uv_t else _bf16(g, H, r, vd)
    fields: dict[str, cd.Field] = dict(
        op="decompress", L=L, H=H, r=r, nope=nope, rope=rope, vdim=vd, latent=latent, W_UK=W_UK,
        uk0=W_UK.stride(0), uk1=W_UK.stride(1), uk2=W_UK.stride(2),
        W_UV=W_UV.transpose(1, 2) if uv_t else W_UV,  # the bytes as stored (uv_t: [H, v, r])
        uv0=W_UV.stride(0), uv1=W_UV.stride(1), uv2=W_UV.stride(2), threads=1 + seed % 2,
    )  # fmt: skip
    c_kv, k_pe = latent[:, :r], latent[:, r:]

    def check(out: dict[str, bytes]) -> None:
        k = cd.tensor(out["k"], torch.bfloat16, (L, H, nope + rope))
        v = cd.tensor(out["v"], torch.bfloat16, (L, H, vd))
        assert torch.equal(k[:, :, nope:], k_pe[:, None].expand(L, H, rope))
        cd_, uk, uv = c_kv.double(), W_UK.double(), W_UV.double()
        check_bf16_gemm(
            k[:, :, :nope],
            torch.einsum("lk,hdk->lhd", cd_, uk),
            torch.einsum("lk,hdk->lhd", cd_.abs(), uk.abs()),
            "k",
        )
        check_bf16_gemm(
            v,
            torch.einsum("lk,hkd->lhd", cd_, uv),
            torch.einsum("lk,hkd->lhd", cd_.abs(), uv.abs()),
            "v",
        )

    return Spec(
        f"decompress-L{L}-H{H}-r{r}-{nope}-{rope}-{vd}{'-t' if uv_t else ''}",
        fields,
        check,
    )


def _mha(
    H: int,
    Lq: int,
    Lk: int,
    D: int,
    Dv: int,
    causal: bool,
    seed: int,
    s: float = 1.0,
) -> Spec:
    g = torch.Generator().manual_seed(seed)
    q = _bf16(g, H, Lq, D, s=s)
    k = _bf16(g, Lk, H, D, s=s).transpose(0, 1)  # [L, H, D] buffers viewed as [H, L, D]
    v = _bf16(g, Lk, H, Dv).transpose(0, 1)
    scale = 1.0 / math.sqrt(D)
    fields: dict[str, cd.Field] = dict(
        op="mha", H=H, Lq=Lq, Lk=Lk, D=D, Dv=Dv, causal=causal, scale=scale, q=q,
        q_s0=q.stride(0), q_s1=q.stride(1), k=k.transpose(0, 1), k_s0=k.stride(0),
        k_s1=k.stride(1), v=v.transpose(0, 1), v_s0=v.stride(0), v_s1=v.stride(1),
        threads=1 + seed % 2,
    )  # fmt: skip

    def check(out: dict[str, bytes]) -> None:
        o = cd.tensor(out["o"], torch.bfloat16, (H, Lq, Dv))
        lse = cd.tensor(out["lse"], torch.float32, (H, Lq))
        check_mha(o, lse, q, k, v, causal, scale)

    return Spec(f"mha-H{H}-{Lq}x{Lk}-D{D}-{Dv}-{'causal' if causal else 'full'}", fields, check)


def _gemm_specs() -> list[Spec]:
    specs = []
    for i, (T, H, K, N) in enumerate(
        [
            (1, 1, 1, 1),
            (5, 3, 33, 70),
            (7, 16, 128, 512),
            (13, 3, 512, 128),
            (0, 2, 8, 16),
            (40, 128, 128, 64),
            (33, 2, 96, 200),
            (2, 4, 33, 129),
            (1, 3, 512, 128),
        ]
    ):
        specs.append(_head_gemm(T, H, K, N, seed=i))
    for i, (L, H, r, nope, rope, vd) in enumerate(
        [
            (1, 1, 2, 1, 0, 1),
            (65, 3, 33, 17, 5, 9),
            (64, 16, 512, 128, 64, 128),
            (300, 2, 96, 40, 8, 70),
            (70, 128, 128, 32, 16, 32),
        ]
    ):
        specs.append(_decompress(L, H, r, nope, rope, vd, seed=i, uv_t=i % 2 == 1))
    for i, (H, Lq, Lk, D, Dv, causal) in enumerate(
        [
            (1, 1, 1, 1, 1, True),
            (3, 65, 65, 33, 17, True),
            (16, 24, 24, 192, 128, True),
            (4, 1, 300, 192, 128, False),
            (4, 100, 30, 8, 70, False),
            (2, 7, 0, 16, 16, False),
            (2, 130, 130, 64, 64, True),
        ]
    ):
        specs.append(_mha(H, Lq, Lk, D, Dv, causal, seed=i, s=6.0 if i == 6 else 1.0))
    return specs


# ---- the vector layer's bf16 widening ---------------------------------------------------------
WIDEN_N = 1 << 16  # every bf16 bit pattern once (a multiple of every level's W)


def _widen_spec() -> Spec:
    """VecF::load_bf16 / load_bf16_n bit for bit against the definition (bits << 16) over all
    65536 patterns (NaN payloads, infinities, denormals, -0), whole vectors and every tail
    length 0 .. W - 1 of the level, each tail read from a buffer of exactly its size (a read
    past it is a sanitizer report), lanes past the tail +0."""
    x = torch.arange(WIDEN_N, dtype=torch.int32).to(torch.int16)  # bits 0x0000 .. 0xffff
    want = (x.to(torch.int64) & 0xFFFF) << 16

    def check(out: dict[str, bytes]) -> None:
        assert "error" not in out, out.get("error", b"").decode()
        w = len(out["y"]) // (4 * WIDEN_N)
        assert w >= 1 and len(out["y"]) == 4 * w * WIDEN_N, f"y has {len(out['y'])} bytes"
        y = cd.tensor(out["y"], torch.int32, (w, WIDEN_N)).to(torch.int64) & 0xFFFFFFFF
        for n in range(w):
            bad = (y[n] != want).nonzero()
            assert bad.numel() == 0, (
                f"tail {n} (0: whole vectors of {w}): {bad.numel()} patterns differ, first "
                f"0x{int(x[bad[0, 0]]) & 0xFFFF:04x} -> 0x{int(y[n, bad[0, 0]]):08x}"
            )
        (dirty,) = struct.unpack("<q", out["dirty"])
        assert dirty == 0, f"{dirty} lanes past a tail were not +0"

    return Spec("widen-bf16-all", dict(op="widen", N=WIDEN_N, x=x), check)


# ---- targets ----------------------------------------------------------------------------------
def _host_levels() -> tuple[str, ...]:
    return host_isas() if platform.machine().lower() in ("x86_64", "amd64") else ()


TARGETS = cd.targets(_host_levels())


@pytest.fixture(scope="module")
def grid(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Spec]]:
    """Every case written once: (folder, name -> spec)."""
    folder = tmp_path_factory.mktemp("core_cases")
    specs = _attention_specs() + _write_specs() + _gemm_specs() + _dsa_specs() + _keyset_specs()
    specs += [_widen_spec()]
    names = [s.name for s in specs]
    assert len(set(names)) == len(names), "duplicate case names"
    for s in specs:
        cd.write_case(folder / f"{s.name}.case", **s.fields)
    return folder, {s.name: s for s in specs}


@pytest.fixture(scope="module")
def drivers(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path | str]:
    """The driver of each selected target whose tools are present (built two at a time, one
    build per distinct set of flags), or why it did not build."""
    out_dir = tmp_path_factory.mktemp("core_drivers")
    selected = {
        item.callspec.params["target"].name
        for item in request.session.items
        if "target" in getattr(getattr(item, "callspec", None), "params", {})
        and item.module is request.module  # test_fuzz.py's "target" is a name, not a Target
    }
    todo = {t.name: t for t in TARGETS if t.name in selected and not t.missing_tools()}
    unique = {}
    for t in todo.values():
        unique.setdefault(tuple(t.flags()), t)

    def one(t: cd.Target) -> Path | str:
        try:
            return cd.compile_driver(t, out_dir)
        except RuntimeError as e:
            return str(e)

    with ThreadPoolExecutor(2) as pool:
        built = dict(zip(unique, pool.map(one, unique.values())))
    return {n: built[tuple(t.flags())] for n, t in todo.items()}


SANITIZER_REPORT = re.compile(r"runtime error:|ERROR: AddressSanitizer|ERROR: LeakSanitizer")


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.name)
def test_target_passes_the_grid(target: cd.Target, grid, drivers) -> None:
    missing = target.missing_tools()
    if missing:
        pytest.skip(
            f"{target.name}: {', '.join(missing)} not installed (python3 -m nox -s cores "
            "installs them where apt-get can)"
        )
    exe = drivers[target.name]
    assert isinstance(exe, Path), exe
    folder, specs = grid
    if target.emulated:
        info = cd.run_driver(target, exe, ["--info"], timeout=60)
        assert info.returncode == 0, info.stderr
        m = re.search(r"sve_vl_bits=(\d+)", info.stdout)
        assert m, info.stdout
        if target.vl_bits:
            assert int(m.group(1)) == target.vl_bits, info.stdout
    chosen = list(specs.values())
    if target.vl_bits:  # SVE under emulation: the light cases
        chosen = [s for s in chosen if _cost(s.fields) <= SVE_MAX_COST or SVE_ALSO.match(s.name)]
    paths = [str(folder / f"{s.name}.case") for s in chosen]
    for p in paths:  # no stale answers from another target
        Path(p + ".out").unlink(missing_ok=True)
    res = cd.run_driver(
        target, exe, paths, timeout=TIMEOUT["emulated" if target.emulated else "native"]
    )
    assert not SANITIZER_REPORT.search(res.stderr), res.stderr[-6000:]
    assert res.returncode == 0, f"driver exit {res.returncode}\n{res.stderr[-6000:]}"
    failures = []
    for s, p in zip(chosen, paths):
        try:
            s.check(cd.read_output(Path(p + ".out")))
        except AssertionError as e:
            failures.append(f"{s.name}: {str(e)[:300]}")
    assert not failures, (
        f"{len(failures)} of {len(chosen)} cases failed on {target.name}:\n" + "\n".join(failures)
    )
