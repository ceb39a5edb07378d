"""pytest conftest for vLLM's MLA backend grid on CPU (ours; copied next to vLLM's test files
as ``conftest.py`` by ``run_grid.py``). What CPU needs, each with its reason:

* vLLM's plugins are loaded before the test module is imported, so ``MLA_ABSORB`` is an
  ``AttentionBackendEnum`` member when the module builds its backend lists.
* ``dist_init`` / ``default_vllm_config`` / ``workspace_init``: the fixtures of vLLM's
  ``tests/conftest.py`` (which imports half of vLLM's test suite and its test-only
  dependencies) written again with the same calls; ``dist_init`` uses gloo, as vLLM's does
  on CPU.
* The mock layer's ``kv_b_proj`` is prepared as vLLM's CPU engine prepares MLA's
  (``_cpu_skip_gemm_dispatch``, then ``process_weights_after_loading``: its ``cpu_linear``).
* ``vllm._custom_ops.concat_and_cache_mla`` (the grid fills and appends to the cache with it)
  is a CUDA-only op; on CPU it is replaced by :func:`cpu_concat_and_cache_mla`, a plain
  torch writer with the CUDA kernel's contract. It is independent of ``mla_backend``.
* Every correctness case runs once per *target*: ``MLA_ABSORB`` at several block sizes
  (vLLM's grid uses a backend's first declared kernel block size only; ours is
  ``MultipleOf(1)``, so that is 1) and the control ``CPU_MLA`` at its declared 16. A block
  size the backend does not declare is skipped through ``supports_block_size``.
* The chunked-context test resizes ``builder.chunked_prefill_workspace`` (an attribute of
  vLLM's ``MLACommonMetadataBuilder``); a builder without that workspace (``MLA_ABSORB``
  reads any context length from the paged cache in one pass) gets an unused placeholder
  attribute, so the test's comparison runs (without the workspace split it forces on
  MLACommon backends).
* A spec-decode row of a backend whose builder declares ``QueryLenSupport.SINGLE_ONLY``
  runs nothing in vLLM's grid (its loop ``continue``s); here it is reported as skipped with
  that reason instead of as a pass.
* ``MLA_GRID_SELECT=slice`` keeps the CI slice (:data:`SLICE`); ``all`` keeps every case.
* A per-row-kind passed/skipped/failed summary (and ``MLA_GRID_REPORT``, JSON).
* Tracing, opt-in (off unless set): ``MLA_GRID_DUMP=<dir>`` saves the torch / numpy /
  ``random`` RNG state at the start of each grid case (``<dir>/rng/<case>.pt``; vLLM's test
  draws its data from the global RNG, seeded once at import, so a case's data depend on the
  cases before it) and, for the chunked-context test, the inputs ``run_attention_backend``
  gets, its output and the SDPA reference it is compared with (``<dir>/<case>.pt``).
  ``MLA_GRID_RNG=<file>`` restores a saved state before each grid case (``<dir>/rng``: each
  case its own): run a case alone with the state it had in a long selection and it sees the
  same data.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import json
import os
import random
import re
import tempfile
import time

import numpy as np
import pytest
import torch
from vllm.plugins import load_general_plugins

load_general_plugins()

from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402

assert "MLA_ABSORB" in AttentionBackendEnum.__members__, "mla-backend's vLLM plugin not loaded"

SELECT = os.environ.get("MLA_GRID_SELECT", "slice")
GRID_TESTS = ("test_backend_correctness", "test_chunked_context_backend_correctness")
#: MLA_ABSORB block sizes in the whole grid: 1 (what vLLM's grid picks from our declaration),
#: and 16 / 64 (what engines use); the control runs at its own declared size
ABSORB_BLOCK_SIZES = tuple(
    int(b) for b in os.environ.get("MLA_GRID_BLOCK_SIZES", "1,16,64").split(",")
)

# -- targets ---------------------------------------------------------------------------


def _targets() -> list[tuple[str, int | None]]:
    names = os.environ.get("MLA_GRID_BACKENDS", "MLA_ABSORB,CPU_MLA").split(",")
    out: list[tuple[str, int | None]] = []
    for name in names:
        if name == "MLA_ABSORB":
            out += [(name, bs) for bs in ABSORB_BLOCK_SIZES]
        else:
            out.append((name, None))  # the backend's own (vLLM's grid choice)
    return out


def _target_id(t: tuple[str, int | None]) -> str:
    return t[0] if t[1] is None else f"{t[0]}-bs{t[1]}"


def pytest_generate_tests(metafunc):
    if metafunc.function.__name__ in GRID_TESTS:
        ts = _targets()
        metafunc.parametrize("mla_grid_target", ts, ids=[_target_id(t) for t in ts])


@pytest.fixture
def mla_grid_target():
    return None


@pytest.fixture(autouse=True)
def _mla_grid_setup(request, mla_grid_target, monkeypatch):
    """Point the module's backend list at one target; set its block size."""
    if mla_grid_target is None:
        yield
        return
    mod = request.module
    name, block_size = mla_grid_target
    backend = AttentionBackendEnum[name]
    assert backend in mod.BACKEND_BLOCK_SIZES, f"{name} not in the grid's backend list"
    monkeypatch.setattr(mod, "BACKENDS_TO_TEST", [backend])
    builder_cls = backend.get_class().get_builder_cls()
    if not hasattr(builder_cls, "chunked_prefill_workspace"):
        # the chunked-context test caps MLACommonMetadataBuilder's context workspace by
        # replacing ``builder.chunked_prefill_workspace``; a builder without one (MLA_ABSORB
        # reads any context from the paged cache in one pass) gets an unused placeholder,
        # so the test's own comparison runs
        monkeypatch.setattr(
            builder_cls, "chunked_prefill_workspace", torch.empty(0, 0), raising=False
        )
    if block_size is not None:
        if not backend.get_class().supports_block_size(block_size):
            pytest.skip(f"{name} does not declare block size {block_size}")
        monkeypatch.setitem(mod.BACKEND_BLOCK_SIZES, backend, block_size)
    spec = request.node.callspec.params.get("batch_spec_name", "")
    if spec.startswith("spec_decode") and backend not in mod.SPEC_DECODE_BACKENDS:
        pytest.skip(
            f"{name}'s builder declares QueryLenSupport.SINGLE_ONLY: vLLM's grid runs no "
            "spec-decode row for it"
        )
    yield


# -- kv_b_proj as vLLM's CPU engine prepares it -------------------------------------------


@pytest.fixture(autouse=True)
def _cpu_kv_b_proj(request, monkeypatch):
    """The grid's mock layer skips ``MLAAttention.__init__`` (which marks ``kv_b_proj`` with
    ``_cpu_skip_gemm_dispatch``) and no model loader runs ``process_weights_after_loading``
    on it, which on CPU sets the ``cpu_linear`` that ``kv_b_proj``'s forward calls (CPU_MLA's
    prefill path uses it); do both when the mock layer is built, as the CPU engine does."""
    cls = getattr(request.module, "MockMLAAttentionLayer", None)
    if cls is None:
        yield
        return
    init = cls.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        proj = kwargs["kv_b_proj"]
        if not hasattr(proj, "cpu_linear") and hasattr(proj, "quant_method"):
            proj._cpu_skip_gemm_dispatch = True
            proj.quant_method.process_weights_after_loading(proj)

    monkeypatch.setattr(cls, "__init__", __init__)
    yield


# -- the CPU cache writer ------------------------------------------------------------------


def cpu_concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale):
    """``_C_cache_ops.concat_and_cache_mla`` (csrc/cache_kernels.cu) in torch: token ``t``
    with ``slot_mapping[t] >= 0`` goes to row ``slot`` of the ``[blocks * block_size, width]``
    cache as ``cat(kv_c[t], k_pe[t])``; for ``fp8``/``fp8_e4m3`` as e4m3 of ``x / scale``
    (the kernel's saturating conversion; bytes in a uint8 cache)."""
    if kv_cache_dtype not in ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3"):
        raise NotImplementedError(f"CPU concat_and_cache_mla for {kv_cache_dtype}")
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    rows = torch.cat([kv_c, k_pe.reshape(k_pe.shape[0], -1)], dim=-1)
    slots = slot_mapping.flatten().long()
    keep = slots >= 0
    rows, slots = rows[: slots.numel()][keep], slots[keep]
    if kv_cache_dtype.startswith("fp8"):
        fmax = torch.finfo(torch.float8_e4m3fn).max
        q = (rows.float() / scale.float()).clamp(-fmax, fmax).to(torch.float8_e4m3fn)
        flat.view(torch.float8_e4m3fn)[slots] = q
    else:
        flat[slots] = rows.to(flat.dtype)


@pytest.fixture(autouse=True)
def _cpu_cache_writer(monkeypatch):
    from vllm import _custom_ops as ops

    monkeypatch.setattr(ops, "concat_and_cache_mla", cpu_concat_and_cache_mla)
    yield


# -- vLLM's fixtures (tests/conftest.py), the same calls ---------------------------------


@pytest.fixture
def dist_init():
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        cleanup_dist_env_and_memory,
        init_distributed_environment,
        initialize_model_parallel,
    )

    fd, temp_file = tempfile.mkstemp()
    os.close(fd)
    try:
        with set_current_vllm_config(VllmConfig()):
            init_distributed_environment(
                world_size=1,
                rank=0,
                distributed_init_method=f"file://{temp_file}",
                local_rank=0,
                backend="gloo",
            )
            initialize_model_parallel(1, 1)
            yield
        cleanup_dist_env_and_memory()
    finally:
        with contextlib.suppress(OSError):
            os.unlink(temp_file)


@pytest.fixture
def default_vllm_config():
    from vllm.config import VllmConfig, set_current_vllm_config

    config = VllmConfig()
    with set_current_vllm_config(config):
        yield config


@pytest.fixture
def workspace_init():
    from vllm.v1.worker.workspace import init_workspace_manager, reset_workspace_manager

    if torch.accelerator.is_available():
        init_workspace_manager(torch.device(0))
    yield
    reset_workspace_manager()


# -- tracing (opt-in): RNG state per case, the chunked-context test's data --------------------

DUMP = os.environ.get("MLA_GRID_DUMP")
RNG_FILE = os.environ.get("MLA_GRID_RNG")


def _case_file(item) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", item.name)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before any fixture runs: restore ``MLA_GRID_RNG``'s state, then save the state."""
    if "mla_grid_target" not in getattr(getattr(item, "callspec", None), "params", {}):
        return
    if RNG_FILE:
        path = RNG_FILE
        if os.path.isdir(path):  # a dump's rng/ folder: each case its own state
            path = os.path.join(path, _case_file(item) + ".pt")
            if not os.path.exists(path):
                raise FileNotFoundError(f"MLA_GRID_RNG={RNG_FILE}: no saved state {path}")
        state = torch.load(path, weights_only=False)
        torch.set_rng_state(state["torch"])
        np.random.set_state(state["numpy"])
        random.setstate(state["random"])
        print(f"[vllm-grid] {item.name}: RNG state restored from {path}", flush=True)
    if DUMP:
        os.makedirs(os.path.join(DUMP, "rng"), exist_ok=True)
        state = {
            "torch": torch.get_rng_state(),
            "numpy": np.random.get_state(),
            "random": random.getstate(),
        }
        torch.save(state, os.path.join(DUMP, "rng", _case_file(item) + ".pt"))


@pytest.fixture(autouse=True)
def _mla_grid_dump(request, monkeypatch):
    """With ``MLA_GRID_DUMP``, the chunked-context test's backend inputs (the paged cache as
    the backend receives it), output and SDPA reference go to ``<dir>/<case>.pt``."""
    if not DUMP or request.node.originalname != "test_chunked_context_backend_correctness":
        yield
        return
    mod = request.module
    run = mod.run_attention_backend
    sig = inspect.signature(run)
    got: dict = {}
    allclose = torch.allclose

    def run_and_keep(*args, **kwargs):
        a = sig.bind(*args, **kwargs).arguments
        md = a["common_attn_metadata"]
        got.update(
            {k: a[k].clone() for k in ("query", "kv_c", "k_pe", "kv_cache")},
            kv_b_weight=a["mock_kv_b_proj"].weight.detach().clone(),
            block_table=md.block_table_tensor.clone(),
            seq_lens=md.seq_lens.clone(),
            query_start_loc=md.query_start_loc.clone(),
            slot_mapping=md.slot_mapping.clone(),
            **{k: a[k] for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                 "v_head_dim", "q_scale", "k_scale", "kv_cache_dtype")},
            block_size=a["kv_cache_spec"].block_size,
            backend=a["backend"].name,
        )  # fmt: skip
        got["output"] = out = run(*args, **kwargs)
        return out

    def allclose_and_keep(a, b, *args, **kwargs):
        if a is got.get("output"):
            got["reference"] = b.clone()
        return allclose(a, b, *args, **kwargs)

    monkeypatch.setattr(mod, "run_attention_backend", run_and_keep)
    monkeypatch.setattr(torch, "allclose", allclose_and_keep)
    yield
    if got:
        path = os.path.join(DUMP, _case_file(request.node) + ".pt")
        os.makedirs(DUMP, exist_ok=True)
        torch.save(got, path)
        print(f"[vllm-grid] {request.node.name}: data saved to {path}", flush=True)


# -- the CI slice ----------------------------------------------------------------------------

#: (test, target id, batch spec, tensor_parallel_size, kv_cache_dtype, (q_scale, k_scale),
#: dims id): every row kind, block sizes 1/16/64, kv cache dtypes auto/fp8/fp8_e4m3, 128/32/16/8
#: heads (tp 1/4/8/16), both dims (deepseek nope 128 v 128, glm nope 192 v 256), both scales
_B, _C = GRID_TESTS
_A1, _A16, _A64 = "MLA_ABSORB-bs1", "MLA_ABSORB-bs16", "MLA_ABSORB-bs64"
_S1, _S23 = (1.0, 1.0), (2.0, 3.0)
SLICE = {
    (_B, _A1, "small_decode", 16, "auto", _S1, "deepseek"),
    (_B, _A16, "small_decode", 4, "fp8", _S23, "glm"),
    (_B, _A64, "single_decode", 8, "fp8_e4m3", _S1, "deepseek"),
    (_B, _A16, "small_prefill", 8, "auto", _S23, "glm"),
    (_B, _A64, "small_prefill", 16, "fp8", _S1, "deepseek"),
    (_B, _A1, "mixed_small", 4, "fp8_e4m3", _S23, "deepseek"),
    (_B, _A64, "mixed_small", 1, "auto", _S1, "glm"),
    (_B, _A16, "spec_decode_small", 16, "auto", _S1, "deepseek"),
    (_B, _A1, "spec_decode_small", 16, "fp8", _S23, "glm"),
    (_C, _A16, None, None, "fp8", None, "deepseek"),
    (_C, _A64, None, None, "auto", None, "glm"),
    (_B, "CPU_MLA", "small_decode", 16, "auto", _S1, "deepseek"),
    (_B, "CPU_MLA", "mixed_small", 16, "auto", _S23, "deepseek"),
    (_B, "CPU_MLA", "spec_decode_small", 16, "auto", _S1, "deepseek"),
    (_B, "CPU_MLA", "small_prefill", 16, "fp8", _S1, "deepseek"),
}


def _key(item) -> tuple | None:
    p = getattr(item, "callspec", None)
    if p is None or "mla_grid_target" not in p.params:
        return None
    p = p.params
    dims = "deepseek" if p["qk_nope_head_dim"] == 128 else "glm"
    scales = (p["q_scale"], p["k_scale"]) if "q_scale" in p else None
    return (
        item.originalname,
        _target_id(p["mla_grid_target"]),
        p.get("batch_spec_name"),
        p.get("tensor_parallel_size"),
        p["kv_cache_dtype"],
        scales,
        dims,
    )


def pytest_collection_modifyitems(config, items):
    if SELECT == "all":
        return
    keep, drop = [], []
    for item in items:
        (keep if _key(item) in SLICE else drop).append(item)
    found = {_key(i) for i in keep}
    missing = SLICE - found
    assert not missing, f"slice cases not collected: {sorted(map(str, missing))}"
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep


# -- summary -------------------------------------------------------------------------------

_results: dict[tuple[str, str], collections.Counter] = collections.defaultdict(
    collections.Counter
)
_skip_reasons: collections.Counter = collections.Counter()
_t0 = time.perf_counter()


def _row_kind(item_params: dict, name: str) -> str:
    if name == "test_chunked_context_backend_correctness":
        return "chunked_context"
    spec = item_params.get("batch_spec_name", "")
    for kind in ("spec_decode", "mixed", "decode", "prefill"):
        if kind in spec:
            return kind
    return spec


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    p = getattr(item, "callspec", None)
    if p is None or "mla_grid_target" not in p.params:
        return
    if rep.when == "call" or (rep.when == "setup" and not rep.passed):
        target = p.params["mla_grid_target"][0]
        kind = _row_kind(p.params, item.originalname)
        state = "passed" if rep.passed else "skipped" if rep.skipped else "failed"
        _results[(kind, target)][state] += 1
        if rep.skipped:
            reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
            _skip_reasons[(target, reason.removeprefix("Skipped: "))] += 1


KINDS = ("decode", "prefill", "mixed", "spec_decode", "chunked_context")


def pytest_terminal_summary(terminalreporter):
    tr = terminalreporter
    tr.section(f"vLLM MLA grid ({SELECT}) per row kind")
    rows = []
    def order(kv):
        (kind, target), _ = kv
        return (KINDS.index(kind) if kind in KINDS else len(KINDS), target)

    for (kind, target), c in sorted(_results.items(), key=order):
        line = (
            f"{kind:16s} {target:11s} passed {c['passed']:4d}  skipped {c['skipped']:4d}  "
            f"failed {c['failed']:4d}"
        )
        tr.write_line(line)
        rows.append({"kind": kind, "backend": target, **c})
    for (target, reason), n in sorted(_skip_reasons.items()):
        tr.write_line(f"skip reason: {target}: {n} x {reason}")
    wall = time.perf_counter() - _t0
    tr.write_line(f"wall time {wall:.0f} s")
    path = os.environ.get("MLA_GRID_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(
                {
                    "select": SELECT,
                    "rows": rows,
                    "skip_reasons": [
                        {"backend": t, "reason": r, "count": n}
                        for (t, r), n in sorted(_skip_reasons.items())
                    ],
                    "wall_s": wall,
                },
                f,
                indent=1,
            )
