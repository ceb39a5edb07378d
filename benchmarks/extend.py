"""``python -m benchmarks extend``: absorbed MLA extend, our native kernels at every ISA level
this CPU runs (or ``--isas``; the best with every cache and peer, the others on bf16): several
new tokens per request, causal among them, onto a cached prefix (chunked prefill continuation,
prefix-cache hits, speculative verify). Compared with the core's torch path and, when vLLM is
importable, AMX_MLA's CPU extend kernel (``torch.ops._C.extend_attention_cpu``, sgl-kernel's;
only where it runs) on the same data.

Ours is called the way an engine calls it: ``mb.MLABatch.build`` (phase EXTEND) + ``mb.plan``
(policy ``absorb``, ``impl='native'`` or ``'torch'``) + ``mb.absorbed_attention`` over a paged
latent cache (page 64, r 512 + rope 64, shuffled pages) that already holds prefix and new rows;
bf16 and fp8 (e4m3 + per-tensor scale) cache rows for the native kernel, bf16 for the torch path.

vLLM's kernel is fed MLA as MQA with one kv head: K = the 576-wide latent rows
(``[c_kv ; k_pe]``), V = their first 512 columns (``c_kv``, a strided view), q = ``[q_lat ;
q_pe]``. The prefix is read from the cache viewed as token rows through ``req_to_token``; the
new tokens' rows come as the separate contiguous ``k_extend`` / ``v_extend`` buffers the kernel
requires (built once, outside the timing). The kernel takes only bf16/fp16 and a cache of q's
dtype (no fp8 rows), head sizes that are multiples of 32, and one kv head in the cache buffer
(a cache with more heads than ``k_extend`` makes it skip the prefix). Its output is checked
against ours before timing.

Kernels are timed interleaved (round-robin, best of N) with the roofline probes
(``benchmarks/roofline.py``: torch's GEMMs and our FMA loop, two streaming reads) in the same
rounds; each shape is judged by the best probe samples of the run so far.
FLOPs count the causal triangle exactly: per request sum_j 2 * H * (prefix + j + 1) * (r + rope
+ r); bytes = cache rows (prefix + new) in the cache dtype + q (r + rope) and o (r) in bf16.
roof = min(peak, intensity x bw) / achieved.

    python -m benchmarks extend [--quick] [--isas LEVELS] [--heads 16,128] [--batches 1,4]
        [--prefixes 0,1024,4096] [--news 16,128,512] [--rounds 3] [--max-gflop 320]

Run it in the vLLM environment (``.nox/demo/bin/python``) to include vLLM's kernel.
"""

from __future__ import annotations

import argparse

import torch

import mla_backend as mb

from . import harness, roofline, vllm_ops
from .problems import paged_latents
from .roofline import roof_cell

FP8 = torch.float8_e4m3fn
R, ROPE, PAGE = 512, 64, 64
DIMS_NOPE_V = 128


def vllm_extend_kernel():
    """AMX_MLA's extend kernel where it runs here, else None."""
    ops = vllm_ops.vllm_ops()
    return torch.ops._C.extend_attention_cpu if vllm_ops.amx_mla_runs(ops) else None


def extend_flops(H: int, B: int, P: int, N: int) -> float:
    """Causal extend: new token j of a request sees prefix + j + 1 keys."""
    keys = N * P + N * (N + 1) // 2
    return 2.0 * H * keys * (R + ROPE + R) * B


def extend_bytes(H: int, B: int, P: int, N: int, row_bytes: int) -> float:
    """Cache rows of prefix and new tokens (``row_bytes`` each) + bf16 q (r + rope) and o (r)."""
    return B * ((P + N) * row_bytes + N * H * (R + ROPE + R) * 2)


def vllm_call(vk, cache, table, B, P, N, q, scale):
    """A closure running vLLM's extend on ``cache`` (bf16), and its output tensor."""
    L = P + N
    rows = cache.view(-1, 1, R + ROPE)
    pos = torch.arange(L)
    req_to_token = (table.long()[:, pos // PAGE] * PAGE + pos % PAGE).contiguous()
    # the new tokens' own rows, as the engine hands them to the kernel
    k_ext = rows[req_to_token[:, P:].reshape(-1)].contiguous()
    v_ext = k_ext[..., :R]
    out = torch.empty(B * N, q.shape[1], R, dtype=torch.bfloat16)
    ridx = torch.arange(B, dtype=torch.int64)
    seq = torch.full((B,), L, dtype=torch.int64)
    ext = torch.full((B,), N, dtype=torch.int64)
    start = torch.arange(B, dtype=torch.int64) * N

    def call():
        vk(
            q,
            k_ext,
            v_ext,
            out,
            rows,
            rows[..., :R],
            req_to_token,
            ridx,
            seq,
            ext,
            start,
            N,
            scale,
            0.0,
            False,
            -1,
            None,
            None,
            None,
        )
        return out

    return call


def run_shape(H, B, P, N, rounds, min_time, vk, torch_max_gflop, roof, isas):
    scale = 1.0 / (192**0.5)
    L = P + N
    dims = mb.MLADims(H, R, DIMS_NOPE_V, ROPE, DIMS_NOPE_V)
    cache32, table = paged_latents(dims, [L] * B, PAGE, torch.float32)
    kv_scale = torch.tensor(cache32.abs().max().item() / 448.0)
    caches = {
        "bf16": (cache32.bfloat16(), None),
        "fp8": ((cache32 / kv_scale).clamp(-448, 448).to(FP8), kv_scale),
    }
    del cache32
    g = torch.Generator().manual_seed(1)
    T = B * N
    q = torch.randn(T, H, R + ROPE, generator=g).bfloat16()
    q_lat, q_pe = q[..., :R], q[..., R:]
    batch = mb.MLABatch.build(
        [P] * B, [N] * B, table, PAGE, mb.Phase.EXTEND, block_table_host=table
    )
    pol = mb.Policy("absorb")
    plans = {
        **{lvl: mb.plan(batch, dims, pol, impl=harness.native_kernels(lvl)) for lvl in isas},
        "native": mb.plan(batch, dims, pol, impl=harness.native_kernels(isas[-1])),
        "torch": mb.plan(batch, dims, pol, impl="torch"),
    }
    fns = {}
    for name, (cache, ks) in caches.items():
        fns[f"native_{name}"] = lambda c=cache, s=ks: mb.absorbed_attention(
            q_lat, q_pe, c, plans["native"], scale, s
        )
    for lvl in isas[:-1]:
        fns[f"native {lvl}_bf16"] = lambda p=plans[lvl]: mb.absorbed_attention(
            q_lat, q_pe, caches["bf16"][0], p, scale, None
        )
    flops = extend_flops(H, B, P, N)
    if flops / 1e9 <= torch_max_gflop:
        fns["torch_bf16"] = lambda: mb.absorbed_attention(
            q_lat, q_pe, caches["bf16"][0], plans["torch"], scale, None
        )
    # correctness of the comparison itself, before timing
    ref = fns["native_bf16"]()[0].float()
    diffs = {}
    if vk is not None:
        fns["vllm_bf16"] = vllm_call(vk, caches["bf16"][0], table, B, P, N, q, scale)
        diffs["vllm"] = (fns["vllm_bf16"]().float() - ref).abs().max().item()
        assert diffs["vllm"] < 5e-2, f"vLLM extend disagrees with native by {diffs['vllm']}"
    if "torch_bf16" in fns:
        diffs["torch"] = (fns["torch_bf16"]()[0].float() - ref).abs().max().item()
        assert diffs["torch"] < 5e-2, f"torch path disagrees with native by {diffs['torch']}"
    diffs["fp8"] = (fns["native_fp8"]()[0].float() - ref).abs().max().item()
    print(
        f"H={H} B={B} prefix={P} new={N}: max |diff| vs native bf16: "
        + ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()),
        flush=True,
    )
    fns.update(roof.probes())
    times = harness.interleaved(fns, rounds, min_time, each_round=roof.sample)
    roof.take(times)
    (peak, _), (bw, _) = roof.peak(), roof.bw()  # the run's best so far
    res = {"_roof": (peak, bw), "_diff": diffs}
    for k, t in times.items():
        nbytes = extend_bytes(H, B, P, N, (R + ROPE) * (1 if k.endswith("fp8") else 2))
        roof = max(flops / peak, nbytes / bw)
        res[k] = (t, roof / t, flops / t, flops / nbytes)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks extend",
                                 description=__doc__.split("\n\n")[0])  # fmt: skip
    ap.add_argument("--isas", default=None, help="native ISA levels (default: all this CPU runs)")
    ap.add_argument("--heads", default="16,128")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--prefixes", default="0,1024,4096")
    ap.add_argument("--news", default="16,128,512")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--min-time", type=float, default=0.1)
    ap.add_argument(
        "--max-gflop", type=float, default=320.0, help="skip shapes above this many GFLOP"
    )
    ap.add_argument(
        "--torch-max-gflop",
        type=float,
        default=40.0,
        help="skip the torch path above this many GFLOP per call (slow)",
    )
    ap.add_argument("--quick", action="store_true", help="a few shapes, 2 rounds")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    isas = args.isas.split(",") if args.isas else list(harness.host_isas())
    isa = isas[-1]
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    heads, batches = ints(args.heads), ints(args.batches)
    prefixes, news = ints(args.prefixes), ints(args.news)
    if args.quick:
        heads, batches, prefixes, news, args.rounds = [16, 128], [1], [1024], [128], 2
    vk = vllm_extend_kernel()
    roof = roofline.Roofline(isas[-1:])
    print(f"native ISA {isa}; AMX_MLA extend kernel {'yes' if vk else 'no'}")
    header = ["H", "batch", "prefix", "new", "GFLOP", "FLOP/B", "peak TF/s", "bw GB/s"]
    header += ["native bf16 ms", "GF/s", "roof"]
    for lvl in isas[:-1]:
        header += [f"native {lvl} bf16 ms", f"{lvl} / {isa}"]
    if vk is not None:
        header += ["vLLM bf16 ms", "GF/s", "roof", "vs vLLM", "vLLM diff"]
    header += ["torch bf16 ms", "roof", "vs torch", "native fp8 ms", "roof", "fp8 vs bf16"]
    rows, roofs, skipped = [], [], []
    nan = (float("nan"),) * 4
    for H in heads:
        for B in batches:
            for P in prefixes:
                for N in news:
                    gf = extend_flops(H, B, P, N) / 1e9
                    if gf > args.max_gflop:
                        skipped.append(f"H{H}/B{B}/P{P}/N{N} ({gf:.0f} GFLOP)")
                        continue
                    res = run_shape(
                        H, B, P, N, args.rounds, args.min_time, vk, args.torch_max_gflop, roof, isas
                    )
                    peak, bw = res.pop("_roof")
                    diffs = res.pop("_diff")
                    roofs.append((peak, bw))
                    nb, nf, tb = res["native_bf16"], res["native_fp8"], res.get("torch_bf16", nan)
                    row = [str(H), str(B), str(P), str(N), f"{gf:.2f}", f"{nb[3]:.0f}"]
                    row += [f"{peak / 1e12:.3f}", f"{bw / 1e9:.2f}"]
                    row += [f"{nb[0] * 1e3:.3f}", f"{nb[2] / 1e9:.0f}", roof_cell(nb[1])]
                    for lvl in isas[:-1]:
                        t_lvl = res[f"native {lvl}_bf16"][0]
                        row += [f"{t_lvl * 1e3:.3f}", f"{t_lvl / nb[0]:.2f}x"]
                    if vk is not None:
                        vb = res["vllm_bf16"]
                        row += [f"{vb[0] * 1e3:.3f}", f"{vb[2] / 1e9:.0f}", roof_cell(vb[1])]
                        row += [f"{vb[0] / nb[0]:.2f}x", f"{diffs['vllm']:.1e}"]
                    row += [f"{tb[0] * 1e3:.3f}", roof_cell(tb[1]), f"{tb[0] / nb[0]:.2f}x"]
                    row += [f"{nf[0] * 1e3:.3f}", roof_cell(nf[1]), f"{nb[0] / nf[0]:.2f}x"]
                    rows.append(row)
                    print(" | ".join(row), flush=True)
    pk = [p for p, _ in roofs]
    bws = [b for _, b in roofs]
    notes = [
        "extend: every request has `prefix` cached tokens and `new` query tokens, causal among "
        "them; GFLOP counts the causal triangle exactly (2 H (new prefix + new (new+1)/2) "
        "(r + rope + r) per request); FLOP/B = GFLOP / bytes (bf16 cache rows + bf16 q and o)",
        "roofline: the best probe samples of the run up to each shape (between every round: "
        "torch's 1024^3 bf16 / fp32 GEMM, our FMA loop at the top level, torch's fp32 sum and "
        "our stream over 256 MiB): peak "
        f"{min(pk) / 1e12:.3f}..{max(pk) / 1e12:.3f} TFLOP/s, read bandwidth "
        f"{min(bws) / 1e9:.2f}..{max(bws) / 1e9:.2f} GB/s; roof = fraction of "
        "min(peak, intensity x bw) (fp8 rows count 1 byte per cached element); every probe's "
        "best over the run: " + roof.summary(),
        f"native = our kernels at ISA level {isa} (native <level> bf16: at that level, "
        "<level> / best > 1: the best level faster); kernels timed interleaved, best of "
        f"{args.rounds} rounds of >= {args.min_time}s each (a kernel whose warm-up call takes "
        "over 1 s: first round only)",
        "native / torch = mb.MLABatch.build(phase EXTEND) + mb.plan(Policy('absorb'), "
        "impl=our kernels at that level / 'torch') + mb.absorbed_attention; torch nan = "
        f"skipped above {args.torch_max_gflop:.0f} GFLOP",
        "vLLM = AMX_MLA's torch.ops._C.extend_attention_cpu (sgl-kernel's CPU extend; bf16 "
        "only, no fp8 cache) as MQA with 1 kv head: K = 576-wide latent rows, V = their first "
        "512 columns; "
        "prefix through req_to_token over the same cache, new rows as contiguous k_extend / "
        "v_extend built outside the timing; its output checked against ours before timing "
        "(vLLM diff = max |o_vLLM - o_native|)"
        if vk is not None
        else "AMX_MLA's extend: "
        + (vllm_ops.amx_mla_unavailable() or "vLLM not importable here")
        + " (no column; CPU_MLA has no extend kernel)",
        "vs vLLM / vs torch = their time / native bf16 time (> 1: ours faster)",
        roofline.ROOF_FLAG_NOTE,
    ]
    if skipped:
        notes.append(f"skipped (over --max-gflop {args.max_gflop:.0f}): " + ", ".join(skipped))
    title = f"Absorbed MLA extend, our kernels at {isa}, vs AMX_MLA's extend"
    harness.write_result("extend", title, notes, harness.table(header, rows))
    return 0
