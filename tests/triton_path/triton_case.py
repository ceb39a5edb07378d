"""Shared support of the Triton tests: the device they run on, the Triton module, a case
(the shared :func:`mla_backend.testing.cases.make_case` builder plus an absorbed query, on the
test device) and the independent float64 absorbed reference (o_lat and LSE, which the shared
oracle, a decompressed attention returning [T, H, v], does not give).

Device: CPU tensors under ``TRITON_INTERPRET=1`` (default), or ``MLA_TEST_DEVICE=cuda`` for the
compiled kernels on a GPU. References and the torch-path cross-check always run on CPU.
"""

from __future__ import annotations

import importlib
import math
import os
import sys

import torch

DEVICE = torch.device(os.environ.get("MLA_TEST_DEVICE", "cpu"))
ON_GPU = DEVICE.type == "cuda"
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the kernels' @triton.jit decoration

import mla_backend as mb  # noqa: E402
from mla_backend.testing.cases import make_case  # noqa: E402


def load_triton_ops():
    """Import the Triton path; under the interpreter, re-decorate its kernels if they were
    imported before the interpreter was switched on (another test module may have imported
    them). The custom ops stay registered once; they read the kernels from the module."""
    from mla_backend.ops.triton import dsa
    from mla_backend.ops.triton import ops as triton_ops
    from mla_backend.ops.triton.jit import attention, cache_write, indexer, sparse_attention

    if ON_GPU:
        return triton_ops
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(attention.absorbed_attn_kernel, InterpretedFunction):
        for module in (attention, cache_write, indexer, sparse_attention):
            importlib.reload(module)  # the kernels' users after the helpers they import
        for name in ("write", "absorbed"):  # the op modules that hold the kernels
            importlib.reload(sys.modules[f"mla_backend.ops.triton.ops.{name}"])
        triton_ops = importlib.reload(sys.modules["mla_backend.ops.triton.ops"])
        importlib.reload(dsa)
    return triton_ops


def load_benchmark(name: str = "gpu"):
    """``benchmarks/<name>.py`` (default ``python -m benchmarks gpu``) as a module."""
    import importlib
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    if root not in sys.path:
        sys.path.insert(0, root)
    return importlib.import_module(f"benchmarks.{name}")


tops = load_triton_ops()
from mla_backend.ops.triton import Kernels as TritonKernels  # noqa: E402


class TCase:
    """A filled, NaN-poisoned paged cache, a batch and absorbed queries on the test device.

    Built with the shared :func:`make_case` (shuffled pages, page 0 and every unwritten row
    NaN, padding slots in the writes); requests with no tokens at all get an all-zero
    block-table row (page 0: NaN). Attributes: ``base`` (the shared case), ``dims``,
    ``kv_cache``, ``kv_scale``, ``batch``, ``q_lat`` [T, H, r], ``q_pe`` [T, H, rope] (on
    DEVICE), ``seqs``: per request float64 [L_i, r + rope], the values the cache holds
    (dequantized), ``scale``.
    """

    def __init__(
        self,
        prefix: list[int],
        new: list[int],
        H: int,
        r: int,
        rope: int,
        page_size: int,
        cache_dtype: torch.dtype = torch.float32,
        q_dtype: torch.dtype = torch.float32,
        seed: int = 0,
        phase: mb.Phase = mb.Phase.MIXED,
        device: torch.device = DEVICE,
        nope: int = 8,
        v: int = 8,
    ) -> None:
        self.dims = mb.MLADims(H, r, nope, rope, v)
        self.device = device
        lens = [p + n for p, n in zip(prefix, new, strict=True)]
        used = [i for i, L in enumerate(lens) if L > 0]
        base = make_case(
            self.dims,
            [prefix[i] for i in used],
            [new[i] for i in used],
            page_size,
            dtype=q_dtype,
            cache_dtype=cache_dtype,
            seed=seed,
            phase=phase,
            impl="torch",  # the case's cache written on the host whatever MLA_BACKEND_IMPL says
        )
        self.base = base
        table = torch.zeros(len(prefix), base.batch.block_table.shape[1], dtype=torch.int32)
        table[used] = base.batch.block_table
        D = r + rope
        self.seqs = [torch.zeros(0, D, dtype=torch.float64) for _ in prefix]
        for k, i in enumerate(used):
            self.seqs[i] = torch.cat([base.c_kv[k], base.k_pe[k]], -1).double()
        self.prefix, self.new = list(prefix), list(new)
        self.page_size, self.phase = page_size, phase
        self.kv_cache = base.kv_cache.to(device)
        self.kv_scale = None if base.kv_scale is None else base.kv_scale.to(device)
        self.set_block_table(table)
        g = torch.Generator().manual_seed(seed + 1)
        T = sum(new)
        self.q_lat = torch.randn(T, H, r, generator=g).to(q_dtype).to(device)
        self.q_pe = base.q_pe.to(device)
        self.scale = 1.0 / math.sqrt(r + rope + 1)

    def set_block_table(self, table: torch.Tensor) -> None:
        """Rebuild the batch around ``table`` (a host tensor; the device copy goes to DEVICE)."""
        self.batch = mb.MLABatch.build(
            self.prefix, self.new, table.to(self.device), self.page_size, self.phase,
            block_table_host=table,
        )

    def plan(self, impl: object = None, **knobs) -> mb.MLAPlan:
        """The absorbed plan for the Triton kernels with tuning ``knobs`` (or ``impl``)."""
        impl = impl if impl is not None else TritonKernels(**knobs)
        return mb.plan(self.batch, self.dims, mb.Policy("absorb"), device=self.device, impl=impl)

    def triton(self, **knobs) -> tuple[torch.Tensor, torch.Tensor]:
        """``mb.absorbed_attention`` on a Triton plan (the public entry point)."""
        return mb.absorbed_attention(
            self.q_lat, self.q_pe, self.kv_cache, self.plan(**knobs), self.scale, self.kv_scale
        )

    def finite_cache(self) -> torch.Tensor:
        """The cache (on CPU) with its NaN rows (outside every kv range) replaced by 7.0."""
        v = self.kv_cache.cpu().float()
        return torch.where(torch.isnan(v), 7.0, v).to(self.kv_cache.dtype)

    def torch_path(self, poisoned: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The core torch path on CPU copies of the same inputs."""
        table = self.batch.host_block_table()
        batch = mb.MLABatch.build(self.prefix, self.new, table, self.page_size, self.phase)
        plan = mb.plan(batch, self.dims, mb.Policy("absorb"), impl="torch")
        cache = self.kv_cache.cpu() if poisoned else self.finite_cache()
        scale = None if self.kv_scale is None else self.kv_scale.cpu()
        return mb.absorbed_attention(
            self.q_lat.cpu(), self.q_pe.cpu(), cache, plan, self.scale, scale
        )

    def reference(self) -> tuple[torch.Tensor, torch.Tensor]:
        return dense_reference(self.q_lat, self.q_pe, self.seqs, self.prefix, self.new, self.scale)


def dense_reference(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    seqs: list[torch.Tensor],
    prefix: list[int],
    new: list[int],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 absorbed attention from the formulas: o [T,H,r], lse [T,H] (on CPU)."""
    T, H, r = q_lat.shape
    q_lat, q_pe = q_lat.cpu().double(), q_pe.cpu().double()
    o = torch.zeros(T, H, r, dtype=torch.float64)
    lse = torch.zeros(T, H, dtype=torch.float64)
    row = 0
    for seq, p, n in zip(seqs, prefix, new, strict=True):
        c, kpe = seq[:, :r], seq[:, r:]
        for j in range(n):
            L = p + j + 1
            s = q_lat[row] @ c[:L].T + q_pe[row] @ kpe[:L].T  # [H, L]
            s = s * scale
            lse[row] = torch.logsumexp(s, dim=-1)
            o[row] = torch.softmax(s, dim=-1) @ c[:L]
            row += 1
    return o, lse


TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2)}


def assert_matches(case: TCase, out: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Shape, dtype, finite (no NaN row was read), close to the float64 reference and to the
    torch path on the same values."""
    o, lse = out
    T, H, r = case.q_lat.shape
    assert o.shape == (T, H, r) and o.dtype == case.q_lat.dtype
    assert o.device.type == case.device.type
    assert lse.shape == (T, H) and lse.dtype == torch.float32
    o, lse = o.cpu(), lse.cpu()
    assert torch.isfinite(o.float()).all() and torch.isfinite(lse).all()
    atol, rtol = TOL[case.q_lat.dtype]
    o_ref, lse_ref = case.reference()
    torch.testing.assert_close(o.double(), o_ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(lse.double(), lse_ref, atol=atol, rtol=rtol)
    o_t, lse_t = case.torch_path()  # cross-check on the same values, NaN rows made finite
    torch.testing.assert_close(o.float(), o_t.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(lse, lse_t, atol=atol, rtol=rtol)
