"""The per-layer calls read no tensor data on the host (issue 8, item 2), on the torch path.

For decode, extend-onto-prefix, mixed and normal-path plans (made beforehand from real data):

- every per-layer call (``MLAAttention(...)(...)``, ``mb.absorbed_attention``,
  ``mb.normal_attention``, ``mb.write_latent``) runs under ``FakeTensorMode`` with every tensor
  argument faked, the plan's index tensors included, and gives outputs of the right shape and
  dtype: a fake tensor has no data, so any ``.item()`` / ``.tolist()`` / ``int(t)`` / ``bool(t)``
  in the call raises;
- a ``TorchDispatchMode`` counting ``aten._local_scalar_dense`` (what ``.item()``, ``int(t)``,
  ``float(t)`` and ``bool(t)`` dispatch to: a device-to-host sync on a GPU) sees zero calls
  during a real run, with bf16 and fp8 caches (with ``kv_scale``).

The helpers take the kernel implementation as an argument; ``tests/triton_path`` runs the same
checks on the Triton kernels.
"""

from __future__ import annotations

import dataclasses
import traceback
from collections.abc import Callable

import pytest
import torch
from torch._subclasses import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import mla_backend as mb
from mla_backend.policy import PathChoice
from mla_backend.testing.cases import Case, make_case, make_dsa_case


class _FixedChoice(mb.Policy):
    """A policy that returns a given per-request decision (a deterministic mixed step)."""

    def __init__(self, use_absorbed: list[bool]) -> None:
        super().__init__("cost")
        self._use = list(use_absorbed)

    def choose(self, batch, dims, device_type="cpu", impl="torch") -> PathChoice:
        return PathChoice(list(self._use))


DIMS = mb.MLADims(num_heads=3, kv_lora_rank=32, qk_nope_head_dim=12, qk_rope_head_dim=16,
                  v_head_dim=20)

# name: (prefix_lens, new_lens, phase, policy, expected plan mode)
SCENARIOS: dict[str, tuple] = {
    "decode": ([5, 37, 70], [1, 1, 1], mb.Phase.DECODE, mb.Policy("absorb"), "absorbed"),
    "extend": ([9, 33, 0], [5, 9, 4], mb.Phase.EXTEND, mb.Policy("absorb"), "absorbed"),
    "mixed": ([0, 40, 17], [12, 1, 3], mb.Phase.MIXED, _FixedChoice([False, True, True]),
              "mixed"),
    "normal": ([0, 21], [7, 4], mb.Phase.EXTEND, mb.Policy("normal"), "normal"),
}
CHUNK = 8  # normal path: prefixes decompressed 8 tokens at a time (several chunks)


def build(name: str, cache_dtype: torch.dtype, impl: object, device: torch.device | str = "cpu",
          dtype: torch.dtype = torch.bfloat16) -> tuple[Case, mb.MLAPlan]:
    """The scenario's case (moved to ``device``) and its plan for ``impl``."""
    prefix, new, phase, policy, mode = SCENARIOS[name]
    case = make_case(DIMS, prefix, new, 16, dtype=dtype, cache_dtype=cache_dtype, seed=3,
                     phase=phase)
    dev = torch.device(device)
    if dev.type != "cpu":
        table = case.batch.block_table
        case.batch = mb.MLABatch.build(prefix, new, table.to(dev), 16, phase,
                                       block_table_host=table)
        for field in ("kv_cache", "kv_scale", "q_nope", "q_pe"):
            t = getattr(case, field)
            setattr(case, field, None if t is None else t.to(dev))
        case.weights = _map_tensors(case.weights, lambda t: t.to(dev))
    plan = mb.plan(case.batch, DIMS, policy, device=dev, impl=impl)
    assert plan.mode == mode
    return case, plan


def _map_tensors(obj, fn: Callable[[torch.Tensor], torch.Tensor], memo: dict | None = None):
    """A copy of a (frozen) dataclass tree with every tensor replaced by ``fn(tensor)``
    (shared sub-objects stay shared: a whole-step plan's ``absorbed`` is its ``step``)."""
    memo = {} if memo is None else memo
    if id(obj) in memo:
        return memo[id(obj)]
    if isinstance(obj, torch.Tensor):
        out = fn(obj)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {}
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if isinstance(v, torch.Tensor) or (
                dataclasses.is_dataclass(v) and not isinstance(v, type)
            ):
                changes[f.name] = _map_tensors(v, fn, memo)
        out = dataclasses.replace(obj, **changes) if changes else obj
    else:
        out = obj
    memo[id(obj)] = out
    return out


def _calls(case: Case, plan: mb.MLAPlan) -> dict[str, Callable[..., object]]:
    """The per-layer calls of one step; each takes (case, plan) so fakes can stand in."""
    scale = DIMS.default_softmax_scale
    T, H = case.q_nope.shape[:2]
    r, rope = DIMS.kv_lora_rank, DIMS.qk_rope_head_dim

    def q_lat(c):
        return torch.ones(T, H, r, dtype=c.q_nope.dtype, device=c.q_nope.device)

    calls = {
        "MLAAttention": lambda c, p: mb.MLAAttention(DIMS, c.weights, chunk_tokens=CHUNK)(
            c.q_nope, c.q_pe, c.kv_cache, p, c.kv_scale
        ),
        "absorbed_attention": lambda c, p: mb.absorbed_attention(
            q_lat(c), c.q_pe, c.kv_cache, p, scale, c.kv_scale
        ),
        "normal_attention": lambda c, p: mb.normal_attention(
            c.q_nope, c.q_pe, c.kv_cache, p, c.weights, scale, c.kv_scale, chunk_tokens=CHUNK
        ),
    }

    def write(c, p):
        dev = c.kv_cache.device
        c_kv = torch.ones(3, r, dtype=c.q_nope.dtype, device=dev)
        k_pe = torch.ones(3, rope, dtype=c.q_nope.dtype, device=dev)
        slots = torch.tensor([1, -1, 2], device=dev)
        if getattr(c, "fake_slots", None) is not None:
            slots = c.fake_slots
        mb.write_latent(c.kv_cache, c_kv, k_pe, slots, c.kv_scale, impl=p.impl)
        return c.kv_cache

    calls["write_latent"] = write
    return calls


def expected_shape(call: str, case: Case) -> tuple[tuple[int, ...], ...]:
    T, H = case.q_nope.shape[:2]
    if call == "MLAAttention":
        return ((T, H, DIMS.v_head_dim),)
    if call == "absorbed_attention":
        return ((T, H, DIMS.kv_lora_rank), (T, H))
    if call == "normal_attention":
        return ((T, H, DIMS.v_head_dim), (T, H))
    return (tuple(case.kv_cache.shape),)


CALLS = ["MLAAttention", "absorbed_attention", "normal_attention", "write_latent"]


def check_fake(name: str, cache_dtype: torch.dtype, impl: object,
               device: torch.device | str = "cpu", calls: list[str] = CALLS) -> None:
    """Per-layer calls under FakeTensorMode, all tensor arguments (and the plan's) fake."""
    case, plan = build(name, cache_dtype, impl, device)
    cd = case.q_nope.dtype
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = dataclasses.replace(case)  # shallow copy; tensors swapped below
        for field in ("kv_cache", "kv_scale", "q_nope", "q_pe"):
            t = getattr(case, field)
            setattr(fake, field, None if t is None else mode.from_tensor(t))
        fake.weights = _map_tensors(case.weights, mode.from_tensor)
        fake.fake_slots = mode.from_tensor(torch.tensor([1, -1, 2], device=case.kv_cache.device))
        fake_plan = _map_tensors(plan, mode.from_tensor)
        assert fake_plan.step.block_table is not plan.step.block_table
        fns = _calls(case, plan)
        for call in calls:
            out = fns[call](fake, fake_plan)
            outs = out if isinstance(out, tuple) else (out,)
            want = expected_shape(call, case)
            assert tuple(tuple(o.shape) for o in outs) == want, (name, call)
            assert all(isinstance(o, torch._subclasses.FakeTensor) for o in outs), (name, call)
            if call in ("MLAAttention", "absorbed_attention", "normal_attention"):
                assert outs[0].dtype == cd, (name, call)
            if len(outs) == 2:
                assert outs[1].dtype == torch.float32, (name, call)
            assert all(o.device == case.kv_cache.device for o in outs), (name, call)


class CountSyncs(TorchDispatchMode):
    """Counts ``aten._local_scalar_dense`` (a tensor value read on the host) and records where
    in mla_backend each one came from."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            frames = [f for f in traceback.extract_stack() if "mla_backend" in f.filename]
            site = frames[-1] if frames else traceback.extract_stack()[-2]
            self.sites.append(f"{site.filename}:{site.lineno} ({site.line})")
        return func(*args, **(kwargs or {}))


def check_no_sync(name: str, cache_dtype: torch.dtype, impl: object,
                  device: torch.device | str = "cpu",
                  calls: list[str] = CALLS) -> dict[str, object]:
    """A real run of the per-layer calls reads no tensor value on the host; returns the
    outputs (checked finite)."""
    case, plan = build(name, cache_dtype, impl, device)
    outs = {}
    fns = _calls(case, plan)
    with CountSyncs() as counter:
        for call in calls:
            outs[call] = fns[call](case, plan)
    assert counter.sites == [], f"{name}: host reads of tensor data at {counter.sites}"
    for call in [c for c in calls if c != "write_latent"]:
        out = outs[call]
        o = out[0] if isinstance(out, tuple) else out
        assert torch.isfinite(o.float()).all(), (name, call)
    return outs


CACHES = [torch.bfloat16, mb.FP8_DTYPE]

# The torch path's cache write indexes with 0-d tensors (a host read of each, i.e. a
# device-to-host sync on a GPU): mla_backend/ops/torch/kernels.py, Kernels.write_latent,
# ``smax = slots[top]`` and ``row[top]`` / ``flat[smax]`` in the ``fill`` line.
TORCH_CALLS = CALLS


@pytest.mark.parametrize("call", TORCH_CALLS)
@pytest.mark.parametrize("cache_dtype", CACHES, ids=["bf16", "fp8"])
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_torch_path_runs_under_fake_tensor_mode(
    name: str, cache_dtype: torch.dtype, call: str
) -> None:
    check_fake(name, cache_dtype, "torch", calls=[call])


@pytest.mark.parametrize("call", TORCH_CALLS)
@pytest.mark.parametrize("cache_dtype", CACHES, ids=["bf16", "fp8"])
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_torch_path_reads_no_tensor_data_on_host(
    name: str, cache_dtype: torch.dtype, call: str
) -> None:
    check_no_sync(name, cache_dtype, "torch", calls=[call])


def test_counter_sees_a_host_read() -> None:
    """The counting mode itself works: ``.item()``, ``int(t)`` and ``bool(t)`` are seen."""
    t = torch.ones(2)
    with CountSyncs() as counter:
        t.sum().item()
        int(t[0])
        bool(t[1] > 0)
    assert len(counter.sites) == 3


# ---- DSA: the indexer's key write, logits, top-k and the sparse attention --------------------
DSA_CALLS = ["write_index_keys", "indexer_logits", "indexer_topk", "sparse_absorbed_attention"]


def _dsa_calls() -> dict[str, Callable[..., object]]:
    """The DSA per-layer calls; each takes (tensors, plan) so fakes can stand in."""

    def write(t, p):
        mb.write_index_keys(t["index_cache"], t["k_I"], t["slots"], impl=p.impl)
        return t["index_cache"]

    return {
        "write_index_keys": write,
        "indexer_logits": lambda t, p: mb.indexer_logits(t["q_I"], t["w"], t["index_cache"], p),
        "indexer_topk": lambda t, p: mb.indexer_topk(t["q_I"], t["w"], t["index_cache"], p, 5),
        "sparse_absorbed_attention": lambda t, p: mb.sparse_absorbed_attention(
            t["q_lat"], t["q_pe"], t["kv_cache"], p, t["idx"], 0.1, t["kv_scale"]
        ),
    }


def _dsa_inputs(cache_dtype: torch.dtype, impl: str) -> tuple[dict, mb.MLAPlan]:
    d = make_dsa_case(DIMS, mb.IndexerDims(4, 32, 5), [5, 37, 0], [1, 1, 4], 16,
                      dtype=torch.bfloat16, cache_dtype=cache_dtype, seed=3,
                      impl="torch")  # fmt: skip
    plan = d.plan(impl=impl)
    T, H = plan.num_tokens, DIMS.num_heads
    t = {
        "index_cache": d.index_cache, "q_I": d.q_I, "w": d.weights, "kv_cache": d.case.kv_cache,
        "kv_scale": d.case.kv_scale, "k_I": torch.ones(3, 32, dtype=torch.bfloat16),
        "slots": torch.tensor([1, -1, 2]),
        "q_lat": torch.ones(T, H, DIMS.kv_lora_rank, dtype=torch.bfloat16),
        "q_pe": torch.ones(T, H, DIMS.qk_rope_head_dim, dtype=torch.bfloat16),
        "idx": torch.tensor([[0, -1, 2, 3, -1]] * T, dtype=torch.int32),
    }  # fmt: skip
    return t, plan


@pytest.mark.parametrize("call", DSA_CALLS)
@pytest.mark.parametrize("impl", ["torch", "native"])
def test_dsa_calls_under_fake_tensor_mode_and_without_host_reads(call: str, impl: str) -> None:
    if impl == "native" and not mb.ops.native.available():
        pytest.skip("native kernels unavailable")
    tensors, plan = _dsa_inputs(torch.bfloat16, impl)
    fn = _dsa_calls()[call]
    with CountSyncs() as counter:
        real = fn(tensors, plan)
    assert counter.sites == [], f"host reads of tensor data at {counter.sites}"
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = {k: None if v is None else mode.from_tensor(v) for k, v in tensors.items()}
        out = fn(fake, _map_tensors(plan, mode.from_tensor))
    reals = real if isinstance(real, tuple) else (real,)
    outs = out if isinstance(out, tuple) else (out,)
    for r_, o_ in zip(reals, outs, strict=True):
        assert isinstance(o_, torch._subclasses.FakeTensor)
        assert o_.shape == r_.shape and o_.dtype == r_.dtype, call
