"""``python -m benchmarks dsa-resources``: the Triton DSA kernels compiled ahead of time for Hopper
(``sm_90a``) on a machine without a GPU, per launch configuration the DSA calls make:
registers, spill bytes, shared memory, MMA kind, and local-memory loads / stores in the SASS.

Each configuration runs the public DSA calls (``mb.write_index_keys``, ``mb.indexer_topk``,
``mb.sparse_absorbed_attention``) on CPU tensors of the real widths (r 512, rope 64, page 64,
indexer 64 x 128, topk 2048) with the launches recorded instead of run (the module's
``wrap_triton`` swapped for a recorder), so what is compiled is exactly what a call launches:
its constexprs and ``num_warps``, and the specialization Triton's launcher derives (pointer
dtypes, 16-divisible pointers and ints, ints equal to 1 as constants). Each launch is compiled
with ``triton.compile`` for ``GPUTarget("cuda", 90, 32)``; the bundled ``ptxas -v`` gives
registers and spills, ``cuobjdump -sass`` the local-memory traffic (``LDL`` / ``STL``).

    python -m benchmarks dsa-resources [--arch 90] [--configs ...] [--out DIR]

Needs ``triton`` (3.6.0 is the GPU machine's version) and no GPU; run it without
``TRITON_INTERPRET`` (a process that imported Triton with the interpreter on cannot compile).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from . import harness

R, ROPE, PAGE, HI, DI, TOPK = 512, 64, 64, 64, 128, 2048
_PTR = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32",
        torch.float8_e4m3fn: "*fp8e4nv", torch.uint8: "*u8", torch.int32: "*i32",
        torch.int64: "*i64"}  # fmt: skip


@dataclass
class Launch:
    kernel: object
    grid: tuple
    args: tuple
    kwargs: dict


@contextlib.contextmanager
def recorded() -> Iterator[list[Launch]]:
    """The DSA module's launches recorded, not run, while active."""
    from mla_backend.ops.triton import dsa

    launches: list[Launch] = []

    def wrap(kernel: object) -> object:
        class _Grid:
            def __getitem__(self, grid: tuple) -> object:
                return lambda *a, **kw: launches.append(Launch(kernel, grid, a, kw))

        return _Grid()

    saved = dsa.wrap_triton, dsa._check_runnable
    dsa.wrap_triton, dsa._check_runnable = wrap, lambda device, kernel: None
    try:
        yield launches
    finally:
        dsa.wrap_triton, dsa._check_runnable = saved


def record(name: str) -> list[Launch]:
    """The launches of configuration ``name`` (:data:`CONFIGS`)."""
    import mla_backend as mb
    from mla_backend.cache_layout import CacheLayout
    from mla_backend.ops.triton import Kernels

    cache, heads, q_dtype, splits = CONFIGS[name]
    B = 2
    kv = [3000, 2500]
    pages = -(-max(kv) // PAGE)
    table = torch.arange(B * pages, dtype=torch.int32).view(B, pages)
    batch = mb.MLABatch.build([L - 1 for L in kv], [1] * B, table, PAGE, mb.Phase.DECODE,
                              block_table_host=table)  # fmt: skip
    dims = mb.MLADims(heads, R, 128, ROPE, 128)
    kern = Kernels(sparse_splits=splits)
    plan = mb.plan(batch, dims, mb.Policy("absorb"), device="cpu", impl=kern,
                   indexer=mb.IndexerDims(HI, DI, TOPK))  # fmt: skip
    n = B * pages
    lay = mb.IndexCacheLayout.named("fp8", DI)
    index_cache = torch.zeros(n, PAGE, lay.width, dtype=torch.uint8)
    kv_scale = None
    if cache == "fp8_ds_mla":
        kv_cache = torch.zeros(n, PAGE, CacheLayout.ds_mla(R, ROPE, torch.bfloat16).width,
                               dtype=torch.uint8)  # fmt: skip
    elif cache == "fp8":
        kv_cache, kv_scale = torch.zeros(n, PAGE, R + ROPE, dtype=mb.FP8_DTYPE), torch.tensor(1.0)
    else:
        kv_cache = torch.zeros(n, PAGE, R + ROPE, dtype=torch.bfloat16)
    q_I = torch.zeros(B, HI, DI, dtype=q_dtype)
    w = torch.zeros(B, HI)
    q_lat, q_pe = torch.zeros(B, heads, R).bfloat16(), torch.zeros(B, heads, ROPE).bfloat16()
    idx = torch.zeros(B, TOPK, dtype=torch.int32)
    with recorded() as launches:
        mb.write_index_keys(index_cache, torch.zeros(B, DI).bfloat16(), torch.arange(B), lay,
                            impl=plan.impl)  # fmt: skip
        mb.indexer_topk(q_I, w, index_cache, plan, TOPK)
        mb.sparse_absorbed_attention(q_lat, q_pe, kv_cache, plan, idx, 0.1, kv_scale)
    return launches


#: name -> (latent cache, heads, q_I dtype, forced sparse splits)
CONFIGS = {
    f"{cache} h{h}{' split' if split > 1 else ''}": (cache, h, torch.float8_e4m3fn, split)
    for cache in ("bf16", "fp8", "fp8_ds_mla")
    for h in (128, 64, 32, 16)
    for split in (1, 4)
    if split == 1 or (cache, h) == ("bf16", 128)
}
CONFIGS["fp8_ds_mla h16 (bf16 q_I)"] = ("fp8_ds_mla", 16, torch.bfloat16, 1)


def source(launch: Launch) -> tuple[object, dict]:
    """(``triton.compiler.ASTSource``, options) of a recorded launch, specialized as Triton's
    launcher specializes (device pointers 16-aligned; ints: 1 a constant, 16-divisible marked)."""
    import triton

    fn = launch.kernel
    options = {k: v for k, v in launch.kwargs.items() if k in ("num_warps", "num_stages")}
    consts = {k: v for k, v in launch.kwargs.items() if k not in options}
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts or i >= len(launch.args):
            sig[name] = "constexpr"
            consts.setdefault(name, fn.params[i].default)
            continue
        v = launch.args[i]
        if isinstance(v, torch.Tensor):
            sig[name] = _PTR[v.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, bool):
            sig[name] = "i1"
        elif isinstance(v, int):
            if v == 1:
                sig[name], consts[name] = "constexpr", 1
                continue
            sig[name] = "i32" if -(2**31) <= v < 2**31 else "i64"
            if v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}.{name}: cannot specialize {type(v).__name__}")
    return triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs), options


def compile_launch(launch: Launch, arch: int = 90) -> dict[str, object]:
    """Compile one launch for ``sm_{arch}a``: its resources (``error`` on a failed compile)."""
    import triton
    from triton.backends.compiler import GPUTarget

    name = launch.kernel.__name__
    out: dict[str, object] = {"kernel": name, "warps": launch.kwargs.get("num_warps", 4)}
    try:
        src, options = source(launch)
        cc = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    except Exception as exc:  # report, keep going
        out["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:160]}"
        return out
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(ptx, "w") as f:
            f.write(cc.asm["ptx"])
        with open(cubin, "wb") as f:
            f.write(cc.asm["cubin"])
        log = subprocess.run([os.path.join(tools, "ptxas"), f"-arch=sm_{arch}a", "-v", ptx,
                              "-o", os.path.join(tmp, "v.cubin")], capture_output=True,
                             text=True, check=True).stderr  # fmt: skip
        sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", cubin],
                              capture_output=True, text=True, check=True).stdout  # fmt: skip
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    ttgir = cc.asm["ttgir"]
    mma = "wgmma" if "warp_group_dot" in ttgir else "mma.sync" if "tt.dot" in ttgir else "none"
    out.update(regs=int(regs.group(1)) if regs else -1,
               spill=f"{spill.group(1)}/{spill.group(2)}" if spill else "?",
               smem_kb=round(cc.metadata.shared / 1024, 1), mma=mma,
               ldl_stl=len(re.findall(r"\b(?:LDL|STL)\b", sass)))  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks dsa-resources", description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)  # fmt: skip
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--out", default=None,
                   help="directory for dsa_resources-latest.md (default benchmarks/results)")
    a = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("benchmarks dsa-resources: unset TRITON_INTERPRET (it compiles for a GPU)")
        return 2
    try:
        import triton
    except ImportError:
        print("benchmarks dsa-resources: needs triton (pip install triton==3.6.0)")
        return 0
    header = ("config", "kernel", "warps", "MMA", "regs", "spill st/ld B", "LDL+STL", "smem KB")
    rows = []
    seen: set[tuple] = set()
    for name in a.configs.split(","):
        for launch in record(name):
            dtypes = tuple(str(x.dtype) for x in launch.args if isinstance(x, torch.Tensor))
            key = (launch.kernel.__name__, dtypes, tuple(sorted(launch.kwargs.items(), key=str)))
            if key in seen:  # the same kernel, pointer types and constexprs: the same binary
                continue
            seen.add(key)
            r = compile_launch(launch, a.arch)
            if "error" in r:
                rows.append([name, str(r["kernel"]), str(r["warps"]), f"failed: {r['error']}",
                             "", "", "", ""])  # fmt: skip
            else:
                rows.append([name, str(r["kernel"]), str(r["warps"]), str(r["mma"]),
                             str(r["regs"]), str(r["spill"]), str(r["ldl_stl"]),
                             str(r["smem_kb"])])  # fmt: skip
            print(" | ".join(rows[-1]), flush=True)
    notes = [
        f"Triton {triton.__version__} compiled for sm_{a.arch}a on this CPU (no GPU); ptxas -v "
        "(bundled) for registers / spills, cuobjdump -sass for LDL / STL",
        f"shapes: r {R} + rope {ROPE}, page {PAGE}, indexer {HI} x {DI} (e4m3 q_I unless "
        f"named), topk {TOPK}, decode; launches recorded from the public DSA calls (the same "
        "constexprs, warps and stages a call launches); a binary shared by several configs is "
        "listed once (64 and 128 heads: one 64-head block)",
    ]
    harness.write_result("dsa_resources", "DSA Triton kernels compiled for Hopper", notes,
                         harness.table(header, rows), Path(a.out) if a.out else None)  # fmt: skip
    return 0
