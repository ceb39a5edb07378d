"""vLLM's own DeepSeek-V4 cache writer and reader, run by Triton's interpreter: the oracle of
``tests/test_v4_cache.py``, in a process of its own.

Run as ``python v4_vllm_oracle.py CASES OUT``: reads the cases (``torch.save``d list of dicts,
see :func:`run_case`), writes the results (``{"results": [...]}``, or ``{"skip": reason}`` when
there is no oracle here). Its own process because Triton decides interpreter or compiler when a
``@triton.jit`` function is decorated, ``triton.language``'s own (``tl.max``, ...) included, at
its import: ``TRITON_INTERPRET=1`` has to be set before Triton is imported, and must not leak
into the test session (other tests import Triton compiled, on a GPU machine).

What runs: vLLM's ``quantize_and_insert_k_cache`` (its launcher and
``quantize_and_insert_k_kernel``) and ``dequantize_and_gather_k_cache`` (its launcher,
``DequantizeAndGatherKCacheKernel``'s launch spec and kernel). vLLM's CPU build turns its Triton
off (``vllm.triton_utils`` finds no CPU backend and hands out placeholders, so ``cache_utils``'s
kernels cannot be launched as imported; importing it also takes ~15 s here): those functions are
compiled from vLLM's installed source file (found without importing vllm), decorators dropped,
into a namespace holding the real ``triton`` / ``triton.language`` and stubs for what the CPU
path never reaches (``has_cutedsl`` False, the FNUZ platform query); the kernels are wrapped with
``triton.jit`` (so interpreted). The reader's kernel-launcher class becomes a small launcher that
runs vLLM's own launch spec (its ``__call__``) and binds inputs as vLLM's launcher does (``name``
-> ``name_ptr``).

Conversions that Triton 3.9's interpreter gets wrong where a GPU does not:

- float32 -> e4m3: the interpreter rounds on the first dropped bit and drops the carry of a
  mantissa that rounds up to 8/8 (31.74 becomes 16). The GPU's conversion (``cvt.rn.satfinite``)
  rounds to nearest even and saturates: the oracle uses :func:`e4m3_rne` for that one conversion
  (numpy, nearest even over the table of e4m3 values; not torch's cast).
- e4m3 -> float: the interpreter decodes e4m3fn's NaN codes (0x7F, 0xFF) as +-480: readers are
  compared on caches without them (the writer never stores them: it saturates).
- float32 -> bf16 of a subnormal (4.4e-39 becomes 5.9e-39): readers are compared on scale bytes
  >= 10, where no value read is a subnormal (the writer stores exponent bytes >= 105).
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import inspect
import os
import sys
from pathlib import Path

import numpy as np

CACHE_UTILS = "models/deepseek_v4/common/ops/cache_utils.py"

_CODES = np.arange(127)  # 0x00 .. 0x7E: the finite non-negative e4m3fn codes, ascending values
_E, _M = _CODES >> 3, _CODES & 7
#: the value of each finite non-negative e4m3fn code 0x00 .. 0x7E
E4M3_VALUES = np.where(_E == 0, _M / 8 * 2.0**-6, (1 + _M / 8) * 2.0 ** (_E - 7))


def e4m3_rne(x: np.ndarray) -> np.ndarray:
    """float values -> e4m3fn bytes: nearest of the table's values, ties to the even code,
    saturated to +-448, sign kept (-0.0 -> 0x80)."""
    x = np.asarray(x, dtype=np.float32)
    sign = np.signbit(x).astype(np.uint8) << 7
    a = np.minimum(np.abs(x).astype(np.float64), 448.0)
    i = np.searchsorted(E4M3_VALUES, a)
    hi, lo = np.minimum(i, 126), np.maximum(i - 1, 0)
    d_lo, d_hi = a - E4M3_VALUES[lo], E4M3_VALUES[hi] - a
    pick = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))
    return pick.astype(np.uint8) | sign


class Skip(Exception):
    """No oracle in this environment (the reason)."""


class VllmKernels:
    """vLLM's writer and reader functions, compiled from its source, kernels interpreted."""

    def __init__(self) -> None:
        try:
            import torch
            import triton
            import triton.language as tl
            import triton.runtime.interpreter as interpreter
        except ImportError as e:
            raise Skip(f"triton's interpreter is not importable: {e}") from None
        spec = importlib.util.find_spec("vllm")
        if spec is None or not spec.submodule_search_locations:
            raise Skip("vllm is not installed")
        path = Path(list(spec.submodule_search_locations)[0]) / CACHE_UTILS
        if not path.is_file():
            raise Skip(f"this vllm has no {CACHE_UTILS}")
        tree = ast.parse(path.read_text(), filename=str(path))
        want = {
            "quantize_and_insert_k_kernel",
            "quantize_and_insert_k_cache",
            "dequantize_and_gather_k_cache",
        }
        body: list[ast.stmt] = []
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name in want:
                body.append(node)
            elif isinstance(node, ast.ClassDef) and node.name == "DequantizeAndGatherKCacheKernel":
                for sub in node.body:
                    if isinstance(sub, ast.FunctionDef) and sub.name in ("kernel", "__call__"):
                        body.append(sub)
                    elif (
                        isinstance(sub, ast.Assign) and ast.unparse(sub.targets[0]) == "NUM_WORKERS"
                    ):
                        body.append(sub)
        names = {getattr(n, "name", "NUM_WORKERS") for n in body}
        missing = (want | {"kernel", "__call__", "NUM_WORKERS"}) - names
        if missing:
            raise Skip(f"vLLM's {path} lacks {sorted(missing)}: not the layout this oracle knows")
        for n in body:
            if isinstance(n, ast.FunctionDef):
                n.decorator_list = []  # line numbers kept: the interpreter reads the source back

        def no_fnuz(*args, **kwargs):
            raise AssertionError("the FNUZ path is not under test")

        ns: dict = {
            "torch": torch,
            "triton": triton,
            "tl": tl,
            "Any": object,
            "LaunchSpec": object,
            "has_cutedsl": lambda: False,
            "current_platform": None,
            "get_fp8_min_max": no_fnuz,
        }
        exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), ns)
        ns["quantize_and_insert_k_kernel"] = triton.jit(ns["quantize_and_insert_k_kernel"])
        gather_kernel = triton.jit(ns["kernel"])
        if type(gather_kernel).__name__ != "InterpretedFunction":
            raise AssertionError("TRITON_INTERPRET=1 was not in effect when triton was imported")
        params = list(inspect.signature(ns["kernel"]).parameters)
        launch_spec = ns["__call__"]

        class Self:
            NUM_WORKERS = ns["NUM_WORKERS"]

        def launch(*args, **kwargs):
            """vLLM's launcher: the launch spec's grid and constants, inputs bound by name."""
            bound = inspect.signature(launch_spec).bind(Self(), *args, **kwargs)
            bound.apply_defaults()
            grid, consts = launch_spec(Self(), *args, **kwargs)
            inputs = {}
            for name, value in bound.arguments.items():
                if name + "_ptr" in params:
                    inputs[name + "_ptr"] = value
                elif name in params:
                    inputs[name] = value
            gather_kernel[grid](**inputs, **consts)

        ns["_DEQUANTIZE_AND_GATHER_K_CACHE_KERNEL"] = launch
        self.ns, self.tl, self.interpreter = ns, tl, interpreter

    @contextlib.contextmanager
    def _gpu_e4m3_rounding(self):
        builder = self.interpreter.InterpreterBuilder
        orig = builder.create_fp_to_fp
        tl, handle = self.tl, self.interpreter.TensorHandle

        def fp_to_fp(b, src, dst_type, rounding_mode):
            if dst_type.scalar == tl.float8e4nv and src.dtype == tl.float32:
                return handle(e4m3_rne(src.data), tl.float8e4nv)
            return orig(b, src, dst_type, rounding_mode)

        builder.create_fp_to_fp = fp_to_fp
        try:
            yield
        finally:
            builder.create_fp_to_fp = orig

    def run_case(self, case: dict):
        """``write``: vLLM's writer of ``k`` (bf16) at ``slots`` into ``cache[:, :page_bytes]``
        (pages ``cache.stride(0)`` apart); returns the whole cache tensor. ``gather``: vLLM's
        reader into a zeroed bf16 ``out`` of ``out_shape``; returns it."""
        import torch

        ns = self.ns
        if case["kind"] == "write":
            cache = case["cache"].clone()
            with self._gpu_e4m3_rounding():
                ns["quantize_and_insert_k_cache"](
                    case["k"],
                    cache[:, : case["page_bytes"]],
                    case["slots"],
                    block_size=case["page_size"],
                )
            return cache
        out = torch.zeros(case["out_shape"], dtype=torch.bfloat16)
        ns["dequantize_and_gather_k_cache"](
            out,
            case["cache"],
            case["seq_lens"],
            case["gather_lens"],
            case["block_table"],
            case["page_size"],
            case["offset"],
        )
        return out


def main(cases_path: str, out_path: str) -> None:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (in VllmKernels)
    import torch

    try:
        kernels = VllmKernels()
    except Skip as e:
        torch.save({"skip": str(e)}, out_path)
        return
    cases = torch.load(cases_path)
    torch.save({"results": [kernels.run_case(c) for c in cases]}, out_path)


if __name__ == "__main__":
    main(*sys.argv[1:3])
