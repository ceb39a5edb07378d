"""The native kernels' ISA levels (mla_backend.ops.native.isa, .build): each level's flags and
macros (x86-64 and aarch64, from any host), CPU feature detection (x86 cpuinfo flags; aarch64 hwcaps
with fabricated AT_HWCAP / AT_HWCAP2 values of real CPUs, and the SVE vector length) and
selection (``MLA_BACKEND_NATIVE_ISA``), a level the CPU lacks never built or loaded (with the
detected features monkeypatched), other architectures without levels, several levels side by
side in one process under their own op namespaces, and the loader's failure path."""

from __future__ import annotations

import warnings

import pytest
import torch

from mla_backend.ops import native
from mla_backend.ops.native import build, engine, isa

AVX2_ONLY = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"})
ALL_FLAGS = frozenset(
    AVX2_ONLY
    | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni"}
    | {"amx_tile", "amx_bf16", "amx_os"}
)


def test_level_flags_are_explicit_and_cumulative():
    flags = {lvl: isa.level_flags(lvl) for lvl in isa.X86_LEVELS}
    assert isa.X86_LEVELS == ("scalar", "avx2", "avx512", "avx512_bf16", "amx")
    assert native.ISA_LEVELS == isa.arch_levels(isa._arch())
    for lvl, f in flags.items():
        assert not any(x.startswith(("-march", "-mtune", "-mcpu")) for x in f), (lvl, f)
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
        isa.level_flags("sse9")


def test_aarch64_level_flags_from_any_host():
    """One explicit -march per aarch64 level (never native), cumulative MLA_HAS_* macros of the
    aarch64 chain only, and the SVE vector length as the 'sve' level's build parameter."""
    assert isa.AARCH64_LEVELS == ("scalar", "neon", "neon_bf16", "sve")
    neon, nbf = isa.level_flags("neon"), isa.level_flags("neon_bf16")
    sve = isa.level_flags("sve", vector_bits=256)
    march = {
        k: [x for x in f if x.startswith("-m")]
        for k, f in (("neon", neon), ("neon_bf16", nbf), ("sve", sve))
    }
    assert march == {
        "neon": ["-march=armv8.2-a+fp16"],
        "neon_bf16": ["-march=armv8.2-a+fp16+bf16"],
        "sve": ["-march=armv8.2-a+fp16+bf16+sve", "-msve-vector-bits=256"],
    }
    assert {x for x in sve if x.startswith("-DMLA_HAS_")} == {
        "-DMLA_HAS_NEON",
        "-DMLA_HAS_NEON_BF16",
        "-DMLA_HAS_SVE",
    }
    assert "-DMLA_HAS_NEON_BF16" not in neon and "-DMLA_HAS_AVX2" not in sve
    for lvl, f in (("neon", neon), ("neon_bf16", nbf), ("sve", sve)):
        assert f"-DMLA_OPS_NS=mla_backend_{lvl}" in f and f"-Dmla_native=mla_native_{lvl}" in f
        assert sum(x.startswith("-DMLA_ISA_") for x in f) == 1
    for bits in isa.SVE_VECTOR_BITS:
        assert f"-msve-vector-bits={bits}" in isa.level_flags("sve", vector_bits=bits)
    with pytest.raises(ValueError, match="vector_bits=384 is not supported"):
        isa.level_flags("sve", vector_bits=384)
    with pytest.raises(ValueError, match="applies to the 'sve' level only"):
        isa.level_flags("neon", vector_bits=128)
    if isa.sve_vector_bits() is None:  # no SVE here: the length must be named
        with pytest.raises(ValueError, match="needs vector_bits"):
            isa.level_flags("sve")


def _bits(*positions: int) -> int:
    return sum(1 << b for b in positions)


# fabricated getauxval values: the bits of the uapi header each CPU sets (plus unrelated ones:
# FP 0, AES 3, PMULL 4, SHA1/2 5/6, CRC32 7, ATOMICS 8, CPUID 11, ASIMDRDM 12, LRCPC 15, ...)
_COMMON = (0, 3, 4, 5, 6, 7, 8, 11, 12, 13, 14, 15, 16)
_N1 = _bits(*_COMMON, 1, 9, 10, 20)  # Neoverse N1: asimd, fphp, asimdhp, asimddp
ARM_CPUS = {
    # name: (AT_HWCAP, AT_HWCAP2, SVE vector length, expected levels)
    "graviton2": (_N1, 0, None, ("scalar", "neon")),
    "ampere_altra": (_N1, 0, None, ("scalar", "neon")),
    "cortex_a72": (_bits(0, 1, 3, 4, 5, 6, 7), 0, None, ("scalar",)),  # Armv8.0: no fp16
    "graviton3": (
        _bits(*_COMMON, 1, 9, 10, 20, 22),
        _bits(0, 9, 12, 13, 14),
        256,
        isa.AARCH64_LEVELS,
    ),
    "graviton4": (
        _bits(*_COMMON, 1, 9, 10, 20, 22),
        _bits(0, 1, 9, 12, 13, 14),
        128,
        isa.AARCH64_LEVELS,
    ),
    "grace": (
        _bits(*_COMMON, 1, 9, 10, 20, 22),
        _bits(0, 1, 9, 12, 13, 14),
        128,
        isa.AARCH64_LEVELS,
    ),
    "a64fx_like": (_bits(*_COMMON, 1, 9, 10, 22), 0, 512, ("scalar", "neon")),  # SVE, no BF16
    "sve_bf16_vl384": (
        _bits(*_COMMON, 1, 9, 10, 22),
        _bits(12, 14),
        384,
        ("scalar", "neon", "neon_bf16"),
    ),  # no build for that length
}


def _fake_arm(monkeypatch, hwcap: int, hwcap2: int, vl: int | None) -> None:
    monkeypatch.setattr(isa, "_arch", lambda: "aarch64")
    monkeypatch.setattr(isa, "_hwcaps", lambda: (hwcap, hwcap2))
    monkeypatch.setattr(isa, "sve_vector_bits", lambda: vl)
    monkeypatch.delenv(isa.ENV_ISA, raising=False)


def test_arm_features_are_the_uapi_hwcap_bits():
    assert isa.arm_features(0, 0) == frozenset()
    assert isa.arm_features(1 << 1, 0) == {"asimd"}
    assert isa.arm_features(1 << 9 | 1 << 10, 0) == {"fphp", "asimdhp"}
    assert isa.arm_features(1 << 22, 0) == {"sve"}
    assert isa.arm_features(0, 1 << 1) == {"sve2"}
    assert isa.arm_features(0, 1 << 12) == {"svebf16"}
    assert isa.arm_features(0, 1 << 14) == {"bf16"}
    assert isa.arm_features(1 << 14, 1 << 22) == frozenset()  # other bits of the words
    assert isa.arm_features((1 << 64) - 1, (1 << 64) - 1) == set(isa._HWCAP_BITS)


@pytest.mark.parametrize("cpu", sorted(ARM_CPUS))
def test_aarch64_levels_from_hwcaps(monkeypatch, cpu):
    hwcap, hwcap2, vl, expect = ARM_CPUS[cpu]
    _fake_arm(monkeypatch, hwcap, hwcap2, vl)
    assert native.host_isas() == expect
    assert native.selected_isa() == expect[-1]
    for lvl in isa.AARCH64_LEVELS:  # forcing any level: accepted iff the CPU runs it
        monkeypatch.setenv(isa.ENV_ISA, lvl)
        if lvl in expect:
            assert native.selected_isa() == lvl
        else:
            with pytest.raises(ValueError, match="this CPU lacks"):
                native.selected_isa()
    monkeypatch.setenv(isa.ENV_ISA, "avx2")
    with pytest.raises(ValueError, match="not supported on aarch64"):
        native.selected_isa()


def test_sve_at_an_unbuilt_vector_length_says_why(monkeypatch):
    hwcap, hwcap2, _, _ = ARM_CPUS["sve_bf16_vl384"]
    _fake_arm(monkeypatch, hwcap, hwcap2, 384)
    monkeypatch.setenv(isa.ENV_ISA, "sve")
    with pytest.raises(ValueError, match="vector length is 384 bits"):
        native.selected_isa()


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
    monkeypatch.setattr(isa, "cpu_features", lambda: feats)
    monkeypatch.setattr(isa, "_arch", lambda: "x86_64")
    monkeypatch.delenv(isa.ENV_ISA, raising=False)
    assert native.host_isas() == expect
    assert native.selected_isa() == expect[-1]


@pytest.mark.parametrize("machine", ["ppc64le", "riscv64", "s390x"])
def test_other_architectures_have_no_levels(monkeypatch, machine):
    monkeypatch.setattr(isa, "_arch", lambda: machine)
    monkeypatch.delenv(isa.ENV_ISA, raising=False)
    assert native.host_isas() == ()
    assert native.selected_isa() == "scalar"  # whose build then says why not
    with pytest.raises(
        RuntimeError, match=f"target x86-64 and aarch64; this machine is '{machine}'"
    ):
        build._build("scalar")
    monkeypatch.setenv(isa.ENV_ISA, "scalar")
    with pytest.raises(ValueError, match=f"this machine is '{machine}'"):
        native.selected_isa()


def test_a_level_of_the_other_architecture_is_never_built(monkeypatch):
    arch = isa._arch()
    other = {"x86_64": "neon", "aarch64": "avx2"}.get(arch)
    if other is None:
        pytest.skip(f"no levels on {arch}")
    with pytest.raises(RuntimeError, match=f"not a level of this machine \\({arch}\\)"):
        build._build(other)


def test_env_forces_a_lower_level_and_names_what_the_cpu_lacks(monkeypatch):
    monkeypatch.setattr(isa, "cpu_features", lambda: AVX2_ONLY)
    monkeypatch.setattr(isa, "_arch", lambda: "x86_64")
    monkeypatch.setenv(isa.ENV_ISA, "scalar")
    assert native.selected_isa() == "scalar"
    monkeypatch.setenv(isa.ENV_ISA, "avx512")
    with pytest.raises(ValueError, match="lacks avx512f, avx512bw, avx512vl, avx512dq"):
        native.selected_isa()
    monkeypatch.setenv(isa.ENV_ISA, "avx9000")
    with pytest.raises(ValueError, match="'avx9000' is not supported"):
        native.selected_isa()


def test_a_level_the_cpu_lacks_is_never_built_or_loaded(monkeypatch):
    """With an AVX2-only CPU detected, asking for AVX-512 fails before any compile / load."""
    from torch.utils import cpp_extension

    loads = []

    def no_load(*a, **k):
        loads.append(k.get("name"))
        raise AssertionError("cpp_extension.load called for a level the CPU lacks")

    monkeypatch.setattr(isa, "cpu_features", lambda: AVX2_ONLY)
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
    monkeypatch.setenv(isa.ENV_ISA, "avx9000")
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert native.available() is False
    assert "avx9000" in native.unavailable_reason()
    with pytest.raises(ValueError, match="avx9000"):
        native.Kernels("avx9000")


@pytest.mark.slow  # builds every level this CPU runs, one after another: minutes (CI's time)
@pytest.mark.skipif(not native.host_isas(), reason="no native ISA level on this machine")
def test_levels_load_side_by_side():
    """Every host level loads into this process under its own op namespace; the bf16 engine
    is compiled into the levels with AVX512-BF16 only."""
    for lvl in native.host_isas():
        assert native.available(lvl), native.unavailable_reason(lvl)
        ns = native.op_namespace(lvl)
        assert ns is getattr(torch.ops, f"mla_backend_{lvl}")
        bf16 = lvl in ("avx512_bf16", "amx")
        assert native.simd_level(lvl) == ("avx512_bf16" if bf16 else "fp32")
        assert native.Kernels(lvl).isa == lvl


@pytest.mark.skipif(not native.host_isas(), reason="no native ISA level on this machine")
def test_simulated_build_failure_warns_once(monkeypatch):
    def boom(isa):
        raise OSError("no C++ compiler found (simulated)")

    monkeypatch.setattr(build, "_build", boom)
    monkeypatch.setattr(build, "_states", {})
    monkeypatch.setenv(isa.ENV_ISA, "scalar")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert native.available() is False
        assert native.available() is False
    assert "simulated" in native.unavailable_reason()
    msgs = [x for x in w if "native CPU kernels" in str(x.message)]
    assert len(msgs) == 1, [str(x.message) for x in w]
    with pytest.raises(RuntimeError, match="simulated"):
        native.absorbed_attention(None)  # the record is read after the build


def test_aarch64_level_the_cpu_lacks_is_never_built(monkeypatch):
    """An A64FX-like CPU (SVE, no BF16): asking for neon_bf16 / sve fails before any compile."""
    from torch.utils import cpp_extension

    def no_load(*a, **k):
        raise AssertionError("cpp_extension.load called for a level the CPU lacks")

    hwcap, hwcap2, vl, _ = ARM_CPUS["a64fx_like"]
    _fake_arm(monkeypatch, hwcap, hwcap2, vl)
    monkeypatch.setattr(cpp_extension, "load", no_load)
    monkeypatch.setattr(build, "_states", {})
    for lvl, lacks in (("neon_bf16", "bf16"), ("sve", "svebf16")):
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            assert native.available(lvl) is False
        reason = native.unavailable_reason(lvl)
        assert "this CPU lacks" in reason and lacks in reason, reason


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
