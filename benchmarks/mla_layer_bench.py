"""One MLA layer's attention, absorption included: ours against the op sequence of vLLM's AMX_MLA
backend on the same data, interleaved in one process.

Ours: ``mb.MLAAttention(dims, weights)(q_nope, q_pe, kv_cache, plan)`` with the plan from
``mb.MLABatch.build`` + ``mb.plan`` (policy ``absorb``, the native kernels): ``q_nope · W_UK``,
the absorbed attention over the paged cache, ``o_lat · W_UV``, exactly what the engines' adapters
call per layer.

AMX_MLA (vLLM 0.32, ``vllm/v1/attention/backends/mla/amx_mla.py``), called through vLLM's public
ops the way that backend calls them: the absorption ``bmm_cpu`` over weights packed once by
``convert_weight_packed``, ``torch.cat([q_lat, q_pe])``, ``cpu_mla_decode`` (one new token per
request) or ``cpu_mla_extend`` (several, causal, onto the cached prefix, the new tokens' rows as
the contiguous ``k_extend`` the kernel takes), then ``bmm_cpu`` with ``W_UV`` into the output. Its
per-step index tensors (``req_to_token`` from the block table) are built outside the timing, as
that backend's metadata builder does once per step; ours includes nothing of the plan either.
On a CPU without AMX (this project's machines) its kernels run their AVX-512 code.

bf16, r 512 + rope 64, nope 128, v 128, page 16 (vLLM's CPU block size for these backends), cache
pages shuffled. The two outputs are compared before timing (max abs difference, reported).

    python benchmarks/mla_layer_bench.py [--quick] [--rounds 3] [--min-time 0.2]

Run it in the vLLM environment (``.nox/vllm/bin/python``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import paged_latents, random_weights, write_table
from native_decode_bench import bench_round

import mla_backend as mb

R, ROPE, NOPE, V, PAGE = 512, 64, 128, 128, 16


def shapes(quick: bool) -> list[tuple[int, int, int, int]]:
    """(heads, batch, cached prefix, new tokens per request)."""
    s = [(16, 8, 160, 1), (16, 32, 512, 1), (16, 1, 4096, 1), (16, 8, 0, 128)]
    if not quick:
        s += [(16, 1, 0, 1024), (16, 4, 1024, 128), (128, 8, 1024, 1), (128, 1, 0, 512)]
    return s


def amx_mla_layer(ops, q_nope, q_pe, cache, table, w, B, P, N, scale):
    """A closure running AMX_MLA's per-layer sequence on this problem (see the module doc)."""
    H = q_nope.shape[1]
    T = q_nope.shape[0]
    w_uk = torch.ops._C.convert_weight_packed(w.W_UK.transpose(1, 2).contiguous())
    w_uv = torch.ops._C.convert_weight_packed(w.W_UV.transpose(1, 2).contiguous())
    rows = cache.view(-1, 1, R + ROPE)
    pos = torch.arange(P + N)
    r2t = (table.long()[:, pos // PAGE] * PAGE + pos % PAGE).contiguous()
    req = torch.arange(B, dtype=torch.long)
    seq = torch.full((B,), P + N, dtype=torch.long)
    ext_lens = torch.full((B,), N, dtype=torch.long)
    ext_start = torch.arange(B, dtype=torch.long) * N
    k_ext = rows[r2t[:, P:].reshape(-1)].contiguous()
    splits = 1  # as AMX_MLA's builder: the power of two >= max_seq // 512, <= 2 x threads
    while splits < max(1, (P + N) // 512):
        splits *= 2
    splits = min(splits, 2 * torch.get_num_threads())

    def run() -> torch.Tensor:
        q_lat = torch.empty(T, H, R, dtype=q_nope.dtype)
        ops.bmm_cpu(q_lat.transpose(0, 1), q_nope.transpose(0, 1), w_uk, True, None)
        mq = torch.cat([q_lat, q_pe], dim=-1)
        o_lat = torch.empty(T, H, R, dtype=q_nope.dtype)
        if N == 1:
            logits = torch.zeros(T, H, splits, R + 1, dtype=torch.float32)
            ops.cpu_mla_decode(mq, rows, rows[..., :R], o_lat, None, None, None, logits, r2t,
                               req, seq, scale, 0.0, False, 0, None, None)  # fmt: skip
        else:
            ops.cpu_mla_extend(mq, k_ext, k_ext[..., :R], o_lat, rows, rows[..., :R], r2t, req,
                               seq, ext_lens, ext_start, N, scale, 0.0, False, 0, None, None,
                               None)  # fmt: skip
        out = torch.empty(T, H * V, dtype=q_nope.dtype)
        ops.bmm_cpu(out.view(T, H, V).transpose(0, 1), o_lat.transpose(0, 1), w_uv, True, None)
        return out.view(T, H, V)

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--min-time", type=float, default=0.2)
    args = ap.parse_args()
    try:
        from vllm import _custom_ops as ops
    except Exception as e:  # pragma: no cover - run in the vLLM env
        raise SystemExit(f"run this in the vLLM environment (vllm not importable: {e})") from e

    load0 = os.getloadavg()
    rows = []
    for H, B, P, N in shapes(args.quick):
        dims = mb.MLADims(H, R, NOPE, ROPE, V)
        w = random_weights(dims, torch.bfloat16)
        attn = mb.MLAAttention(dims, w)
        cache, table = paged_latents(dims, [P + N] * B, PAGE, torch.bfloat16)
        phase = mb.Phase.DECODE if N == 1 else mb.Phase.EXTEND
        batch = mb.MLABatch.build([P] * B, [N] * B, table, PAGE, phase)
        plan = mb.plan(batch, dims, mb.Policy("absorb"))
        picked = mb.plan(batch, dims, mb.Policy("cost"))  # what the engines run
        g = torch.Generator().manual_seed(H + B + P + N)
        q = torch.randn(B * N, H, NOPE + ROPE, generator=g).to(torch.bfloat16)
        q_nope, q_pe = q[:, :, :NOPE], q[:, :, NOPE:]
        scale = dims.default_softmax_scale
        fns = {
            "ours": lambda: attn(q_nope, q_pe, cache, plan),
            "amx": amx_mla_layer(ops, q_nope, q_pe, cache, table, w, B, P, N, scale),
        }
        if picked.mode != "absorbed":
            fns["policy"] = lambda: attn(q_nope, q_pe, cache, picked)
        a, b = fns["ours"]().float(), fns["amx"]().float()
        diff = (a - b).abs().max().item()
        best = bench_round(fns, args.rounds, args.min_time)
        pol = best.get("policy", best["ours"])
        rows.append([
            str(H), str(B), str(P), str(N), f"{best['ours'] * 1e3:.3f}",
            f"{best['amx'] * 1e3:.3f}", f"{best['amx'] / best['ours']:.2f}x", picked.mode,
            f"{pol * 1e3:.3f}", f"{best['amx'] / pol:.2f}x",
            f"{diff:.2g} / {a.abs().max().item():.2g}", plan.impl.name,
        ])  # fmt: skip
        print(" | ".join(rows[-1]), flush=True)
    load1 = os.getloadavg()
    header = ["H", "batch", "prefix", "new", "ours absorbed ms", "AMX_MLA ms",
              "AMX_MLA / ours absorbed", "policy picks", "ours picked ms",
              "AMX_MLA / ours picked", "max |diff| / max |o| (absorbed)",
              "our kernels"]  # fmt: skip
    notes = [
        "one MLA layer's attention incl. q_nope·W_UK and o_lat·W_UV, bf16, r 512 + rope 64, "
        f"nope 128, v 128, page {PAGE}, shuffled pages; best of {args.rounds} interleaved "
        f"rounds of >= {args.min_time}s",
        "ours = mb.MLAAttention(...)(q_nope, q_pe, cache, plan): 'absorbed' with "
        "mb.plan(policy absorb), 'picked' with the default cost policy's plan (what the "
        "engines run; the normal path where it picks normal, else the same as absorbed)",
        "AMX_MLA = vLLM's AMXMLAImpl sequence through vllm._custom_ops: bmm_cpu (weights packed "
        "by convert_weight_packed) + cat + cpu_mla_decode / cpu_mla_extend + bmm_cpu; index "
        "tensors built outside the timing. On a CPU without AMX its kernels run their AVX-512 "
        f"code (AMX tiles on this CPU: {torch.cpu._is_amx_tile_supported()})",
        "AMX_MLA / ours > 1: ours faster",
        f"load average at start {load0[0]:.2f}, at end {load1[0]:.2f} ({os.cpu_count()} CPUs)",
    ]
    write_table("mla_layer", header, rows, notes)


if __name__ == "__main__":
    main()
