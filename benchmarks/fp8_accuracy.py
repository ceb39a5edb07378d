"""``python -m benchmarks fp8-accuracy``: where the fp8 latent caches lose accuracy, below the
engine (no vLLM; seconds).

For each tiny DeepSeek-V2 checkpoint of integrations/vllm/tests/test_fp8_accuracy.py, the
cached latents of transformers' fp32 ``DeepseekV2ForCausalLM`` on the test's prompts (``c_kv``
= ``kv_a_layernorm``'s output, ``k_pe`` after RoPE; every layer) are captured and

1. quantized the two ways the engine stores them, with the core's own quantizers:
   per-tensor fp8 (float8_e4m3fn, scale 1.0 = vLLM's default ``k_scale``, clamped to +-448,
   c_kv and k_pe) and ``fp8_ds_mla`` (``CacheLayout.pack``/``unpack``: per token, tiles of 128
   c_kv values with their own float32 scale; k_pe kept, here in fp32); reported: the
   relative error of every c_kv value (``|deq - x| / |x|``: median, 99th percentile, and the
   share "lost", off by more than 25%: flushed to zero or saturated), the same median for
   k_pe, the share of c_kv values that per-tensor fp8 stores as subnormals or zero
   (``|x| < 2^-6``) or saturates (``|x| > 448``), and the smallest tile max over the row max
   (median over tokens; near 1: every tile's scale is the row's, the tiles cannot help);
2. fed back into the same fp32 model in place of the exact latents (a forward hook on
   ``kv_a_layernorm`` and a wrapper of the model file's ``apply_rotary_emb``), which gives the
   teacher-forced log-prob error of the cache format alone (no bf16 compute, no engine):
   ``max``/``mean`` |log p_fp8 - log p_fp32| over every prompt position.

    python -m benchmarks fp8-accuracy [--reseed K ...]

``--reseed K [K ...]``: one table per K, with K added to every checkpoint's seed (other
random weights, same construction).

The end-to-end numbers (vLLM, bf16 model) are in the test module and the vLLM README.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from mla_backend.fp8 import FP8_MAX
from mla_backend.testing.tiny_model import make_tiny_deepseek_v2

from . import harness


def _test_module() -> Any:
    """The vLLM fp8 accuracy test module, whose checkpoints, prompts and quantizers this
    analysis measures (loaded by path: the test directory is not a package)."""
    import importlib.util

    path = harness.ROOT / "integrations" / "vllm" / "tests" / "test_fp8_accuracy.py"
    spec = importlib.util.spec_from_file_location("_fp8_accuracy_test", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))  # its own sibling imports
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(path.parent))
    return mod


_T = _test_module()
CHECKPOINTS, LATENT_ONLY, SEEDS = _T.CHECKPOINTS, _T.LATENT_ONLY, _T.SEEDS
fp8_ds_mla_ckv, fp8_per_tensor = _T.fp8_ds_mla_ckv, _T.fp8_per_tensor

FORMATS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], Callable | None]] = {
    # name: (c_kv quantizer, k_pe quantizer or None = exact)
    "fp8": (fp8_per_tensor, fp8_per_tensor),
    "fp8_ds_mla": (fp8_ds_mla_ckv, None),
}


@contextlib.contextmanager
def _quantized_latents(model: Any, fmt: str | None, capture: dict | None = None) -> Iterator:
    """Run ``model`` with its cached latents replaced by the format's dequantized values
    (``fmt`` None: exact), optionally capturing the exact latents per layer."""
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as mod

    q_ckv, q_pe = FORMATS[fmt] if fmt else (None, None)
    handles = []
    for li, layer in enumerate(model.model.layers):

        def hook(_m: Any, _i: Any, out: torch.Tensor, li: int = li) -> torch.Tensor:
            if capture is not None:
                capture.setdefault(("c_kv", li), []).append(out.detach().reshape(-1, out.shape[-1]))
            return q_ckv(out) if q_ckv else out

        handles.append(layer.self_attn.kv_a_layernorm.register_forward_hook(hook))
    orig = mod.apply_rotary_emb
    calls = [0]

    def rope(xq: torch.Tensor, xk: torch.Tensor, freqs: torch.Tensor) -> Any:
        q, k = orig(xq, xk, freqs)
        if capture is not None:
            li = calls[0] % len(model.model.layers)
            capture.setdefault(("k_pe", li), []).append(k.detach().reshape(-1, k.shape[-1]))
        calls[0] += 1
        return q, (q_pe(k) if q_pe else k)

    mod.apply_rotary_emb = rope
    try:
        yield
    finally:
        mod.apply_rotary_emb = orig
        for h in handles:
            h.remove()


@torch.no_grad()
def _logprobs(model: Any, prompts: list[list[int]], fmt: str | None, capture=None) -> list:
    out = []
    with _quantized_latents(model, fmt, capture):
        for p in prompts:
            logits = model(torch.tensor([p])).logits[0].float()
            lp = torch.log_softmax(logits[:-1], dim=-1)
            out.append(lp[torch.arange(len(p) - 1), torch.tensor(p[1:])].double())
    return out


def _value_rel(x: torch.Tensor, deq: torch.Tensor) -> torch.Tensor:
    """|deq - x| / |x| of every nonzero value."""
    nz = x != 0
    return ((deq.float() - x).abs()[nz] / x.abs()[nz]).flatten()


def _quantile(x: torch.Tensor, q: float) -> float:
    return x.kthvalue(max(1, int(q * x.numel()))).values.item()


def analyse(name: str, kw: dict[str, Any], seed: int, root: Path) -> dict[str, Any]:
    import transformers

    path = make_tiny_deepseek_v2(root / name, dtype="float32", seed=seed, **kw)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    prompts = _T._prompts()
    cap: dict = {}
    ref = _logprobs(model, prompts, None, cap)
    ckv = torch.cat([torch.cat(v) for k, v in sorted(cap.items()) if k[0] == "c_kv"])
    kpe = torch.cat([torch.cat(v) for k, v in sorted(cap.items()) if k[0] == "k_pe"])
    a = ckv.abs()
    tiles = a.view(a.shape[0], -1, 128).amax(-1)
    res: dict[str, Any] = {
        "ckv_absmax": a.max().item(),
        "ckv_p01": a.flatten().kthvalue(max(1, a.numel() // 100)).values.item(),
        "kpe_absmax": kpe.abs().max().item(),
        "sub": (a < 2.0**-6).float().mean().item(),
        "sat": (a > FP8_MAX).float().mean().item(),
        "tile_ratio": (tiles.amin(-1) / tiles.amax(-1)).median().item(),
    }
    for fmt, (q_ckv, q_pe) in FORMATS.items():
        rel = _value_rel(ckv, q_ckv(ckv))
        rel_pe = _value_rel(kpe, q_pe(kpe)) if q_pe else torch.zeros(1)
        got = _logprobs(model, prompts, fmt)
        err = torch.cat([(g - r).abs() for g, r in zip(got, ref, strict=True)])
        res[fmt] = {
            "rel_med": rel.median().item(),
            "rel_p99": _quantile(rel, 0.99),
            "lost": (rel > 0.25).float().mean().item(),
            "rel_pe": rel_pe.median().item(),
            "max": err.max().item(),
            "mean": err.mean().item(),
        }
    return res


def table(results: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| checkpoint | c_kv max | c_kv p1 | share < 2^-6 | share > 448 | min tile/row max "
        "| format | c_kv rel. err median / p99 | c_kv lost | k_pe rel. err median "
        "| log-prob err max | mean |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        for fmt in FORMATS:
            f = r[fmt]
            head = (
                f"| {name} | {r['ckv_absmax']:.3g} | {r['ckv_p01']:.2g} | {r['sub']:.1%} "
                f"| {r['sat']:.1%} | {r['tile_ratio']:.2f} "
            )
            lines.append(
                head + f"| {fmt} | {f['rel_med']:.3f} / {f['rel_p99']:.3f} | {f['lost']:.1%} "
                f"| {f['rel_pe']:.3f} "
                f"| {f['max']:.3f} | {f['mean']:.4f} |"
            )
        ratio = r["fp8_ds_mla"]["max"] / r["fp8"]["max"]
        lines.append(f"| {name} | | | | | | ds / fp8 | | | | {ratio:.2f} | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks fp8-accuracy",
                                 description=__doc__.split("\n")[0])  # fmt: skip
    ap.add_argument(
        "--reseed", type=int, nargs="+", default=[0], help="add each of these to every seed"
    )
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    note = (
        "fp8 latent caches below the engine: transformers fp32 with its cached latents "
        "quantized (per-tensor fp8 scale 1.0: c_kv and k_pe; fp8_ds_mla: c_kv tiles, exact "
        "k_pe); log-prob error vs the exact model over every prompt position"
    )
    text = ""
    for k in args.reseed:
        with tempfile.TemporaryDirectory() as tmp:
            results = {
                name: analyse(name, kw, SEEDS[name] + k, Path(tmp))
                for name, kw in {**CHECKPOINTS, **LATENT_ONLY}.items()
            }
        text += f"\nSeeds: the test's + {k}.\n\n" + table(results) + "\n"
    harness.write_result("fp8_accuracy", "fp8 latent caches below the engine", [note], text)
    return 0
