"""The plain-PyTorch implementation of the device seam: runs on every device (the fallback),
and the torch code every other implementation delegates to, explicitly, for what its own
kernels do not serve (:func:`torch_default`).

One module per op, named as the other implementations name theirs: :mod:`.cache_write` (the
latent cache write), :mod:`.absorbed_attention` (MQA over the latent rows), :mod:`.paged` (the
normal path's reads of the latent cache), :mod:`.decompress` (latent rows -> per-head K / V),
:mod:`.mha` (MHA with its log-sum-exp over torch's fused SDPA), :mod:`.indexer` (DSA's index-key
write, lightning-indexer logits and top-k), :mod:`.sparse_attention` (DSA's sparse absorbed
attention), :mod:`.sparse_mha` (DSA's sparse MHA: MHA under a per-row mask) and
:mod:`.keyset_attention` (absorbed attention over key sets: windows, index lists into one or two
caches, sinks); :mod:`.kernels` holds :class:`Kernels` over them.
"""

from __future__ import annotations

from .kernels import DEFAULT, Kernels, torch_default

__all__ = ["DEFAULT", "Kernels", "torch_default"]
