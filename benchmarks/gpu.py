"""``python -m benchmarks gpu``: the Triton absorbed-MLA kernels on FlashMLA's published shapes.

Needs a CUDA or ROCm device (on CPU it says so and exits 0: the Triton interpreter is a
correctness tool, its timings mean nothing). Shapes follow FlashMLA's decode benchmark:
batch 128, mean kv length 4096 / 8192 (fixed, or ragged ~ N(mean, mean/2) clipped at q_len),
query heads 16 / 32 / 64 / 128 (TP 8 / 4 / 2 / 1 of DeepSeek-V3), q_len 1 (decode) and 2
(MTP / speculative verify: an extend of 2 causal tokens onto the prefix), latent 576 = r 512 +
rope 64, value 512, page size 64. Throughput uses FlashMLA's formulas, so numbers are
comparable with its README (H800: ~3000 GB/s memory-bound, 580-660 TFLOP/s compute-bound):

    FLOPs = 2 * q_len * total_kv * heads * (576 + 512)
    bytes = (total_kv * 576 + batch * q_len * heads * (576 + 512)) * 2   (bf16; an fp8 cache
            counts its 576 kv elements at 1 byte, q and o stay bf16)
    TFLOP/s = FLOPs / 1e9 / ms;  GB/s = bytes / 1e6 / ms

Each shape is planned once (``mb.plan`` with ``mla_backend.ops.triton.Kernels()``) and timed
through the per-layer call ``mb.absorbed_attention``; ``graph_ms`` times the same call
replayed from a CUDA graph (after checking a replay reproduces the eager output bit for bit).

Columns beside ours, on the same cache and queries in the same run, where importable:
``flashinfer_ms`` (FlashInfer's ``BatchMLAPagedAttentionWrapper``, planned once per shape, run
per call; bf16 cache, r 512 / rope 64) and ``flashmla_ms`` (FlashMLA's ``flash_mla_with_kvcache``
with its ``get_mla_metadata`` schedule; page 64). ``max|o-fi|`` compares FlashInfer's output with
ours. The header prints the machine's measured device-to-device copy bandwidth (GB/s, read +
write) and bf16 GEMM throughput (TFLOP/s, 8192^3 ``torch.matmul``): ``%copy`` is our GB/s over
the copy bandwidth, ``%gemm`` our TFLOP/s over the GEMM throughput.

Usage: python -m benchmarks gpu [--cache fp8|fp8_ds_mla] [--quick] [--no-check]
           [--no-graph] [--no-others] [--q-lens 1,2,16] [--peak-tflops 989 --peak-gbs 3350]
           [--heads 16,128] [--means 4096,8192] [--batch 128] [--no-varlen] [--gluon]
       TRITON_INTERPRET=1 python -m benchmarks gpu --smoke   (CPU: plumbing only)
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from typing import NamedTuple

import torch

R, ROPE, DV = 512, 64, 512
D = R + ROPE
PAGE = 64


def _flashmla_throughput(
    ms: float, batch: int, q_len: int, heads: int, total_kv: int, kv_bytes: int, q_bytes: int = 2
) -> tuple[float, float]:
    """(TFLOP/s, GB/s) with FlashMLA's accounting (one kv head of width 576, value 512).

    ``kv_bytes``: cache element size (2 bf16, 1 fp8); ``q_bytes``: query / output element
    size (bf16). With both 2 this is exactly FlashMLA's formula.
    """
    flops = 2 * q_len * total_kv * heads * (D + DV)
    nbytes = total_kv * D * kv_bytes + batch * q_len * heads * (D + DV) * q_bytes
    return flops / 1e9 / ms, nbytes / 1e6 / ms


def measured_copy_gbs(dev: torch.device, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + written per second)."""
    import triton

    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dev)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src))
    return 2 * nbytes / 1e6 / ms


def measured_gemm_tflops(dev: torch.device, n: int = 8192) -> float:
    """bf16 dense GEMM throughput (``torch.matmul`` of two n x n matrices) in TFLOP/s."""
    import triton

    a = torch.randn(n, n, dtype=torch.bfloat16, device=dev)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=dev)
    ms = triton.testing.do_bench(lambda: a @ b)
    return 2 * n**3 / 1e9 / ms


class SameData(NamedTuple):
    """One shape's data, shared by every kernel timed on it.

    q_lat [T, H, r], q_pe [T, H, rope] (bf16); cache [pages, page_size, r + rope]; table: the
    host block table [B, max_pages] int32; kv_lens: per request (host ints); q_len: new
    tokens per request; scale: the softmax scale.
    """

    q_lat: torch.Tensor
    q_pe: torch.Tensor
    cache: torch.Tensor
    table: torch.Tensor
    kv_lens: list[int]
    q_len: int
    scale: float

    def pages(self) -> list[list[int]]:
        """Each request's used physical pages (host ints) from the host block table."""
        rows, page = self.table.tolist(), self.cache.shape[1]
        return [rows[i][: -(-L // page)] for i, L in enumerate(self.kv_lens)]


def flashinfer_runner(data: SameData) -> Callable[[], tuple[torch.Tensor, torch.Tensor]] | str:
    """FlashInfer's MLA paged wrapper on our cache (views of its r and rope columns), planned
    here once; returns a call giving (o [T, H, r], natural-log lse [T, H]), or why not."""
    try:
        import flashinfer
    except Exception as exc:  # not installed, or its import fails on this machine
        return f"flashinfer not importable ({type(exc).__name__})"
    q_lat, q_pe, cache, _, kv_lens, q_len, scale = data
    if cache.dtype not in (torch.bfloat16, torch.float16):
        return f"flashinfer MLA wrapper: {cache.dtype} cache not served"
    dev = cache.device
    batch = len(kv_lens)
    pages = data.pages()
    kv_indptr = [0]
    for p in pages:
        kv_indptr.append(kv_indptr[-1] + len(p))
    i32 = torch.int32
    qo_indptr = torch.arange(0, batch + 1, dtype=i32) * q_len
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
    wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(workspace)
    wrapper.plan(
        qo_indptr,
        torch.tensor(kv_indptr, dtype=i32),
        torch.tensor([x for p in pages for x in p], dtype=i32, device=dev),
        torch.tensor(kv_lens, dtype=i32),
        q_lat.shape[1],
        R,
        ROPE,
        cache.shape[1],
        q_len > 1,  # causal among the new tokens (bottom-right aligned)
        scale,
        q_lat.dtype,
        cache.dtype,
    )
    import inspect

    base_e = "return_lse_base_on_e" in inspect.signature(wrapper.run).parameters
    ckv, kpe = cache[..., :R], cache[..., R:]

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        if base_e:
            return wrapper.run(q_lat, q_pe, ckv, kpe, return_lse=True, return_lse_base_on_e=True)
        o, lse2 = wrapper.run(q_lat, q_pe, ckv, kpe, return_lse=True)
        return o, lse2 * 0.6931471805599453  # its LSE is base 2 in these versions

    return run


def flashmla_runner(data: SameData) -> Callable[[], object] | str:
    """FlashMLA's decode kernel on the same cache (bf16, page 64) with its own scheduler
    metadata; returns a call, or why not."""
    try:
        import flash_mla
    except Exception as exc:
        return f"flash_mla not importable ({type(exc).__name__})"
    q_lat, q_pe, cache, table, kv_lens, q_len, scale = data
    if cache.dtype != torch.bfloat16 or cache.shape[1] != 64:
        return f"flash_mla: {cache.dtype} cache, page {cache.shape[1]} not benchmarked"
    dev = cache.device
    batch, heads = len(kv_lens), q_lat.shape[1]
    q = torch.cat([q_lat, q_pe], -1).view(batch, q_len, heads, D)
    seqlens = torch.tensor(kv_lens, dtype=torch.int32, device=dev)
    block_table = table.to(device=dev, dtype=torch.int32)
    kvcache = cache.view(cache.shape[0], 64, 1, D)
    meta, splits = flash_mla.get_mla_metadata(seqlens, q_len * heads, 1)

    def run() -> object:
        return flash_mla.flash_mla_with_kvcache(
            q, kvcache, block_table, seqlens, R, meta, splits, softmax_scale=scale, causal=True
        )

    return run


def _case(
    dev: torch.device,
    batch: int,
    mean_kv: int,
    heads: int,
    q_len: int,
    varlen: bool,
    cache_dtype: torch.dtype,
):
    """Build (q_lat, q_pe, kv_cache, MLABatch, kv_scale, kv_lens) on ``dev``."""
    import mla_backend as mb

    kv_lens = [mean_kv] * batch
    if varlen:
        kv_lens = [max(int(random.normalvariate(mean_kv, mean_kv / 2)), q_len) for _ in kv_lens]
    pages = [-(-L // PAGE) for L in kv_lens]
    max_pages = max(pages)
    perm = torch.randperm(sum(pages)).to(torch.int32)
    table = torch.zeros(batch, max_pages, dtype=torch.int32)  # host copy, as engines have
    k = 0
    for i, n in enumerate(pages):
        table[i, :n] = perm[k : k + n]
        k += n
    cache = torch.randn(sum(pages), PAGE, D, device=dev, dtype=torch.bfloat16)
    kv_scale = None
    if cache_dtype == torch.uint8:  # fp8_ds_mla rows (656 B/token), per-token tile scales
        from mla_backend.cache_layout import CacheLayout

        layout = CacheLayout.ds_mla(R, ROPE, torch.bfloat16)
        flat = cache.view(-1, D)
        cache = layout.pack(flat[:, :R], flat[:, R:]).view(sum(pages), PAGE, layout.width)
    elif cache_dtype != torch.bfloat16:
        kv_scale = torch.tensor(0.05, device=dev)
        cache = (cache.float() / kv_scale).clamp(-448, 448).to(cache_dtype)
    batch_desc = mb.MLABatch.build(
        [L - q_len for L in kv_lens],
        [q_len] * batch,
        table.to(dev),
        PAGE,
        mb.Phase.DECODE if q_len == 1 else mb.Phase.TARGET_VERIFY,
        block_table_host=table,
    )
    T = batch * q_len
    q_lat = torch.randn(T, heads, R, device=dev, dtype=torch.bfloat16)
    q_pe = torch.randn(T, heads, ROPE, device=dev, dtype=torch.bfloat16)
    return q_lat, q_pe, cache, batch_desc, kv_scale, kv_lens, table


def sweep(
    dev: torch.device,
    batch: int,
    means: list[int],
    head_list: list[int],
    q_lens: list[int],
    cache_dtype: torch.dtype,
    timer: Callable[[Callable[[], object]], float],
    check: bool = True,
    peaks: tuple[float, float] | None = None,
    graph_timer: Callable[[Callable[[], object]], float] | None = None,
    measured: tuple[float, float] | None = None,
    others: bool = False,
    varlens: tuple[bool, ...] = (False, True),
    gluon: bool = False,
) -> float:
    """Time every shape and print one row each; returns the worst max|o_triton - o_torch|.

    ``timer(fn)`` returns milliseconds per call; ``peaks`` = (TFLOP/s, GB/s) of the device to
    print the fraction of the roofline bound max(bytes / bandwidth, FLOPs / peak);
    ``graph_timer(fn)`` (optional) times the same call captured in a CUDA graph (the plan's
    tensors stay at fixed addresses; the per-layer call reads nothing back on the host);
    ``measured`` = (GEMM TFLOP/s, copy GB/s) of this machine adds ``%gemm`` / ``%copy``;
    ``others`` adds FlashInfer's and FlashMLA's times on the same data where importable;
    ``gluon`` the opt-in Gluon kernel's time (``Kernels(gluon=True)``; ``nan`` where it does
    not serve the shape) and its max difference from the Triton kernel's output.
    """
    import mla_backend as mb
    from mla_backend.ops.triton import Kernels as TritonKernels

    # bytes per cache element: fp8_ds_mla counts its whole 656-byte row over the 576 values
    kv_bytes = {torch.float8_e4m3fn: 1, torch.uint8: 656 / 576}.get(cache_dtype, 2)
    scale = 1.0 / (192**0.5)
    worst = 0.0
    print(
        "batch mean_kv heads q_len varlen  parts      ms  TFLOP/s    GB/s  max|o-torch|"
        + ("  %roofline" if peaks else "")
        + ("  %gemm  %copy" if measured else "")
        + ("  graph_ms" if graph_timer else "")
        + ("  flashinfer_ms  max|o-fi|  flashmla_ms" if others else "")
        + ("  gluon_ms  max|o-gluon|" if gluon else ""),
        flush=True,
    )
    skipped: set[str] = set()
    absorb = mb.Policy("absorb")
    for mean_kv in means:
        for heads in head_list:
            dims = mb.MLADims(heads, R, 128, ROPE, DV)
            for q_len in q_lens:
                for varlen in varlens:
                    q_lat, q_pe, cache, b, kv_scale, kv_lens, table = _case(
                        dev, batch, mean_kv, heads, q_len, varlen, cache_dtype
                    )
                    plan = mb.plan(b, dims, absorb, device=dev, impl=TritonKernels())
                    parts = plan.step.work.num_kv_splits  # schedule pieces per head block

                    def run(q_lat=q_lat, q_pe=q_pe, cache=cache, plan=plan, kv_scale=kv_scale):
                        return mb.absorbed_attention(q_lat, q_pe, cache, plan, scale, kv_scale)

                    err = float("nan")
                    if check:
                        o, _ = run()
                        torch_plan = mb.plan(b, dims, absorb, device=dev, impl="torch")
                        o_ref, _ = mb.absorbed_attention(
                            q_lat, q_pe, cache, torch_plan, scale, kv_scale
                        )
                        err = float((o.float() - o_ref.float()).abs().max())
                        worst = max(worst, err)
                        del o, o_ref
                    ms = timer(run)
                    tflops, gbs = _flashmla_throughput(
                        ms, batch, q_len, heads, sum(kv_lens), kv_bytes
                    )
                    extra = ""
                    if peaks:
                        bound_ms = max(gbs * ms / peaks[1], tflops * ms / peaks[0])
                        extra = f"  {100 * bound_ms / ms:9.1f}"
                    if measured:
                        pct = (100 * tflops / measured[0], 100 * gbs / measured[1])
                        extra += f"  {pct[0]:5.1f}  {pct[1]:5.1f}"
                    if graph_timer:
                        extra += f"  {graph_timer(run):8.3f}"
                    if others:
                        data = SameData(q_lat, q_pe, cache, table, kv_lens, q_len, scale)
                        extra += _other_columns(run, timer, skipped, data)
                    if gluon:
                        extra += _gluon_column(
                            run, timer, skipped, b, dims, dev, (q_lat, q_pe, cache, scale,
                                                                kv_scale))
                    print(
                        f"{batch:5d} {mean_kv:7d} {heads:5d} {q_len:5d} {str(varlen):>6} "
                        f"{parts:6d} {ms:7.3f} {tflops:8.1f} {gbs:7.0f}  {err:.3e}{extra}",
                        flush=True,
                    )
                    del q_lat, q_pe, cache
                    if dev.type == "cuda":
                        torch.cuda.empty_cache()
    for why in sorted(skipped):
        print(f"  (column n/a: {why})")
    return worst


def _other_columns(
    ours: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    timer: Callable[[Callable[[], object]], float],
    skipped: set[str],
    data: SameData,
) -> str:
    """FlashInfer's ms and max|o - ours|, FlashMLA's ms, on one shape (``nan`` where not
    run; the reason is collected in ``skipped``)."""
    nan = float("nan")
    fi_ms = fi_err = fm_ms = nan
    fi = flashinfer_runner(data)
    if isinstance(fi, str):
        skipped.add(fi)
    else:
        try:
            o_fi, _ = fi()
            fi_err = float((o_fi.float() - ours()[0].float()).abs().max())
            fi_ms = timer(fi)
        except Exception as exc:  # report, keep sweeping
            skipped.add(f"flashinfer failed: {type(exc).__name__}: {exc}")
    fm = flashmla_runner(data)
    if isinstance(fm, str):
        skipped.add(fm)
    else:
        try:
            fm_ms = timer(fm)
        except Exception as exc:
            skipped.add(f"flash_mla failed: {type(exc).__name__}: {exc}")
    return f"  {fi_ms:13.3f}  {fi_err:9.2e}  {fm_ms:11.3f}"


def _gluon_column(
    ours: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    timer: Callable[[Callable[[], object]], float],
    skipped: set[str],
    batch: object,
    dims: object,
    dev: torch.device,
    args: tuple,
) -> str:
    """The Gluon kernel's ms and max|o - ours| on one shape (``nan`` where not run)."""
    import mla_backend as mb
    from mla_backend.ops.triton import Kernels as TritonKernels
    from mla_backend.ops.triton import ops as tops

    nan = float("nan")
    q_lat, q_pe, cache, scale, kv_scale = args
    plan = mb.plan(batch, dims, mb.Policy("absorb"), device=dev, impl=TritonKernels(gluon=True))
    block_q = plan.step.work.block_q
    block_h = TritonKernels(gluon=True)._block_h(dims, block_q)
    if not tops.gluon.gluon_serves(q_lat, q_pe, cache, block_q, block_h):
        skipped.add("gluon: not served (CUDA, bf16/fp16 cache, page 64, r 512, rope 64 only)")
        return f"  {nan:8.3f}  {nan:10.2e}"

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        return mb.absorbed_attention(q_lat, q_pe, cache, plan, scale, kv_scale)

    try:
        err = float((run()[0].float() - ours()[0].float()).abs().max())
        return f"  {timer(run):8.3f}  {err:10.2e}"
    except Exception as exc:  # report, keep sweeping
        skipped.add(f"gluon failed: {type(exc).__name__}: {str(exc)[:200]}")
        return f"  {nan:8.3f}  {nan:10.2e}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks gpu", description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)  # fmt: skip
    p.add_argument(
        "--cache", choices=["bf16", "fp8", "fp8_ds_mla"], default="bf16", help="latent cache"
    )
    p.add_argument("--quick", action="store_true", help="only mean kv 4096, heads 16 and 128")
    p.add_argument("--heads", default=None, help="query heads, e.g. 16,128 (default: all)")
    p.add_argument("--means", default=None, help="mean kv lengths, e.g. 4096,8192")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--no-varlen", action="store_true", help="fixed kv lengths only")
    p.add_argument("--gluon", action="store_true", help="add the Gluon kernel's column")
    p.add_argument("--no-check", action="store_true", help="skip the torch-path comparison")
    p.add_argument("--q-lens", default="1,2", help="new tokens per request (e.g. 1,2,16,64)")
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="device bf16 dense peak (e.g. 989 for H100/H800 SXM) to print %% of roofline",
    )
    p.add_argument(
        "--peak-gbs", type=float, default=None, help="device memory bandwidth in GB/s (3350)"
    )
    p.add_argument(
        "--no-graph", action="store_true", help="skip the CUDA-graph replay timing (graph_ms)"
    )
    p.add_argument(
        "--no-others",
        action="store_true",
        help="skip the FlashInfer / FlashMLA columns and the measured copy / GEMM peaks",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny shapes on CPU under TRITON_INTERPRET=1, no timing (tests the script itself)",
    )
    args = p.parse_args(argv)
    cache_dtype = {"fp8": torch.float8_e4m3fn, "fp8_ds_mla": torch.uint8}.get(
        args.cache, torch.bfloat16
    )
    q_lens = [int(x) for x in args.q_lens.split(",") if x.strip()]
    peaks = None
    if args.peak_tflops is not None and args.peak_gbs is not None:
        peaks = (args.peak_tflops, args.peak_gbs)

    if args.smoke:
        return _smoke(cache_dtype, peaks)
    if not torch.cuda.is_available():
        print(
            "benchmarks gpu: needs a CUDA or ROCm GPU (torch.cuda.is_available() is False); "
            "nothing to measure on this machine. The kernels' correctness is tested on CPU "
            "under TRITON_INTERPRET=1 (tests/triton_path)."
        )
        return 0
    try:
        import triton
    except ImportError:
        print("benchmarks gpu: triton is not installed (pip install 'mla-backend[triton]')")
        return 0
    from mla_backend.ops.triton.jit import heuristics as hx

    torch.manual_seed(0)
    random.seed(0)
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    print(
        f"device: {name}, SMs/CUs: {hx.sm_count(dev)}, cache {args.cache}, page {PAGE}; "
        f"torch {torch.__version__}, triton {triton.__version__}",
        flush=True,
    )
    measured = None
    if not args.no_others:
        measured = (measured_gemm_tflops(dev), measured_copy_gbs(dev))
        print(f"measured: bf16 GEMM {measured[0]:.0f} TFLOP/s, copy {measured[1]:.0f} GB/s",
              flush=True)
    means = [4096] if args.quick else [4096, 8192]
    head_list = [16, 128] if args.quick else [16, 32, 64, 128]
    if args.means:
        means = [int(x) for x in args.means.split(",")]
    if args.heads:
        head_list = [int(x) for x in args.heads.split(",")]
    sweep(
        dev,
        args.batch,
        means,
        head_list,
        q_lens,
        cache_dtype,
        timer=triton.testing.do_bench,
        check=not args.no_check,
        peaks=peaks,
        graph_timer=None if args.no_graph else _graph_timer,
        measured=measured,
        others=not args.no_others,
        varlens=(False,) if args.no_varlen else (False, True),
        gluon=args.gluon,
    )
    return 0


def _graph_timer(fn: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Capture one call in a CUDA graph, check a replay reproduces the eager output bit for
    bit, then time replays (``triton.testing.do_bench_cudagraph``); NaN if capture fails."""
    import triton

    try:
        eager = fn()[0].clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()[0]
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        if not torch.equal(out, eager):
            print("  (graph replay output differs from the eager call)")
            return float("nan")
        del graph, out
        return triton.testing.do_bench_cudagraph(fn)
    except Exception as exc:  # report, keep sweeping
        print(f"  (CUDA-graph capture failed: {type(exc).__name__}: {exc})")
        return float("nan")


def _smoke(cache_dtype: torch.dtype, peaks: tuple[float, float] | None) -> int:
    """The whole sweep on tiny CPU shapes under the interpreter, with a fake 1 ms timer."""
    from mla_backend.ops.triton.jit import heuristics as hx

    if not hx.interpreting():
        print("benchmarks gpu --smoke: set TRITON_INTERPRET=1 (CPU tensors need the interpreter)")
        return 2
    torch.manual_seed(0)
    random.seed(0)
    worst = sweep(
        torch.device("cpu"),
        2,
        [80],
        [16],
        [1, 2],
        cache_dtype,
        timer=lambda fn: 1.0,
        peaks=peaks,
        others=True,  # the FlashInfer / FlashMLA columns' plumbing (n/a without a GPU)
        gluon=True,  # the Gluon column's plumbing (not served on CPU: nan)
    )
    return 0 if worst < 5e-2 else 1
