"""The absorbed kernel's default launch configurations, and DSA's sparse attention and indexer,
compiled ahead of time for Hopper (``sm_90a``) on the CPU (``benchmarks/gpu_resources.py``, no
GPU needed): each compiles, fits the 227 KB of shared memory a CTA may use, and keeps
local-memory traffic (spills) out of the kv loop (DSA's kernels: no spill at all); the 64-row
configs get Hopper's wgmma. A small set here; ``python -m benchmarks gpu-resources`` prints the
whole grid; its default run (both archs, sm_90a and sm_100a) is run here too, narrowed to one
config (and in full under ``-m slow``), with a compile that aborts its process reported as a
row. Skipped on the GPU run (CPU work, no GPU time)."""

from __future__ import annotations

import sys

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


def _table(path) -> dict[tuple[str, str], str]:
    """The rows of a table written by ``gpu-resources --out``: (config, arch) -> the row."""
    rows = {}
    for line in path.read_text().splitlines():
        cells = [x.strip() for x in line.split("|")[1:-1]]
        if len(cells) > 2 and cells[1].startswith("sm_"):
            rows[(cells[0], cells[1])] = line
    return rows


def test_default_archs_run_to_the_end(tmp_path) -> None:
    """The command with its default archs (sm_90a, sm_100a) on the config whose sm_100a compile
    used to abort the whole run (128 heads: the Gluon kernel's wgmma): a compiled row per arch,
    the Gluon kernel on sm_90a, the Triton kernel (tcgen05) on sm_100a."""
    out = tmp_path / "t.md"
    assert res.main(["--quick", "--heads", "128", "--q-lens", "1", "--caches", "bf16",
                     "--out", str(out)]) == 0
    rows = _table(out)
    assert set(rows) == {("bf16 h128 q1", "sm_90a"), ("bf16 h128 q1", "sm_100a")}
    for line in rows.values():
        assert "failed" not in line and "skipped" not in line, line
    assert "| wgmma |" in rows[("bf16 h128 q1", "sm_90a")]
    assert "| tcgen05 |" in rows[("bf16 h128 q1", "sm_100a")]


def test_gluon_rows_off_hopper_are_skipped_with_the_reason() -> None:
    gluon = res.Config(128, 1, "bf16", (("gluon", True),))
    (r,) = res.compile_isolated([gluon], 100)
    assert not r.error and "sm_90a only" in r.skipped and r.regs == 0
    assert "skipped: the Gluon kernel serves sm_90a only" in res.row(r)


@pytest.mark.slow
def test_full_default_run(tmp_path) -> None:
    """``python -m benchmarks gpu-resources`` with every default (both archs, the knob grid):
    it finishes and every row is compiled or skipped with its reason."""
    out = tmp_path / "t.md"
    assert res.main(["--out", str(out)]) == 0
    rows = _table(out)
    assert {arch for _, arch in rows} == {"sm_90a", "sm_100a"}
    assert not [line for line in rows.values() if "failed" in line]


_FAKE_CHILD = """
import json, os, sys
args = sys.argv[1:]
arch = int(args[args.index("--arch") + 1])
for h, *_ in json.loads(args[args.index("--json") + 1]):
    if h == 99:  # as LLVM does when it cannot select an instruction
        sys.stderr.write("LLVM ERROR: Cannot select: intrinsic\\n")
        sys.stderr.flush()
        os.abort()
    if h == 7:
        sys.exit(3)
    print(json.dumps({"config": None, "arch": arch, "regs": h}), flush=True)
"""


def test_a_compile_that_aborts_its_process_is_a_row(tmp_path) -> None:
    """A child that aborts on a config: that config's row says so (the LLVM message), a fresh
    child compiles the rest; a child failing otherwise raises."""
    script = tmp_path / "child.py"
    script.write_text(_FAKE_CHILD)
    child = [sys.executable, str(script)]
    configs = [res.Config(h, 1, "bf16") for h in (16, 99, 32, 99, 64)]
    seen = []
    got = res.compile_isolated(configs, 100, on_result=seen.append, child=child)
    assert [r.config for r in got] == configs and seen == got
    assert [r.regs for r in got] == [16, 0, 32, 0, 64]
    for r in (got[1], got[3]):
        assert "compile aborted the process" in r.error and "LLVM ERROR" in r.error
        assert r.arch == 100 and "failed: compile aborted" in res.row(r)
    assert not got[0].error and not got[4].error
    with pytest.raises(RuntimeError, match="exit 3"):
        res.compile_isolated([res.Config(7, 1, "bf16")], 90, child=child)
