"""The resolved selection (:mod:`mla_backend.selection`), the registry of implementations and the
one module that reads ``MLA_BACKEND_*`` variables (:mod:`mla_backend.config`): what runs is
reported with why, follows the variables, and bad values are refused naming them."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mla_backend as mb
from mla_backend import config, selection
from mla_backend.ops import native
from mla_backend.ops.registry import Registry
from mla_backend.policy import Policy
from mla_backend.selection import resolve

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")


def test_cpu_selection_names_every_decision_and_its_reason(monkeypatch) -> None:
    for v in config.VARIABLES:
        monkeypatch.delenv(v.name, raising=False)
    sel = resolve(CPU)
    assert sel.device == "cpu" and sel.kernels.name == sel.impl.value
    if native.available():
        assert sel.impl.value == "native" and sel.impl.why.startswith("auto on cpu")
        assert sel.isa.value == native.selected_isa()
        assert "best level this CPU runs" in sel.isa.why
        assert sel.attention_engine is not None and sel.gemm_dispatch is not None
        assert sel.cost_profile.value.startswith(f"native:{sel.isa.value}")
        assert "mla_backend/profiles.json" in sel.cost_profile.why
    else:
        assert sel.impl.value == "torch" and "native unavailable" in sel.impl.why
    assert sel.policy.value == "cost" and sel.policy.why.startswith("default")
    assert sel.variables == ()
    assert resolve(CPU) is sel  # once per configuration
    for label, decision in sel.rows():
        assert decision.value and decision.why, label
        assert f"{label:<17} {decision.value}" in sel.report()


def test_variables_force_decisions_and_say_so(monkeypatch) -> None:
    monkeypatch.setenv("MLA_BACKEND_IMPL", "torch")
    monkeypatch.setenv("MLA_BACKEND_POLICY", "sglang")
    monkeypatch.setenv("MLA_BACKEND_CHUNKED_PREFIX_THRESHOLD", "4096")
    sel = resolve(CPU)
    assert (sel.impl.value, sel.impl.why) == ("torch", "MLA_BACKEND_IMPL=torch")
    assert sel.isa is None and sel.kernels.name == "torch"
    assert sel.policy.value == "sglang (threshold 4096)"
    assert dict(sel.variables)["MLA_BACKEND_POLICY"] == "sglang"
    assert resolve(CPU, "torch").impl.why.startswith("impl='torch'")


@pytest.mark.skipif(not native.host_isas(), reason="no native level on this machine")
def test_forced_isa_and_engine_are_reported(monkeypatch) -> None:
    monkeypatch.delenv("MLA_BACKEND_IMPL", raising=False)
    monkeypatch.setenv("MLA_BACKEND_NATIVE_ISA", "scalar")
    sel = resolve(CPU)
    assert sel.impl.value == "native"
    assert (sel.isa.value, sel.isa.why) == ("scalar", "MLA_BACKEND_NATIVE_ISA=scalar")
    assert sel.attention_engine.value == "fp32" and sel.kernels.level == "scalar"
    monkeypatch.setenv("MLA_BACKEND_NATIVE_ENGINE", "fp32")
    assert resolve(CPU).attention_engine.why == "MLA_BACKEND_NATIVE_ENGINE=fp32"


def test_bad_values_are_refused_naming_them(monkeypatch) -> None:
    monkeypatch.setenv("MLA_BACKEND_IMPL", "cuda")
    with pytest.raises(ValueError, match="MLA_BACKEND_IMPL='cuda' is not supported; supported:"):
        resolve(CPU)
    monkeypatch.setenv("MLA_BACKEND_IMPL", "native")
    with pytest.raises(ValueError, match="serves cpu tensors, not meta"):
        resolve("meta")
    monkeypatch.setenv("MLA_BACKEND_IMPL", "torch")
    monkeypatch.setenv("MLA_BACKEND_POLICY", "fastest")
    with pytest.raises(ValueError, match="MLA_BACKEND_POLICY='fastest'.*cost, sglang"):
        resolve(CPU)


def test_plan_uses_the_selections_policy_parsed_once_per_configuration(monkeypatch) -> None:
    monkeypatch.setenv("MLA_BACKEND_IMPL", "torch")
    monkeypatch.setenv("MLA_BACKEND_POLICY", "normal")
    sel = resolve(CPU)
    assert sel.plan_policy.mode == "normal" and sel.policy.value == "normal"
    assert selection.resolve_policy() is sel.plan_policy
    used: list[Policy] = []
    choose = Policy.choose
    monkeypatch.setattr(Policy, "choose", lambda self, *a, **k: used.append(self) or choose(
        self, *a, **k))
    parse = Policy.from_settings

    def parsed_again(*args: object) -> Policy:
        raise AssertionError("plan() parsed MLA_BACKEND_POLICY again")

    monkeypatch.setattr(Policy, "from_settings", parsed_again)
    b = mb.MLABatch.build([0, 3], [4, 2], torch.zeros(2, 5, dtype=torch.int32), 4,
                          mb.Phase.EXTEND)  # fmt: skip
    dims = mb.MLADims(2, 16, 8, 4, 8)
    plans = [mb.plan(b, dims) for _ in range(3)] + [mb.plan(b, dims, impl="torch")]
    assert used == [sel.plan_policy] * 4 and {p.mode for p in plans} == {"normal"}
    assert mb.plan(b, dims, Policy("absorb")).mode == "absorbed"  # the caller's wins
    # a changed variable is another configuration: its own policy, parsed once
    monkeypatch.setattr(Policy, "from_settings", parse)
    monkeypatch.setenv("MLA_BACKEND_POLICY", "absorb")
    assert mb.plan(b, dims).mode == "absorbed" and used[-1] is resolve(CPU).plan_policy
    assert used[-1] is not sel.plan_policy and used[-1].mode == "absorb"
    monkeypatch.setenv("MLA_BACKEND_CHUNKED_PREFIX_THRESHOLD", "-3")
    with pytest.raises(ValueError, match="MLA_BACKEND_CHUNKED_PREFIX_THRESHOLD=-3 must be >= 0"):
        mb.plan(b, dims)


def test_native_that_cannot_load_falls_back_to_torch_saying_why(monkeypatch) -> None:
    monkeypatch.setenv("MLA_BACKEND_IMPL", "native")
    monkeypatch.setenv("MLA_BACKEND_POLICY", "absorb")  # a configuration of its own
    real = selection._probe
    monkeypatch.setattr(
        selection, "_probe",
        lambda entry, s: "no compiler (test)" if entry.name == "native" else real(entry, s),
    )
    monkeypatch.setattr(selection, "_CACHE", {})
    sel = resolve(CPU)
    assert sel.impl.value == "torch"
    assert "no compiler (test)" in sel.impl.why and "fell back to torch" in sel.impl.why


def test_registry_registers_once_and_lists_names() -> None:
    reg = Registry()

    @reg.register("a", devices=("cpu",), summary="A")
    def make_a():  # noqa: ANN202
        raise AssertionError("factories are lazy: never called by registration")

    with pytest.raises(ValueError, match="registered twice"):
        reg.register("a")(make_a)
    with pytest.raises(ValueError, match="'b' is not supported; supported: a"):
        reg.entry("b")
    assert reg.entry("a").serves("cpu") and not reg.entry("a").serves("cuda")
    assert set(selection.IMPLS.names()) == {"torch", "native", "triton", "flashinfer"}


def test_settings_follow_the_environment(monkeypatch) -> None:
    monkeypatch.delenv("MLA_BACKEND_POLICY", raising=False)
    first = config.current()
    assert config.current() is first and first.policy == "cost"
    monkeypatch.setenv("MLA_BACKEND_POLICY", "  normal ")
    assert config.current().policy == "normal" and config.current().is_set("MLA_BACKEND_POLICY")
    monkeypatch.setenv("MLA_BACKEND_POLICY", "")
    assert config.current().policy == "cost"  # empty reads as unset


def _sources() -> list[Path]:
    dirs = ("mla_backend", "integrations", "benchmarks", "examples", "tests")
    return [p for d in dirs for p in (ROOT / d).rglob("*.py") if ".nox" not in p.parts] + [
        ROOT / "noxfile.py"
    ]


def test_every_variable_is_in_the_one_table() -> None:
    names = {v.name for v in config.VARIABLES}
    used = set()
    for p in _sources():
        used |= set(re.findall(r"\bMLA_BACKEND_[A-Z0-9_]*[A-Z0-9]\b", p.read_text()))
    assert used - names == set(), "add these to mla_backend/config.py VARIABLES"
    assert names - used == set(), "documented but never used"
    table = config.markdown_table()
    assert all(f"`{n}`" in table for n in names)


def test_only_the_config_module_reads_the_variables() -> None:
    """No product module reads an ``MLA_BACKEND_*`` variable from ``os.environ`` itself."""
    offenders = []
    for d in ("mla_backend", "integrations"):
        for p in (ROOT / d).rglob("*.py"):
            if p.name == "config.py" or "tests" in p.parts:
                continue
            for node in ast.walk(ast.parse(p.read_text())):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and (
                    node.func.attr in ("get", "getenv") and node.args
                    and isinstance(node.args[0], ast.Constant)
                    and str(node.args[0].value).startswith("MLA_BACKEND_")
                ):
                    offenders.append(f"{p.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []


def test_info_command_prints_the_selection() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "mla_backend", "info"], capture_output=True, text=True,
        timeout=600, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "device cpu:" in text and "implementation" in text and "policy" in text
    assert "MLA_BACKEND_IMPL" in text and "ISA flags:" in text


def test_adapters_log_the_selection_once(monkeypatch, caplog) -> None:
    import logging

    monkeypatch.setattr(selection, "_logged", set())
    log = logging.getLogger("mla_backend.test_adapter")
    with caplog.at_level(logging.INFO, logger=log.name):
        first = selection.log_once(log, "cpu")
        selection.log_once(log, torch.device("cpu"))
    lines = [r.getMessage() for r in caplog.records if r.name == log.name]
    assert lines == [first.summary()]
    assert lines[0].startswith("mla_backend on cpu: implementation=")
