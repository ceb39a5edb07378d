"""The native kernels' ISA levels (mla_backend.ops.native.build): each level's flags and macros,
CPU feature detection and selection (``MLA_BACKEND_NATIVE_ISA``), a level the CPU lacks never
built or loaded (with the detected features monkeypatched), several levels side by side in one
process under their own op namespaces, and the loader's failure path."""

from __future__ import annotations

import warnings

import pytest
import torch

from mla_backend.ops import native
from mla_backend.ops.native import build, engine

AVX2_ONLY = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"})
ALL_FLAGS = frozenset(
    AVX2_ONLY
    | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni"}
    | {"amx_tile", "amx_bf16", "amx_os"}
)


def test_level_flags_are_explicit_and_cumulative():
    flags = {lvl: build.level_flags(lvl) for lvl in native.ISA_LEVELS}
    assert native.ISA_LEVELS == ("scalar", "avx2", "avx512", "avx512_bf16", "amx")
    for lvl, f in flags.items():
        assert not any(x.startswith("-march") for x in f), (lvl, f)
        assert f"-DMLA_OPS_NS=mla_backend_{lvl}" in f
        assert sum(x.startswith("-DMLA_ISA_") for x in f) == 1
    assert not any(x.startswith("-m") for x in flags["scalar"])
    m = {lvl: {x for x in f if x.startswith("-m")} for lvl, f in flags.items()}
    assert m["avx2"] == {"-mavx2", "-mfma", "-mf16c", "-mbmi2"}
    assert m["avx512"] - m["avx2"] == {"-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"}
    assert m["avx512_bf16"] - m["avx512"] == {"-mavx512bf16", "-mavx512vnni"}
    assert m["amx"] - m["avx512_bf16"] == {"-mamx-tile", "-mamx-bf16"}
    assert "-DMLA_HAS_AVX512BF16" in flags["amx"] and "-DMLA_HAS_AVX512" not in flags["avx2"]
    with pytest.raises(ValueError, match="'sse9' is not supported"):
        build.level_flags("sse9")


@pytest.mark.parametrize(
    "feats,expect",
    [
        (frozenset(), ("scalar",)),
        (AVX2_ONLY, ("scalar", "avx2")),
        (AVX2_ONLY | {"avx512f", "avx512bw", "avx512vl"}, ("scalar", "avx2")),  # no DQ
        (ALL_FLAGS - {"amx_os"}, ("scalar", "avx2", "avx512", "avx512_bf16")),  # no OS permission
        (ALL_FLAGS, native.ISA_LEVELS),
    ],
)
def test_host_isas_follow_the_cpu_features(monkeypatch, feats, expect):
    monkeypatch.setattr(build, "cpu_features", lambda: feats)
    monkeypatch.setattr(build, "_is_x86_64", lambda: True)
    monkeypatch.delenv(build.ENV_ISA, raising=False)
    assert native.host_isas() == expect
    assert native.selected_isa() == expect[-1]


def test_off_x86_no_levels(monkeypatch):
    monkeypatch.setattr(build, "_is_x86_64", lambda: False)
    monkeypatch.delenv(build.ENV_ISA, raising=False)
    assert native.host_isas() == ()
    with pytest.raises(RuntimeError, match="target x86-64"):
        build._build("scalar")


def test_env_forces_a_lower_level_and_names_what_the_cpu_lacks(monkeypatch):
    monkeypatch.setattr(build, "cpu_features", lambda: AVX2_ONLY)
    monkeypatch.setattr(build, "_is_x86_64", lambda: True)
    monkeypatch.setenv(build.ENV_ISA, "scalar")
    assert native.selected_isa() == "scalar"
    monkeypatch.setenv(build.ENV_ISA, "avx512")
    with pytest.raises(ValueError, match="lacks avx512f, avx512bw, avx512vl, avx512dq"):
        native.selected_isa()
    monkeypatch.setenv(build.ENV_ISA, "avx9000")
    with pytest.raises(ValueError, match="'avx9000' is not supported"):
        native.selected_isa()


def test_a_level_the_cpu_lacks_is_never_built_or_loaded(monkeypatch):
    """With an AVX2-only CPU detected, asking for AVX-512 fails before any compile / load."""
    from torch.utils import cpp_extension

    loads = []

    def no_load(*a, **k):
        loads.append(k.get("name"))
        raise AssertionError("cpp_extension.load called for a level the CPU lacks")

    monkeypatch.setattr(build, "cpu_features", lambda: AVX2_ONLY)
    monkeypatch.setattr(cpp_extension, "load", no_load)
    monkeypatch.setattr(build, "_states", {})
    for lvl in ("avx512", "avx512_bf16", "amx"):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            assert native.available(lvl) is False
        assert "this CPU lacks" in native.unavailable_reason(lvl)
        assert len(w) == 1 and lvl in str(w[0].message)
    assert loads == []


def test_bad_env_level_makes_the_kernels_unavailable_saying_why(monkeypatch):
    monkeypatch.setattr(build, "_states", {})
    monkeypatch.setenv(build.ENV_ISA, "avx9000")
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert native.available() is False
    assert "avx9000" in native.unavailable_reason()
    with pytest.raises(ValueError, match="avx9000"):
        native.Kernels("avx9000")


@pytest.mark.skipif(not native.host_isas(), reason="no native ISA level on this machine")
def test_levels_load_side_by_side():
    """Every host level loads into this process under its own op namespace; the bf16 engine
    is compiled into the levels with AVX512-BF16 only."""
    for lvl in native.host_isas():
        assert native.available(lvl), native.unavailable_reason(lvl)
        ns = native.op_namespace(lvl)
        assert ns is getattr(torch.ops, f"mla_backend_{lvl}")
        bf16 = native.ISA_LEVELS.index(lvl) >= native.ISA_LEVELS.index("avx512_bf16")
        assert native.simd_level(lvl) == ("avx512_bf16" if bf16 else "fp32")
        assert native.Kernels(lvl).isa == lvl


@pytest.mark.skipif(not native.host_isas(), reason="no native ISA level on this machine")
def test_simulated_build_failure_warns_once(monkeypatch):
    def boom(isa):
        raise OSError("no C++ compiler found (simulated)")

    monkeypatch.setattr(build, "_build", boom)
    monkeypatch.setattr(build, "_states", {})
    monkeypatch.setenv(build.ENV_ISA, "scalar")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert native.available() is False
        assert native.available() is False
    assert "simulated" in native.unavailable_reason()
    msgs = [x for x in w if "native CPU kernels" in str(x.message)]
    assert len(msgs) == 1, [str(x.message) for x in w]
    with pytest.raises(RuntimeError, match="simulated"):
        native.absorbed_attention(*([None] * 6), 1.0)


# ---- the engine rule (mla_backend.ops.native.engine) ----------------------------------------
@pytest.mark.parametrize(
    "vendor,want",
    [
        ("GenuineIntel", {"avx512_bf16": "fp32", "amx": "amx+fp32"}),
        ("AuthenticAMD", {"avx512_bf16": "bf16", "amx": "amx+bf16"}),
        ("", {"avx512_bf16": "fp32", "amx": "amx+fp32"}),
    ],
)
def test_engine_rule_per_level_and_vendor(monkeypatch, vendor, want):
    """bf16 dot products only where they outrun fp32 FMA (AMD); AMX tiles at level amx; the
    fp32 engine below avx512_bf16 whatever the vendor."""
    monkeypatch.delenv(engine.ENV_ENGINE, raising=False)
    for lvl in native.ISA_LEVELS:
        got = engine.attention_engine(lvl, vendor=vendor)
        assert got == want.get(lvl, "fp32"), (lvl, got)
        assert got in engine.level_engines(lvl)


def test_engine_env_override_is_validated(monkeypatch):
    monkeypatch.setenv(engine.ENV_ENGINE, "bf16")
    assert engine.attention_engine("avx512_bf16", vendor="GenuineIntel") == "bf16"
    with pytest.raises(ValueError, match="bf16.*avx512"):
        engine.attention_engine("avx512")
    monkeypatch.setenv(engine.ENV_ENGINE, "tiles")
    with pytest.raises(ValueError, match="tiles"):
        engine.attention_engine("amx")
    with pytest.raises(ValueError, match="warp"):
        engine.engine_code("warp")
    assert [engine.engine_code(e) for e in engine.ENGINES] == [0, 1, 2, 3]
