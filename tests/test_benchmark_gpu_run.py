"""The prepared GPU run (``python -m benchmarks gpu-run``) without a GPU: its dry run (stages in
order, each in its time box, a stage that outlives its box killed and the run going on, the
files it leaves: at most the 8 the device tool returns), and the summary's reading of the
benchmark's tables (the issue's targets, the decisions of ``gpu-plan.md``) on tables written in
the benchmark's format."""

from __future__ import annotations

import time

from benchmarks import gpu_run
from benchmarks.gpu_summary import parse_table, summarize


def test_dry_run_respects_the_deadline_and_writes_the_8_files(tmp_path) -> None:
    scale, deadline = 0.02, 500
    t = time.time()
    assert gpu_run.main(["--out", str(tmp_path), "--dry-run", "--scale", str(scale),
                         "--deadline", str(deadline), "--overrun", "tests"]) == 0
    wall = time.time() - t
    names = sorted(p.name for p in tmp_path.iterdir())
    assert set(names) <= set(gpu_run.FILES) and len(gpu_run.FILES) <= 8
    assert {"run.log", "summary.md", "env.txt", "pytest.log", "bench_bf16.txt"} <= set(names)
    log = (tmp_path / "run.log").read_text()
    assert "tests: killed at its 170 s box" in log  # the overrun stage, killed at its cap
    stages = ("tests", "bench_bf16", "bench_fp8", "bench_sparse", "sweep")
    order = [log.index(f"{s}: start") for s in stages]
    assert order == sorted(order)
    assert wall < deadline * scale + 5
    assert "tests/triton_path" in (tmp_path / "pytest.log").read_text()


BF16 = """device: NVIDIA H100 80GB HBM3, SMs/CUs: 132, cache bf16, page 64; torch 2.11 triton 3.6.0
measured: bf16 GEMM 800 TFLOP/s, copy 3000 GB/s
batch mean_kv heads q_len varlen  parts      ms  TFLOP/s    GB/s  max|o-torch|  %gemm  %copy  flashinfer_ms  max|o-fi|  flashmla_ms
  128    4096    16     1  False    264   0.200    100.0    2400  1.0e-02   12.5   80.0          0.250   1.0e-02          nan
  128    4096    16     2  False    264   0.240    100.0    2400  1.0e-02   12.5   80.0          0.300   1.0e-02          nan
  128    4096   128     1  False     66   1.000    200.0     400  1.0e-02   25.0   13.0          0.600   1.0e-02          nan
  (column n/a: flash_mla not importable (ModuleNotFoundError))
device: NVIDIA H100 80GB HBM3, SMs/CUs: 132, cache bf16, page 64; torch 2.11 triton 3.6.0
batch mean_kv heads q_len varlen  parts      ms  TFLOP/s    GB/s  max|o-torch|  gluon_ms  max|o-gluon|
  128    4096    16     1  False    264   0.200    100.0    2400  nan     0.180    1.0e-02
  128    4096    16     2  False    264   0.240    100.0    2400  nan     0.300    1.0e-02
  128    4096   128     1  False     66   1.000    200.0     400  nan       nan        nan
  (column n/a: gluon failed: boom)
"""  # noqa: E501
FP8 = """device: NVIDIA H100 80GB HBM3, SMs/CUs: 132, cache fp8, page 64; torch 2.11 triton 3.6.0
batch mean_kv heads q_len varlen  parts      ms  TFLOP/s    GB/s  max|o-torch|
  128    4096    16     1  False    264   0.100    100.0    2400  1.0e-02
device: NVIDIA H100 80GB HBM3, SMs/CUs: 132, cache fp8_ds_mla, page 64; torch 2.11 triton 3.6.0
batch mean_kv heads q_len varlen  parts      ms  TFLOP/s    GB/s  max|o-torch|
  128    4096    16     1  False    264   0.180    100.0    2400  1.0e-02
"""
SPARSE = """batch | kv | heads | cache | dense ms | indexer ms | idx+sparse ms | dense/(idx+sparse)
128 | 32768 | 128 | bf16 | 20.0 | 1.0 | 2.0 | 10.00x
"""
SWEEP = SPARSE + """device NVIDIA H100; batch 128, kv 4096 (fixed), page 64; ms = do_bench median
heads cache      q_len knobs                              parts      ms    GB/s TFLOP/s  max|o-default|  vs_default
   16 bf16           1 default                              264   0.200    2400   100.0       0.000e+00       1.00x
   16 bf16           1 block_n=32                           264   0.180    2600   110.0       7.000e-03       1.11x
   16 bf16           1 gluon=True                           264   0.100    2600   110.0       9.000e-01       2.00x
  128 bf16           1 default                               66   1.000     400   200.0       0.000e+00       1.00x
  128 bf16           1 num_stages=2                          66   0.990     400   200.0       0.000e+00       1.01x
"""  # noqa: E501


def test_summary_checks_targets_and_applies_the_plan(tmp_path) -> None:
    (tmp_path / "bench_bf16.txt").write_text(BF16)
    (tmp_path / "bench_fp8.txt").write_text(FP8)
    (tmp_path / "sweep.txt").write_text(SWEEP)
    (tmp_path / "pytest.log").write_text("FAILED tests/x.py::test_y\n1 failed, 9 passed\n")
    assert len(parse_table(BF16, "batch")) == 6
    text = summarize(tmp_path, [("tests", "rc=1", 100.0)])
    assert "GPU tests: 1 failed, 9 passed" in text and "FAILED tests/x.py::test_y" in text
    # 16 heads: 2400 / 3000 = 80% of copy, Gluon 0.2 / 0.18 of that: met
    assert "| >= 75% of copy | (4096, 16, 1) | 80.0% | 88.9% | yes |" in text
    # 128 heads: 200 / 800 = 25% of GEMM: not met; FlashInfer 1.67x faster: its default
    assert "| >= 40% of GEMM | (4096, 128, 1) | 25.0% | n/a | NO |" in text
    assert "FlashInfer 1.67x our best at (4096, 128, 1)" in text
    assert "| >= 1.0x FlashInfer | (4096, 16, 1) | 1.25x | 1.39x | yes |" in text
    assert "| 128 | 32768 | 128 | bf16 | 20.0 | 1.0 | 2.0 | 10.00x |" in text
    # verify: Triton 1.2x decode (met), Gluon 1.67x
    assert "| verify <= 1.3x decode | (4096, 16, 2) | 1.20x | 1.67x | yes |" in text
    assert "Gluon 1.11x Triton at (4096, 16, 1)" in text
    # fp8 2.0x bf16 at 16 heads (met), fp8_ds_mla 1.11x (not met)
    assert "| fp8 >= 1.3x bf16 | (4096, 16, 1) | 2.00x | - | yes |" in text
    assert "| fp8_ds_mla >= 1.3x bf16 | (4096, 16, 1) | 1.11x | - | NO |" in text
    # sweep: block_n=32 wins (1.11x, same output); gluon=True differs in output: not taken
    assert "heads 16 bf16 q_len 1: block_n=32 becomes the default" in text
    assert "heads 128 bf16 q_len 1: the default stays" in text
    assert "no path with a failing test becomes a default" in text
