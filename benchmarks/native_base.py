"""A baseline build of the native absorption GEMM from another git revision, for before/after
tables in one process (``benchmarks/gemm.py``): ``csrc/head_gemm.cpp`` of that revision and the
headers it includes, compiled with the level's flags (``build.level_flags``) under op and C++
namespaces of their own (``torch.ops.mla_gemm_base_<level>``, ``mla_native_base_<level>``), so
it loads beside the current build of the same level. A revision that registers its ops in
``csrc/api.cpp`` (not in ``head_gemm.cpp``) gets a one-op registration of ``head_gemm`` of its
own (:data:`_HEAD_GEMM_ONLY`).
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from mla_backend.ops.native.isa import level_flags

ROOT = Path(__file__).resolve().parents[1]
CSRC = "mla_backend/ops/native/csrc"
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
#: the registration of the head GEMM alone, for a revision whose head_gemm.cpp registers nothing
_HEAD_GEMM_ONLY = """#include <torch/library.h>
#include "ops.h"
TORCH_LIBRARY(MLA_OPS_NS, m) { m.def("native_head_gemm", &mla_native::head_gemm); }
"""


def _sources(ref: str) -> dict[str, str]:
    """head_gemm.cpp at ``ref`` and every header it includes (transitively), by file name."""

    def show(name: str) -> str:
        out = subprocess.run(["git", "show", f"{ref}:{CSRC}/{name}"], cwd=ROOT,
                             capture_output=True, text=True)  # fmt: skip
        if out.returncode != 0:
            raise ValueError(f"cannot read {CSRC}/{name} at git revision {ref!r}: {out.stderr}")
        return out.stdout

    texts: dict[str, str] = {}
    todo = ["head_gemm.cpp"]
    while todo:
        name = todo.pop()
        if name not in texts:
            texts[name] = show(name)
            todo += _INCLUDE.findall(texts[name])
    return texts


def load_base_head_gemm(
    ref: str, isa: str
) -> Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]:
    """``head_gemm(x, packed, n)`` of git revision ``ref`` built at level ``isa`` (same
    arguments and packed layout as ``mla_backend.ops.native.head_gemm``)."""
    from torch.utils import cpp_extension

    texts = _sources(ref)
    ns = f"mla_gemm_base_{isa}"
    flags = [f for f in level_flags(isa) if not f.startswith(("-DMLA_OPS_NS=", "-Dmla_native="))]
    flags += [f"-DMLA_OPS_NS={ns}", f"-Dmla_native=mla_native_base_{isa}", "-fopenmp"]
    h = hashlib.sha1(" ".join(flags).encode())
    for name in sorted(texts):
        h.update(name.encode() + texts[name].encode())
    src = Path(tempfile.gettempdir()) / f"mla_gemm_base_{os.getuid()}" / h.hexdigest()[:12]
    src.mkdir(parents=True, exist_ok=True)
    sources = ["head_gemm.cpp"]
    if "TORCH_LIBRARY" not in texts["head_gemm.cpp"]:
        texts["head_gemm_api.cpp"] = _HEAD_GEMM_ONLY
        sources.append("head_gemm_api.cpp")
    for name, text in texts.items():
        (src / name).write_text(text)
    cpp_extension.load(name=f"{ns}_{h.hexdigest()[:12]}", sources=[str(src / s) for s in sources],
                       extra_cflags=flags, extra_ldflags=["-fopenmp"],
                       extra_include_paths=[str(src)], is_python_module=False)  # fmt: skip
    op = getattr(torch.ops, ns).native_head_gemm
    return lambda x, packed, n: op(x, packed, int(n))
