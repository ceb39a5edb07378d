"""The libFuzzer targets of the native kernels' torch-free cores (``tests/native_core/fuzz/``,
:mod:`mla_backend.testing.fuzz_cores`), time-boxed: each target built at every x86-64 ISA level
this host runs (``-fsanitize=fuzzer,address,undefined``) and run for :data:`SECONDS` over a fresh
working corpus and the committed seeds, two at a time. Any crash, sanitizer report, failed
check (a wrong answer, a silent acceptance, a false refusal, a write outside the outputs), hang
or leak fails the test with the run's report. Skipped, naming what is missing, where clang++ or
its libFuzzer runtime is not installed (``python3 -m nox -s cores`` installs them where apt-get
can). The long run: ``python -m mla_backend.testing.fuzz_cores --minutes 30``.
"""

from __future__ import annotations

import platform
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from mla_backend.ops.native import host_isas
from mla_backend.testing import fuzz_cores as fc

SECONDS = 6  # per target and level: 8 targets x 2 levels, 2 at once: about a minute of runs
LEVELS = host_isas() if platform.machine().lower() in ("x86_64", "amd64") else ()
CASES = [(t, lvl) for lvl in LEVELS for t in fc.TARGETS]


@pytest.fixture(scope="module")
def outcomes(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[tuple[str, str], fc.Outcome | str]:
    """The outcome of each selected (target, level), or why it did not build (two at a time)."""
    if fc.missing():
        return {}
    work = tmp_path_factory.mktemp("fuzz_work")
    selected = [
        (item.callspec.params["target"], item.callspec.params["level"])
        for item in request.session.items
        if {"target", "level"} <= set(getattr(getattr(item, "callspec", None), "params", {}))
        and item.module is request.module
    ]

    def one(case: tuple[str, str]) -> fc.Outcome | str:
        target, level = case
        try:
            exe = fc.compile_target(target, level)
        except RuntimeError as e:
            return str(e)
        return fc.run_target(exe, target, level, Path(work) / level / target, seconds=SECONDS)

    with ThreadPoolExecutor(2) as pool:
        return dict(zip(selected, pool.map(one, selected)))


@pytest.mark.parametrize(("target", "level"), CASES, ids=[f"{t}-{lvl}" for t, lvl in CASES])
def test_fuzz_target_finds_nothing(target: str, level: str, outcomes) -> None:
    why = fc.missing()
    if why:
        pytest.skip(why)
    o = outcomes[(target, level)]
    assert isinstance(o, fc.Outcome), o
    assert not o.failed, f"fuzz_{target} at {level} after {o.runs} runs:\n{o.report}"
    assert o.runs > 0, f"fuzz_{target} at {level} ran no input"


def test_every_target_has_seeds_and_a_source() -> None:
    for t in fc.TARGETS:
        assert (fc.FUZZ_DIR / f"fuzz_{t}.cpp").is_file(), t
        seeds = fc.SEEDS / t
        assert seeds.is_dir() and any(seeds.iterdir()), f"no committed seeds for {t}"
