"""The no_absorb() policy family: each rule's decisions on constructed batches."""

from __future__ import annotations

import pytest
import torch

import mla_backend as mb
from mla_backend.ops.native import Kernels as NativeKernels
from mla_backend.ops.native.profile import (
    CPU_NATIVE_PROFILE,
    ENGINE_PROFILES,
    PROFILES,
    profile_for,
)
from mla_backend.policy import CPU_PROFILE, absorbed_cost, normal_cost

DEEPSEEK = mb.MLADims(128, 512, 128, 64, 128)
LITE = mb.MLADims(16, 512, 128, 64, 128)


def batch(prefix: list[int], new: list[int], phase: mb.Phase) -> mb.MLABatch:
    pages = max(p + n for p, n in zip(prefix, new))
    return mb.MLABatch.build(
        prefix, new, torch.zeros(len(prefix), pages, dtype=torch.int32), 1, phase
    )


@pytest.mark.parametrize(
    "prefix,new,phase,normal",
    [
        ([0, 0], [100, 7], mb.Phase.EXTEND, True),  # fresh prefill
        ([0, 5], [100, 7], mb.Phase.EXTEND, False),  # extend onto a short prefix
        ([9000, 0], [100, 7], mb.Phase.EXTEND, True),  # long prefix: chunked-prefix MHA
        ([0, 0], [1, 1], mb.Phase.DECODE, False),
        ([0, 0], [4, 4], mb.Phase.TARGET_VERIFY, False),
        ([0, 0], [4, 4], mb.Phase.DRAFT_EXTEND, False),
        ([0, 0], [100, 1], mb.Phase.MIXED, False),  # not a plain extend batch
    ],
)
def test_sglang_rule(prefix: list[int], new: list[int], phase: mb.Phase, normal: bool) -> None:
    p = mb.Policy("sglang", chunked_prefix_threshold=8192)
    b = batch(prefix, new, phase)
    assert p.batch_uses_normal(b, DEEPSEEK) is normal
    assert p.choose(b, DEEPSEEK).use_absorbed == [not normal] * len(prefix)


def test_debug_modes() -> None:
    b = batch([0, 50], [300, 1], mb.Phase.MIXED)
    assert mb.Policy("absorb").choose(b, DEEPSEEK).batch_mode == "absorbed"
    assert mb.Policy("normal").choose(b, DEEPSEEK).batch_mode == "normal"


def test_cost_mode_decisions() -> None:
    p = mb.Policy("cost")
    b = batch([0, 4000, 0, 4000], [1, 1, 2048, 2048], mb.Phase.MIXED)
    assert p.choose(b, DEEPSEEK).use_absorbed == [True, True, False, False]
    spec = batch([0, 0], [2048, 2048], mb.Phase.TARGET_VERIFY)
    assert p.choose(spec, DEEPSEEK).batch_mode == "absorbed"
    assert not p.batch_uses_normal(batch([0, 0], [1, 1], mb.Phase.DECODE), DEEPSEEK)
    assert p.batch_uses_normal(batch([0, 0], [2048, 900], mb.Phase.EXTEND), DEEPSEEK)


def switch_point(dims: mb.MLADims, prefix: int, profile=CPU_PROFILE) -> int:
    """Smallest N where the normal path is estimated cheaper; asserts monotonicity."""
    wins = [
        absorbed_cost(dims, prefix, n, profile) <= normal_cost(dims, prefix, n, profile)
        for n in range(1, 4096)
    ]
    switch = wins.index(False) + 1
    assert all(wins[: switch - 1]) and not any(wins[switch - 1 :])
    return switch


@pytest.mark.parametrize("dims", [DEEPSEEK, LITE], ids=["deepseek", "lite"])
def test_cost_crossover_is_monotone_and_near_the_notes(dims: mb.MLADims) -> None:
    """Absorbed wins for few new tokens, normal for many. Onto a cached prefix the switch lies
    within a factor of 3 of the notes' FLOP-only estimate (~170 new tokens: decompressing the
    prefix costs r*(nope+v) per head and token, absorbed attention 2r+rope - (nope+rope+v)
    more per query); a fresh prefill switches earlier (nothing cached to decompress)."""
    flop_only = (
        dims.kv_lora_rank
        * (dims.qk_nope_head_dim + dims.v_head_dim)
        / (2 * dims.kv_lora_rank - dims.qk_nope_head_dim - dims.v_head_dim)
    )
    for prefix in (1024, 4096, 16384):
        assert flop_only / 3 <= switch_point(dims, prefix) <= flop_only * 3
    assert switch_point(dims, 0) < switch_point(dims, 4096)
    # a long cached prefix keeps a short extend absorbed
    assert absorbed_cost(dims, 16384, 64, CPU_PROFILE) < normal_cost(dims, 16384, 64, CPU_PROFILE)


@pytest.mark.parametrize("dims", [DEEPSEEK, LITE], ids=["deepseek", "lite"])
def test_native_profile_crossover(dims: mb.MLADims) -> None:
    """With the native kernels (bf16 MHA for the normal path): one switch per prefix length,
    fresh prefills go normal from ~100-300 new tokens (python -m benchmarks policy measured
    the crossover at 128-192 for 16 and 128 heads), decodes and short extends stay absorbed."""
    fresh = switch_point(dims, 0, CPU_NATIVE_PROFILE)
    assert 96 <= fresh <= 320, fresh
    for prefix in (1024, 4096, 16384):
        assert switch_point(dims, prefix, CPU_NATIVE_PROFILE) >= fresh
    p = mb.Policy("cost")
    b = batch([0, 4000, 0, 4000], [1, 1, 2048, 16], mb.Phase.MIXED)
    profile = NativeKernels().cost_profile(torch.device("cpu"))
    assert p.choose(b, dims, profile).use_absorbed == [True, True, False, True]


@pytest.mark.parametrize("level", sorted(k for k in PROFILES if k is not None))
@pytest.mark.parametrize("dims", [DEEPSEEK, LITE], ids=["deepseek", "lite"])
def test_every_level_profile_is_sane(level: str, dims: mb.MLADims) -> None:
    """Each ISA level's profile: decodes and 16-token extends onto a long prefix stay
    absorbed, a 2K fresh prefill goes normal (measured at avx2 under the AVX2 cap and at amx:
    benchmarks/results/policy-latest.md), one switch per prefix length."""
    profile = PROFILES[level]
    for prefix in (4000, 16384):
        for new in (1, 16):
            absorbed = absorbed_cost(dims, prefix, new, profile)
            assert absorbed < normal_cost(dims, prefix, new, profile)
    assert normal_cost(dims, 0, 2048, profile) < absorbed_cost(dims, 0, 2048, profile)
    for prefix in (0, 1024, 4096, 16384):
        switch_point(dims, prefix, profile)  # asserts a single switch


@pytest.mark.parametrize(
    "engine,fitted_on", [("fp32", "avx512_bf16"), ("bf16", None)], ids=["intel", "amd"]
)
def test_avx512_bf16_profile_follows_the_engine(
    monkeypatch: pytest.MonkeyPatch, engine: str, fitted_on: str | None
) -> None:
    """avx512_bf16's absorbed attention runs the fp32 engine on Intel and the bf16 engine on
    AMD (ops/native/engine.py); each was fitted apart (Xeon 2026-11-24 / Zen 4 2026-11-23),
    and the kernels price the paths with the one of the engine they run."""
    monkeypatch.setenv("MLA_BACKEND_NATIVE_ENGINE", engine)
    kernels = NativeKernels(isa="avx512_bf16")
    want = PROFILES[fitted_on] if fitted_on else ENGINE_PROFILES["avx512_bf16", "bf16"]
    assert kernels.cost_profile(torch.device("cpu")) == want
    assert want != PROFILES["avx512_bf16"] or engine == "fp32"
    assert profile_for("avx512", engine) == PROFILES["avx512"]  # one engine: by level only


def test_env_selects_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLA_BACKEND_POLICY", "SGLang")
    monkeypatch.setenv("MLA_BACKEND_CHUNKED_PREFIX_THRESHOLD", "100")
    p = mb.Policy.from_env()
    assert p.mode == "sglang" and p.chunked_prefix_threshold == 100
    monkeypatch.setenv("MLA_BACKEND_POLICY", "fastest")
    with pytest.raises(ValueError, match="'fastest'"):
        mb.Policy.from_env()
    monkeypatch.setenv("MLA_BACKEND_POLICY", "cost")
    monkeypatch.setenv("MLA_BACKEND_CHUNKED_PREFIX_THRESHOLD", "lots")
    with pytest.raises(ValueError, match="'lots'"):
        mb.Policy.from_env()


def test_choice_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("DEBUG", logger="mla_backend.policy"):
        mb.Policy("cost").choose(batch([0], [1], mb.Phase.DECODE), LITE)
    assert "-> absorbed" in caplog.text
