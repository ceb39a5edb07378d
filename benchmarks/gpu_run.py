"""``python -m benchmarks gpu-run``: the one prepared GPU run (H100 / H200, ~8 minutes): GPU tests
of the compiled kernels (dense, Gluon, the DSA kernels: all of ``tests/triton_path``), the GPU
benchmark (bf16 / fp8 / fp8_ds_mla, 16 and 128 heads, batch 128, kv 4K and 8K, 1- and 2-token
queries) with FlashInfer's column, the Gluon kernel's column and the measured copy / GEMM
ceilings, the DSA sparse decode against dense (``gpu-sparse``), a tile sweep, and a summary that
checks the issue's targets and applies the decisions written down before the run
(``benchmarks/results/gpu-plan.md``).

    cd <repo> && python3 -m benchmarks gpu-run --out "$OUT"      # on the GPU machine
    python3 -m benchmarks gpu-run --out /tmp/gpu_dry --dry-run   # here: control flow only

Take along (the device tool's ``carry``): ``.whl/`` (flashinfer-python 0.6.13, apache-tvm-ffi,
hypothesis and sortedcontainers wheels for CPython 3.12, ~18 MB; the run goes on without
FlashInfer's column when they are missing). The run sets ``MLA_BACKEND_IMPL=triton``, never
``TRITON_INTERPRET``, and installs the wheels with ``pip install --no-index --no-deps --target``.

Stages, in order, each a subprocess with its own time box (``min(cap, what is left of the
deadline minus what the later stages need at least)``); a stage that runs over is killed and
what it wrote stays (every table prints row by row). FlashInfer's nvcc JIT build runs in the
background from the start and is waited for only until the bf16 benchmark must begin.
Files in ``--out`` (8): ``env.txt``, ``run.log`` (stage times), ``pytest.log``,
``flashinfer.log``, ``bench_bf16.txt``, ``bench_fp8.txt``, ``sweep.txt`` (the DSA table, then the
sweep), ``summary.md``.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FILES = ("env.txt", "run.log", "pytest.log", "flashinfer.log", "bench_bf16.txt",
         "bench_fp8.txt", "sweep.txt", "summary.md")
#: where the carried wheels are installed (tests' helpers / FlashInfer, kept apart so that the
#: test stage cannot start a second FlashInfer JIT build)
SITE_TEST, SITE_FI = "/tmp/mla_site_test", "/tmp/mla_site_fi"


@dataclass
class Stage:
    """One stage: its output file, its cap (s), the least it needs to be worth starting (s)."""

    name: str
    out: str
    cap: float
    need: float
    ran_s: float = 0.0
    status: str = "not run"


@dataclass
class Run:
    out: Path
    deadline: float
    dry: bool
    scale: float = 1.0
    t0: float = field(default_factory=time.time)
    env: dict[str, str] = field(default_factory=dict)
    log: list[str] = field(default_factory=list)

    def left(self) -> float:
        return self.deadline - (time.time() - self.t0)

    def say(self, msg: str) -> None:
        """A line of run.log; times in planned seconds (the dry run's are scaled back)."""
        t = (time.time() - self.t0) / self.scale
        line = f"[t={t:6.1f}s left={self.left() / self.scale:6.1f}s] {msg}"
        self.log.append(line)
        print(line, flush=True)
        (self.out / "run.log").write_text("\n".join(self.log) + "\n")

    def box(self, stage: Stage, later_need: float) -> float:
        """The stage's time box: its cap, or what is left after the later stages' needs."""
        return max(0.0, min(stage.cap * self.scale, self.left() - later_need * self.scale))

    def run(self, stage: Stage, cmd: list[str], later_need: float, env: dict | None = None,
            append: bool = False, simulate: float | None = None) -> int | None:
        """Run ``cmd`` into ``stage.out`` within its box; None if it was not started or was
        killed at the end of its box. ``simulate``: the dry run's stand-in duration (s)."""
        box = self.box(stage, later_need)
        if stage.status == "not selected":
            self.say(f"{stage.name}: not selected")
            return None
        if box < stage.need * self.scale:
            stage.status = (f"skipped ({box / self.scale:.0f} s left for it, needs "
                            f"{stage.need:.0f})")
            self.say(f"{stage.name}: {stage.status}")
            return None
        if self.dry:
            pretend = stage.cap * 0.5 if simulate is None else simulate
            cmd = [sys.executable, "-c", f"import time; print('DRY RUN:', {' '.join(cmd)!r}); "
                   f"time.sleep({pretend * self.scale})"]
        self.say(f"{stage.name}: start (box {box / self.scale:.0f} s): {' '.join(cmd)[:200]}")
        t = time.time()
        with open(self.out / stage.out, "a" if append else "w") as f:
            try:
                rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                                    env={**os.environ, **self.env, **(env or {})},
                                    timeout=box).returncode
                stage.status = f"rc={rc}"
            except subprocess.TimeoutExpired:
                rc = None
                stage.status = (f"killed at its {box / self.scale:.0f} s box (partial output "
                                "kept)")
                f.write(f"\n[gpu-run: killed after {box / self.scale:.0f} s]\n")
        stage.ran_s += (time.time() - t) / self.scale
        self.say(f"{stage.name}: {stage.status} after {stage.ran_s:.1f} s")
        return rc


def _environment(run: Run) -> None:
    """Versions, the GPU, nvcc, libcuda, xdist -> env.txt; the run's environment variables."""
    run.env.update(
        MLA_BACKEND_IMPL="triton", PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1",
        TRITON_CACHE_DIR="/tmp/mla_triton_cache", PYTHONPATH=f"{ROOT}:{SITE_TEST}",
    )
    os.environ.pop("TRITON_INTERPRET", None)
    lines = [f"gpu-run {time.strftime('%Y-%m-%d %H:%M:%S %Z')}; repo {ROOT}"]
    probes = [
        ["nvidia-smi", "--query-gpu=name,memory.total,clocks.max.sm,driver_version",
         "--format=csv"],
        [sys.executable, "-c", "import torch, triton, numpy; print('torch', torch.__version__, "
         "'cuda', torch.version.cuda, 'triton', triton.__version__, 'numpy', numpy.__version__,"
         " 'capability', torch.cuda.get_device_capability() if torch.cuda.is_available() "
         "else None)"],
        [sys.executable, "-c", "import xdist; print('xdist', xdist.__version__)"],
        [sys.executable, "-c", "import hypothesis; print('hypothesis', hypothesis.__version__)"],
        ["nvcc", "--version"], ["git", "log", "-1", "--oneline"], ["nproc"],
    ]
    for cmd in probes:
        if run.dry:
            lines.append(f"DRY RUN: {' '.join(cmd)}")
            continue
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd=ROOT)
            lines.append((p.stdout + p.stderr).strip()[-600:])
        except Exception as exc:  # a missing tool is a line in env.txt, not a failure
            lines.append(f"{cmd[0]}: {type(exc).__name__}: {exc}")
    (run.out / "env.txt").write_text("\n".join(lines) + "\n")


def _install_wheels(run: Run) -> bool:
    """The carried wheels into two --target folders; True when FlashInfer's are there."""
    wheels = sorted(glob.glob(str(ROOT / ".whl" / "*.whl")))
    fi = [w for w in wheels if re.search(r"(flashinfer|tvm_ffi)", os.path.basename(w))]
    rest = [w for w in wheels if w not in fi]
    with open(run.out / "flashinfer.log", "w") as f:
        f.write(f"wheels: {[os.path.basename(w) for w in wheels]}\n")
        for target, group in ((SITE_TEST, rest), (SITE_FI, fi)):
            if not group or run.dry:
                continue
            p = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index",
                                "--no-deps", "--no-compile", "--target", target, *group],
                               stdout=f, stderr=subprocess.STDOUT, timeout=120)
            f.write(f"pip install --target {target}: rc={p.returncode}\n")
            if p.returncode and target == SITE_FI:
                return False
    return len(fi) == 2


def _start_flashinfer_jit(run: Run) -> subprocess.Popen | None:
    """FlashInfer's sm90 MLA module built by nvcc in the background (~1 min)."""
    # every later stage that imports FlashInfer reads the module this build leaves here
    run.env.update(FLASHINFER_WORKSPACE_BASE="/tmp/mla_fiws", MAX_JOBS="14",
                   FLASHINFER_CUDA_ARCH_LIST=os.environ.get("FLASHINFER_CUDA_ARCH_LIST", "9.0a"))
    nvcc = shutil.which("nvcc")
    stub = nvcc and Path(nvcc).resolve().parents[1] / "lib64" / "stubs" / "libcuda.so"
    if not (stub and stub.exists()):  # FlashInfer links -lcuda: the driver's library then
        p = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True)
        m = re.search(r"=>\s*(\S*libcuda\.so\S*)", p.stdout)
        if m:
            run.env["FLASHINFER_EXTRA_LDFLAGS"] = f"-L{os.path.dirname(m.group(1))}"
    env = {**os.environ, **run.env, "PYTHONPATH": f"{ROOT}:{SITE_FI}"}
    code = ("import time, torch, flashinfer, flashinfer.mla as m; t = time.time(); "
            "print('flashinfer', flashinfer.__version__, flush=True); "
            "m.get_batch_mla_module('fa3', torch.bfloat16, torch.bfloat16, torch.bfloat16, "
            "torch.int32, 512, 64, False); print('fa3 MLA module built in %.0f s' % "
            "(time.time() - t))")
    if run.dry:
        code = "import time; print('DRY RUN: flashinfer JIT'); time.sleep(%f)" % (60 * run.scale)
    log = open(run.out / "flashinfer.log", "a")
    run.say("flashinfer: JIT build started in the background")
    return subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT,
                            cwd=ROOT, env=env)


def _wait_jit(run: Run, jit: subprocess.Popen | None, until_left: float, most: float) -> bool:
    """Wait for the JIT build at most ``most`` s and while more than ``until_left`` s are
    left (planned seconds); True if it built."""
    if jit is None:
        return False
    stop = min(run.left() - until_left * run.scale, most * run.scale)
    t = time.time()
    while jit.poll() is None and time.time() - t < stop:
        time.sleep(0.05 if run.dry else 2)
    if jit.poll() is None:
        jit.kill()
        run.say("flashinfer: JIT build not done in time: killed, FlashInfer columns n/a")
        return False
    ok = jit.returncode == 0
    run.say(f"flashinfer: JIT build {'done' if ok else f'failed (rc={jit.returncode})'}")
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks gpu-run", description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpu_run_out"))
    p.add_argument("--deadline", type=float, default=500.0, help="seconds for the whole run")
    p.add_argument("--dry-run", action="store_true",
                   help="no GPU: every stage a stand-in that sleeps (scaled by --scale)")
    p.add_argument("--scale", type=float, default=None,
                   help="dry run: seconds per planned second (default 0.01)")
    p.add_argument("--overrun", default="tests",
                   help="dry run: the stage whose stand-in outlives its box (timeout path)")
    p.add_argument("--stages", default=None,
                   help="comma-separated stages to run (default all; a rerun after a fix)")
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    scale = (a.scale or 0.01) if a.dry_run else 1.0
    run = Run(out, a.deadline * scale, a.dry_run, scale)
    py = sys.executable
    S = {s.name: s for s in [
        Stage("tests", "pytest.log", 170, 40),
        Stage("gluon_tests", "pytest.log", 45, 15),
        Stage("bench_bf16", "bench_bf16.txt", 110, 45),
        Stage("bench_gluon", "bench_bf16.txt", 50, 20),
        Stage("bench_fp8", "bench_fp8.txt", 40, 20),
        Stage("bench_ds", "bench_fp8.txt", 40, 20),
        Stage("bench_sparse", "sweep.txt", 70, 25),
        Stage("sweep", "sweep.txt", 110, 25),
        Stage("fi_tests", "flashinfer.log", 35, 15),
    ]}

    chosen = set(S) if a.stages is None else set(a.stages.split(","))
    if chosen - set(S):
        p.error(f"--stages {sorted(chosen - set(S))} unknown; stages: {', '.join(S)}")
    for name in set(S) - chosen:
        S[name].cap = S[name].need = 0.0  # a box of 0 s: reported as skipped
        S[name].status = "not selected"

    def need_after(*names: str) -> float:
        return sum(S[n].need for n in names)

    def sim(name: str) -> float | None:
        return S[name].cap * 1.5 if a.dry_run and a.overrun == name else None

    _environment(run)
    run.say(f"gpu-run: deadline {a.deadline:.0f} s{' (dry run, scaled)' if a.dry_run else ''}")
    fi_ok = _install_wheels(run)
    jit = _start_flashinfer_jit(run) if (fi_ok or a.dry_run) else None
    if not (fi_ok or a.dry_run):
        run.say("flashinfer: no wheels in .whl/: FlashInfer columns and tests n/a")

    xdist = [] if a.dry_run else ["-n", "8"]
    if not a.dry_run and "xdist" not in (out / "env.txt").read_text():
        xdist = []
    # -v: a PASSED / FAILED line per test, so a stage killed at its box still tells
    pytest = [py, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-rfEs"]
    # the Gluon kernel's tests and timings run apart, each in its own box: a kernel that hangs
    # on the GPU (an mbarrier never completed) costs its box, not the run
    run.run(S["tests"], [*pytest, *xdist, "tests/triton_path/test_triton_gpu_only.py",
                         "tests/triton_path", "-k", "not gluon"],
            need_after("gluon_tests", "bench_bf16", "bench_fp8", "bench_ds", "bench_sparse",
                       "sweep"),
            env={"MLA_TEST_DEVICE": "cuda"}, simulate=sim("tests"))
    run.run(S["gluon_tests"], [*pytest, "tests/triton_path/test_triton_gpu_only.py", "-k",
                               "gluon"],
            need_after("bench_bf16", "bench_fp8", "bench_ds", "bench_sparse", "sweep"),
            env={"MLA_TEST_DEVICE": "cuda"}, append=True, simulate=sim("gluon_tests"))
    fi_built = _wait_jit(run, jit, S["bench_bf16"].cap
                         + need_after("bench_gluon", "bench_fp8", "bench_ds", "bench_sparse",
                                      "sweep"), most=45)
    fi_path = {"PYTHONPATH": f"{ROOT}:{SITE_TEST}:{SITE_FI}"} if fi_built else {}
    bench = [py, "-m", "benchmarks", "gpu", "--batch", "128", "--heads", "16,128",
             "--q-lens", "1,2", "--no-varlen", "--no-graph"]
    run.run(S["bench_bf16"], [*bench, "--means", "4096,8192"],
            need_after("bench_gluon", "bench_fp8", "bench_ds", "bench_sparse", "sweep"),
            env=fi_path,
            simulate=sim("bench_bf16"))
    run.run(S["bench_gluon"], [*bench, "--means", "4096,8192", "--gluon", "--no-others",
                               "--no-check"],
            need_after("bench_fp8", "bench_ds", "bench_sparse", "sweep"), append=True,
            simulate=sim("bench_gluon"))
    run.run(S["bench_fp8"], [*bench, "--means", "4096", "--cache", "fp8", "--no-others"],
            need_after("bench_ds", "bench_sparse", "sweep"), simulate=sim("bench_fp8"))
    run.run(S["bench_ds"], [*bench, "--means", "4096", "--cache", "fp8_ds_mla", "--no-others"],
            need_after("bench_sparse", "sweep"), append=True, simulate=sim("bench_ds"))
    # DSA: indexer top-k + sparse attention vs dense absorbed decode (128 heads, topk 2048),
    # each shape checked against the torch path on the GPU before it is timed
    run.run(S["bench_sparse"], [py, "-m", "benchmarks", "gpu-sparse", "--batches", "128",
                                "--lens", "8192,32768", "--caches", "bf16,fp8_ds_mla"],
            need_after("sweep"), simulate=sim("bench_sparse"))
    later = need_after("fi_tests") if fi_built else 0.0
    box = run.box(S["sweep"], later) / scale
    run.run(S["sweep"], [py, "-m", "benchmarks", "gpu-sweep",
                         "--budget-s", f"{max(box - 25, 5):.0f}"], later, append=True,
            simulate=sim("sweep"))
    if fi_built:
        run.run(S["fi_tests"], [*pytest, "tests/triton_path/test_triton_gpu_only.py",
                                "tests/triton_path/test_flashinfer_seam.py", "-k", "flashinfer"],
                0, env={**fi_path, "MLA_TEST_DEVICE": "cuda"}, append=True,
                simulate=sim("fi_tests"))
    if jit is not None and jit.poll() is None:
        jit.kill()
    from .gpu_summary import summarize

    text = summarize(out, [(s.name, s.status, s.ran_s) for s in S.values()])
    (out / "summary.md").write_text(text)
    run.say(f"gpu-run: done in {time.time() - run.t0:.0f} s; files: "
            f"{sorted(x.name for x in out.iterdir())}")
    print(text, flush=True)
    return 0
