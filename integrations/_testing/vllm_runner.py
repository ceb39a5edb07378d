"""Run one vLLM attention backend on a fixed workload and report tokens/s, generations,
KV-cache bytes per token and attention-weight bytes per layer beyond the checkpoint's; used
by the demo (``examples/vllm_demo.py``) and the engine benchmark (``python -m benchmarks vllm``).

Every timed iteration uses prompts no earlier run has seen (no prefix-cache hits). Each
backend runs in its own fresh process (``python -m
mla_backend_integrations._testing.vllm_runner``, the spec as JSON on stdin) so only one engine is
alive at a time and every backend starts from the same state. The child prints one JSON line
prefixed with ``RESULT:``; an engine that fails to start or run raises :class:`EngineFailed`
with the reason from its log.

``RunSpec.profile_dir`` adds one generate per workload under vLLM's torch profiler
(``profiler_config={"profiler": "torch"}``, after the timed runs, on prompts no run has seen):
the engine's worker writes its trace and ``<backend>-<workload>_<rank>.profiler_out.txt`` (the op
table, CPU time of the worker) to ``profile_dir``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .vllm_backends import FORCE_ENV, engine_env, failure_reason, selected_from_log

_PREFIX = "RESULT:"
_ELEM = {"float32": 4, "float16": 2, "bfloat16": 2}
# native ISA levels whose absorption GEMM keeps packed copies of W_UK / W_UV
_PACKED_ISAS = ("avx512_bf16", "amx")


@dataclass
class Workload:
    """``num_prompts`` prompts of ``input_len`` random token ids (or the given ``texts``),
    ``output_len`` greedy tokens each (EOS ignored), timed ``iters`` times after a warm-up."""

    name: str
    num_prompts: int
    input_len: int
    output_len: int
    iters: int = 2
    texts: list[str] | None = None
    seed: int = 0


@dataclass
class RunSpec:
    """One engine run: ``backend`` on ``model``, our native kernels at ``isa`` (None: the
    process's default level), on this CPU or on an imitated one of level ``imitate``
    (:mod:`.cpu_imitation`)."""

    model: str
    backend: str
    workloads: list[Workload]
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    isa: str | None = None
    imitate: str | None = None
    profile_dir: str | None = None


class EngineFailed(RuntimeError):
    """An engine process failed; ``reason`` is one line from its log."""

    def __init__(self, backend: str, reason: str) -> None:
        super().__init__(f"{backend}: {reason}")
        self.backend = backend
        self.reason = reason


def kv_bytes_per_token(
    model_dir: str | Path, kv_cache_dtype: str = "auto", model_dtype: str | None = None
) -> int:
    """Latent KV-cache bytes per token over all layers, from the config: layers * row bytes,
    a row being (r + rope) elements of the cache dtype, or for ``fp8_ds_mla`` the core's
    tile-scaled row (r e4m3 bytes + 4 per 128-value tile + rope in the model dtype: 656 at
    r 512, rope 64, bf16)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    r, rope = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    model_elem = _ELEM.get(model_dtype or "", _ELEM.get(cfg.get("torch_dtype") or "", 2))
    if kv_cache_dtype == "fp8_ds_mla":
        import torch

        from mla_backend.cache_layout import CacheLayout

        rope_dtype = {4: torch.float32, 2: torch.bfloat16}[model_elem]
        row = CacheLayout.ds_mla(r, rope, rope_dtype).bytes_per_token
    elif kv_cache_dtype.startswith("fp8"):
        row = r + rope
    else:
        row = (r + rope) * {"bfloat16": 2, "float16": 2}.get(kv_cache_dtype, model_elem)
    return cfg["num_hidden_layers"] * row


def engine_kv_bytes_per_token(llm: Any) -> int | None:
    """The KV bytes per token (all layers) the engine actually allocated, on vLLM CPU: the
    worker fills ``VLLM_CPU_KVCACHE_SPACE`` GiB with ``num_gpu_blocks`` blocks of
    ``block_size`` tokens (each block's size is the layers' KV spec page size, after the
    backend's ``customize_spec``). None elsewhere (GPU memory is sized differently)."""
    cfg = llm.llm_engine.vllm_config
    space = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    blocks = cfg.cache_config.num_gpu_blocks
    if space is None or not blocks or cfg.device_config.device_type != "cpu":
        return None
    space_b = int(float(space) * 2**30)
    per_block = space_b / blocks
    per_token = round(per_block / cfg.cache_config.block_size)
    if space_b // (per_token * cfg.cache_config.block_size) != blocks:
        return None  # not the CPU worker's simple division: do not guess
    return per_token


def attn_weight_extra_bytes(
    model_dir: str | Path, backend: str, dtype: str, native_isa: str = "scalar"
) -> int:
    """Attention-weight bytes per layer that a backend holds beyond the checkpoint's
    ``kv_b_proj`` weight (unquantized checkpoints), with K = H * (nope + v) * r elements
    (``kv_b_proj``'s size), c = checkpoint element size, a = the model's (``dtype``):

    - MLA_ABSORB: the core's ``W_UK`` [H, nope, r] + ``W_UV`` [H, r, v] in the model dtype
      (K * a, ``mla_backend.weights_from_kv_b_proj``), plus, for a bf16 model where our
      kernels run at ``native_isa`` avx512_bf16 or amx, the native kernels' packed copies of
      both (``native.pack_heads``: K * a up to padding to even rows and blocks of 64
      columns), plus what vLLM's ``MLAAttention`` makes
      for every backend but AMX_MLA (``W_UK_T`` / ``W_UV``, see CPU_MLA).
    - CPU_MLA (vLLM's generic path, ``MLAAttention.process_weights_after_loading``):
      ``W_UK_T`` / ``W_UV`` are views of ``kv_b_proj.weight`` when it is already in the model
      dtype (``get_and_maybe_dequant_weights`` returns the weight itself), else a converted
      copy: 0 or K * a.
    - AMX_MLA (``AMXMLAImpl.process_weights_after_loading``): VNNI-packed ``W_UK`` / ``W_UV``
      in the model dtype (``convert_weight_packed`` keeps the element count: measured 2 MiB in
      and out for [16, 512, 128] bf16), after which ``MLAAttention`` releases
      ``kv_b_proj.weight``: K * a - K * c.
    """
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    K = cfg["num_attention_heads"] * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"])
    K *= cfg["kv_lora_rank"]
    c = _ELEM[cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"]
    a = _ELEM[dtype] if dtype in _ELEM else c
    generic = 0 if a == c else K * a
    if backend == "AMX_MLA":
        return K * a - K * c
    if backend == "MLA_ABSORB":
        packed = 0
        if a == 2 and dtype == "bfloat16" and native_isa in _PACKED_ISAS:
            H, nope, v = (cfg[k] for k in ("num_attention_heads", "qk_nope_head_dim", "v_head_dim"))
            r, cols = cfg["kv_lora_rank"], 64
            packed = H * 2 * cols * a * (
                -(-r // cols) * -(-nope // 2) + -(-v // cols) * -(-r // 2)
            )
        return K * a + packed + generic
    return generic


def _process_tree(root: int) -> list[int]:
    """``root`` and its descendants (Linux ``/proc``; ``[root]`` elsewhere)."""
    parent: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        parent[int(stat.parent.name)] = int(fields[1])
    tree, todo = [root], [root]
    while todo:
        pid = todo.pop()
        kids = [p for p, pp in parent.items() if pp == pid]
        tree += kids
        todo += kids
    return tree


def loaded_vllm_kernels(root: int | None = None) -> str:
    """Which of vLLM's CPU kernel libraries (``_C``, ``_C_AVX512``, ``_C_AVX2``) process
    ``root`` (default: this one) and its descendants (the engine core, its workers) have
    mapped, from their ``/proc/<pid>/maps``; "none" where none has."""
    found: set[str] = set()
    for pid in _process_tree(os.getpid() if root is None else root):
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        found.update(re.findall(r"/vllm/(_C(?:_AVX\w+)?)\.abi3\.so", maps))
    return ",".join(sorted(found)) or "none"


def _child(spec: RunSpec) -> dict[str, Any]:
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from mla_backend.testing.host import selected_isa

    t0 = time.perf_counter()
    kwargs = dict(spec.engine_kwargs)
    if spec.profile_dir is not None:
        kwargs["profiler_config"] = {
            "profiler": "torch",
            "torch_profiler_dir": str(Path(spec.profile_dir).resolve()),
            "torch_profiler_use_gzip": False,
            "torch_profiler_with_stack": False,
            "ignore_frontend": True,
        }
    llm = LLM(spec.model, attention_backend=spec.backend, seed=0, **kwargs)
    startup = time.perf_counter() - t0
    cfg = llm.llm_engine.vllm_config
    kv_measured = engine_kv_bytes_per_token(llm)
    kv_expected = kv_bytes_per_token(
        spec.model,
        str(cfg.cache_config.cache_dtype),
        str(cfg.model_config.dtype).removeprefix("torch."),
    )
    result: dict[str, Any] = {
        "backend": spec.backend,
        "amx_forced": os.environ.get(FORCE_ENV) == "1",
        "native_isa": selected_isa(),
        "torch_capability": str(torch.backends.cpu.get_cpu_capability()),
        "vllm_kernels": loaded_vllm_kernels(),
        "model_dtype": str(cfg.model_config.dtype).removeprefix("torch."),
        "startup_s": startup,
        "block_size": cfg.cache_config.block_size,
        "chunked_prefill": cfg.scheduler_config.enable_chunked_prefill,
        "prefix_caching": cfg.cache_config.enable_prefix_caching,
        "kv_cache_dtype": str(cfg.cache_config.cache_dtype),
        # what the engine allocated (vLLM CPU), else the figure from the config
        "kv_bytes_per_token": kv_measured if kv_measured is not None else kv_expected,
        "kv_bytes_per_token_source": "engine" if kv_measured is not None else "config",
        "kv_bytes_per_token_expected": kv_expected,
        "workloads": [],
    }
    vocab = llm.llm_engine.model_config.get_vocab_size()
    for w in spec.workloads:
        sp = SamplingParams(max_tokens=w.output_len, temperature=0.0, ignore_eos=True)

        def make_prompts(k: int, w: Workload = w) -> list[Any]:
            # k = 0: the measured prompts; k > 0: different prompts for warm-up and for each
            # further timed iteration, so no timed run is served from the prefix cache
            if w.texts is not None:
                return (
                    list(w.texts)
                    if k == 0
                    else [" ".join(t.split()[::-1]) + " be" * k for t in w.texts]
                )
            g = torch.Generator().manual_seed(w.seed * 1000 + k)
            return [
                TokensPrompt(
                    prompt_token_ids=torch.randint(4, vocab, (w.input_len,), generator=g).tolist()
                )
                for _ in range(w.num_prompts)
            ]

        llm.generate(make_prompts(1), sp, use_tqdm=False)  # warm-up
        times = []
        outs = None
        for it in range(w.iters):
            prompts = make_prompts(0 if it == 0 else it + 1)
            t = time.perf_counter()
            res = llm.generate(prompts, sp, use_tqdm=False)
            times.append(time.perf_counter() - t)
            if it == 0:
                outs = res
        assert outs is not None
        profiled_s = None
        if spec.profile_dir is not None:
            profiled_s = _profiled_generate(llm, make_prompts(w.iters + 1), sp,
                                            f"{spec.backend}-{w.name}")  # fmt: skip
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        n_in = sum(len(o.prompt_token_ids or []) for o in outs)
        best = min(times)
        result["workloads"].append(
            {
                "name": w.name,
                "num_prompts": len(prompts),
                "input_tokens": n_in,
                "output_tokens": n_out,
                "latency_s": best,
                "latency_all_s": times,
                "profiled_s": profiled_s,
                "output_tok_s": n_out / best,
                "total_tok_s": (n_in + n_out) / best,
                "texts": [o.outputs[0].text for o in outs] if w.texts is not None else None,
                "token_ids": [list(o.outputs[0].token_ids) for o in outs][:4],
            }
        )
    return result


def _profiled_generate(llm: Any, prompts: list[Any], sp: Any, name: str) -> float:
    """One generate under vLLM's torch profiler (the engine was made with a
    ``profiler_config``): the worker writes ``<name>_<rank>.profiler_out.txt`` (the op table)
    and its trace to the profiler's directory. Returns the generate's wall s."""
    llm.start_profile(name)
    t = time.perf_counter()
    llm.generate(prompts, sp, use_tqdm=False)
    wall = time.perf_counter() - t
    llm.stop_profile()
    return wall


def run_backend(spec: RunSpec, timeout: float = 1800.0) -> dict[str, Any]:
    """Run ``spec`` in a fresh Python process and return its result dict; raise
    :class:`EngineFailed` (with the reason from the engine's log) when it fails."""
    try:
        env, _ = engine_env(spec.backend, isa=spec.isa, imitate=spec.imitate)
    except RuntimeError as e:
        raise EngineFailed(spec.backend, str(e)) from e
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    payload = json.dumps(
        {
            "model": spec.model,
            "backend": spec.backend,
            "engine_kwargs": spec.engine_kwargs,
            "workloads": [asdict(w) for w in spec.workloads],
            "profile_dir": spec.profile_dir,
        }
    )
    try:
        proc = subprocess.run(
            [sys.executable, "-m", __name__],
            input=payload,
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as e:
        raise EngineFailed(spec.backend, f"no result within {timeout:.0f} s") from e
    for line in proc.stdout.splitlines():
        if line.startswith(_PREFIX):
            result = json.loads(line[len(_PREFIX) :])
            # the backend the engine ran: vLLM's CPU platform may serve another than asked
            result["selected"] = selected_from_log(proc.stdout + proc.stderr) or "?"
            result["attn_weight_extra_bytes_per_layer"] = attn_weight_extra_bytes(
                spec.model, result["selected"], result["model_dtype"], result["native_isa"]
            )
            return result
    raise EngineFailed(spec.backend, failure_reason(proc.stderr + proc.stdout, proc.returncode))


def main() -> None:
    """Child entry: read a RunSpec as JSON on stdin, print ``RESULT:{json}``."""
    raw = json.loads(sys.stdin.read())
    spec = RunSpec(
        model=raw["model"],
        backend=raw["backend"],
        engine_kwargs=raw["engine_kwargs"],
        workloads=[Workload(**w) for w in raw["workloads"]],
        profile_dir=raw.get("profile_dir"),
    )
    result = _child(spec)
    print(_PREFIX + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
