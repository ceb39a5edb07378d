"""The roofline plot's reader of ``decode-latest.md`` (benchmarks/plot.py): ceilings, the run's
roof and each kernel's point come back from a section as the benchmark wrote them."""

from __future__ import annotations

import pytest

from benchmarks.plot import parse_decode

HOST = "CPU: Some CPU (2 cores, x86_64); torch CPU capability AVX2, AMX tiles no; load average 3.0"
ROBUST = f"""## Absorbed MLA decode per ISA level vs vLLM's CPU kernels (2026-01-01T0000Z)

{HOST}

- compute ceiling for ours <isa>: that level's own, ...: avx2 0.250 TFLOP/s (fma avx2), avx512 0.464 TFLOP/s (fma avx512); for the peers: 1.087 TFLOP/s (torch gemm bf16); bw 7.8 GB/s (stream ours: ...)

|   H | batch |    kv | shape's GEMM TF/s | shape's bw GB/s | ours avx2 bf16 ms (roof) | CPU_MLA bf16 ms (roof) | CPU_MLA / ours avx2 |
|-----|-------|-------|-------------------|-----------------|--------------------------|------------------------|---------------------|
|  16 |     1 |  4096 | 0.1 fp32 | 5.0 | 2.000 (20%) | 4.000 (10%) | 2.00x |
| 128 |     2 |  1024 | 0.1 fp32 | 5.0 | 8.000 (20%!) | - | - |
"""  # noqa: E501
OLD = f"""# Absorbed MLA decode per ISA level vs vLLM's CPU kernels (2026-01-02T0000Z)

{HOST}

- peak = ... (measured once before the shapes): avx2 0.090 TFLOP/s

|   H | batch |   kv |  peak TF/s | bw GB/s | ours avx2 bf16 ms (roof) |
|-----|-------|------|------------|---------|--------------------------|
|  16 |     1 | 4096 | 1.0 fp32 | 6.0 | 2.000 (20%) |
|  16 |     1 | 8192 | 3.0 fp32 | 2.0 | 4.000 (20%) |
"""


def _expect(H: int, B: int, L: int, ms: float) -> tuple[float, float]:
    # absorbed decode with a bf16 cache, r 512 + rope 64: per request and head 2 L (r + rope)
    # FLOPs for the scores and 2 L r for P.V; the cache is read once: L (r + rope) 2 bytes
    flops = 2 * H * B * L * (2 * 512 + 64)
    nbytes = B * L * (512 + 64) * 2
    return flops / nbytes, flops / (ms / 1e3)


def test_robust_section() -> None:
    (run,) = parse_decode(ROBUST)
    assert run.stamp == "2026-01-01T0000Z" and run.imitated is False
    assert run.ceilings == pytest.approx({"avx2": 0.250e12, "avx512": 0.464e12})
    assert (run.peak, run.bw) == pytest.approx((1.087e12, 7.8e9))
    got = run.points
    assert sorted(got) == ["CPU_MLA bf16", "ours avx2 bf16"]
    flat = lambda pts: [v for p in pts for v in p]  # noqa: E731
    assert flat(got["ours avx2 bf16"]) == pytest.approx(
        flat([_expect(16, 1, 4096, 2.0), _expect(128, 2, 1024, 8.0)])
    )
    assert flat(got["CPU_MLA bf16"]) == pytest.approx(flat([_expect(16, 1, 4096, 4.0)]))


def test_old_section_and_order() -> None:
    runs = parse_decode(ROBUST + "\n---\n\n" + OLD)
    assert [r.stamp for r in runs] == ["2026-01-01T0000Z", "2026-01-02T0000Z"]
    old = runs[1]
    assert old.peak is None and old.ceilings == pytest.approx({"avx2": 0.090e12})
    assert old.peaks == pytest.approx([1e12, 3e12]) and old.bws == pytest.approx([6e9, 2e9])


def test_unknown_header_is_named() -> None:
    bad = ROBUST.replace("shape's GEMM TF/s", "GEMM")
    with pytest.raises(ValueError, match="decode table header"):
        parse_decode(bad)
