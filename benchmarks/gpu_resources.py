"""``python -m benchmarks gpu-resources``: the Triton absorbed-attention kernel (and DSA's sparse
attention and indexer, ``--ops``) compiled ahead of time for Hopper (``sm_90a``) and Blackwell
(``sm_100a``) on a machine without a GPU, per launch configuration the seam can pick: registers,
spill bytes, spills inside the kv loop, shared memory, MMA kind, kv-tile buffers, CTAs per SM.

A configuration is (heads, new tokens per request, cache layout, ``Kernels`` knobs, op). Each is
planned on CPU tensors of the real widths (r 512, rope 64, page 64) and called through
:func:`mla_backend.ops.triton.ops.absorbed_attention` under
:func:`~mla_backend.ops.triton.ops.record_launches`, so what is compiled is exactly what the call
launches (its constexprs, ``num_warps``, ``num_stages``, and the argument specialization
Triton's launcher derives: pointer dtypes, ints equal to 1 or divisible by 16). The launch is
compiled with ``triton.compile`` for a ``GPUTarget``; ``ptxas -v`` (bundled with Triton) gives
registers and spill bytes, ``cuobjdump -sass`` the kv loop: the innermost loop that holds an
MMA, where a local-memory load or store (``LDL`` / ``STL``) is a spill on the hot path.

    python -m benchmarks gpu-resources [--arch 90,100] [--heads 16,32,64,128] [--quick]
        [--ops absorbed,sparse,indexer] [--out benchmarks/results/gpu_resources-latest.md]

DSA ops (decode, topk 2048): ``sparse`` records ``mb.sparse_absorbed_attention`` over the
``cache`` latent layout (the loop over index blocks is its kv loop); ``indexer`` records the
logits kernel of ``mb.indexer_topk`` (64 index heads x 128): cache ``fp8`` is vLLM's fp8 index
cache with e4m3 queries, ``bf16`` a bf16 index cache with bf16 queries. ``keyset`` records
``mb.keyset_attention`` in DeepSeek-V4's shape: value = key over the 512-wide row (448 + rope
64), a window of 128 rows, 512 entries of a second cache, a sink (cache ``bf16`` or ``fp8``).

Each arch's configs compile in a child process (one for all of them, a fresh one after a
crash): a compile that aborts the process (an LLVM error) is reported as that config's row and
the run goes on. Launches are recorded for the arch they compile for, so a config names what
that GPU runs: the Gluon kernel serves sm_90a only (its ``gluon=True`` rows on other archs say
so, skipped), the Triton kernel serves the rest.

Needs ``triton`` (3.6.0 is the GPU machine's version) and nothing else; every compile takes
0.5-4 s on one CPU core.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

R, ROPE, PAGE = 512, 64, 64
CACHES = ("bf16", "fp16", "fp8", "fp8_ds_mla")
#: DSA's ops with an MMA loop (``Config.op``) -> the kernel whose launch is compiled
DSA_KERNELS = {"sparse": "sparse_attn_kernel", "indexer": "indexer_logits_kernel",
               "keyset": "keyset_attn_kernel"}
#: the key-set attention's V4 shape: window, compressed entries attended per token
V4_WINDOW, V4_ENTRIES = 128, 512
INDEX_HEADS, INDEX_DIM, TOPK = 64, 128, 2048
#: Hopper's and Blackwell's shared memory per SM available to CTAs (bytes; 227 KB per CTA)
SMEM_PER_SM = {90: 228 * 1024, 100: 228 * 1024}
SMEM_PER_CTA = {90: 227 * 1024, 100: 227 * 1024}
REGS_PER_SM = 65536
#: the queries' dtypes a :class:`Config` names
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MAX_CTAS_PER_SM = 32


@dataclass(frozen=True)
class Config:
    """One launch configuration: heads, new tokens per request, cache layout, ``Kernels``
    knobs (as keyword arguments of :class:`mla_backend.ops.triton.Kernels`), and the op
    (``absorbed``, or one of :data:`DSA_KERNELS`)."""

    heads: int
    q_len: int
    cache: str
    knobs: tuple[tuple[str, object], ...] = ()
    op: str = "absorbed"
    #: the queries' (compute) dtype: bf16 (the models'), fp16 or fp32
    dtype: str = "bf16"

    @property
    def name(self) -> str:
        knobs = "".join(f" {k}={v}" for k, v in self.knobs)
        if self.dtype != "bf16":
            knobs = f" q={self.dtype}" + knobs
        if self.op == "indexer":
            return f"indexer {self.cache}{knobs}"
        op = "" if self.op == "absorbed" else f"{self.op} "
        return f"{op}{self.cache} h{self.heads} q{self.q_len}{knobs}"


@dataclass
class Result:
    """What the compile of one configuration showed (``error`` set when it failed)."""

    config: Config
    arch: int
    rows: int = 0
    block_n: int = 0
    num_warps: int = 0
    num_stages: int = 0
    regs: int = 0
    spill_bytes: int = 0
    spill_in_loop: int = 0
    shared: int = 0
    mma: str = ""
    kv_buffers: int = 0
    loop_instrs: int = 0
    cvt_in_loop: int = 0
    cp_async: int = 0
    ctas_per_sm: int = 0
    secs: float = 0.0
    error: str = ""
    #: why the config was not compiled for this arch (no kernel of it serves there)
    skipped: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def fits_shared(self) -> bool:
        return not self.error and self.shared <= SMEM_PER_CTA[self.arch]


def _tools() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def record(config: Config, arch: int | None = None) -> tuple[object, object]:
    """(attention launch, plan) of ``config``: planned and called on small CPU tensors of the
    real widths, the launch recorded (not run) for compute capability ``arch`` (None: any)."""
    import mla_backend as mb
    from mla_backend.cache_layout import CacheLayout
    from mla_backend.ops.triton import Kernels
    from mla_backend.ops.triton import ops as tops

    if config.op != "absorbed":
        return _record_dsa(config, arch), None
    H, q_len = config.heads, config.q_len
    kv_lens = [200, 130]  # 4 and 3 pages
    table = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 0]], dtype=torch.int32)
    phase = mb.Phase.DECODE if q_len == 1 else mb.Phase.TARGET_VERIFY
    batch = mb.MLABatch.build([L - q_len for L in kv_lens], [q_len] * 2, table, PAGE, phase,
                              block_table_host=table)
    dims = mb.MLADims(H, R, 128, ROPE, R)
    cd = torch.float16 if config.cache == "fp16" else DTYPES[config.dtype]
    n_pages = 7
    kv_scale = None
    if config.cache == "fp8_ds_mla":
        cache = torch.zeros(n_pages, PAGE, CacheLayout.ds_mla(R, ROPE, cd).width,
                            dtype=torch.uint8)
    elif config.cache == "fp8":
        cache = torch.zeros(n_pages, PAGE, R + ROPE, dtype=mb.FP8_DTYPE)
        kv_scale = torch.tensor(0.5)
    else:
        cache = torch.zeros(n_pages, PAGE, R + ROPE, dtype=cd)
    plan = mb.plan(batch, dims, mb.Policy("absorb"), device=torch.device("cpu"),
                   impl=Kernels(**dict(config.knobs)))
    T = 2 * q_len
    q_lat, q_pe = torch.zeros(T, H, R, dtype=cd), torch.zeros(T, H, ROPE, dtype=cd)
    with tops.record_launches(arch) as launches:
        mb.absorbed_attention(q_lat, q_pe, cache, plan, 0.1, kv_scale)
    attn = [x for x in launches if _fn(x.kernel).__name__.startswith("absorbed_attn")]
    if len(attn) != 1:
        raise RuntimeError(f"expected one absorbed attention launch, recorded {launches}")
    return attn[0], plan


def _record_dsa(config: Config, arch: int | None = None) -> object:
    """The launch of DSA op ``config.op``'s kernel (:data:`DSA_KERNELS`) at decode: two
    requests of 3000 / 2500 tokens, topk 2048, recorded (not run) on CPU tensors."""
    import mla_backend as mb
    from mla_backend.cache_layout import CacheLayout
    from mla_backend.ops.triton import Kernels
    from mla_backend.ops.triton import ops as tops

    if config.op not in DSA_KERNELS:
        raise ValueError(f"op {config.op!r} is not supported; use absorbed or {list(DSA_KERNELS)}")
    H, kv = config.heads, [3000, 2500]
    pages = -(-max(kv) // PAGE)
    table = torch.arange(2 * pages, dtype=torch.int32).view(2, pages)
    batch = mb.MLABatch.build([L - 1 for L in kv], [1, 1], table, PAGE, mb.Phase.DECODE,
                              block_table_host=table)
    plan = mb.plan(batch, mb.MLADims(H, R, 128, ROPE, R), mb.Policy("absorb"),
                   device=torch.device("cpu"), impl=Kernels(**dict(config.knobs)),
                   indexer=mb.IndexerDims(INDEX_HEADS, INDEX_DIM, TOPK))
    n = 2 * pages
    with tops.record_launches(arch) as launches:
        if config.op == "indexer":
            fp8 = config.cache == "fp8"
            index_cache = torch.zeros(n, PAGE, INDEX_DIM + 4 * fp8,
                                      dtype=torch.uint8 if fp8 else torch.bfloat16)
            q_dt = mb.FP8_DTYPE if fp8 else torch.bfloat16
            mb.indexer_topk(torch.zeros(2, INDEX_HEADS, INDEX_DIM).to(q_dt),
                            torch.zeros(2, INDEX_HEADS), index_cache, plan, TOPK)
        elif config.op == "keyset":
            _launch_keyset(H, n, config.cache, batch, Kernels(**dict(config.knobs)))
        else:
            kv_scale = None
            if config.cache == "fp8_ds_mla":
                width = CacheLayout.ds_mla(R, ROPE, torch.bfloat16).width
                cache = torch.zeros(n, PAGE, width, dtype=torch.uint8)
            elif config.cache == "fp8":
                cache, kv_scale = torch.zeros(n, PAGE, R + ROPE, dtype=mb.FP8_DTYPE), \
                    torch.tensor(0.5)
            else:
                cd = torch.float16 if config.cache == "fp16" else torch.bfloat16
                cache = torch.zeros(n, PAGE, R + ROPE, dtype=cd)
            cd = torch.float16 if config.cache == "fp16" else torch.bfloat16
            mb.sparse_absorbed_attention(torch.zeros(2, H, R, dtype=cd),
                                         torch.zeros(2, H, ROPE, dtype=cd), cache, plan,
                                         torch.zeros(2, TOPK, dtype=torch.int32), 0.1, kv_scale)
    found = [x for x in launches if _fn(x.kernel).__name__ == DSA_KERNELS[config.op]]
    if len(found) != 1:
        raise RuntimeError(f"expected one {DSA_KERNELS[config.op]} launch, recorded {launches}")
    return found[0]


def _launch_keyset(H: int, n: int, cache: str, batch: object, kernels: object) -> None:
    """DeepSeek-V4's key-set call (:data:`V4_WINDOW`, :data:`V4_ENTRIES`) on ``n`` pages of
    each cache, under the caller's launch recording."""
    import mla_backend as mb

    r = R - 64  # V4: 448 + rope 64 = the 512-wide row, value = key
    plan = mb.plan(batch, mb.MLADims(H, r, 128, 64, R), mb.Policy("absorb"),
                   device=torch.device("cpu"), impl=kernels, window=V4_WINDOW)
    dt = mb.FP8_DTYPE if cache == "fp8" else torch.bfloat16
    kv_scale = torch.tensor(0.5) if cache == "fp8" else None
    rows = torch.zeros(n, PAGE, r + 64, dtype=dt)
    extra = mb.KeyCache(torch.zeros(n, PAGE, r + 64, dtype=dt), batch.block_table,
                        torch.full((2,), V4_ENTRIES, dtype=torch.int32))
    mb.keyset_attention(torch.zeros(2, H, r, dtype=torch.bfloat16),
                        torch.zeros(2, H, 64, dtype=torch.bfloat16), rows, plan, 0.1, kv_scale,
                        extra=extra, extra_indices=torch.zeros(2, V4_ENTRIES, dtype=torch.int32),
                        sink=torch.zeros(H), value_is_key=True)


def _fn(kernel: object) -> object:
    return getattr(kernel, "fn", kernel)


@functools.lru_cache(maxsize=8)
def _compiled_module(path: str) -> object:
    """The kernels' module at ``path`` loaded afresh with the interpreter off, so every
    ``@triton.jit`` function in it (the helpers a kernel calls too) compiles."""
    with _no_interpreter():
        spec = importlib.util.spec_from_file_location(f"_aot_{abs(hash(path))}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def _no_interpreter() -> Iterator[None]:
    """``TRITON_INTERPRET`` off (Triton reads it when decorating and when compiling)."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old


def compiled(kernel: object) -> object:
    """``kernel`` as a compilable ``JITFunction`` (under ``TRITON_INTERPRET=1`` the package's
    kernels are the interpreter's wrappers)."""
    import triton

    if isinstance(kernel, triton.runtime.jit.JITFunction):
        return kernel
    fn = _fn(kernel)
    path = sys.modules[fn.__module__].__file__
    return getattr(_compiled_module(path), fn.__name__)


def source(launch: object) -> tuple[object, dict[str, int]]:
    """(``triton.compiler.ASTSource``, launch options) of a recorded launch, specialized as
    Triton's launcher specializes its arguments."""
    import triton
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    fn = compiled(launch.kernel)
    options = {k: v for k, v in launch.kwargs.items() if k in ("num_warps", "num_stages")}
    constexprs = {k: v for k, v in launch.kwargs.items() if k not in options}
    sig, consts, attrs = {}, {}, {}
    positional = dict(zip(fn.arg_names, launch.args))
    for i, name in enumerate(fn.arg_names):
        if name in constexprs or name not in positional:
            value = constexprs.get(name, fn.params[i].default)
            sig[name], consts[name] = "constexpr", value
            continue
        value = positional[name]
        if hasattr(value, "block_shape"):  # a TMA descriptor
            ty, spec = native_specialize_impl(BaseBackend, value, False, True, True)
        elif isinstance(value, torch.Tensor):
            ty, spec = native_specialize_impl(BaseBackend, value, False, True, True)
            spec = "D"  # device allocations are 16-byte aligned (CPU ones need not be)
        elif isinstance(value, float):
            ty, spec = "fp32", ""
        else:
            ty, spec = native_specialize_impl(BaseBackend, value, False, True, True)
        if ty == "constexpr":
            consts[name] = value
        if spec == "D":
            attrs[(i,)] = [["tt.divisibility", 16]]
        sig[name] = ty
    make = triton.compiler.ASTSource
    if _is_gluon(fn):
        from triton.experimental.gluon._runtime import GluonASTSource as make
    return make(fn=fn, signature=sig, constexprs=consts, attrs=attrs), options


def _is_gluon(fn: object) -> bool:
    return type(fn).__name__.startswith("Gluon")


@contextlib.contextmanager
def _ptxas_log() -> Iterator[io.StringIO]:
    """Triton compiles (never reads its cache) and prints ``ptxas -v`` to stdout while this is
    active."""
    from triton import knobs

    buf = io.StringIO()
    old = knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile
    knobs.nvidia.dump_ptxas_log = knobs.compilation.always_compile = True
    try:
        with contextlib.redirect_stdout(buf):
            yield buf
    finally:
        knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile = old


def kv_loop(sass: str) -> list[str]:
    """The instructions of the innermost loop of ``sass`` (``cuobjdump -sass`` text) that holds
    an MMA (``HMMA`` / ``HGMMA`` / ``UTCHMMA``...): the kv loop of an attention kernel."""
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2)))
    loops = []
    for addr, text in ins:
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            loops.append((int(m.group(1), 16), addr))
    with_mma = [
        (a, b) for a, b in loops if any(a <= x <= b and "MMA" in t for x, t in ins)
    ]
    if not with_mma:
        return []
    a, b = min(with_mma, key=lambda ab: ab[1] - ab[0])
    return [t for x, t in ins if a <= x <= b]


def _mma_kind(ttgir: str) -> str:
    if "tc_gen5_mma" in ttgir or "tcgen05" in ttgir:
        return "tcgen05"
    if "ttng.warp_group_dot" in ttgir:
        return "wgmma"
    if "tt.dot" in ttgir:
        return "mma.sync"
    return "none"


def _kv_buffers(ttgir: str, block_n: int) -> int:
    """Buffers of the kv tile in shared memory: the leading dim of a 3-D ``local_alloc`` whose
    tile has ``block_n`` rows (a pipelined load), else 1 if a 2-D one exists, else 0."""
    best = 0
    alloc = r"ttg\.local_alloc[^\n]*?->\s*!ttg\.memdesc<([0-9x]+)x(?:f|bf|i|u)"
    for m in re.finditer(alloc, ttgir):
        dims = [int(x) for x in m.group(1).split("x")]
        if len(dims) == 3 and block_n in dims[1:]:
            best = max(best, dims[0])
        elif len(dims) == 2 and block_n in dims:
            best = max(best, 1)
    return best


def residency(regs: int, threads: int, shared: int, arch: int) -> int:
    """CTAs of one kernel resident per SM: limited by registers (allocated per warp in units
    of 256), shared memory (+1 KB reserved per CTA) and the 32-CTA cap."""
    per_warp = -(-max(regs, 1) * 32 // 256) * 256
    by_regs = REGS_PER_SM // (per_warp * (threads // 32))
    by_smem = SMEM_PER_SM[arch] // (shared + 1024) if shared else MAX_CTAS_PER_SM
    return max(0, min(by_regs, by_smem, MAX_CTAS_PER_SM))


def compile_config(config: Config, arch: int = 90) -> Result:
    """Compile ``config`` for ``sm_{arch}a`` and read its resources (never raises: a failed
    compile, e.g. shared memory over the limit, is the result's ``error``)."""
    import triton
    from triton.backends.compiler import GPUTarget

    res = Result(config, arch)
    t0 = time.time()
    try:
        launch, _ = record(config, arch)
        if dict(config.knobs).get("gluon") and not _is_gluon(launch.kernel):
            res.skipped = f"the Gluon kernel serves sm_90a only, not sm_{arch}a (Triton runs)"
            res.secs = time.time() - t0
            return res
        kw = launch.kwargs
        res.rows = kw.get("BLOCK_Q", 1) * kw["BLOCK_H"]
        res.block_n = kw.get("BLOCK_N", 64)  # the Gluon kernel: one 64-row page per tile
        src, options = source(launch)
        res.num_warps = options.get("num_warps", 4)
        res.num_stages = options.get("num_stages", 3)
        with _no_interpreter(), _ptxas_log() as log:
            cc = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    except Exception as exc:  # report, keep going
        res.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:160]}"
        res.notes.append(str(exc))
        res.secs = time.time() - t0
        return res
    text = log.getvalue()
    m = re.search(r"Used (\d+) registers", text)
    m2 = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if not m or not m2:
        raise RuntimeError(f"no ptxas -v report in the compile's output: {text[-300:]!r}")
    res.regs, res.spill_bytes = int(m.group(1)), int(m2.group(1))
    res.shared = int(cc.metadata.shared)
    ttgir = cc.asm["ttgir"]
    res.mma = _mma_kind(ttgir)
    res.kv_buffers = _kv_buffers(ttgir, res.block_n)
    res.cp_async = len(re.findall(r"cp\.async\.(?:ca|cg)|cp\.async\.bulk", cc.asm["ptx"]))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cc.asm["cubin"])
        sass = subprocess.run([os.path.join(_tools(), "cuobjdump"), "-sass", path],
                              capture_output=True, text=True, check=True).stdout
    body = kv_loop(sass)
    res.loop_instrs = len(body)
    res.spill_in_loop = sum(1 for t in body if re.search(r"\b(LDL|STL)\b", t))
    res.cvt_in_loop = sum(1 for t in body if re.search(r"\b(F2F|F2FP|I2F|F2I|HADD2\.F32)\b", t))
    res.ctas_per_sm = residency(res.regs, 32 * res.num_warps, res.shared, arch)
    res.secs = time.time() - t0
    return res


def default_configs(heads: list[int], q_lens: list[int], caches: list[str]) -> list[Config]:
    """Every (heads, q_len, cache) with the default knobs: what the seam launches."""
    return [Config(h, q, c) for c in caches for h in heads for q in q_lens]


def dsa_configs(heads: list[int], caches: list[str]) -> list[Config]:
    """DSA's kernels at decode: the sparse attention per heads and latent cache (and split
    lists at the largest head count), the indexer over both index caches."""
    out = [Config(h, 1, c, op="sparse") for c in caches for h in heads]
    out.append(Config(max(heads), 1, "bf16", (("sparse_splits", 4),), op="sparse"))
    return out + [Config(INDEX_HEADS, 1, c, op="indexer") for c in ("fp8", "bf16")]


def knob_configs(heads: list[int]) -> list[Config]:
    """The tile knobs' other values at decode: kv tile, rows per program, padded rows,
    ``num_stages``, ``num_warps``, chunk width (bf16), the e4m3 caches' fp16 dots, and the
    Gluon kernel (decode and 2-token verify)."""
    out = []
    for h in heads:
        for bn in (16, 32, 64):
            out.append(Config(h, 1, "bf16", (("block_n", bn),)))
        for rows in (16, 32):
            if rows < h:
                out.append(Config(h, 1, "bf16", (("rows_per_program", rows),)))
        if h < 64:
            out.append(Config(h, 1, "bf16", (("pad_rows", True),)))
        for st in (1, 2, 4):
            out.append(Config(h, 1, "bf16", (("num_stages", st),)))
        out.append(Config(h, 1, "bf16", (("num_warps", 4 if h >= 64 else 8),)))
        for chunk in (64, 256, 512):
            out.append(Config(h, 1, "bf16", (("chunk", chunk),)))
        for cache in ("fp8", "fp8_ds_mla"):
            out.append(Config(h, 1, cache, (("fp8_f16", True),)))
        for q in (1, 2):
            out.append(Config(h, q, "bf16", (("gluon", True),)))
    return out


HEADER = ("| config | arch | rows | BLOCK_N | warps | stages | MMA | regs | spill B | spill in kv "
          "loop | smem KB | kv buffers | CTAs/SM | kv-loop instrs | cvt in loop | cp.async |")


def row(r: Result) -> str:
    if r.skipped:
        return f"| {r.config.name} | sm_{r.arch}a | skipped: {r.skipped} |" + " |" * 13
    if r.error:
        return f"| {r.config.name} | sm_{r.arch}a | {r.rows} | {r.block_n} | {r.num_warps} | " \
               f"{r.num_stages} | failed: {r.error} |" + " |" * 10
    return (
        f"| {r.config.name} | sm_{r.arch}a | {r.rows} | {r.block_n} | {r.num_warps} | "
        f"{r.num_stages} | {r.mma} | {r.regs} | {r.spill_bytes} | "
        f"{'**yes** (' + str(r.spill_in_loop) + ')' if r.spill_in_loop else 'no'} | "
        f"{r.shared / 1024:.0f} | {r.kv_buffers} | {r.ctas_per_sm} | {r.loop_instrs} | "
        f"{r.cvt_in_loop} | {r.cp_async} |"
    )


def _rows(text: str) -> dict[tuple[str, str], list[str]]:
    """A table printed by this command, by (config, arch): its cells."""
    out = {}
    for line in text.splitlines():
        cells = [x.strip() for x in line.split("|")[1:-1]]
        if len(cells) >= 16 and cells[1].startswith("sm_"):
            out[(cells[0], cells[1])] = cells
    return out


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def compile_isolated(
    configs: list[Config],
    arch: int = 90,
    on_result: Callable[[Result], None] | None = None,
    child: list[str] | None = None,
) -> list[Result]:
    """:func:`compile_config` of each config for ``sm_{arch}a``, in a child Python process
    without ``TRITON_INTERPRET`` (a process that imported Triton with the interpreter on cannot
    compile: Triton's own ``@jit`` library functions, ``tl.zeros`` ..., are then interpreted
    ones). A compile that kills the child (an LLVM abort: a signal, or exit 134) is that
    config's result, ``error`` set, and a fresh child goes on with the rest; any other failure
    of the child raises. ``on_result``: called with each result as it arrives; ``child``: the
    child's command before ``--arch``/``--json`` (default: this command)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = child or [sys.executable, "-m", "benchmarks", "gpu-resources"]
    out: list[Result] = []
    while len(out) < len(configs):
        todo = configs[len(out):]
        payload = json.dumps([[c.heads, c.q_len, c.cache, [list(k) for k in c.knobs], c.op,
                               c.dtype] for c in todo])
        with tempfile.TemporaryFile("w+") as err:
            proc = subprocess.Popen([*cmd, "--arch", str(arch), "--json", payload], cwd=root,
                                    env=env, stdout=subprocess.PIPE, stderr=err, text=True)
            started = len(out)
            for line in proc.stdout:
                if not line.startswith("{") or len(out) == len(configs):
                    continue
                d = json.loads(line)
                d.pop("config")
                out.append(Result(configs[len(out)], **d))
                if on_result:
                    on_result(out[-1])
            rc = proc.wait()
            err.seek(0)
            stderr = err.read()
        if len(out) == len(configs):
            break
        if rc >= 0 and rc != 134:  # not an abort: the child itself is broken
            raise RuntimeError(f"gpu-resources child failed (exit {rc}) after "
                               f"{len(out) - started} of {len(todo)} configs: {stderr[-2000:]}")
        tail = [x.strip() for x in stderr.splitlines() if x.strip()]
        why = tail[-1][:200] if tail else "no message"
        how = f"signal {-rc}" if rc < 0 else f"exit {rc}"
        out.append(Result(configs[len(out)], arch, error=f"compile aborted the process "
                                                          f"({how}): {why}"))
        if on_result:
            on_result(out[-1])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks gpu-resources", description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--arch", default="90,100", help="compute capabilities (90: sm_90a, 100)")
    p.add_argument("--heads", default="16,32,64,128")
    p.add_argument("--q-lens", default="1,2")
    p.add_argument("--caches", default=",".join(CACHES))
    p.add_argument("--quick", action="store_true", help="defaults only, no knob grid")
    p.add_argument("--out", default=None, help="also write the table to this markdown file")
    p.add_argument("--before", default=None,
                   help="a previous run's table (this command's stdout): a 'before' column")
    p.add_argument("--ops", default="absorbed",
                   help="kernels: absorbed and / or DSA's sparse, indexer (comma separated)")
    p.add_argument("--json", default=None, help="JSON list of [heads, q_len, cache, knobs, op, "
                   "dtype]: "
                   "compile these for the first --arch and print one JSON result per line")
    a = p.parse_args(argv)
    try:
        import triton
    except ImportError:
        print("benchmarks gpu-resources: needs triton (pip install triton==3.6.0)")
        return 0
    heads = [int(x) for x in a.heads.split(",")]
    archs = [int(x) for x in a.arch.split(",")]
    if a.json:
        for h, q, cache, knobs, *op in json.loads(a.json):
            c = Config(h, q, cache, tuple(tuple(k) for k in knobs), *op)
            r = compile_config(c, archs[0])
            print(json.dumps(dataclasses.asdict(r)), flush=True)
        return 0
    ops = a.ops.split(",")
    configs = []
    if "absorbed" in ops:
        configs = default_configs(heads, [int(x) for x in a.q_lens.split(",")],
                                  a.caches.split(","))
        if not a.quick:
            configs += knob_configs(heads)
    dsa = [c for c in dsa_configs(heads, a.caches.split(",")) if c.op in ops]
    configs += dsa
    before = _rows(open(a.before).read()) if a.before else {}
    header = HEADER + (" before: regs / spill B / spill in loop / smem KB / kv-loop instrs |"
                       if before else "")
    lines = [header, "|" + "---|" * (16 + bool(before))]
    print(f"triton {triton.__version__}; r {R}, rope {ROPE}, page {PAGE}; {len(configs)} "
          f"configs x archs {archs}", flush=True)
    print(header, flush=True)
    def report(r: Result) -> None:
        line = row(r)
        if before:
            old = before.get(tuple(x.strip() for x in line.split("|")[1:3]))
            line += (f" {old[7]} / {old[8]} / {old[9]} / {old[10]} / {old[13]} |" if old
                     else " - |")
        lines.append(line)
        print(line, flush=True)

    for arch in archs:
        compile_isolated(configs, arch, on_result=report)
    if a.out:
        cpu = _cpu_name()
        with open(a.out, "w") as f:
            f.write(f"# The Triton kernels ({', '.join(ops)}) compiled for "
                    f"{', '.join(f'sm_{x}a' for x in archs)}"
                    f" on the CPU (python -m benchmarks gpu-resources)\n\n"
                    f"{time.strftime('%Y-%m-%d %H:%MZ', time.gmtime())}; compiled on {cpu}; "
                    f"triton {triton.__version__} (the GPU machine's); r {R}, rope {ROPE}, "
                    f"page {PAGE}. No GPU ran: registers and spills from ptxas -v, the kv loop "
                    f"from cuobjdump -sass, CTAs/SM from registers and shared memory.\n\n")
            f.write("\n".join(lines) + "\n")
    return 0
