"""What a user installs: the wheel holds every file of the source tree's packages (``mla_backend/``
whole; ``integrations/`` as ``mla_backend_integrations`` without its tests, READMEs, requirement
files and vLLM's upstream test tooling) and nothing else, and its entry points name modules it
holds.

The wheel is the installed one where this environment has a non-editable install (the nox
sessions install the built wheel), else one built here from a copy of the sources (setuptools'
backend, no network).
"""

from __future__ import annotations

import fnmatch
import importlib.metadata as md
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DIST = "mla-backend"
#: source folder -> its name in the wheel
SHIPPED = {"mla_backend": "mla_backend", "integrations": "mla_backend_integrations"}
#: files of those folders that are not shipped (fnmatch patterns on the source path)
NOT_SHIPPED = (
    "integrations/*/tests/*",
    "integrations/*/README.md",
    "integrations/*/*.txt",
    "integrations/vllm/upstream/*",
)


def source_files() -> set[str]:
    """The wheel's paths of the source files that should ship."""
    out = set()
    for folder, name in SHIPPED.items():
        for p in (ROOT / folder).rglob("*"):
            rel = p.relative_to(ROOT).as_posix()
            if p.is_dir() or "__pycache__" in p.parts or p.suffix == ".pyc":
                continue
            if not any(fnmatch.fnmatch(rel, pat) for pat in NOT_SHIPPED):
                out.add(name + rel[len(folder) :])
    return out


def _installed_wheel_files() -> set[str] | None:
    """The installed distribution's package files, or None where it is absent, editable, or
    metadata in the source tree (an ``*.egg-info`` of a legacy build)."""
    try:
        dist = md.distribution(DIST)
    except md.PackageNotFoundError:
        return None
    direct = dist.read_text("direct_url.json")
    if direct and json.loads(direct).get("dir_info", {}).get("editable"):
        return None
    if Path(str(dist.locate_file(""))).resolve() == ROOT:
        return None
    return {
        f.as_posix() for f in dist.files or ()
        if f.parts[0] in SHIPPED.values() and "__pycache__" not in f.parts
    }  # fmt: skip


def _built_wheel(tmp: Path) -> tuple[set[str], str]:
    """Build a wheel from a copy of the sources; its package files and entry_points.txt."""
    pytest.importorskip("setuptools", minversion="70.1")  # bdist_wheel built in
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in SHIPPED:
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp / "dist"), str(src)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    (wheel,) = (tmp / "dist").glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        eps = next(z.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
    return {n for n in names if n.split("/")[0] in SHIPPED.values()}, eps


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> tuple[set[str], list[str]]:
    """(package files, entry point values) of the wheel under test."""
    installed = _installed_wheel_files()
    if installed is not None:
        eps = [ep.value for ep in md.distribution(DIST).entry_points]
        return installed, eps
    files, text = _built_wheel(tmp_path_factory.mktemp("wheel"))
    eps = [line.split("=", 1)[1].strip() for line in text.splitlines() if "=" in line]
    return files, eps


def test_source_tree_is_read() -> None:
    files = source_files()
    assert "mla_backend/ops/flashinfer/kernels.py" in files
    assert "mla_backend/profiles.json" in files
    assert "mla_backend_integrations/vllm/plugin.py" in files
    assert not any("/tests/" in f for f in files if f.startswith("mla_backend_integrations"))


def test_wheel_holds_the_source_tree(wheel: tuple[set[str], list[str]]) -> None:
    files, _ = wheel
    want = source_files()
    missing, extra = sorted(want - files), sorted(files - want)
    assert not missing, f"the wheel lacks {missing}: add them to setup.py / package-data"
    assert not extra, f"the wheel holds files the source tree lacks or does not ship: {extra}"


def test_entry_points_name_shipped_modules(wheel: tuple[set[str], list[str]]) -> None:
    files, eps = wheel
    assert eps, "no entry points: vLLM and SGLang find the adapters through them"
    for value in eps:
        module = value.split(":", 1)[0].replace(".", "/")
        assert f"{module}.py" in files or f"{module}/__init__.py" in files, value
