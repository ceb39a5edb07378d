"""Test set-up for the SGLang integration.

* Puts the import-only stand-ins (``stubs/``: torchvision, sgl_kernel) on ``sys.path`` and
  on ``PYTHONPATH`` (for server subprocesses): SGLang 0.5.23 imports both at module level and
  neither has a CPU build that loads against torch 2.13.0+cpu. Test tooling only.
* Loads SGLang's plugins (our entry point) once, as every SGLang process does.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

STUBS = str(Path(__file__).resolve().parent / "stubs")
if STUBS not in sys.path:
    sys.path.insert(0, STUBS)
_pp = os.environ.get("PYTHONPATH", "")
if STUBS not in _pp.split(os.pathsep):
    os.environ["PYTHONPATH"] = STUBS + (os.pathsep + _pp if _pp else "")


@pytest.fixture(scope="session", autouse=True)
def _sglang_plugins() -> None:
    from sglang.srt.plugins import load_plugins

    load_plugins()
