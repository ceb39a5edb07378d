"""The property-based fuzzer of the public entry points (:mod:`mla_backend.testing.fuzz`), time
boxed: a bounded number of hypothesis examples per target, on the torch implementation and the
native kernels at every ISA level this CPU runs (the ``kernels`` fixture). Deterministic
(derandomized) in CI; the long run with a kept corpus is ``python -m
mla_backend.testing.fuzz --minutes 10``."""

from __future__ import annotations

import pytest

from mla_backend.testing.fuzz import TARGETS, run_target

#: examples per target and implementation (the time box: well under 60 s per implementation)
EXAMPLES = {"write_latent": 60, "write_index_keys": 60, "absorbed": 60, "dsa": 40, "merge": 40}


@pytest.mark.parametrize("target", list(TARGETS))
def test_fuzz(kernels: object, target: str) -> None:
    if target == "merge" and getattr(kernels, "name", "") == "native":
        pytest.skip("merge_attention_shards has no implementation seam: run once (torch)")
    impl = "torch" if kernels.name == "torch" else f"native-{kernels.isa}"
    run_target(target, impl, EXAMPLES[target], derandomize=True)
