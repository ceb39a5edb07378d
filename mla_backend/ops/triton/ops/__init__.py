"""The Triton implementation's ``torch.library`` custom ops over the paged latent cache (the GPU
path: CUDA and ROCm), one module per job:

- :mod:`.launch`: launching a kernel (through ``torch.library.wrap_triton``; Gluon kernels
  directly), and recording launches instead (:func:`record_launches`, for the ahead-of-time
  resource check, per target arch);
- :mod:`.checks`: the dtypes the kernels take, the cache row width, and when a call may run
  (GPU tensors, or CPU ones under the interpreter; ``FakeTensor`` calls launch nothing);
- :mod:`.fp8_decode`: how e4m3 cache bytes are decoded on a device (:func:`fp8_mode`);
- :mod:`.write`: ``mla_backend::triton_write_latent`` (:func:`write_latent`): one program per
  new token scatters ``[c_kv ; k_pe]`` into its slot (mutates the cache);
- :mod:`.absorbed`: ``mla_backend::triton_absorbed_attention`` (:func:`absorbed_attention`):
  grouped-head paged attention over the latent cache (decode and extend onto a prefix, ragged
  batches) in FlashMLA's shape: up to 64 query rows per program, the kv work cut into pieces by
  the plan's schedule (:mod:`..schedule`), split blocks' partials merged by LSE in a second
  kernel;
- :mod:`.gluon`: the Gluon kernel's launcher and the rule for when it serves a call.

:class:`mla_backend.ops.triton.Kernels` (in :mod:`..kernels`) is the
:class:`mla_backend.ops.KernelImpl` over them; DSA's ops are in :mod:`..dsa`. The ops are built
with ``torch.library.triton_op``, so ``torch.compile`` and ``FakeTensorMode`` trace them like
built-in operators. The Python wrappers check shapes and dtypes and turn the plan part into the
ops' tensor arguments; nothing in a call reads tensor data on the host (no ``.item()``, no
``.tolist()``), so a call can run under ``FakeTensorMode`` and be captured in a CUDA graph.

Precision (issue 12): the scores are fp32 from the dot products (``tl.dot`` accumulates in
fp32) through the online softmax; the probabilities are rounded to the query's dtype before
``P @ V``, which accumulates in fp32; split partials and the LSE merge are fp32; the output is
rounded once.

The kernels also run on CPU tensors under ``TRITON_INTERPRET=1``, which is how this project
tests them without a GPU. The interpreter cannot ``tl.dot`` bfloat16 operands (it multiplies
their raw bit patterns, triton-lang/triton#11584), so when interpreting, bf16 dot operands are
widened to fp32 first; the products are identical (bf16 -> fp32 is exact) and the
probabilities are still rounded to bf16 before ``P @ V`` as on a GPU. Its fp32 -> bf16 cast
truncates where GPUs round to nearest even, so when interpreting the kernels round
probabilities and bf16 outputs to the bf16 grid first (``ROUND_BF16``; compiled GPU kernels
do not need it and do not run it). Under the interpreter a ``FakeTensorMode`` call allocates
the outputs and launches nothing (the interpreter runs kernels on real data; on a GPU
``wrap_triton`` records the launch instead), and ``torch.compile`` of the ops needs a GPU.
"""

from __future__ import annotations

from . import absorbed, checks, fp8_decode, gluon, launch, write
from .absorbed import absorbed_attention, attention_meta
from .fp8_decode import fp8_mode
from .launch import Launch, record_launches, target_arch
from .write import write_latent

__all__ = [
    "Launch", "absorbed", "absorbed_attention", "attention_meta", "checks", "fp8_decode",
    "fp8_mode", "gluon", "launch", "record_launches", "target_arch", "write", "write_latent",
]  # fmt: skip
