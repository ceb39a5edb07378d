"""``python -m benchmarks policy``: checks the policy against measurement: for extends of N
new tokens onto P cached ones, time the absorbed path and the normal path side by side (full
paths, including the absorption bmms / the decompression) and report which one the cost model picks.

    python -m benchmarks policy [--heads 128,16] [--rounds 3] [--quick] [--fit]
    python -m benchmarks policy --sparse [--heads 8] [--topk 256] [--shapes 0+512,...] [--fit]

The two paths are timed interleaved (``harness.interleaved``: best of ``--rounds`` rounds, each
round times both), so a load change between them shows in both. ``--fit`` also searches a grid
of profiles at the level's peak and bandwidth (:func:`fit_profile`) for the one that picks the
measured shapes best and, where it picks them better than the current profile, stores it in the
package's data file (``mla_backend/profiles.json``) under the name the running implementation
reads (``native:<level>[:<engine>]``: ``mla_backend.ops.native.profile.profile_key`` of the
resolved selection; ``cpu`` for the torch implementation) with the fit's CPU, date and score
(:func:`store_if_better`).

``--sparse`` does the same for a DSA layer's options (prefills, extends onto prefixes, decode:
``benchmarks.sparse_mha.measure``): the policy's route per shape against the fastest of the
sparse absorbed attention, the sparse MHA's two variants and, where the context fits topk, the
dense paths; ``--fit`` then fits the profile's indexer / sparse efficiencies
(:data:`SPARSE_FIT_GRID`, :func:`fit_sparse_profile`) and stores them where they pick better.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

import mla_backend as mb
from mla_backend.cost import (
    PROFILES_PATH,
    DeviceProfile,
    absorbed_cost,
    normal_cost,
    store_profile,
    stored_fit,
)
from mla_backend.ops.native.profile import profile_key
from mla_backend.selection import resolve

from . import harness
from .harness import interleaved, write_result
from .problems import paged_latents, random_weights

DT = torch.bfloat16
CLOSE = 0.1  # a pick within 10% of the faster path counts as right (either is, within noise)

#: the grid :func:`fit_profile` searches (the profile fields a fit sets)
FIT_GRID = {
    "absorbed_efficiency": (0.3, 0.5, 0.7, 1.0, 1.2, 1.5, 2.0, 2.5, 3.0),
    "attn_efficiency": (0.3, 0.5, 0.6, 0.8, 1.0, 1.2, 1.5),
    "normal_overhead": (0.1e-3, 0.3e-3, 0.6e-3, 1e-3, 2e-3, 5e-3),
}


#: the grid :func:`fit_sparse_profile` searches (the DSA fields of the profile)
SPARSE_FIT_GRID = {
    "index_efficiency": (0.1, 0.2, 0.4, 0.7, 1.0, 1.5),
    "sparse_efficiency": (0.1, 0.2, 0.3, 0.5, 0.7, 1.0, 1.5, 2.0),
    "sparse_mha_efficiency": (0.1, 0.2, 0.3, 0.5, 0.8, 1.0, 1.5),
}


@dataclasses.dataclass(frozen=True)
class SparseMeasured:
    """One DSA shape's side-by-side times (seconds, ``benchmarks.sparse_mha.OPTIONS``)."""

    heads: int
    index_heads: int
    topk: int
    prefix: int
    new: int
    times: Mapping[str, float]


def sparse_route(profile: DeviceProfile, m: SparseMeasured) -> str:
    """The cost policy's route for a measured DSA shape on ``profile``."""
    dims = mb.MLADims(m.heads, 512, 128, 64, 128)
    ix = mb.IndexerDims(m.index_heads, 128, m.topk)
    pol = mb.Policy("cost", profile=profile)
    phase = mb.Phase.DECODE if m.new == 1 else mb.Phase.EXTEND
    absorbed = pol.request_uses_absorbed(dims, m.prefix, m.new, phase)
    return pol.dsa_route(dims, ix, m.prefix, m.new, phase, absorbed)


def sparse_score(profile: DeviceProfile, shapes: Sequence[SparseMeasured]) -> tuple[int, float]:
    """(right picks, summed regret) of ``profile``'s routes on the measured DSA shapes."""
    from .sparse_mha import fastest, route_time

    right, regret = 0, 0.0
    for m in shapes:
        best = route_time(m.times, fastest(m.times, m.prefix + m.new <= m.topk))
        picked = route_time(m.times, sparse_route(profile, m))
        right += is_right(picked, best)
        regret += picked / best - 1
    return right, regret


def fit_sparse_profile(base: DeviceProfile, shapes: Sequence[SparseMeasured]) -> DeviceProfile:
    """The profile of :data:`SPARSE_FIT_GRID` (``base``'s other fields) that routes the most
    DSA shapes right, least summed regret among those."""
    grid = [dataclasses.replace(base, **dict(zip(SPARSE_FIT_GRID, values)))
            for values in itertools.product(*SPARSE_FIT_GRID.values())]  # fmt: skip
    return max(grid, key=lambda p: (lambda r: (r[0], -r[1]))(sparse_score(p, shapes)))


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
    ap.add_argument("--sparse", action="store_true",
                    help="DSA shapes: sparse absorbed vs sparse MHA (vs dense within topk)")
    ap.add_argument("--topk", type=int, default=256, help="index_topk of --sparse")
    ap.add_argument("--index-heads", type=int, default=8, help="indexer heads of --sparse")
    ap.add_argument("--shapes", default="0+512,0+2048,1024+256,2048+64,4096+8,4096+1",
                    help="P+N shapes of --sparse")
    args = ap.parse_args(argv)
    if args.sparse:
        return _sparse_main(args)
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
        shapes = (f"H {args.heads}, P {','.join(map(str, prefixes))}, N "
                  f"{','.join(map(str, news))}, {args.rounds} interleaved rounds")  # fmt: skip
        notes.append(_fit_note(measured, shapes))
    write_result("policy", "Cost policy vs measurement: absorbed or normal path", notes,
                 harness.table(header, rows))
    return 0


def store_if_better(
    name: str,
    current: DeviceProfile,
    best: DeviceProfile,
    measured: Sequence[Measured],
    fit: Mapping[str, str],
    path: Path = PROFILES_PATH,
) -> str:
    """Store ``best`` as profile ``name`` (with ``fit`` and the score) where it picks
    ``measured`` better than ``current`` (more right picks, or as many with less regret);
    returns the line that says what happened."""
    (r0, g0), (r1, g1) = score(current, measured), score(best, measured)
    if (r1, -g1) <= (r0, -g0):
        return f"profile {name!r} kept: the best fit picks no better"
    n = len(measured)
    store_profile(name, best, {**fit, "score": f"{r1}/{n} right, summed regret {g1:.2f} (the "
                               f"profile it replaces: {r0}/{n}, {g0:.2f})"}, path)  # fmt: skip
    return f"best fit stored as {name!r} in {path.name}"


def _fit_note(measured: Sequence[Measured], shapes: str) -> str:
    """The level's current profile and the best fit of :data:`FIT_GRID`, each with its score;
    the fit stored where it is better (:func:`store_if_better`)."""
    cpu = torch.device("cpu")
    sel = resolve(cpu)  # what runs here: the kernels, their ISA level and attention engine
    current = sel.kernels.cost_profile(cpu)
    best = fit_profile(current, measured)
    lines = []
    for name, prof in (("current profile", current), ("best fit", best)):
        right, regret = score(prof, measured)
        lines.append(f"{name}: absorbed_efficiency {prof.absorbed_efficiency}, attn_efficiency "
                     f"{prof.attn_efficiency}, normal_overhead {prof.normal_overhead * 1e3:g} ms "
                     f"(peak {prof.peak_flops / 1e12:g} TF/s): {right}/{len(measured)} right, "
                     f"summed regret {regret:.2f}")  # fmt: skip
    native = sel.isa is not None and sel.attention_engine is not None
    name = profile_key(sel.isa.value, sel.attention_engine.value) if native else "cpu"
    stamp = harness.utc_stamp()
    fit = {"cpu": harness.describe_host(), "date": stamp,
           "shapes": f"{shapes}, load average {os.getloadavg()[0]:.1f}",
           "run": f"benchmarks/results/policy-history.md, {stamp}"}  # fmt: skip
    lines.append(store_if_better(name, current, best, measured, fit))
    print("\n".join(lines), flush=True)
    return "; ".join(lines)


def _sparse_main(args: argparse.Namespace) -> int:
    """``--sparse``: time the DSA shapes, compare the policy's routes, optionally fit."""
    from .sparse_mha import fastest, parse_shapes, route_time
    from .sparse_mha import measure as measure_sparse

    kern = resolve(torch.device("cpu")).kernels
    prof = kern.cost_profile(torch.device("cpu"))
    heads = "8" if args.heads == "128,16" else args.heads
    measured, rows = [], []
    for h in (int(x) for x in heads.split(",")):
        for P, N in parse_shapes(args.shapes):
            t = measure_sparse(h, args.index_heads, args.topk, P, N, kern, args.rounds, 0.05)
            m = SparseMeasured(h, args.index_heads, args.topk, P, N, t)
            measured.append(m)
            best, picked = fastest(t, P + N <= args.topk), sparse_route(prof, m)
            ok = is_right(route_time(t, picked), route_time(t, best))
            rows.append([str(h), f"{P}+{N}"] + [f"{route_time(t, r) * 1e3:.1f}" for r in
                        ("sparse_absorbed", "sparse_masked", "sparse_gather")]  # fmt: skip
                        + [best, picked, "yes" if ok else "NO"])
            print(" ".join(rows[-1]), flush=True)
    right, regret = sparse_score(prof, measured)
    notes = [f"DSA shapes, bf16, page 64, r=512 rope=64 nope=v=128, indexer {args.index_heads} "
             f"heads x 128 (fp8 cache), index_topk {args.topk}; sparse times include the "
             f"indexer; {args.rounds} interleaved rounds; {harness.describe_host()}",
             f"policy routes {right}/{len(measured)} shapes right (a pick within 10% of the "
             f"fastest counts), summed regret {regret:.2f}"]  # fmt: skip
    if args.fit:
        best = fit_sparse_profile(prof, measured)
        r1, g1 = sparse_score(best, measured)
        line = (f"best fit: index_efficiency {best.index_efficiency}, sparse_efficiency "
                f"{best.sparse_efficiency}, sparse_mha_efficiency {best.sparse_mha_efficiency}: "
                f"{r1}/{len(measured)} right, summed regret {g1:.2f}")  # fmt: skip
        sel = resolve(torch.device("cpu"))
        native = sel.isa is not None and sel.attention_engine is not None
        name = profile_key(sel.isa.value, sel.attention_engine.value) if native else "cpu"
        if (r1, -g1) > (right, -regret):
            stamp = harness.utc_stamp()
            fit = {**stored_fit(name), "dsa_fit": f"{harness.describe_host()}, {stamp}: "
                   f"{r1}/{len(measured)} DSA shapes right (was {right}), H {heads}, topk "
                   f"{args.topk}, shapes {args.shapes}"}  # fmt: skip
            store_profile(name, best, fit)
            line += f"; stored as {name!r}"
        else:
            line += f"; profile {name!r} kept"
        print(line, flush=True)
        notes.append(line)
    header = ["H", "P+N", "sparse absorbed ms", "sparse MHA masked ms", "sparse MHA gather ms",
              "fastest", "policy picks", "ok"]  # fmt: skip
    write_result("policy_dsa", "Cost policy vs measurement: a DSA layer's routes", notes,
                 harness.table(header, rows))
    return 0
