"""``python -m benchmarks layer``: one MLA layer's attention, both absorptions included, ours at
every native ISA level this CPU runs against the op sequences of vLLM's CPU_MLA (every CPU) and
AMX_MLA (where its kernels run) on the same data, interleaved in one process.

Ours: ``mb.MLAAttention(dims, weights)(q_nope, q_pe, kv_cache, plan)`` with the plan from
``mb.MLABatch.build`` + ``mb.plan`` (policy ``absorb``, our native kernels at that level):
``q_nope · W_UK``, the absorbed attention over the paged cache, ``o_lat · W_UV``, what the
engines' adapters call per layer; "picked" is the default cost policy's plan (what the engines
run) at the selected level.

CPU_MLA (decode shapes only: its kernel is decode-only, its prefill is SDPA over decompressed
K/V): ``torch.bmm`` on vLLM's strided weight views, cat, ``mla_decode_kvcache``, ``torch.bmm``
(``benchmarks/vllm_ops.py``). AMX_MLA: ``bmm_cpu`` over packed weights, ``cpu_mla_decode`` /
``cpu_mla_extend``. Per-step index tensors are built outside the timing, as those backends'
metadata builders do once per step; ours includes nothing of the plan either.

bf16, r 512 + rope 64, nope 128, v 128, page 16 (vLLM's CPU block size), shuffled pages. The
outputs are compared before timing. Run it in the vLLM environment for the vLLM columns.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

import mla_backend as mb

from . import harness, vllm_ops
from .problems import paged_latents, random_kv_b

R, ROPE, NOPE, V, PAGE = 512, 64, 128, 128, 16


def shapes(quick: bool) -> list[tuple[int, int, int, int]]:
    """(heads, batch, cached prefix, new tokens per request)."""
    s = [(16, 8, 160, 1), (16, 32, 512, 1), (16, 1, 4096, 1), (16, 8, 0, 128)]
    if not quick:
        s += [(16, 1, 0, 1024), (16, 4, 1024, 128), (128, 8, 1024, 1), (128, 1, 0, 512)]
    return s


def run_shape(H: int, B: int, P: int, N: int, isas: list[str], ops: object | None, amx: bool,
              rounds: int, min_time: float) -> tuple[dict[str, float], str, float]:  # fmt: skip
    """(best seconds per kernel, the cost policy's pick, max |diff| vs the first peer)."""
    dims = mb.MLADims(H, R, NOPE, ROPE, V)
    kv_b = random_kv_b(dims, torch.bfloat16)
    w = mb.split_kv_b_proj(kv_b, dims)
    cache, table = paged_latents(dims, [P + N] * B, PAGE, torch.bfloat16)
    phase = mb.Phase.DECODE if N == 1 else mb.Phase.EXTEND
    batch = mb.MLABatch.build([P] * B, [N] * B, table, PAGE, phase)
    g = torch.Generator().manual_seed(H + B + P + N)
    q = torch.randn(B * N, H, NOPE + ROPE, generator=g).to(torch.bfloat16)
    q_nope, q_pe = q[:, :, :NOPE], q[:, :, NOPE:]
    scale = dims.default_softmax_scale
    fns: dict[str, Callable[[], torch.Tensor]] = {}
    for isa in isas:  # one layer object per level: each packs the weights its own way
        k = harness.native_kernels(isa)
        attn = mb.MLAAttention(dims, w)
        plan = mb.plan(batch, dims, mb.Policy("absorb"), impl=k)
        fns[f"ours {isa}"] = lambda a=attn, p=plan: a(q_nope, q_pe, cache, p)
    picked = mb.plan(batch, dims, mb.Policy("cost"))
    if picked.mode != "absorbed":
        attn_picked = mb.MLAAttention(dims, w)
        fns["ours picked"] = lambda: attn_picked(q_nope, q_pe, cache, picked)
    if ops is not None and N == 1:
        fns["CPU_MLA"] = vllm_ops.cpu_mla_layer(ops, q_nope, q_pe, cache, table, P + 1, kv_b,
                                                dims, scale)  # fmt: skip
    if amx:
        fns["AMX_MLA"] = vllm_ops.amx_mla_layer(ops, q_nope, q_pe, cache, table, w, B, P, N,
                                                scale)  # fmt: skip
    ours = fns[f"ours {isas[-1]}"]().float()
    diff = 0.0
    for k in ("CPU_MLA", "AMX_MLA"):
        if k in fns:
            diff = max(diff, (fns[k]().float() - ours).abs().max().item())
    assert diff < 0.1 * max(1.0, ours.abs().max().item()), f"peers disagree with ours: {diff}"
    return harness.interleaved(fns, rounds, min_time), picked.mode, diff


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks layer",
                                 description=__doc__.split("\n\n")[0])  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="four small shapes")
    ap.add_argument("--isas", default=None, help="native ISA levels (default: all this CPU runs)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--min-time", type=float, default=0.2)
    args = ap.parse_args(argv)
    isas = args.isas.split(",") if args.isas else list(harness.host_isas())
    ops = vllm_ops.vllm_ops()
    amx = vllm_ops.amx_mla_runs(ops)
    peers = (["CPU_MLA"] if ops is not None else []) + (["AMX_MLA"] if amx else [])
    header = ["H", "batch", "prefix", "new"] + [f"ours {i} ms" for i in isas] + [
        f"{p} ms" for p in peers
    ] + [f"{p} / ours {i}" for p in peers for i in isas] + [
        "policy picks", "ours picked ms", "max abs diff vs peers"
    ]  # fmt: skip
    rows = []
    for H, B, P, N in shapes(args.quick):
        t, pick, diff = run_shape(H, B, P, N, isas, ops, amx, args.rounds, args.min_time)
        row = [str(H), str(B), str(P), str(N)] + [f"{t[f'ours {i}'] * 1e3:.3f}" for i in isas]
        row += [f"{t[p] * 1e3:.3f}" if p in t else "-" for p in peers]
        row += [f"{t[p] / t[f'ours {i}']:.2f}x" if p in t else "-" for p in peers for i in isas]
        picked = t.get("ours picked", t[f"ours {isas[-1]}"])
        row += [pick, f"{picked * 1e3:.3f}", f"{diff:.2g}"]
        rows.append(row)
        print(" | ".join(row), flush=True)
    notes = [
        "one MLA layer's attention incl. q_nope·W_UK and o_lat·W_UV, bf16, r 512 + rope 64, "
        f"nope 128, v 128, page {PAGE}, shuffled pages; best of {args.rounds} interleaved "
        f"rounds of >= {args.min_time}s",
        "ours <isa> = mb.MLAAttention(...)(q_nope, q_pe, cache, plan) with policy absorb on our "
        "native kernels at that level; picked = the cost policy's plan (normal path where it "
        "picks normal, else the absorbed one) at the selected level",
        "X / ours > 1: ours faster",
    ] + vllm_ops.peer_notes(
        ops, amx, "vLLM's generic MLAAttention + CPUMLAImpl sequence: torch.bmm on W_UK_T "
        "(kv_b's [r, H, nope] permuted to [H, nope, r], a strided view), cat, "
        "mla_decode_kvcache, torch.bmm on W_UV; decode shapes only ('-' elsewhere)",
        "AMXMLAImpl's sequence: bmm_cpu (convert_weight_packed weights) + cat + "
        "cpu_mla_decode / cpu_mla_extend + bmm_cpu",
    )  # fmt: skip
    harness.write_result("layer", "One MLA layer, absorptions included, per ISA level vs vLLM",
                         notes, harness.table(header, rows))  # fmt: skip
    return 0
