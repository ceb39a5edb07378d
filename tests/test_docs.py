"""The documentation shows what the code decides, rendered from it: ``docs/design.md`` the order
``MLA_BACKEND_IMPL=auto`` tries per device type (:data:`mla_backend.selection.AUTO_ORDER`), and
``docs/engines.md`` each engine adapter's workaround table (its ``compat.WORKAROUNDS``, read as
data: importing a ``compat`` module imports no engine). A change to either fails here until
the function's output is pasted into the document (the README's configuration table is
``tests/test_readme.py``'s)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from mla_backend import config, selection

ROOT = Path(__file__).resolve().parents[1]
DESIGN = (ROOT / "docs" / "design.md").read_text()
ENGINES = (ROOT / "docs" / "engines.md").read_text()


def test_design_shows_the_auto_order() -> None:
    table = selection.auto_order_table()
    assert table in DESIGN, (
        "docs/design.md's auto-order table differs from "
        "mla_backend.selection.auto_order_table(): paste the function's output there"
    )
    for device, order in selection.AUTO_ORDER.items():
        assert f"| `{device}` | {', '.join(f'`{n}`' for n in order)} |" in table


def test_auto_order_names_registered_implementations_and_config_names_them_all() -> None:
    names = set(selection.IMPLS.names())
    for order in [*selection.AUTO_ORDER.values(), selection.OTHER_ORDER]:
        assert order and set(order) <= names and order[-1] == "torch"  # torch always runs
    meaning = config.variable("MLA_BACKEND_IMPL").meaning
    assert all(name in meaning for name in names), meaning


def _compat(engine: str) -> ModuleType:
    import importlib

    return importlib.import_module(f"mla_backend_integrations.{engine}.compat")


@pytest.mark.parametrize("engine,label", [("vllm", "vLLM"), ("sglang", "SGLang")])
def test_engines_doc_shows_each_workaround_table(engine: str, label: str) -> None:
    from mla_backend_integrations._common import Workaround, workaround_table

    compat = _compat(engine)
    declared = {v.name for v in vars(compat).values() if isinstance(v, Workaround)}
    listed = [w.name for w in compat.WORKAROUNDS]
    assert sorted(listed) == sorted(declared), "a Workaround is missing from WORKAROUNDS"
    for w in compat.WORKAROUNDS:
        assert w.upstream.strip() and w.remedy.strip() and w.versions[0] < w.versions[1], w.name
    table = workaround_table(compat.WORKAROUNDS, label)
    assert table in ENGINES, (
        f"docs/engines.md's {label} workaround table differs from workaround_table("
        f"{engine}.compat.WORKAROUNDS, {label!r}): paste the function's output there"
    )
    assert len(table.splitlines()) == 2 + len(listed)


def test_compat_modules_import_no_engine() -> None:
    code = (
        "import sys\n"
        "import mla_backend_integrations.vllm.compat, mla_backend_integrations.sglang.compat\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('vllm', 'sglang', 'sgl_kernel')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_a_workaround_outside_its_versions_is_skipped_once(caplog) -> None:
    from mla_backend_integrations import _common

    w = _common.Workaround(
        "test-only", ((1, 2), (1, 4)), "upstream does X", lambda: "1.4.0", "test.compat",
        "we do Y",
    )  # fmt: skip
    assert w.applies("1.2.0") and w.applies("1.3.9+cpu") and w.range_text() == ">= 1.2, < 1.4"
    with caplog.at_level("WARNING", logger="test.compat"):
        assert not w.applies() and not w.applies("1.1") and not w.applies("dev")
    (record,) = caplog.records
    assert "'test-only'" in record.getMessage() and ">= 1.2, < 1.4" in record.getMessage()
    _common._SKIPPED.discard("test-only")


@pytest.mark.parametrize("split", [True, False])
def test_sglang_split_qk_list_edit_is_idempotent_and_guarded(monkeypatch, split: bool) -> None:
    compat = _compat("sglang")
    inside = compat.TESTED_SGLANG_RANGE[0]
    w = compat.SPLIT_QK_BACKENDS
    at = ".".join(map(str, inside))
    monkeypatch.setattr(compat, "SPLIT_QK_BACKENDS", w.__class__(
        **{**w.__dict__, "version_of": lambda: at}))  # fmt: skip
    start = ["fa3", "mla_absorb"] if not split else ["fa3"]
    backends = list(start)
    for _ in range(2):
        compat.use_split_qk(backends, "mla_absorb", split)
        assert backends == (["fa3", "mla_absorb"] if split else ["fa3"])
    monkeypatch.setattr(compat, "SPLIT_QK_BACKENDS", w.__class__(
        **{**w.__dict__, "version_of": lambda: "0.9.0"}))  # fmt: skip
    untouched = list(start)
    compat.use_split_qk(untouched, "mla_absorb", split)
    assert untouched == start
    from mla_backend_integrations import _common

    _common._SKIPPED.discard(w.name)  # the real workaround's skip is still logged once
