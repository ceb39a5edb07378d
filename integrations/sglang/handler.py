"""DeepSeek forward-method handler for ``mla_absorb``: the core's policy picks MLA or MHA.

SGLang's ``DeepseekV2AttentionMLA.dispatch_attn_forward_method`` asks
``AttentionBackendRegistry.get_handler(<backend name>)(attn, forward_batch)`` which forward
method to run for the batch. We answer from the step's plan, made once per forward in the
backend's metadata (``plan.uses_normal``: the policy decided per request, once, in ``mb.plan``;
no second per-batch rule here):

- absorbed (``AttnForwardMethod.MLA``): decode, speculative verify / draft-extend, and extends
  the policy prices cheaper absorbed (short extends onto a prefix);
- normal (``AttnForwardMethod.MHA``): fresh prefills and, as the core decides, long cached
  prefixes. The core's normal path reads prefix + new tokens from the latent cache and
  decompresses a long prefix in bounded chunks merged by LSE, so SGLang's own chunked-KV
  loop (``MHA_CHUNKED_KV``) is never needed: one ``attn_mha`` call per layer.

The handler also binds the layer's module to the backend, so the normal path can use the
model's absorbed weights (``w_kc`` / ``w_vc``) whatever layout SGLang repacked
``kv_b_proj`` into.
"""

from __future__ import annotations

from typing import Any

from mla_backend_integrations.sglang.compat import absorbed_forward_method
from sglang.srt.models.deepseek_common.attention_backend_handler import (
    _dispatch_mla_subtype,
)
from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import (
    AttnForwardMethod,
)


def our_backend(forward_batch: Any) -> Any:
    """The step's ``mla_absorb`` backend (through SGLang's wrappers), or None."""
    from mla_backend_integrations.sglang.backend import MLAAbsorbBackend
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_mha import (
        resolve_attn_backend,
    )

    backend = resolve_attn_backend(forward_batch)
    return backend if isinstance(backend, MLAAbsorbBackend) else None


def handle_attention_mla_absorb(attn: Any, forward_batch: Any) -> AttnForwardMethod:
    """Forward method for one DeepSeek attention layer and batch (MLA or MHA)."""
    backend = our_backend(forward_batch)
    if backend is None:  # e.g. called for a wrapped/hybrid backend we do not own: absorb
        return _dispatch_mla_subtype(attn, forward_batch)
    backend.bind_layer(attn)
    if backend.forward_metadata is None:
        backend.init_forward_metadata(forward_batch)
    plan = backend.forward_metadata.plan
    if plan.uses_normal and not backend.uses_sparse(plan):
        return AttnForwardMethod.MHA
    # absorbed: the plain MLA method (compat: the CPU fused-rope subtype would bypass us)
    return absorbed_forward_method(attn, forward_batch)
