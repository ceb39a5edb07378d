"""``python -m benchmarks policy``: checks the policy against measurement: for extends of N
new tokens onto P cached ones, time the absorbed path and the normal path side by side (full
paths, including the absorption bmms / the decompression) and report which one the cost model picks.

    python -m benchmarks policy [--heads 128,16] [--rounds 3] [--quick] [--fit]

The two paths are timed interleaved (``harness.interleaved``: best of ``--rounds`` rounds, each
round times both), so a load change between them shows in both. ``--fit`` also searches a grid
of profiles at the level's peak and bandwidth (:func:`fit_profile`) for the one that picks the
measured shapes best, to refit the level's profile (``mla_backend/ops/native/profile.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
from collections.abc import Sequence

import torch

import mla_backend as mb
from mla_backend.cost import DeviceProfile, absorbed_cost, normal_cost
from mla_backend.selection import get_impl

from . import harness
from .harness import interleaved, write_result
from .problems import paged_latents, random_weights

DT = torch.bfloat16
CLOSE = 0.1  # a pick within 10% of the faster path counts as right (either is, within noise)

#: the grid :func:`fit_profile` searches (the profile fields the fits in profile.py set)
FIT_GRID = {
    "absorbed_efficiency": (0.3, 0.5, 0.7, 1.0, 1.2, 1.5, 2.0, 2.5, 3.0),
    "attn_efficiency": (0.3, 0.5, 0.6, 0.8, 1.0, 1.2, 1.5),
    "normal_overhead": (0.1e-3, 0.3e-3, 0.6e-3, 1e-3, 2e-3, 5e-3),
}


@dataclasses.dataclass(frozen=True)
class Measured:
    """One shape's side-by-side times (seconds) of the two paths."""

    heads: int
    prefix: int
    new: int
    absorbed: float
    normal: float


def is_right(picked: float, best: float) -> bool:
    """A pick taking ``picked`` seconds where the faster path takes ``best`` is right when it is
    the faster one or within :data:`CLOSE` of it (either is, within noise)."""
    return picked == best or (picked - best) / best < CLOSE


def score(profile: DeviceProfile, shapes: Sequence[Measured]) -> tuple[int, float]:
    """(right picks, summed regret) of ``profile`` on the measured shapes: a pick is right when
    it is the faster path or within :data:`CLOSE` of it; regret = picked / faster - 1."""
    right, regret = 0, 0.0
    for m in shapes:
        dims = mb.MLADims(m.heads, 512, 128, 64, 128)
        absorbed = absorbed_cost(dims, m.prefix, m.new, profile) <= normal_cost(
            dims, m.prefix, m.new, profile)
        picked, best = (m.absorbed if absorbed else m.normal), min(m.absorbed, m.normal)
        right += is_right(picked, best)
        regret += picked / best - 1
    return right, regret


def fit_profile(base: DeviceProfile, shapes: Sequence[Measured]) -> DeviceProfile:
    """The profile of :data:`FIT_GRID` (at ``base``'s peak, bandwidth and cache size) that picks
    the most shapes right, least summed regret among those."""
    grid = [dataclasses.replace(base, **dict(zip(FIT_GRID, values)))
            for values in itertools.product(*FIT_GRID.values())]  # fmt: skip
    def rank(profile: DeviceProfile) -> tuple[int, float]:
        right, regret = score(profile, shapes)
        return right, -regret

    return max(grid, key=rank)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks policy",
                                 description=__doc__.split("\n\n")[0])  # fmt: skip
    ap.add_argument("--heads", default="128,16")
    ap.add_argument("--prefix", default="0,1024,4096")
    ap.add_argument("--new", default="16,64,128,256,512,1024")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--fit", action="store_true",
                    help="also fit the level's profile to this run (fit_profile)")
    args = ap.parse_args(argv)
    prefixes = [0, 1024] if args.quick else [int(x) for x in args.prefix.split(",")]
    news = [16, 256] if args.quick else [int(x) for x in args.new.split(",")]
    policy = mb.Policy("cost")
    rows, agree, total, measured = [], 0, 0, []
    for h in (int(x) for x in args.heads.split(",")):
        dims = mb.MLADims(h, 512, 128, 64, 128)
        w = random_weights(dims, DT)
        attn = mb.MLAAttention(dims, w)
        for P in prefixes:
            for N in news:
                cache, table = paged_latents(dims, [P + N], 64, DT)
                b = mb.MLABatch.build([P], [N], table, 64, mb.Phase.EXTEND)
                g = torch.Generator().manual_seed(0)
                qn = torch.randn(N, h, 128, generator=g).to(DT)
                qp = torch.randn(N, h, 64, generator=g).to(DT)
                pa = mb.plan(b, dims, mb.Policy("absorb"))
                pn = mb.plan(b, dims, mb.Policy("normal"))
                t = interleaved({"absorbed": functools.partial(attn, qn, qp, cache, pa),
                                 "normal": functools.partial(attn, qn, qp, cache, pn)},
                                args.rounds, 0.05)  # fmt: skip
                ta, tn = t["absorbed"], t["normal"]
                measured.append(Measured(h, P, N, ta, tn))
                picked = mb.plan(b, dims, policy).mode
                faster = "absorbed" if ta <= tn else "normal"
                ok = is_right(ta if picked == "absorbed" else tn, min(ta, tn))
                agree += ok
                total += 1
                rows.append([str(h), str(P), str(N), f"{ta * 1e3:.1f}", f"{tn * 1e3:.1f}",
                             faster, picked, "yes" if ok else "NO"])
                print(" ".join(rows[-1]), flush=True)
    header = ["H", "prefix P", "new N", "absorbed ms", "normal ms", "faster", "policy picks",
              "ok"]  # fmt: skip
    notes = ["bf16, page 64, shuffled pages, r=512 rope=64 nope=v=128; one request per step",
             f"policy agrees with the measurement in {agree}/{total} cases "
             "(a pick within 10% of the faster path counts as agreeing)"]  # fmt: skip
    if args.fit:
        notes.append(_fit_note(measured))
    write_result("policy", "Cost policy vs measurement: absorbed or normal path", notes,
                 harness.table(header, rows))
    return 0


def _fit_note(measured: Sequence[Measured]) -> str:
    """The level's current profile and the best fit of :data:`FIT_GRID`, each with its score."""
    current = get_impl(torch.device("cpu")).cost_profile(torch.device("cpu"))
    best = fit_profile(current, measured)
    lines = []
    for name, prof in (("current profile", current), ("best fit", best)):
        right, regret = score(prof, measured)
        lines.append(f"{name}: absorbed_efficiency {prof.absorbed_efficiency}, attn_efficiency "
                     f"{prof.attn_efficiency}, normal_overhead {prof.normal_overhead * 1e3:g} ms "
                     f"(peak {prof.peak_flops / 1e12:g} TF/s): {right}/{len(measured)} right, "
                     f"summed regret {regret:.2f}")  # fmt: skip
    print("\n".join(lines), flush=True)
    return "; ".join(lines)
