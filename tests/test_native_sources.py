"""Every file of the native kernels' ``csrc/`` is an input of their build: compiled
(``build._SOURCES``) or hashed into the extension's name (``build._HEADERS``), so a change to any
header rebuilds the kernels instead of loading a stale build; and every header compiles on its
own (it includes what it uses) at this host's best x86-64 level."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from mla_backend.ops.native import build, isa


def test_every_csrc_file_is_a_build_input() -> None:
    files = {p.name for p in build._CSRC.iterdir() if p.suffix in (".h", ".cpp")}
    inputs = set(build._SOURCES) | set(build._HEADERS)
    assert files == inputs, (
        f"not build inputs: {sorted(files - inputs)}; listed but missing: {sorted(inputs - files)}"
    )


@pytest.mark.parametrize("header", sorted(build._HEADERS))
def test_each_header_compiles_alone(header: str) -> None:
    cxx = shutil.which("c++") or shutil.which("g++")
    levels = list(isa.host_isas())
    if cxx is None or not levels:
        pytest.skip("no C++ compiler or no native level on this machine")
    flags = isa.level_flags(levels[-1])
    if header == "ops.h":  # the torch layer's header (the others are torch-free)
        from torch.utils import cpp_extension

        flags += [f"-I{p}" for p in cpp_extension.include_paths()]
    out = subprocess.run(
        [cxx, "-x", "c++", *flags, f"-I{build._CSRC}", "-fsyntax-only", "-"],
        input=f'#include "{header}"\n', capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
