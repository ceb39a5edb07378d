"""Score a chunked-context dump of vLLM's MLA grid (``MLA_GRID_DUMP``, ``grid_conftest.py``)
against the float64 truth of the same inputs: the oracle ``reference_mla_attention`` in float64
on the dumped bf16 query / latents (context read back from the paged cache through the block
table), and float64 models of two pipelines' bf16 roundings (the grid reference's decompressed
K/V; an absorbed backend's ``q_lat`` / ``o_lat``).

    python integrations/vllm/upstream/trace_report.py base.pt [label=other.pt ...]

``base.pt`` holds the grid's reference; each ``other.pt`` is the same case (inputs checked
equal) from another run, e.g. ``MLA_GRID_RNG`` replays under another policy or branch.
"""

from __future__ import annotations

import sys

import torch

from mla_backend.testing.reference import reference_mla_attention

#: the grid's tolerance for an auto (bf16) cache
RTOL, ATOL = 1e-2, 1e-2


def sequences(d: dict) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int]]:
    """Per request the whole sequence's c_kv [L, r] and k_pe [L, rope] (cached context, then
    the new tokens), and the number of new tokens."""
    bs, r = d["block_size"], d["kv_lora_rank"]
    cache = d["kv_cache"].reshape(-1, d["kv_cache"].shape[-1])
    qsl, seq = d["query_start_loc"].tolist(), d["seq_lens"].tolist()
    c_kv, k_pe, new = [], [], []
    for i in range(len(seq)):
        a, b = qsl[i], qsl[i + 1]
        pos = torch.arange(seq[i] - (b - a))
        ctx = cache[d["block_table"][i, pos // bs].long() * bs + pos % bs]
        c_kv.append(torch.cat([ctx[:, :r], d["kv_c"][a:b]]))
        k_pe.append(torch.cat([ctx[:, r:], d["k_pe"][a:b].reshape(b - a, -1)]))
        new.append(b - a)
    return c_kv, k_pe, new


def truth_and_models(d: dict) -> dict[str, torch.Tensor]:
    """[T, H*v] float64: ``truth``; ``bf16 K/V``: K/V decompressed and rounded to bf16, the rest
    exact; ``bf16 q_lat+o_lat``: the absorbed query and latent output rounded to bf16."""
    nope, rope, v = d["qk_nope_head_dim"], d["qk_rope_head_dim"], d["v_head_dim"]
    q, W = d["query"], d["kv_b_weight"]
    T, H = q.shape[:2]
    c_kv, k_pe, new = sequences(d)
    out = {
        "truth": reference_mla_attention(
            q[..., :nope], q[..., nope:], c_kv, k_pe, W, nope, v, new, dtype=torch.float64
        ).reshape(T, -1)
    }
    w = W.double().reshape(H, nope + v, -1)
    scale = (nope + rope) ** -0.5
    kv_model, lat_model, row = [], [], 0
    for c, kp, n in zip(c_kv, k_pe, new, strict=True):
        L = c.shape[0]
        c, kp, qq = c.double(), kp.double(), q[row : row + n].double().transpose(0, 1)
        masked = torch.arange(L)[None, :] > (L - n + torch.arange(n))[:, None]

        def attend(s: torch.Tensor, masked: torch.Tensor = masked) -> torch.Tensor:
            return torch.softmax((s * scale).masked_fill(masked, float("-inf")), -1)

        k_nope = torch.einsum("lr,hdr->hld", c, w[:, :nope]).bfloat16().double()
        vv = torch.einsum("lr,hdr->hld", c, w[:, nope:]).bfloat16().double()
        k = torch.cat([k_nope, kp[None].expand(H, L, rope)], -1)
        kv_model.append((attend(qq @ k.transpose(1, 2)) @ vv).transpose(0, 1))
        q_lat = torch.einsum("hnd,hdr->hnr", qq[..., :nope], w[:, :nope]).bfloat16().double()
        o_lat = (attend(q_lat @ c.T + qq[..., nope:] @ kp.T) @ c).bfloat16().double()
        lat_model.append(torch.einsum("hnr,hdr->nhd", o_lat, w[:, nope:]))
        row += n
    out["bf16 K/V"] = torch.cat(kv_model).reshape(T, -1)
    out["bf16 q_lat+o_lat"] = torch.cat(lat_model).reshape(T, -1)
    return out


def rejected(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """The elements the grid's ``torch.allclose`` rejects (in bf16 when both are bf16)."""
    if x.dtype != ref.dtype:
        x, ref = x.double(), ref.double()
    return ~torch.isclose(x, ref, rtol=RTOL, atol=ATOL)


def report(base: dict, others: dict[str, dict]) -> list[str]:
    """Lines: the rejected elements of ``base``'s output, then |x - truth| max / mean and the
    grid check of every output (the reference, base's, the models, the rounded truth, others')."""
    ours, ref = base["output"], base["reference"]
    m = truth_and_models(base)
    truth = m["truth"]
    bad = rejected(ours, ref)
    v, qsl = base["v_head_dim"], base["query_start_loc"].tolist()
    lines = [f"{ours.numel()} outputs, block size {base['block_size']}: {int(bad.sum())} rejected"]
    for t, col in bad.nonzero().tolist():
        req = max(i for i in range(len(qsl) - 1) if qsl[i] <= t)
        o, rf, tr = ours[t, col].item(), ref[t, col].item(), truth[t, col].item()
        lines.append(
            f"  token {t} (request {req}, new token {t - qsl[req]}) head {col // v} dim "
            f"{col % v}: ours {o:+.6f} ref {rf:+.6f} truth {tr:+.6f} |ours-truth| "
            f"{abs(o - tr):.5f} |ref-truth| {abs(rf - tr):.5f} allowance "
            f"{ATOL + RTOL * abs(rf):.5f}"
        )
    rows = {"grid reference": ref, "ours": ours}
    rows.update({f"model {k}": x for k, x in m.items() if k != "truth"})
    rows["truth rounded to bf16"] = truth.bfloat16()
    for label, d in others.items():
        for k in ("query", "kv_c", "k_pe", "kv_cache", "kv_b_weight", "block_table"):
            if not torch.equal(d[k], base[k]):
                raise ValueError(f"{label}: its {k} differs from the base dump's")
        rows[label] = d["output"]
    for name, x in rows.items():
        e = (x.double() - truth).abs()
        lines.append(
            f"{name:28s} |x-truth| max {e.max().item():.5f} mean {e.mean().item():.2e}; "
            f"rejected vs grid ref {int(rejected(x, ref).sum())}"
        )
    return lines


def main(argv: list[str]) -> None:
    load = lambda p: torch.load(p, weights_only=False)  # noqa: E731
    others = dict(a.split("=", 1) for a in argv[1:])
    print("\n".join(report(load(argv[0]), {k: load(p) for k, p in others.items()})))


if __name__ == "__main__":
    main(sys.argv[1:])
