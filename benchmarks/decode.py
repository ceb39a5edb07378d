"""``python -m benchmarks decode``: absorbed MLA decode, our native kernels at every ISA level
this CPU runs, side by side with vLLM CPU_MLA's decode kernel (every CPU) and AMX_MLA's (where it
runs) and the core's torch path, on the same page-16 bf16 cache, in one run.

r 512 + rope 64, shuffled pages, one new token per request. Kernels and the roofline probes are
timed in the same interleaved rounds: roof = share of min(ceiling, intensity x bandwidth) with
1152 bytes per token. The roofline (``benchmarks/roofline.py``) is the best of every probe
sample of the run (torch's GEMMs, our FMA loop and torch's capped GEMM per level, two streaming
reads); a roof share above 100% is flagged '!'. ``--caches fp8,fp8_ds_mla`` adds our kernels on
those caches (576 / 656 bytes per token) at every level. Outputs are checked against CPU_MLA's
(or the torch path's) before timing. Writes ``decode-latest.md`` (and the history) and, with
matplotlib, one roofline plot per ISA level (``roofline-<isa>-latest.png``).

Run it in the vLLM environment (``.nox/demo/bin/python -m benchmarks decode``) for vLLM's kernels.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

import mla_backend as mb

from . import harness, plot, roofline, vllm_ops
from .problems import DS, ROPE, R, flops_bytes, paged_latents

PAGE = 16


Cache = tuple[torch.Tensor, torch.Tensor | None]  # (cache, fp8 scale)


def caches(cache: torch.Tensor, kinds: list[str]) -> dict[str, Cache]:
    """The bf16 cache and, as asked, its fp8 (per-tensor scale) and fp8_ds_mla copies."""
    out: dict[str, Cache] = {"bf16": (cache, None)}
    c32 = cache.float()
    if "fp8" in kinds:
        s = torch.tensor(c32.abs().max().item() / 448.0)
        out["fp8"] = ((c32 / s).clamp(-448, 448).to(torch.float8_e4m3fn), s)
    if "fp8_ds_mla" in kinds:
        rows = c32.view(-1, R + ROPE)
        out["fp8_ds_mla"] = (DS.pack(rows[:, :R], rows[:, R:]).view(*cache.shape[:2], -1), None)
    return out


def run_shape(H: int, B: int, L: int, isas: list[str], kinds: list[str], ops: object | None,
              amx: bool, rounds: int, min_time: float, torch_max_tokens: int,
              roof: roofline.Roofline) -> dict[str, object]:  # fmt: skip
    """Times of every kernel on one shape, with this shape's roofline."""
    dims = mb.MLADims(H, R, 128, ROPE, 128)
    scale = 1.0 / (192**0.5)
    cache, table = paged_latents(dims, [L] * B, PAGE, torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    q_lat = torch.randn(B, H, R, generator=g).bfloat16()
    q_pe = torch.randn(B, H, ROPE, generator=g).bfloat16()
    batch = mb.MLABatch.build([L - 1] * B, [1] * B, table, PAGE, mb.Phase.DECODE,
                              block_table_host=table)  # fmt: skip
    fns: dict[str, Callable[[], object]] = {}
    for kind, (c, ks) in caches(cache, kinds).items():
        for isa in isas:
            p = mb.plan(batch, dims, mb.Policy("absorb"), impl=harness.native_kernels(isa))
            fns[f"ours {isa} {kind}"] = lambda c=c, ks=ks, p=p: mb.absorbed_attention(
                q_lat, q_pe, c, p, scale, ks
            )[0]
    if B * L <= torch_max_tokens:
        p_t = mb.plan(batch, dims, mb.Policy("absorb"), impl="torch")
        fns["torch bf16"] = lambda: mb.absorbed_attention(q_lat, q_pe, cache, p_t, scale)[0]
    q = torch.cat([q_lat, q_pe], -1).contiguous()
    if ops is not None:
        seq = torch.full((B,), L, dtype=torch.int32)
        fns["CPU_MLA bf16"] = vllm_ops.cpu_mla_decode(ops, q, cache, table, seq, scale)
    if amx:
        fns["AMX_MLA bf16"] = vllm_ops.amx_mla_decode(ops, q, cache, table, L, scale)
    ref_key = "CPU_MLA bf16" if "CPU_MLA bf16" in fns else "torch bf16"
    ref = fns[ref_key]().float() if ref_key in fns else None
    for k, f in fns.items():  # the comparison itself is checked first
        if ref is not None and k.endswith("bf16"):
            diff = (f().float() - ref).abs().max().item()
            assert diff < 5e-2, f"{k} disagrees with {ref_key} by {diff}"
    fns.update(roof.probes())
    times = harness.interleaved(fns, rounds, min_time, each_round=roof.sample)
    return {"times": times, "probes": roof.take(times)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks decode",
                                 description=__doc__.split("\n\n")[0])  # fmt: skip
    ap.add_argument("--heads", default="16,128")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--lens", default="1024,4096,16384")
    ap.add_argument("--caches", default="bf16", help="bf16[,fp8][,fp8_ds_mla] (ours)")
    ap.add_argument("--isas", default=None, help="native ISA levels (default: all this CPU runs)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--min-time", type=float, default=0.1)
    ap.add_argument("--mem-gib", type=float, default=6.0, help="skip shapes above this")
    ap.add_argument("--torch-max-tokens", type=int, default=131072,
                    help="skip the torch path above this many cached tokens per step")  # fmt: skip
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    isas = args.isas.split(",") if args.isas else list(harness.host_isas())
    kinds = args.caches.split(",")
    ops = vllm_ops.vllm_ops()
    amx = vllm_ops.amx_mla_runs(ops)
    roof = roofline.Roofline(isas)
    results = []
    for H in (int(x) for x in args.heads.split(",")):
        for B in (int(x) for x in args.batches.split(",")):
            for L in (int(x) for x in args.lens.split(",")):
                if B * L * (R + ROPE) * (2 + 4 + 1 + 1) / 2**30 > args.mem_gib:
                    continue
                res = run_shape(H, B, L, isas, kinds, ops, amx, args.rounds, args.min_time,
                                args.torch_max_tokens, roof)  # fmt: skip
                results.append(((H, B, L), res))
                t = res["times"]
                ms = ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in t.items())
                print(f"H{H} B{B} L{L}: {ms}", flush=True)
    kernels: list[str] = []  # every kernel of any shape (the torch path skips large ones)
    for _, res in results:
        kernels += [k for k in res["times"] if k not in kernels]
    (peak, peak_src), (bw, bw_src) = roof.peak(), roof.bw()
    ceilings = {isa: roof.ceiling(isa) for isa in isas}
    header = ["H", "batch", "kv", "shape's GEMM TF/s", "shape's bw GB/s"]
    header += [f"{k} ms (roof)" for k in kernels]
    others = [k for k in ("CPU_MLA bf16", "AMX_MLA bf16", "torch bf16") if k in kernels]
    header += [f"{o.split()[0]} / ours {isa}" for o in others for isa in isas]
    rows, points = [], {}
    for (H, B, L), res in results:
        t, sp = res["times"], res["probes"]
        row = [str(H), str(B), str(L), f"{sp.peak / 1e12:.3f} {sp.which}", f"{sp.bw / 1e9:.1f}"]
        for k in kernels:
            if k not in t:
                row.append("-")
                continue
            f, nb = flops_bytes(H, B, L, k.rsplit(" ", 1)[1])
            pk = ceilings[k.split()[1]][0] if k.startswith("ours") else peak
            share = roofline.roof_fraction(f, nb, t[k], pk, bw)
            row.append(f"{t[k] * 1e3:.3f} ({roofline.roof_cell(share)})")
            points.setdefault(k, []).append((f / nb, f / t[k]))
        row += [f"{t[o] / t[f'ours {isa} bf16']:.2f}x" if o in t else "-"
                for o in others for isa in isas]  # fmt: skip
        rows.append(row)
    notes = [
        f"bf16 cache, page {PAGE}, shuffled pages, r {R} + rope {ROPE}; kernels and roofline "
        f"probes timed interleaved, best of {args.rounds} rounds of >= {args.min_time}s",
        "roof = share of min(ceiling, intensity x bw) with each cache's bytes per token (bf16 "
        f"1152, fp8 576, fp8_ds_mla {DS.bytes_per_token}); every ceiling is the best sample of "
        "the whole run (probes between every round of every shape: load only lowers a sample)",
        "compute ceiling for ours <isa>: that level's own, the better of torch's 1024^3 GEMM "
        "(bf16 or fp32) capped at the level in a child process (ATEN_CPU_CAPABILITY, "
        "ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS) and our FMA loop at the level "
        "(benchmarks/micro/dot_throughput.cpp --peak, all threads): "
        + ", ".join(f"{i} {c / 1e12:.3f} TFLOP/s ({src})" for i, (c, src) in ceilings.items())
        + f"; for the peers: {peak / 1e12:.3f} TFLOP/s ({peak_src}); bw {bw / 1e9:.1f} GB/s "
        f"({bw_src}: the better of torch's fp32 sum and our 32-byte-load stream over 256 MiB)",
        "every probe's best over the run (samples): " + roof.summary(),
        "shape's GEMM / bw columns: torch's in-process GEMM and fp32 sum in that shape's own "
        "rounds (they show the load; the roof uses the run's best)",
        roofline.ROOF_FLAG_NOTE,
        f"ours <isa> = mb.absorbed_attention with a plan on our native kernels at that ISA "
        f"level (levels: {', '.join(isas)}); torch = the core's torch path",
        "X / ours <isa> > 1: ours faster",
    ] + vllm_ops.peer_notes(
        ops, amx, "torch.ops._C.mla_decode_kvcache (vLLM CPU_MLA's decode, any CPU)",
        "vLLM AMX_MLA's decode_attention_cpu (sgl-kernel's), req_to_token built outside the "
        "timing",
    )  # fmt: skip
    harness.write_result("decode", "Absorbed MLA decode per ISA level vs vLLM's CPU kernels",
                         notes, harness.table(header, rows))  # fmt: skip
    if results:
        plot.roofline_per_isa("decode", points, peak, bw, {i: c for i, (c, _) in ceilings.items()})
    return 0
