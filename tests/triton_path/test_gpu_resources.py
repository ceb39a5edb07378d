"""The absorbed kernel's default launch configurations, and DSA's sparse attention and indexer,
compiled ahead of time for Hopper (``sm_90a``) on the CPU (``benchmarks/gpu_resources.py``, no
GPU needed): each compiles, fits the 227 KB of shared memory a CTA may use, and keeps
local-memory traffic (spills) out of the kv loop (DSA's kernels: no spill at all); the 64-row
configs get Hopper's wgmma. A small set here; ``python -m benchmarks gpu-resources`` prints the
whole grid. Skipped on the GPU run (CPU work, no GPU time)."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from triton_case import ON_GPU, load_benchmark  # noqa: E402

from mla_backend.ops.triton.jit import heuristics as hx  # noqa: E402

pytestmark = pytest.mark.skipif(ON_GPU, reason="ahead-of-time compile: CPU work")

res = load_benchmark("gpu_resources")

DEFAULTS = [
    res.Config(16, 1, "bf16"),
    res.Config(128, 1, "bf16"),
    res.Config(16, 1, "fp8"),
    res.Config(16, 1, "fp8_ds_mla"),
    res.Config(128, 2, "fp8_ds_mla"),
    # the Gluon kernel (opt-in): FlashMLA's 64 rows, two warpgroups, TMA double buffer
    res.Config(16, 1, "bf16", (("gluon", True),)),
    res.Config(128, 1, "bf16", (("gluon", True),)),
    # DSA: the sparse attention (16 / 128 heads, bf16 and fp8_ds_mla latents) and the indexer
    res.Config(16, 1, "fp8_ds_mla", op="sparse"),
    res.Config(128, 1, "bf16", op="sparse"),
    res.Config(128, 1, "fp8_ds_mla", op="sparse"),
    res.Config(64, 1, "fp8", op="indexer"),
    # the key-set attention in DeepSeek-V4's shape (64 / 128 heads, bf16 and fp8 rows)
    res.Config(64, 1, "bf16", op="keyset"),
    res.Config(128, 1, "fp8", op="keyset"),
]
#: fp32 queries (tests, fp32 models) of the 512-wide latent at 64 rows: they must fit the shared
#: memory (spills are accepted there); the first two failed to launch on an H200 before kv_block
#: gave them 16-row kv tiles
FP32 = [
    res.Config(4, 16, "fp8_ds_mla", dtype="fp32"),
    res.Config(128, 1, "fp8", dtype="fp32"),
    res.Config(128, 1, "bf16", dtype="fp32"),
]


@pytest.fixture(scope="module")
def compiled() -> dict:
    """The defaults compiled once, in one process without the interpreter."""
    return {r.config: r for r in res.compile_isolated(DEFAULTS + FP32, 90)}


@pytest.mark.parametrize("config", DEFAULTS, ids=lambda c: c.name)
def test_default_config_compiles_for_sm90a_without_spills_in_the_kv_loop(
    config, compiled
) -> None:
    r = compiled[config]
    assert not r.error, r.notes
    assert r.fits_shared, f"{r.shared} B of shared memory"
    assert r.spill_in_loop == 0, f"{r.spill_in_loop} local loads/stores in the kv loop"
    assert r.loop_instrs > 0 and r.ctas_per_sm >= 1
    gluon = dict(config.knobs).get("gluon", False)
    assert r.mma == ("wgmma" if r.rows >= 64 or gluon else "mma.sync")
    if gluon:
        assert r.kv_buffers == 2 and r.num_warps == 8 and r.block_n == 64
        return
    if config.op == "keyset":  # its three key lists: a few spill bytes outside the kv loops
        assert r.spill_bytes <= 1024, f"{r.spill_bytes} spill bytes"
        return
    if config.op != "absorbed":  # DSA's kernels: no spill at all (their own tiles)
        assert r.spill_bytes == 0, f"{r.spill_bytes} spill bytes"
        return
    # the split count's residency estimate is the compiled kernel's
    assert hx.ctas_per_sm(r.rows, r.block_n, r.num_warps) == r.ctas_per_sm


@pytest.mark.parametrize("config", FP32, ids=lambda c: c.name)
def test_fp32_query_configs_fit_shared_memory(config, compiled) -> None:
    r = compiled[config]
    assert not r.error, r.notes
    assert r.fits_shared, f"{r.shared} B of shared memory"


def test_kv_loop_is_the_innermost_loop_with_an_mma() -> None:
    sass = """
        /*0000*/  MOV R1, c[0x0][0x28] ;
        /*0010*/  LDG.E R2, [R4.64] ;
        /*0020*/  HMMA.16816.F32.BF16 R8, R12, R16, R8 ;
        /*0030*/  STL [R1], R8 ;
        /*0040*/  @P0 BRA 0x10 ;
        /*0050*/  LDL R3, [R1] ;
        /*0060*/  @P1 BRA 0x0 ;
        /*0070*/  EXIT ;
    """
    body = res.kv_loop(sass)
    assert body == ["LDG.E R2, [R4.64]", "HMMA.16816.F32.BF16 R8, R12, R16, R8", "STL [R1], R8",
                    "@P0 BRA 0x10"]
    assert res.kv_loop(sass.replace("HMMA", "FFMA")) == []


def test_residency() -> None:
    # 255 registers x 128 threads: 2 CTAs by registers; 100 KB of shared memory: 2 by smem
    assert res.residency(255, 128, 100 * 1024, 90) == 2
    assert res.residency(168, 128, 30 * 1024, 90) == 3  # 168 -> 5376 per warp: 3 by registers
    assert res.residency(255, 256, 150 * 1024, 90) == 1
    assert res.residency(64, 128, 0, 90) == 8
