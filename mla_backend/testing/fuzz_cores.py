"""The libFuzzer targets of the native kernels' torch-free cores (``tests/native_core/fuzz/``,
one per entry point: :data:`TARGETS`): their builds at an x86-64 ISA level (``clang++
-fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all`` over the level's flags from
``mla_backend.ops.native.isa``), their runs over a corpus and what each run reached.

Corpora: ``tests/native_core/fuzz/corpus/<target>/`` holds small committed seeds (read only
here); a run adds what it finds to a working corpus (``tests/native_core/fuzz/work/<target>/``
by default, ignored by git; ``--work`` moves it), which the next run starts from. A crash,
sanitizer report or failed check stops the run and leaves the input in ``<work>/artifacts/``.

    python -m mla_backend.testing.fuzz_cores --minutes 30 --level avx2 [--target indexer ...]

runs each target for the time given (``--jobs`` at once) and prints, per target, the
executions, executions per second, the corpus size and the outcome; exits 1 on any finding.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..ops.native import build, isa
from . import cross_tools

FUZZ_DIR = Path(__file__).resolve().parents[2] / "tests" / "native_core" / "fuzz"
SEEDS = FUZZ_DIR / "corpus"
WORK = FUZZ_DIR / "work"
#: one target per torch-free entry point: fuzz_<name>.cpp
TARGETS = (
    "write_latent",
    "absorbed_attention",
    "sparse_attention",
    "keyset_attention",
    "indexer",
    "mha",
    "decompress",
    "head_gemm",
)
CXX = "clang++"
FLAGS = [
    "-O1", "-gline-tables-only", "-fsanitize=fuzzer,address,undefined", "-fno-sanitize-recover=all",
    "-fno-omit-frame-pointer",
]  # fmt: skip
ENV = {
    "ASAN_OPTIONS": "detect_leaks=1:abort_on_error=0",
    "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1",
}
#: seconds one input may take before libFuzzer calls it a hang
HANG_S = 30


def missing() -> str | None:
    """Why the targets cannot be built here (None when they can): clang++ or its libFuzzer
    runtime (:func:`~mla_backend.testing.cross_tools.fuzzer_runtime`) is missing, or this is not
    x86-64."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "the fuzz targets are built for x86-64 ISA levels only"
    if shutil.which(CXX) is None:
        return f"{CXX} is not installed (Debian: clang; python3 -m nox -s cores installs it)"
    if cross_tools.fuzzer_runtime() is None:
        return f"{CXX} has no libFuzzer runtime (Debian: libclang-rt-dev, the default clang's)"
    return None


def cache_dir() -> Path:
    """Where built targets are kept (named by a hash of their sources and flags)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mla_backend" / "fuzz"


def flags(level: str) -> list[str]:
    """The compiler flags of the targets at ISA level ``level`` (the later -O1 wins)."""
    return [*isa.level_flags(level), f"-I{build._CSRC}", f"-I{FUZZ_DIR}", "-pthread", *FLAGS]


_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def sources(src: Path) -> list[Path]:
    """``src`` and every file it includes with ``#include "..."`` (found next to the including
    file, in :data:`FUZZ_DIR` or in the kernels' ``csrc/``), transitively."""
    seen: set[Path] = set()
    todo = [src]
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        for name in _INCLUDE.findall(f.read_text()):
            found = [d / name for d in (f.parent, FUZZ_DIR, build._CSRC) if (d / name).is_file()]
            todo += found[:1]
    return sorted(seen)


def compile_target(target: str, level: str, out_dir: Path | None = None) -> Path:
    """``target`` built at ``level`` under ``out_dir`` (default :func:`cache_dir`; reused while
    its :func:`sources` and flags are the same); RuntimeError with the compiler's output on
    failure."""
    if target not in TARGETS:
        raise ValueError(f"unknown fuzz target {target!r}; use one of {', '.join(TARGETS)}")
    why = missing()
    if why:
        raise RuntimeError(why)
    out_dir = out_dir or cache_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    src = FUZZ_DIR / f"fuzz_{target}.cpp"
    cmd = [CXX, *flags(level), str(src)]
    h = hashlib.sha1(" ".join(cmd).encode())
    for f in sources(src):
        h.update(f.read_bytes())
    exe = out_dir / f"fuzz_{target}-{level}-{h.hexdigest()[:12]}"
    if not exe.exists():
        tmp = exe.with_name(f"{exe.name}.{os.getpid()}.tmp")
        res = subprocess.run([*cmd, "-o", str(tmp)], capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"fuzz_{target} at {level}: build failed\n{res.stderr[-6000:]}")
        tmp.replace(exe)
    return exe


@dataclass(frozen=True)
class Outcome:
    """One run of one target."""

    target: str
    level: str
    runs: int  # inputs executed
    seconds: float
    corpus: int  # inputs in the working corpus after the run
    failed: bool  # a crash, sanitizer report, failed check, hang or leak
    report: str  # the run's output tail where it failed

    @property
    def exec_per_s(self) -> float:
        return self.runs / self.seconds if self.seconds > 0 else 0.0


_RUNS = re.compile(r"stat::number_of_executed_units:\s*(\d+)")


def run_target(
    exe: Path,
    target: str,
    level: str,
    work: Path,
    seconds: float | None = None,
    runs: int | None = None,
    seed: int | None = None,
) -> Outcome:
    """``exe`` over the working corpus ``work`` (created; new inputs are added to it) and the
    committed seeds, for ``seconds`` or ``runs`` inputs, whichever is given (both: the first
    reached). Failing inputs go to ``work/artifacts/``."""
    work.mkdir(parents=True, exist_ok=True)
    art = work / "artifacts"
    art.mkdir(exist_ok=True)
    args = [
        str(exe), "-print_final_stats=1", f"-timeout={HANG_S}", "-rss_limit_mb=4096",
        f"-artifact_prefix={art}/", "-max_len=4096",
    ]  # fmt: skip
    if seconds is not None:
        args.append(f"-max_total_time={max(1, int(seconds))}")
    if runs is not None:
        args.append(f"-runs={runs}")
    if seed is not None:
        args.append(f"-seed={seed}")
    seeds = SEEDS / target
    args += [str(work)] + ([str(seeds)] if seeds.is_dir() else [])
    t0 = time.monotonic()
    limit = (seconds or 0) + 4 * HANG_S + 120 if runs is None else None
    res = subprocess.run(
        args, capture_output=True, text=True, env={**os.environ, **ENV}, timeout=limit
    )
    took = time.monotonic() - t0
    m = _RUNS.search(res.stderr)
    n = sum(1 for p in work.iterdir() if p.is_file())
    return Outcome(
        target, level, int(m.group(1)) if m else 0, took, n, res.returncode != 0,
        res.stderr[-8000:] if res.returncode != 0 else "",
    )  # fmt: skip


def merge_seeds(exe: Path, target: str, work: Path, keep: int = 48) -> int:
    """Adds to the committed seeds of ``target`` up to ``keep`` inputs of ``work`` (the largest
    of libFuzzer's ``-merge=1`` minimal set over seeds and work, which are not seeds yet);
    returns how many it added."""
    seeds = SEEDS / target
    seeds.mkdir(parents=True, exist_ok=True)
    tmp = work.parent / f"{target}.merge"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    subprocess.run(
        [str(exe), "-merge=1", str(tmp), str(seeds), str(work)], capture_output=True,
        env={**os.environ, **ENV}, check=True,
    )  # fmt: skip
    have = {p.name for p in seeds.iterdir()}
    new = sorted((p for p in tmp.iterdir() if p.name not in have), key=lambda p: -p.stat().st_size)
    for p in new[:keep]:
        shutil.copy(p, seeds / p.name)
    shutil.rmtree(tmp)
    return len(new[:keep])


def run_all(
    level: str,
    targets: Sequence[str] = TARGETS,
    seconds: float | None = None,
    runs: int | None = None,
    work_root: Path = WORK,
    jobs: int = 2,
    out_dir: Path | None = None,
) -> list[Outcome]:
    """Each of ``targets`` built at ``level`` and run (``jobs`` at once) over
    ``work_root/<target>``; the outcomes in ``targets``' order. A target that fails to build
    raises its RuntimeError."""

    def one(t: str) -> Outcome:
        exe = compile_target(t, level, out_dir)
        return run_target(exe, t, level, work_root / t, seconds=seconds, runs=runs)

    with ThreadPoolExecutor(max(1, jobs)) as pool:
        return list(pool.map(one, targets))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=1.0, help="per target (default 1)")
    ap.add_argument("--runs", type=int, default=None, help="inputs per target (stop there)")
    ap.add_argument(
        "--level",
        action="append",
        help="repeatable; default: each level this host runs",
    )
    ap.add_argument("--target", action="append", choices=TARGETS, help="repeatable; default all")
    ap.add_argument("--work", type=Path, default=WORK, help=f"working corpora (default {WORK})")
    ap.add_argument("--jobs", type=int, default=2, help="targets run at once (default 2)")
    ap.add_argument(
        "--merge-seeds", action="store_true",
        help="afterwards add each target's most telling new inputs to its committed seeds",
    )  # fmt: skip
    a = ap.parse_args(argv)
    why = missing()
    if why:
        print(f"fuzz_cores: cannot run: {why}")
        return 2
    from ..ops.native import host_isas

    levels = a.level or [lvl for lvl in host_isas() if lvl in isa.arch_levels("x86_64")]
    failed = False
    print(f"{'target':20} {'level':12} {'runs':>10} {'exec/s':>8} {'corpus':>7}  outcome")
    for lvl in levels:
        # each level's working corpus of its own (their coverage differs by level)
        for o in run_all(lvl, a.target or TARGETS, a.minutes * 60, a.runs, a.work / lvl, a.jobs):
            outcome = "FAILED" if o.failed else "ok"
            rate = f"{o.exec_per_s:>8.0f}"
            print(
                f"{o.target:20} {o.level:12} {o.runs:>10} {rate} {o.corpus:>7}  {outcome}",
                flush=True,
            )
            if o.failed:
                failed = True
                print(o.report, file=sys.stderr)
            elif a.merge_seeds:
                exe = compile_target(o.target, lvl)
                n = merge_seeds(exe, o.target, a.work / lvl / o.target)
                print(f"  {n} new seeds in {SEEDS / o.target}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
