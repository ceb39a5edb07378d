"""Decode benchmark of the native CPU absorbed-MLA kernel (mla_backend.ops.native) against the
core's torch path and, when vLLM is importable, vLLM's CPU MLA decode kernel
(``torch.ops._C.decode_attention_cpu``, sgl-kernel's, AMX where the CPU has it) on the same cache.

bf16, fp8 (e4m3 + per-tensor scale, 576 B/token) and fp8_ds_mla (e4m3 tiles of 128 with a
float32 scale each, rope in bf16: 656 B/token) caches, page 64, r 512 + rope 64, shuffled pages,
one new token per request. Kernels are timed interleaved (round-robin, best of N). The roofline
is measured in the same run: peak bf16 matmul FLOP/s and streaming read bandwidth; each
kernel's fraction is of min(peak, intensity x bandwidth) with the bytes per token of its own
cache layout (1152 / 576 / 656).

    python benchmarks/native_decode_bench.py [--quick] [--heads 16,128] [--batches 1,8,32]
        [--lens 1024,4096,16384] [--rounds 3] [--mem-gib 8]

Run it in the vLLM environment (``.nox/vllm/bin/python``) to include vLLM's kernel.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_table

import mla_backend as mb
from mla_backend.cache_layout import CacheLayout
from mla_backend.ops import native

FP8 = torch.float8_e4m3fn
R, ROPE, PAGE = 512, 64, 64
DS = CacheLayout.ds_mla(R, ROPE, torch.bfloat16)  # 656 bytes per token
BYTES_PER_TOKEN = {"bf16": (R + ROPE) * 2, "fp8": R + ROPE, "ds": DS.bytes_per_token}


def vllm_kernel():
    try:
        import vllm._custom_ops  # noqa: F401

        return torch.ops._C.decode_attention_cpu
    except Exception:
        return None


_ROOF: dict[str, torch.Tensor] = {}


def roofline_operands(n: int = 1536, mbytes: int = 256) -> None:
    """Operands of the two roofline probes: an n^3 bf16 matmul (peak FLOP/s) and a skinny
    matmul streaming a [rows, 576] bf16 matrix of ``mbytes`` MiB (read bandwidth)."""
    g = torch.Generator().manual_seed(0)
    _ROOF["a"] = torch.randn(n, n, generator=g).bfloat16()
    _ROOF["b"] = torch.randn(n, n, generator=g).bfloat16()
    rows = mbytes * (1 << 20) // (576 * 2)
    _ROOF["big"] = torch.randn(rows, 576, generator=g).bfloat16()
    _ROOF["x"] = torch.randn(16, 576, generator=g).bfloat16()


def make_problem(H: int, B: int, L: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    D = R + ROPE
    pages = -(-L // PAGE)
    num = B * pages + 1
    cache32 = torch.randn(num, PAGE, D, generator=g) * 0.5
    perm = torch.randperm(num - 1, generator=g) + 1
    table = perm[: B * pages].view(B, pages).to(torch.int32)
    q_lat = torch.randn(B, H, R, generator=g).bfloat16()
    q_pe = torch.randn(B, H, ROPE, generator=g).bfloat16()
    return cache32, table, q_lat, q_pe


def bench_round(fns: dict, rounds: int, min_time: float) -> dict:
    """Interleaved best-of-``rounds``: every round times each kernel once (>= min_time).
    A kernel whose warm-up call takes over a second is timed in the first round only."""
    best = dict.fromkeys(fns, float("inf"))
    slow = set()
    for k, f in fns.items():  # warm-up
        t0 = time.perf_counter()
        f()
        if time.perf_counter() - t0 > 1.0:
            slow.add(k)
    for rnd in range(rounds):
        for k, f in fns.items():
            if k in slow and rnd > 0:
                continue
            n, t0 = 0, time.perf_counter()
            while True:
                f()
                n += 1
                dt = time.perf_counter() - t0
                if dt >= min_time:
                    break
            best[k] = min(best[k], dt / n)
    return best


def run_shape(H, B, L, _peak, _bw, rounds, min_time, vk, torch_max_tokens):
    scale = 1.0 / (192**0.5)
    cache32, table, q_lat, q_pe = make_problem(H, B, L)
    kv_scale = torch.tensor(cache32.abs().max().item() / 448.0)
    rows32 = cache32.view(-1, R + ROPE)
    caches = {
        "bf16": (cache32.bfloat16(), None),
        "fp8": ((cache32 / kv_scale).clamp(-448, 448).to(FP8), kv_scale),
        # fp8_ds_mla rows written by the core's torch writer (bit-identical to the native one)
        "ds": (DS.pack(rows32[:, :R], rows32[:, R:]).view(*cache32.shape[:2], -1), None),
    }
    del cache32, rows32
    cu = torch.arange(B + 1, dtype=torch.int32)
    kvl = torch.full((B,), L, dtype=torch.int32)
    dims = mb.MLADims(H, R, 128, ROPE, 128)
    batch = mb.MLABatch.build(
        [L - 1] * B, [1] * B, table, PAGE, mb.Phase.DECODE, block_table_host=table
    )
    plan_t = mb.plan(batch, dims, mb.Policy("absorb"), impl="torch")
    fns = {}
    for name, (cache, ks) in caches.items():
        fns[f"native_{name}"] = lambda c=cache, s=ks: native.absorbed_attention(
            q_lat, q_pe, c, table, cu, kvl, scale, s
        )
        if B * L <= torch_max_tokens and name != "ds":
            fns[f"torch_{name}"] = lambda c=cache, s=ks: mb.absorbed_attention(
                q_lat, q_pe, c, plan_t, scale, s
            )
    if vk is not None:
        kb = caches["bf16"][0].view(-1, 1, R + ROPE)
        pos = torch.arange(L)
        req_to_token = (table.long()[:, pos // PAGE] * PAGE + pos % PAGE).contiguous()
        splits = 1
        while splits < L / 512:
            splits *= 2
        splits = min(splits, 2 * torch.get_num_threads())
        q = torch.cat([q_lat, q_pe], -1).contiguous()
        out = torch.empty(B, H, R, dtype=torch.bfloat16)
        logits = torch.empty(B, H, splits, R + 1, dtype=torch.float32)
        ridx = torch.arange(B, dtype=torch.int64)
        slen = torch.full((B,), L, dtype=torch.int64)
        fns["vllm_bf16"] = lambda: vk(
            q,
            kb,
            kb[..., :R],
            out,
            None,
            None,
            None,
            logits,
            req_to_token,
            ridx,
            slen,
            scale,
            0.0,
            False,
            0,
            None,
            None,
        )
        # correctness check of the comparison itself
        fns["vllm_bf16"]()
        o_n, _ = fns["native_bf16"]()
        diff = (out.float() - o_n.float()).abs().max().item()
        assert diff < 5e-2, f"vLLM kernel disagrees with native by {diff}"
    # and the ds cache's output is the bf16 one up to the tile quantization
    o_ds, _ = fns["native_ds"]()
    diff = (fns["native_bf16"]()[0].float() - o_ds.float()).abs().max().item()
    assert diff < 0.1, f"native fp8_ds_mla output differs from bf16 by {diff}"
    # the roofline, timed in the same interleaved rounds (the machine is shared: its load
    # moves during a run, so each shape is judged against the roofline of its own rounds)
    fns["_peak"] = lambda: torch.mm(_ROOF["a"], _ROOF["b"])
    fns["_bw"] = lambda: torch.mm(_ROOF["x"], _ROOF["big"].t())
    times = bench_round(fns, rounds, min_time)
    peak = 2 * _ROOF["a"].shape[0] ** 3 / times.pop("_peak")
    bw = _ROOF["big"].numel() * 2 / times.pop("_bw")
    flops = 2 * H * L * (2 * R + ROPE) * B
    out = {"_roof": (peak, bw)}
    for k, t in times.items():
        nbytes = B * L * BYTES_PER_TOKEN[k.rsplit("_", 1)[1]]
        roof = max(flops / peak, nbytes / bw)
        out[k] = (t, roof / t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", default="16,128")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--lens", default="1024,4096,16384")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--min-time", type=float, default=0.1)
    ap.add_argument("--mem-gib", type=float, default=8.0, help="skip shapes above this")
    ap.add_argument(
        "--torch-max-tokens",
        type=int,
        default=131072,
        help="skip the torch path above this many cached tokens per step (slow)",
    )
    ap.add_argument("--quick", action="store_true", help="a few shapes, 2 rounds, no file")
    args = ap.parse_args()
    torch.manual_seed(0)
    if not native.available():
        sys.exit(f"native kernels unavailable: {native.unavailable_reason()}")
    heads = [int(x) for x in args.heads.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    lens = [int(x) for x in args.lens.split(",")]
    if args.quick:
        heads, batches, lens, args.rounds = [16, 128], [1, 32], [4096], 2
    vk = vllm_kernel()
    load0 = os.getloadavg()
    roofline_operands()
    print(f"native engine {native.simd_level()}; vLLM kernel {'yes' if vk else 'no'}")
    header = [
        "H",
        "batch",
        "kv",
        "peak TF/s",
        "bw GB/s",
        "native bf16 ms",
        "roof",
        "torch bf16 ms",
        "roof",
        "vs torch",
    ]
    if vk is not None:
        header += ["vLLM bf16 ms", "roof", "vs vLLM"]
    header += ["native fp8 ms", "roof", "fp8 vs bf16", "torch fp8 ms", "fp8 vs torch"]
    header += ["native ds ms", "roof", "ds vs bf16", "ds vs fp8"]
    if vk is not None:
        header += ["ds vs vLLM bf16"]
    rows, roofs = [], []
    for H in heads:
        for B in batches:
            for L in lens:
                # fp32 source + the three caches + the ds packing's temporaries
                gib = B * L * ((R + ROPE) * (4 + 2 + 1) + DS.width + 2 * R * 4) / 2**30
                if gib > args.mem_gib:
                    continue
                res = run_shape(
                    H, B, L, 0.0, 0.0, args.rounds, args.min_time, vk, args.torch_max_tokens
                )
                peak, bw = res.pop("_roof")
                roofs.append((peak, bw))
                skip = (float("nan"), float("nan"))
                nb, tb = res["native_bf16"], res.get("torch_bf16", skip)
                nf, tf = res["native_fp8"], res.get("torch_fp8", skip)
                row = [
                    str(H),
                    str(B),
                    str(L),
                    f"{peak / 1e12:.3f}",
                    f"{bw / 1e9:.2f}",
                    f"{nb[0] * 1e3:.3f}",
                    f"{nb[1]:.0%}",
                    f"{tb[0] * 1e3:.3f}",
                    f"{tb[1]:.0%}",
                    f"{tb[0] / nb[0]:.2f}x",
                ]
                if vk is not None:
                    vb = res["vllm_bf16"]
                    row += [f"{vb[0] * 1e3:.3f}", f"{vb[1]:.0%}", f"{vb[0] / nb[0]:.2f}x"]
                row += [
                    f"{nf[0] * 1e3:.3f}",
                    f"{nf[1]:.0%}",
                    f"{nb[0] / nf[0]:.2f}x",
                    f"{tf[0] * 1e3:.3f}",
                    f"{tf[0] / nf[0]:.2f}x",
                ]
                nd = res["native_ds"]
                row += [
                    f"{nd[0] * 1e3:.3f}",
                    f"{nd[1]:.0%}",
                    f"{nb[0] / nd[0]:.2f}x",
                    f"{nf[0] / nd[0]:.2f}x",
                ]
                if vk is not None:
                    row += [f"{res['vllm_bf16'][0] / nd[0]:.2f}x"]
                rows.append(row)
                print(" | ".join(row), flush=True)
    load1 = os.getloadavg()
    pk = [p for p, _ in roofs]
    bws = [b for _, b in roofs]
    notes = [
        "roofline measured per shape, in the same interleaved rounds as the kernels (1536^3 "
        "bf16 matmul; skinny matmul streaming 256 MiB): peak "
        f"{min(pk) / 1e12:.3f}..{max(pk) / 1e12:.3f} TFLOP/s, read bandwidth "
        f"{min(bws) / 1e9:.2f}..{max(bws) / 1e9:.2f} GB/s over the run; roof = fraction of "
        "min(peak, intensity x bw) with each layout's bytes per token (bf16 1152, fp8 576, "
        f"fp8_ds_mla {DS.bytes_per_token})",
        "ds = fp8_ds_mla cache (uint8 rows: e4m3 tiles of 128 + float32 tile scale, rope bf16), "
        "native kernel only (scales applied in registers); ds vs bf16 / ds vs fp8 = time ratio "
        "(> 1: ds faster); vLLM's CPU kernel has no fp8 cache, so ds vs vLLM bf16 is against "
        "its bf16 cache",
        f"native engine: {native.simd_level()}; kernels timed interleaved, best of "
        f"{args.rounds} rounds of >= {args.min_time}s each",
        "torch = the core's torch path (mb.absorbed_attention with a plan for impl='torch', "
        "host block table given); nan = skipped (more than --torch-max-tokens cached tokens: "
        "its page gather alone takes seconds there)",
        "vLLM = torch.ops._C.decode_attention_cpu (sgl-kernel's decode, bf16 only) on the same "
        "cache viewed as rows, req_to_token built once outside the timing, splits as vLLM "
        "picks them"
        if vk is not None
        else "vLLM not importable in this environment",
        f"load average at start {load0[0]:.2f}, at end {load1[0]:.2f} (machine shared; "
        f"{os.cpu_count()} CPUs)",
    ]
    if args.quick:
        print("\n".join(notes))
        return
    write_table("native_decode", header, rows, notes)


if __name__ == "__main__":
    main()
