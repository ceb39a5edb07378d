"""``python -m benchmarks gpu-sparse``: DeepSeek Sparse Attention decode on a GPU with the Triton
kernels: the lightning indexer's top-k plus the sparse absorbed attention over the selected
latent rows, against the dense absorbed decode over every cached token, on the same cache.

DeepSeek-V3.2 shapes: 128 query heads (TP 1), latent r 512 + rope 64 (bf16 cache, or
``fp8_ds_mla``: 656 bytes per token), page 64, shuffled pages; indexer 64 heads x 128 over vLLM's
fp8 index cache (132 bytes per token), q_I e4m3 (vLLM's quantized queries, their scale folded
into the weights), index_topk 2048; one new token per request; batch 64 / 128; kv 8K / 32K.
Per shape, in one run on the same data: ``dense`` = ``mb.absorbed_attention`` (the Triton dense
kernel); ``indexer`` = ``mb.indexer_topk``; ``sparse`` = ``mb.sparse_absorbed_attention`` over the
indexer's selection. Throughput accounting:

    indexer: FLOPs = 2 x 64 x 128 x batch x kv;  bytes = 132 x batch x kv (index keys)
    sparse:  FLOPs = 2 x batch x heads x topk x (576 + 512);  bytes = batch x topk x row bytes
             (+ q and o in bf16)

Before timing, each shape is checked against the torch path on the same device: the top-k sets
(``agree``: the fraction of equal entries; near-ties may differ) and the sparse output
(``max abs(o - torch)`` on the same index lists). The table is printed and, with ``--out DIR``,
kept as ``DIR/gpu_sparse-latest.md`` (the GPU run writes it to its output folder; commit it to
``benchmarks/results/``).

Usage: python -m benchmarks gpu-sparse [--batches 64,128] [--lens 8192,32768]
           [--caches bf16,fp8_ds_mla] [--heads 128] [--topk 2048] [--no-check] [--out DIR]
       TRITON_INTERPRET=1 python -m benchmarks gpu-sparse --smoke   (CPU: plumbing only)
"""

from __future__ import annotations

import argparse
import datetime
from collections.abc import Callable
from pathlib import Path

import torch

from . import harness

R, ROPE, PAGE, HI, DI = 512, 64, 64, 64, 128
INDEX_BYTES = DI + 4
#: tokens written per cache-fill call (bounds the fill's temporaries)
FILL_CHUNK = 1 << 17

HEADER = ("batch", "kv", "heads", "cache", "dense ms", "indexer ms", "idx TFLOP/s", "idx GB/s",
          "sparse ms", "sparse TFLOP/s", "sparse GB/s", "idx+sparse ms", "dense/(idx+sparse)",
          "agree", "max abs(o - torch)")  # fmt: skip


class Shape:
    """One shape's data on ``dev``: latent and index caches, queries, the Triton plan."""

    def __init__(self, dev: torch.device, batch: int, kv: int, heads: int, topk: int,
                 cache: str, hi: int = HI, seed: int = 0) -> None:  # fmt: skip
        import mla_backend as mb
        from mla_backend.cache_layout import CacheLayout
        from mla_backend.ops.triton import Kernels

        g = torch.Generator().manual_seed(seed)
        self.batch, self.kv, self.heads, self.topk, self.cache_name = batch, kv, heads, topk, cache
        self.dims = mb.MLADims(heads, R, 128, ROPE, 128)
        self.scale = 1.0 / (192**0.5)
        pages = -(-kv // PAGE)
        perm = torch.randperm(batch * pages, generator=g).to(torch.int32)
        table = perm.view(batch, pages)  # host copy, as engines have
        num_pages = batch * pages
        if cache == "fp8_ds_mla":
            width, dt = CacheLayout.ds_mla(R, ROPE, torch.bfloat16).width, torch.uint8
        else:
            width, dt = R + ROPE, torch.bfloat16
        self.cache = torch.empty(num_pages, PAGE, width, dtype=dt, device=dev)
        lay = mb.IndexCacheLayout.named("fp8", DI)
        self.index_cache = torch.empty(num_pages, PAGE, lay.width, dtype=torch.uint8, device=dev)
        impl = Kernels()
        slots_all = (table.long()[:, :, None] * PAGE + torch.arange(PAGE)).view(batch, -1)
        slots_all = slots_all[:, :kv].reshape(-1).to(dev)
        for s0 in range(0, slots_all.shape[0], FILL_CHUNK):  # the Triton writers fill both
            slots = slots_all[s0 : s0 + FILL_CHUNK]
            n = slots.shape[0]
            c_kv = torch.randn(n, R, device=dev, dtype=torch.bfloat16)
            k_pe = torch.randn(n, ROPE, device=dev, dtype=torch.bfloat16)
            mb.write_latent(self.cache, c_kv, k_pe, slots, impl=impl)
            k_I = torch.randn(n, DI, device=dev, dtype=torch.bfloat16)
            mb.write_index_keys(self.index_cache, k_I, slots, lay, impl=impl)
        self.batch_desc = mb.MLABatch.build([kv - 1] * batch, [1] * batch, table.to(dev), PAGE,
                                            mb.Phase.DECODE, block_table_host=table)  # fmt: skip
        self.indexer = mb.IndexerDims(hi, DI, topk)
        self.plan = mb.plan(self.batch_desc, self.dims, mb.Policy("absorb"), device=dev,
                            impl=impl, indexer=self.indexer)  # fmt: skip
        T = batch
        self.q_lat = torch.randn(T, heads, R, device=dev, dtype=torch.bfloat16)
        self.q_pe = torch.randn(T, heads, ROPE, device=dev, dtype=torch.bfloat16)
        self.q_I = (torch.randn(T, hi, DI, device=dev) * 16).to(torch.float8_e4m3fn)
        self.weights = torch.randn(T, hi, device=dev) / hi

    def calls(self) -> dict[str, Callable[[], object]]:
        import mla_backend as mb

        idx = self.topk_indices()
        return {
            "dense": lambda: mb.absorbed_attention(self.q_lat, self.q_pe, self.cache, self.plan,
                                                   self.scale),  # fmt: skip
            "indexer": self.topk_indices,
            "sparse": lambda: mb.sparse_absorbed_attention(self.q_lat, self.q_pe, self.cache,
                                                           self.plan, idx, self.scale),  # fmt: skip
        }

    def topk_indices(self, plan: object = None) -> torch.Tensor:
        import mla_backend as mb

        return mb.indexer_topk(self.q_I, self.weights, self.index_cache, plan or self.plan,
                               self.topk)  # fmt: skip

    def check(self) -> tuple[float, float]:
        """(top-k agreement with the torch path, max|o - torch path's o| on the same lists)."""
        import mla_backend as mb

        torch_plan = mb.plan(self.batch_desc, self.dims, mb.Policy("absorb"), impl="torch",
                             device=self.cache.device, indexer=self.indexer)  # fmt: skip
        idx = self.topk_indices()
        ref = self.topk_indices(torch_plan)
        agree = float((idx == ref).float().mean())
        o, _ = mb.sparse_absorbed_attention(self.q_lat, self.q_pe, self.cache, self.plan, idx,
                                            self.scale)  # fmt: skip
        o_t, _ = mb.sparse_absorbed_attention(self.q_lat, self.q_pe, self.cache, torch_plan,
                                              idx, self.scale)  # fmt: skip
        return agree, float((o.float() - o_t.float()).abs().max())

    def row(self, ms: dict[str, float], agree: float, err: float) -> list[str]:
        B, L, H, k = self.batch, self.kv, self.heads, self.topk
        row_bytes = self.cache.shape[-1] * self.cache.element_size()
        i_flops, i_bytes = 2.0 * self.indexer.n_heads * DI * B * L, float(INDEX_BYTES * B * L)
        s_flops = 2.0 * B * H * min(k, L) * (R + ROPE + R)
        s_bytes = float(B * min(k, L) * row_bytes + B * H * (R + ROPE + R) * 2)
        both = ms["indexer"] + ms["sparse"]
        return [
            str(B), str(L), str(H), self.cache_name, f"{ms['dense']:.3f}",
            f"{ms['indexer']:.3f}", f"{i_flops / 1e9 / ms['indexer']:.1f}",
            f"{i_bytes / 1e6 / ms['indexer']:.0f}", f"{ms['sparse']:.3f}",
            f"{s_flops / 1e9 / ms['sparse']:.1f}", f"{s_bytes / 1e6 / ms['sparse']:.0f}",
            f"{both:.3f}", f"{ms['dense'] / both:.2f}x", f"{agree:.4f}", f"{err:.2e}",
        ]  # fmt: skip


def sweep(dev: torch.device, batches: list[int], lens: list[int], heads: list[int],
          caches: list[str], topk: int, timer: Callable[[Callable[[], object]], float],
          check: bool = True, hi: int = HI) -> list[list[str]]:  # fmt: skip
    """One table row per shape (printed as it is measured)."""
    rows = []
    print(" | ".join(HEADER), flush=True)
    for cache in caches:
        for H in heads:
            for B in batches:
                for L in lens:
                    s = Shape(dev, B, L, H, topk, cache, hi)
                    agree, err = s.check() if check else (float("nan"), float("nan"))
                    ms = {name: timer(fn) for name, fn in s.calls().items()}
                    rows.append(s.row(ms, agree, err))
                    print(" | ".join(rows[-1]), flush=True)
                    del s
                    if dev.type == "cuda":
                        torch.cuda.empty_cache()
    return rows


def write(rows: list[list[str]], notes: list[str], out: str) -> None:
    """``gpu_sparse-latest.md`` (and its history) in directory ``out``."""
    harness.write_result("gpu_sparse", "DSA decode on a GPU: indexer + sparse vs dense (Triton)",
                         notes, harness.table(HEADER, rows), Path(out))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks gpu-sparse", description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)  # fmt: skip
    p.add_argument("--batches", default="64,128")
    p.add_argument("--lens", default="8192,32768")
    p.add_argument("--heads", default="128")
    p.add_argument("--caches", default="bf16,fp8_ds_mla")
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--no-check", action="store_true", help="skip the torch-path comparison")
    p.add_argument("--out", default=None,
                   help="directory to write gpu_sparse-latest.md (and -history.md) into")
    p.add_argument("--smoke", action="store_true",
                   help="tiny CPU shapes under TRITON_INTERPRET=1, fake timer")  # fmt: skip
    a = p.parse_args(argv)
    caches = [c for c in a.caches.split(",") if c]
    for c in caches:
        if c not in ("bf16", "fp8_ds_mla"):
            raise SystemExit(f"--caches {c!r} is not supported; use bf16 and/or fp8_ds_mla")
    ints = [[int(x) for x in v.split(",")] for v in (a.batches, a.lens, a.heads)]
    if a.smoke:
        return _smoke(caches, a.out)
    if not torch.cuda.is_available():
        print("benchmarks gpu-sparse: needs a CUDA GPU (torch.cuda.is_available() is False); "
              "the kernels are tested on CPU under TRITON_INTERPRET=1 (tests/triton_path)")
        return 0
    import triton

    torch.manual_seed(0)
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    notes = [
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M}Z, {name}; torch "
        f"{torch.__version__}, triton {triton.__version__}; Triton kernels (ops.triton)",
        f"latent r {R} + rope {ROPE}, page {PAGE}, shuffled pages; indexer {HI} heads x {DI}, "
        f"vLLM's fp8 index cache ({INDEX_BYTES} B/token), q_I e4m3; topk {a.topk}; decode "
        "(1 new token per request); triton.testing.do_bench medians",
        "agree: fraction of top-k entries equal to the torch path's on the same device; "
        "max abs(o - torch): sparse output vs the torch path's on the same lists",
    ]
    print("\n".join(notes), flush=True)
    rows = sweep(dev, ints[0], ints[1], ints[2], caches, a.topk, triton.testing.do_bench,
                 check=not a.no_check)  # fmt: skip
    if a.out:
        write(rows, notes, a.out)
    return 0


def _smoke(caches: list[str], out: str | None) -> int:
    """The sweep on tiny CPU shapes under the interpreter, a fake 1 ms timer, checks on."""
    from mla_backend.ops.triton.jit import heuristics as hx

    if not hx.interpreting():
        print("benchmarks gpu-sparse --smoke: set TRITON_INTERPRET=1 (CPU tensors need the "
              "interpreter)")  # fmt: skip
        return 2
    torch.manual_seed(0)
    rows = sweep(torch.device("cpu"), [2], [150], [16], caches, 64, lambda fn: (fn(), 1.0)[1],
                 check=True, hi=16)  # fmt: skip
    if out:
        write(rows, ["smoke run (CPU, interpreter, fake timer)"], out)
    ok = all(float(r[-2]) > 0.99 and float(r[-1]) < 5e-2 for r in rows)
    return 0 if ok else 1
