"""The native ops' one registration (``csrc/api.cpp``) and their fakes
(:data:`mla_backend.ops.native.build.FAKES`): the C++ sources register ops in ``api.cpp`` only,
each registered function declared in ``ops.h``; every op of a loaded build (per ISA level) that
takes a tensor has a fake whose parameters are the schema's arguments (names, order, defaults),
and the check names each kind of drift."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from mla_backend.ops import native
from mla_backend.ops.native import build

CSRC = Path(build.__file__).resolve().parent / "csrc"


def test_ops_are_registered_in_api_cpp_only() -> None:
    registering = sorted(
        p.name for p in CSRC.glob("*.cpp") if re.search(r"TORCH_LIBRARY\w*\s*\(", p.read_text())
    )
    assert registering == ["api.cpp"]
    api, header = (CSRC / "api.cpp").read_text(), (CSRC / "ops.h").read_text()
    impls = re.findall(r"&mla_native::(\w+)", api)
    assert len(impls) == len(set(impls)) and impls
    for fn in impls:  # each registered function is declared in the one header
        assert re.search(rf"\b{fn}\(", header), fn
    defined = set(re.findall(r'm\.def\(\s*"(native_\w+)\(', api))
    assert defined == set(build.FAKES) | {"native_simd_info"}


def test_every_op_of_a_build_has_a_fake_matching_its_schema(isa: str) -> None:
    native.op_namespace(isa)  # built and loaded
    schemas = build.registered_schemas(f"mla_backend_{isa}")
    assert set(schemas) == set(build.FAKES) | {"native_simd_info"}
    assert build.schema_mismatches(schemas) == []


def test_schema_drift_is_named() -> None:
    schemas = {
        "native_x": torch._C.parse_schema("native_x(Tensor a, int b=0, float? c=None) -> Tensor"),
        "native_y": torch._C.parse_schema("native_y(Tensor a) -> ()"),
        "native_z": torch._C.parse_schema("native_z() -> int"),  # no tensor: needs no fake
    }

    def good(a, b=0, c=None):  # noqa: ANN001, ANN202
        return a

    def renamed(a, n=0, c=None):  # noqa: ANN001, ANN202
        return a

    def no_default(a, b, c=None):  # noqa: ANN001, ANN202
        return a

    def other_default(a, b=1, c=None):  # noqa: ANN001, ANN202
        return a

    assert build.schema_mismatches(schemas, {"native_x": good, "native_y": lambda a: None}) == []
    y = {"native_y": lambda a: None}
    for fake, why in [
        (renamed, r"parameters \(a, n, c\) != the schema's \(a, b, c\)"),
        (no_default, "b: default 'none' != the schema's 0"),
        (other_default, "b: default 1 != the schema's 0"),
    ]:
        (problem,) = build.schema_mismatches(schemas, {"native_x": fake, **y})
        assert problem.startswith("native_x: its fake's ") and re.search(why, problem), problem
    missing = build.schema_mismatches(schemas, y)
    assert missing == ["native_x: no fake function (add it to build.FAKES)"]
    extra = {"native_x": good, **y, "native_w": good}
    assert build.schema_mismatches(schemas, extra) == ["native_w: a fake of no registered op"]

