"""Helpers shared by the operator benchmarks: random paged problems and result tables."""

from __future__ import annotations

import datetime
import platform
from pathlib import Path

import torch

import mla_backend as mb

RESULTS = Path(__file__).resolve().parent / "results"


def paged_latents(dims: mb.MLADims, kv_lens: list[int], page_size: int, dtype: torch.dtype,
                  seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A random latent cache holding ``kv_lens`` tokens per request in shuffled pages
    (page 0 unused). Returns (kv_cache [P, page, r + rope], block_table [B, max_pages])."""
    g = torch.Generator().manual_seed(seed)
    pages = [-(-n // page_size) for n in kv_lens]
    num = sum(pages) + 1
    cache = (torch.randn(num, page_size, dims.latent_dim, generator=g) * 0.5).to(dtype)
    perm = torch.randperm(num - 1, generator=g) + 1
    table = torch.zeros(len(kv_lens), max(pages), dtype=torch.int32)
    k = 0
    for i, n in enumerate(pages):
        table[i, :n] = perm[k : k + n]
        k += n
    return cache, table


def random_weights(dims: mb.MLADims, dtype: torch.dtype, seed: int = 0) -> mb.AbsorbWeights:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(dims.num_heads * (dims.qk_nope_head_dim + dims.v_head_dim),
                    dims.kv_lora_rank, generator=g) / dims.kv_lora_rank**0.5
    return mb.split_kv_b_proj(w.to(dtype), dims)


def write_table(name: str, header: list[str], rows: list[list[str]], notes: list[str]) -> Path:
    """Print a markdown table and write it (with machine notes) to benchmarks/results/."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    line = lambda cells: "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    text = [line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    text += [line(r) for r in rows]
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H%M%SZ")
    body = "\n".join(
        [f"# {name} ({stamp})", "",
         f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
         f"{platform.processor() or platform.machine()}", ""]
        + [f"- {n}" for n in notes] + [""] + text + [""]
    )
    print(body)
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}-{stamp}.md"
    path.write_text(body)
    (RESULTS / f"{name}-latest.md").write_text(body)
    return path
