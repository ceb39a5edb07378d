"""``python -m benchmarks gpu-sweep``: the Triton absorbed kernel's tile knobs timed on one GPU
(batch 128, fixed kv lengths, page 64): per (heads, cache, q_len) group the default
``Kernels()`` first, then each knob setting (``block_n``, ``rows_per_program``, ``pad_rows``,
``num_warps``, ``num_stages``, ``chunk``, ``num_kv_splits``, ``fp8_f16``, the Gluon kernel),
each checked against the default's output and timed (``triton.testing.do_bench`` median).
Prints one row per setting as it goes; stops starting settings after ``--budget-s``.

    python -m benchmarks gpu-sweep [--mean-kv 4096] [--budget-s 100]
    TRITON_INTERPRET=1 python -m benchmarks gpu-sweep --smoke      (CPU: plumbing only)
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from . import gpu

#: (heads, cache, q_len) -> knob settings, most telling first (each costs a compile + timing)
GROUPS: list[tuple[tuple[int, str, int], list[dict[str, object]]]] = [
    ((16, "bf16", 1), [{"block_n": 32}, {"pad_rows": True},
                       {"num_stages": 2}, {"chunk": 256}, {"num_warps": 8}, {"block_n": 16},
                       {"chunk": 64}]),
    ((128, "bf16", 1), [{"block_n": 64}, {"num_stages": 2},
                        {"block_n": 64, "num_stages": 2}, {"splits_per_sm": 1.0},
                        {"chunk": 256}, {"num_warps": 4}, {"rows_per_program": 32}]),
    ((16, "fp8", 1), [{"fp8_f16": True}, {"block_n": 64}, {"fp8_f16": True, "block_n": 64}]),
    ((128, "fp8", 1), [{"fp8_f16": True}, {"block_n": 64}]),
    ((16, "fp8_ds_mla", 1), [{"fp8_f16": True}, {"block_n": 64}]),
    ((128, "fp8_ds_mla", 1), [{"fp8_f16": True}]),
    ((16, "bf16", 2), [{"pad_rows": True}]),
    # the Gluon kernel last: should it hang on the GPU, only these rows are lost
    ((16, "bf16", 1), [{"gluon": True}]),
    ((128, "bf16", 1), [{"gluon": True}]),
    ((16, "bf16", 2), [{"gluon": True}]),
    ((128, "bf16", 2), [{"gluon": True}]),
]
CACHE_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "fp8_ds_mla": torch.uint8}


def _kernels(knobs: dict[str, object], heads: int, dev: torch.device):
    """``Kernels(**knobs)``; ``splits_per_sm`` x SMs (per head block) becomes
    ``num_kv_splits``."""
    from mla_backend.ops.triton import Kernels
    from mla_backend.ops.triton.jit import heuristics as hx

    knobs = dict(knobs)
    per_sm = knobs.pop("splits_per_sm", None)
    if per_sm is not None:
        blocks = -(-heads // 64)
        knobs["num_kv_splits"] = max(1, int(per_sm * hx.sm_count(dev) / blocks))
    return Kernels(**knobs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks gpu-sweep", description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mean-kv", type=int, default=4096)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--budget-s", type=float, default=100.0, help="start no setting after this")
    p.add_argument("--smoke", action="store_true", help="tiny CPU shapes, fake timer")
    a = p.parse_args(argv)
    import mla_backend as mb

    if a.smoke:
        dev, batch, mean_kv = torch.device("cpu"), 2, 80
        timer = lambda fn: 1.0  # noqa: E731
        groups = [((16, "bf16", 1), [{"block_n": 32}, {"gluon": True}, {"pad_rows": True}]),
                  ((16, "fp8", 1), [{"fp8_f16": True}])]
    else:
        if not torch.cuda.is_available():
            print("benchmarks gpu-sweep: needs a CUDA GPU; nothing to measure here")
            return 0
        import triton

        dev, batch, mean_kv = torch.device("cuda"), a.batch, a.mean_kv
        timer = lambda fn: triton.testing.do_bench(fn, return_mode="median")  # noqa: E731
        groups = GROUPS
    torch.manual_seed(0)
    random.seed(0)
    t0 = time.time()
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(f"device {name}; batch {batch}, kv {mean_kv} (fixed), page {gpu.PAGE}; "
          "ms = do_bench median", flush=True)
    print("heads cache      q_len knobs                              parts      ms    GB/s "
          "TFLOP/s  max|o-default|  vs_default", flush=True)
    absorb = mb.Policy("absorb")
    for (heads, cache_name, q_len), knob_list in groups:
        if time.time() - t0 > a.budget_s:
            print("  (budget reached: remaining groups not run)", flush=True)
            break
        dims = mb.MLADims(heads, gpu.R, 128, gpu.ROPE, gpu.DV)
        cache_dtype = CACHE_DTYPES[cache_name]
        q_lat, q_pe, cache, b, kv_scale, kv_lens, _ = gpu._case(
            dev, batch, mean_kv, heads, q_len, False, cache_dtype)
        kv_bytes = {torch.float8_e4m3fn: 1, torch.uint8: 656 / 576}.get(cache_dtype, 2)
        scale = 1.0 / 192**0.5
        base = None
        for knobs in [{}] + knob_list:
            if knobs and time.time() - t0 > a.budget_s:
                print("  (budget reached)", flush=True)
                break
            label = ",".join(f"{k}={v}" for k, v in knobs.items()) or "default"
            try:
                plan = mb.plan(b, dims, absorb, device=dev, impl=_kernels(knobs, heads, dev))

                def run(plan=plan, d=(q_lat, q_pe, cache, scale, kv_scale)):
                    return mb.absorbed_attention(d[0], d[1], d[2], plan, d[3], d[4])

                o = run()[0].float()
                ms = timer(run)
            except Exception as exc:  # e.g. out of shared memory: report, go on
                print(f"{heads:5d} {cache_name:10s} {q_len:5d} {label:34s} failed: "
                      f"{type(exc).__name__}: {str(exc)[:120]}", flush=True)
                continue
            if base is None:
                base = (o, ms)
            err = float((o - base[0]).abs().max())
            tf, gbs = gpu._flashmla_throughput(ms, batch, q_len, heads, sum(kv_lens), kv_bytes)
            print(f"{heads:5d} {cache_name:10s} {q_len:5d} {label:34s} "
                  f"{plan.step.work.num_kv_splits:5d} {ms:7.3f} {gbs:7.0f} {tf:7.1f}  "
                  f"{err:14.3e}  {base[1] / ms:9.2f}x", flush=True)
        del q_lat, q_pe, cache, base
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return 0
