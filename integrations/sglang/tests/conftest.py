"""Test set-up for the SGLang integration.

* Puts the import-only stand-ins (``stubs/``: torchvision, sgl_kernel) on ``sys.path`` and
  on ``PYTHONPATH`` (for server subprocesses) through ``compat.add_import_stubs`` (the
  workaround, its SGLang versions and why). The stand-ins are test tooling only.
* Loads SGLang's plugins (our entry point) once, as every SGLang process does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from mla_backend_integrations.sglang.compat import add_import_stubs

STUBS = str(Path(__file__).resolve().parent / "stubs")
add_import_stubs(STUBS)


@pytest.fixture(scope="session", autouse=True)
def _sglang_plugins() -> None:
    from sglang.srt.plugins import load_plugins

    load_plugins()
