"""Property-based fuzzer of the public entry points (issue 36, item 4): valid and malformed
metadata mixed, for ``MLABatch.build``, ``plan``, ``write_latent``, ``absorbed_attention``,
``MLAAttention``, ``write_index_keys``, ``indexer_logits``, ``indexer_topk``,
``sparse_absorbed_attention`` and ``merge_attention_shards``.

Each target draws one case (hypothesis ``st.data()``): sizes, a paged cache in one of its
layouts, a batch whose lengths, block table and host copy may be broken (negative or huge
lengths, pages out of range, negative or repeated, a host copy that differs, a table too
narrow, wrong dtypes / ranks), slot mappings and index lists with out-of-range, repeated and
padding entries, ``topk`` 0 or beyond the context, wrong dtypes, ranks, devices (``meta``) and
softmax scales, zero-token steps, NaN / inf values. The property, for every case:

- a case drawn malformed must be refused with ValueError / TypeError / RuntimeError (any
  other exception, a crash or a hang is a finding) and a refused call writes nothing (every
  cache stays bit-identical);
- a valid case must not be refused, and its result must equal the float64 oracle
  (:mod:`mla_backend.testing.reference`, written plainly here for the cache rows): attention
  outputs and LSEs within the dtype's tolerance (non-finite exactly where the oracle's are),
  cache writes value for value, rows a write does not address bit-identical.

A finding raises :class:`FuzzFailure` (hypothesis shrinks it to a minimal case). The CI test
(``tests/test_fuzz.py``) runs a bounded number of examples per target and implementation; the
longer run keeps its corpus (hypothesis's example database, failures first) in a directory::

    python -m mla_backend.testing.fuzz --minutes 10 --impl native --dir .fuzz
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.database import DirectoryBasedExampleDatabase

import mla_backend as mb

from ..cache_layout import CacheLayout
from ..index_cache import IndexCacheLayout
from ..policy import PathChoice
from .cases import ds_mla_dequantized, index_fp8_dequantized
from .dsa_checks import check_topk
from .reference import plain_attention, reference_indexer_logits, reference_sparse_attention

#: what a refusal may raise (anything else is a finding)
REFUSALS = (ValueError, TypeError, RuntimeError)
#: max error of an output relative to max(1, |oracle|), by the queries' dtype
TOL = {torch.float32: 1e-4, torch.bfloat16: 6e-2, torch.float16: 1e-2}
FP8 = mb.FP8_DTYPE
Draw = Callable[[st.SearchStrategy[Any]], Any]


class FuzzFailure(AssertionError):
    """A finding: a silent acceptance, a wrong answer, a refused valid input, a stray write."""


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def expect(
    fn: Callable[[], Any], bad: str | None, *watch: torch.Tensor, writes: bool = False
) -> Any:
    """Run ``fn``: a malformed case (``bad`` says how) must be refused with a message and write
    none of ``watch``; a valid one (``bad`` None) must not be refused, nor write ``watch``
    unless it ``writes`` (a cache writer; its target checks what it wrote). Returns fn's
    result, or None after a refusal."""
    before = [w.clone() for w in watch]
    try:
        out = fn()
    except REFUSALS as e:
        if bad is None:
            raise FuzzFailure(f"a valid case was refused: {type(e).__name__}: {e}") from e
        if not str(e).strip():
            raise FuzzFailure(f"refused ({bad}) without a message") from e
        for w, b in zip(watch, before, strict=True):
            if not _same_bits(w, b):
                raise FuzzFailure(f"a refused call ({bad}) wrote into a cache") from e
        return None
    if bad is not None:
        raise FuzzFailure(f"silent acceptance: {bad}")
    if not writes and not all(_same_bits(w, b) for w, b in zip(watch, before, strict=True)):
        raise FuzzFailure("a call that reads a cache wrote into it")
    return out


def _close(out: torch.Tensor, ref: torch.Tensor, tol: float, what: str) -> None:
    """out within tol x max(1, |ref|) of ref where ref is finite, -inf where ref is (a token
    that sees no key); where ref is NaN or +inf (a non-finite input reached the token) the
    attention's result is unspecified (:func:`mla_backend.absorbed_attention`)."""
    o, r = out.double(), ref.double()
    if o.shape != r.shape:
        raise FuzzFailure(f"{what}: shape {tuple(o.shape)} != the oracle's {tuple(r.shape)}")
    fin = torch.isfinite(r)
    known = fin | torch.isneginf(r)
    if not torch.equal(torch.isneginf(o[known]), torch.isneginf(r[known])) or not torch.isfinite(
        o[fin]
    ).all():
        raise FuzzFailure(f"{what}: non-finite entries differ from the oracle's:\n{o}\n{r}")
    if fin.any():
        scale = max(1.0, r[fin].abs().max().item())
        err = (o[fin] - r[fin]).abs().max().item()
        if err > tol * scale:
            raise FuzzFailure(f"{what}: max error {err:.3g} > {tol * scale:.3g}:\n{o}\n{r}")


def _randn(
    draw: Draw, *shape: int, specials: bool | tuple[float, ...] = True
) -> torch.Tensor:
    """A float32 tensor of standard normals (seeded by the draw), sometimes holding one of
    ``specials`` (True: NaN, +inf, -inf)."""
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    x = torch.randn(*shape, generator=g)
    values = (math.nan, math.inf, -math.inf) if specials is True else specials or ()
    if values and x.numel() and draw(st.integers(0, 9)) == 0:
        x.view(-1)[draw(st.integers(0, x.numel() - 1))] = draw(st.sampled_from(values))
    return x


def _slots(draw: Draw, T: int, n_rows: int) -> tuple[list[int], str | None]:
    """T slots of a cache of n_rows: distinct valid ones, padding (< 0), out of range; and
    what is wrong (None when every slot is valid or padding)."""
    free = draw(st.permutations(range(n_rows))) if n_rows else []
    slots, bad = [], None
    for t in range(T):
        what = draw(st.sampled_from(["valid", "valid", "valid", "pad", "oob"]))
        if what == "valid" and t < len(free):
            slots.append(free[t])
        elif what == "oob":
            slots.append(n_rows + draw(st.sampled_from([0, 1, 7, 2**31 - 1 - n_rows])))
            bad = f"slot {slots[-1]} outside a cache of {n_rows} rows"
        else:
            slots.append(draw(st.sampled_from([-1, -5, -(2**31)])))
    return slots, bad


# ---- a paged latent cache and its values -----------------------------------------------------
def _latent_cache(
    draw: Draw, num_pages: int, ps: int, r: int, rope: int, kind: str, cdt: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(cache [P, ps, W] of ``kind``, its kv_scale, the values each row holds: float64
    [P * ps, r + rope]), every row written with random finite values."""
    n = num_pages * ps
    c, kp = _randn(draw, n, r, specials=False), _randn(draw, n, rope, specials=False)
    if kind == "plain":
        cache = torch.cat([c, kp], -1).to(cdt).view(num_pages, ps, r + rope)
        return cache, None, cache.view(n, -1).double()
    if kind == "fp8":
        scale = torch.tensor(draw(st.sampled_from([0.02, 0.5, 1.0, 3.0])), dtype=torch.float32)
        stored = (torch.cat([c, kp], -1) / scale).clamp(-448, 448).to(FP8)
        values = stored.double() * scale.double()
        return stored.view(num_pages, ps, r + rope), scale, values
    lay = CacheLayout.ds_mla(r, rope, cdt)
    cache = torch.zeros(num_pages, ps, lay.width, dtype=torch.uint8)
    c, kp = c.to(cdt), kp.to(cdt)
    mb.write_latent(cache, c, kp, torch.arange(n), impl="torch")
    values = torch.cat([ds_mla_dequantized(c), kp.float()], -1).double()
    return cache, None, values


# ---- a batch, valid or broken ----------------------------------------------------------------
class Step:
    """A drawn step: its lengths, block table (and host copy), page size and what is wrong with
    it (``bad``: None when valid)."""

    def __init__(self, draw: Draw, num_pages_extra: int = 2) -> None:
        B = draw(st.integers(0, 3))
        self.prefix = [draw(st.integers(0, 12)) for _ in range(B)]
        self.new = [draw(st.integers(0, 3)) for _ in range(B)]
        self.ps = draw(st.sampled_from([1, 2, 4, 16]))
        need = [-(-(p + n) // self.ps) for p, n in zip(self.prefix, self.new, strict=True)]
        self.num_pages = max(1, sum(need) + draw(st.integers(0, num_pages_extra)))
        cols = max(need + [0]) + draw(st.integers(0, 1))
        g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
        # repeated pages are valid (the same rows read twice); unused entries are garbage
        table = torch.randint(0, self.num_pages, (B, cols), generator=g, dtype=torch.int32)
        for i, k in enumerate(need):
            table[i, k:] = draw(st.sampled_from([0, -7, 10**6]))
        self.bad: str | None = None
        self.host: torch.Tensor | None = None
        used = [(i, j) for i, k in enumerate(need) for j in range(k)]
        how = draw(st.sampled_from(["ok"] * 10 + ["negative", "huge", "narrow", "page_oob",
                                                   "page_neg", "host_differs", "host_equal",
                                                   "table_dtype", "table_rank", "page_size"]))
        if how == "negative" and B:
            which = draw(st.sampled_from(["prefix", "new"]))
            getattr(self, which)[draw(st.integers(0, B - 1))] = -draw(st.integers(1, 2**40))
            self.bad = f"a negative {which} length"
        elif how == "huge" and B:
            self.prefix[draw(st.integers(0, B - 1))] = draw(st.sampled_from([2**31, 2**62]))
            self.bad = "a huge prefix length (more pages than the table has)"
        elif how == "narrow" and cols and any(need):
            table = table[:, : max(need) - 1]
            self.bad = "a block table narrower than the longest request"
        elif how in ("page_oob", "page_neg") and used:
            i, j = used[draw(st.integers(0, len(used) - 1))]
            table[i, j] = (
                draw(st.sampled_from([self.num_pages, self.num_pages + 3, 10**8, 2**31 - 1]))
                if how == "page_oob" else draw(st.sampled_from([-1, -(2**31)]))
            )  # fmt: skip
            self.bad = f"block_table[{i}, {j}] = {int(table[i, j])} is not a page of the cache"
        elif how == "host_differs" and used:
            self.host = table.clone()
            i, j = used[draw(st.integers(0, len(used) - 1))]
            self.host[i, j] = (int(table[i, j]) + 1) % (self.num_pages + 1)
            self.bad = "block_table_host differs from the CPU block table"
        elif how == "host_equal":
            self.host = table.clone()
        elif how == "table_dtype":
            table = table.float()
            self.bad = "a float block table"
        elif how == "table_rank":
            table = table.reshape(-1)
            self.bad = "a 1-D block table"
        elif how == "page_size":
            self.ps = draw(st.sampled_from([0, -4]))
            self.bad = f"page_size {self.ps}"
        self.table = table

    @property
    def num_tokens(self) -> int:
        return sum(n for n in self.new if n > 0)

    @property
    def valid(self) -> bool:
        return self.bad is None

    def batch(self) -> mb.MLABatch:
        return mb.MLABatch.build(self.prefix, self.new, self.table, self.ps,
                                 block_table_host=self.host)  # fmt: skip

    def rows(self, i: int) -> list[int]:
        """Flat cache rows of request i's kv positions (a valid step only)."""
        L, ps = self.prefix[i] + self.new[i], self.ps
        return [int(self.table[i, p // ps]) * ps + p % ps for p in range(L)]


def _impl(name: str) -> Any:
    """``torch`` or ``native`` / ``native-<isa>`` -> the implementation argument."""
    if name.startswith("native-"):
        from ..ops import native

        return native.Kernels(isa=name.split("-", 1)[1])
    return name


def _dims(draw: Draw) -> mb.MLADims:
    return mb.MLADims(draw(st.integers(1, 3)), draw(st.sampled_from([4, 8, 12])), 4,
                      draw(st.sampled_from([0, 4])), 4)  # fmt: skip


def _kinds(draw: Draw) -> tuple[str, torch.dtype]:
    """(cache kind, compute dtype)."""
    kind = draw(st.sampled_from(["plain", "plain", "fp8", "fp8_ds_mla"]))
    return kind, draw(st.sampled_from([torch.float32, torch.bfloat16]))


# ---- targets ---------------------------------------------------------------------------------
def fuzz_write_latent(draw: Draw, impl: Any) -> None:
    """``write_latent``: slots valid (distinct), padding, out of range; wrong dtypes, ranks,
    devices, token counts; NaN / inf values. Written rows as the layout's rule stores them,
    every other row bit-identical."""
    r, rope = draw(st.sampled_from([4, 8, 12])), draw(st.sampled_from([0, 4]))
    kind, cdt = _kinds(draw)
    P, ps = draw(st.integers(0, 3)), draw(st.integers(1, 4))
    n_rows = P * ps
    if kind == "plain":
        cache = _randn(draw, P, ps, r + rope, specials=False).to(cdt)
        kv_scale = None
    elif kind == "fp8":
        cache = _randn(draw, P, ps, r + rope, specials=False).to(FP8)
        kv_scale = torch.tensor(draw(st.sampled_from([0.02, 1.0, 4.0])))
    else:
        cache = torch.randint(0, 256, (P, ps, CacheLayout.ds_mla(r, rope, cdt).width),
                              dtype=torch.uint8)  # fmt: skip
        kv_scale = None
    T = draw(st.integers(0, 5))
    slots, bad = _slots(draw, T, n_rows)
    c_kv = _randn(draw, T, r, specials=kind != "fp8_ds_mla").to(cdt)
    k_pe = _randn(draw, T, rope, specials=kind != "fp8_ds_mla").to(cdt)
    sm = torch.tensor(slots + [draw(st.integers(-3, n_rows + 3))] * draw(st.integers(0, 1)),
                      dtype=draw(st.sampled_from([torch.int32, torch.int64])))  # fmt: skip
    how = draw(st.sampled_from(["ok"] * 8 + ["c_dtype", "slot_dtype", "rank", "meta", "short",
                                             "tokens", "width", "scale"]))
    if how == "c_dtype":
        c_kv = c_kv.to(draw(st.sampled_from([torch.float64, torch.int32, FP8])))
        bad = f"c_kv dtype {c_kv.dtype}"
    elif how == "slot_dtype":
        sm = sm.float()
        bad = "a float slot_mapping"
    elif how == "rank":
        c_kv = c_kv[None]
        bad = "a 3-D c_kv"
    elif how == "meta":
        which = draw(st.sampled_from(["c_kv", "k_pe", "slots"]))
        c_kv, k_pe, sm = (x.to("meta") if w == which else x
                          for w, x in (("c_kv", c_kv), ("k_pe", k_pe), ("slots", sm)))  # fmt: skip
        bad = f"{which} on the meta device"
    elif how == "short" and T:
        sm = sm[: T - 1]
        bad = "a slot_mapping shorter than T"
    elif how == "tokens":
        k_pe = torch.cat([k_pe, k_pe[:1].clone()]) if T else torch.zeros(1, rope, dtype=cdt)
        bad = "c_kv and k_pe disagree on T"
    elif how == "width":
        c_kv = torch.cat([c_kv, c_kv[:, :1]], 1)
        bad = "a c_kv wider than the cache's r"
    elif how == "scale" and kind == "fp8":
        kv_scale = draw(st.sampled_from([torch.ones(2), torch.tensor(0.0), torch.tensor(-2.0),
                                         torch.tensor(math.nan), torch.tensor(math.inf),
                                         torch.tensor(1, dtype=torch.int32)]))  # fmt: skip
        bad = f"kv_scale {kv_scale}"
    before = cache.clone()
    res = expect(lambda: mb.write_latent(cache, c_kv, k_pe, sm, kv_scale, impl=impl), bad, cache,
                 writes=True)  # fmt: skip
    if bad is not None or res is not None:
        return
    want = before.clone().view(n_rows, cache.shape[-1])
    for t, s in enumerate(slots):
        if s < 0:
            continue
        if kind == "plain":
            want[s] = torch.cat([c_kv[t], k_pe[t]]).to(cdt)
        elif kind == "fp8":
            want[s] = (torch.cat([c_kv[t], k_pe[t]]).float() / kv_scale).clamp(-448, 448).to(FP8)
    got = cache.view(n_rows, cache.shape[-1])
    if kind == "fp8_ds_mla":  # written rows read back as the rule stores them
        lay = CacheLayout.ds_mla(r, rope, cdt)
        written = [s for s in slots if s >= 0]
        keep = [i for i in range(n_rows) if i not in written]
        if not _same_bits(got[keep], want[keep]):
            raise FuzzFailure("write_latent changed a row it does not address")
        for t, s in enumerate(slots):
            if s >= 0:
                back = lay.decode(got[s : s + 1], torch.float32, None).double()[0]
                exp = torch.cat([ds_mla_dequantized(c_kv[t : t + 1])[0], k_pe[t].float()])
                _close(back, exp.double(), 0.0, f"fp8_ds_mla row of token {t}")
        return
    a, b = got.float(), want.float()
    if not (torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0), b.nan_to_num(0))):
        raise FuzzFailure(f"write_latent ({kind}) stored\n{got}\nnot\n{want}")


def fuzz_write_index_keys(draw: Draw, impl: Any) -> None:
    """``write_index_keys``: vLLM's fp8 layout (plain and ue8m0 scales) and plain caches; slots
    valid, padding, out of range; wrong dtypes, ranks, devices, token counts; +-inf keys (NaN
    too in a plain cache). Written keys read back as the writer rule stores them (vLLM's, as
    :func:`~mla_backend.testing.cases.index_fp8_dequantized` writes it plainly), every other
    slot bit-identical."""
    Di = draw(st.sampled_from([8, 16]))
    kind = draw(st.sampled_from(["fp8", "fp8", "plain"]))
    cdt = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    fmt = draw(st.sampled_from([None, "ue8m0"]))
    lay = (IndexCacheLayout.named("fp8", Di, draw(st.sampled_from([Di, Di // 2])), scale_fmt=fmt)
           if kind == "fp8" else IndexCacheLayout("plain", Di, 0, cdt))  # fmt: skip
    P, ps = draw(st.integers(0, 3)), draw(st.integers(1, 4))
    n_rows = P * ps
    cache = torch.randint(0, 256, (P, ps, lay.width * lay.dtype.itemsize), dtype=torch.uint8)
    cache = cache.view(lay.dtype)
    T = draw(st.integers(0, 5))
    slots, bad = _slots(draw, T, n_rows)
    k = _randn(draw, T, Di, specials=(math.inf, -math.inf) if kind == "fp8" else True).to(cdt)
    sm = torch.tensor(slots, dtype=draw(st.sampled_from([torch.int32, torch.int64])))
    how = draw(st.sampled_from(["ok"] * 8 + ["k_dtype", "slot_dtype", "rank", "meta", "short",
                                             "width"]))
    if how == "k_dtype":
        k = k.to(draw(st.sampled_from([torch.float64, torch.int32, FP8])))
        bad = f"k_I dtype {k.dtype}"
    elif how == "slot_dtype":
        sm = sm.float()
        bad = "a float slot_mapping"
    elif how == "rank":
        k = k[None]
        bad = "a 3-D k_I"
    elif how == "meta":
        k, sm, bad = (k.to("meta"), sm, "k_I on meta") if draw(st.booleans()) else (
            k, sm.to("meta"), "slot_mapping on meta")  # fmt: skip
    elif how == "short" and T:
        sm = sm[: T - 1]
        bad = "a slot_mapping shorter than T"
    elif how == "width":
        k = torch.cat([k, k[:, :1]], 1)
        bad = "keys wider than the layout's index_head_dim"
    before = cache.clone()
    expect(lambda: mb.write_index_keys(cache, k, sm, lay, impl=impl), bad, cache, writes=True)
    if bad is not None:
        return
    values, scales = lay.page_views(cache)
    old_v, old_s = lay.page_views(before)
    written = {sl: t for t, sl in enumerate(slots) if sl >= 0}
    for sl in range(n_rows):
        pg, off = divmod(sl, ps)
        if sl not in written:
            same = _same_bits(values[pg, off], old_v[pg, off]) and (
                scales is None or _same_bits(scales[pg, off], old_s[pg, off]))  # fmt: skip
            if not same:
                raise FuzzFailure(f"write_index_keys changed slot {sl}, which it does not address")
            continue
        key = k[written[sl] : written[sl] + 1]
        if kind == "plain":
            got, want = values[pg, off].double(), key[0].double()
        else:
            got = lay.decode(values[pg, off][None], scales[pg, off][None])[0].double()
            want = index_fp8_dequantized(key, lay.quant_block_size, fmt == "ue8m0")[0].double()
        if not (torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(0),
                                                                       want.nan_to_num(0))):
            raise FuzzFailure(f"slot {sl} reads back {got.tolist()}, not {want.tolist()}")


def _oracle_absorbed(st_: Step, values: torch.Tensor, q: torch.Tensor, r: int, scale: float):
    """Per request: plain float64 MQA of its new tokens over its latent rows."""
    T, H = q.shape[:2]
    o = torch.zeros(T, H, r, dtype=torch.float64)
    lse = torch.full((T, H), -math.inf, dtype=torch.float64)
    t0 = 0
    for i, (p, n) in enumerate(zip(st_.prefix, st_.new, strict=True)):
        if n == 0:
            continue
        kv = values[st_.rows(i)]  # [L, r + rope]
        oi, li = plain_attention(q[t0 : t0 + n], kv[:, None], kv[:, None, :r], p, scale, None)
        o[t0 : t0 + n], lse[t0 : t0 + n] = oi, li
        t0 += n
    return o, lse


def fuzz_absorbed(draw: Draw, impl: Any) -> None:
    """``MLABatch.build`` + ``plan`` + ``absorbed_attention`` or ``MLAAttention`` (absorbed,
    normal or mixed per request) over a drawn step and cache layout; broken steps and calls
    must be refused, valid ones equal the oracle; the cache is never written."""
    dims = _dims(draw)
    H, r, rope, nope, v = (dims.num_heads, dims.kv_lora_rank, dims.qk_rope_head_dim,
                           dims.qk_nope_head_dim, dims.v_head_dim)  # fmt: skip
    kind, cdt = _kinds(draw)
    s = Step(draw)
    cache, kv_scale, values = _latent_cache(draw, s.num_pages, max(s.ps, 1), r, rope, kind, cdt)
    T = s.num_tokens
    layer = draw(st.booleans())
    q_nope = _randn(draw, T, H, nope).to(cdt)
    q_lat = _randn(draw, T, H, r).to(cdt)
    q_pe = _randn(draw, T, H, rope).to(cdt)
    if draw(st.booleans()):  # a view with odd strides (the last dim contiguous or not)
        q_lat = torch.cat([q_lat, q_lat], -1)[..., ::2] if draw(st.booleans()) else (
            q_lat.transpose(0, 1).contiguous().transpose(0, 1))  # fmt: skip
    scale: Any = draw(st.sampled_from([dims.default_softmax_scale, 0.05, 1.0]))
    W_UK = (_randn(draw, H, nope, r, specials=False) / 2).to(cdt)
    W_UV = (_randn(draw, H, r, v, specials=False) / 2).to(cdt)
    bad = s.bad
    if kind == "fp8" and draw(st.integers(0, 4)) == 0:  # no scale: 1.0
        values, kv_scale = values / kv_scale.double(), None
    how = draw(st.sampled_from(["ok"] * 8 + ["scale", "tokens", "heads", "dtype", "meta",
                                             "rope", "cache_width", "kv_scale"]))
    if how == "scale":
        scale = draw(st.sampled_from([None, 0.0, -1.0, math.nan, math.inf, "0.1"]))
        bad = bad or f"softmax_scale {scale!r}"
        if layer and scale is None:  # MLAAttention's default scale
            bad = s.bad
    elif how == "tokens":
        q_nope, q_lat, q_pe = (torch.cat([x, x[:1] if T else torch.zeros(1, *x.shape[1:],
                                                                          dtype=cdt)])
                               for x in (q_nope, q_lat, q_pe))  # fmt: skip
        bad = bad or "one query token more than the step"
    elif how == "heads":
        q_nope, q_lat, q_pe = (torch.cat([x, x[:, :1]], 1) for x in (q_nope, q_lat, q_pe))
        bad = bad or "one head more than the dims"
    elif how == "dtype":
        q_lat, q_nope = q_lat.double(), q_nope.double()
        bad = bad or "float64 queries"
    elif how == "meta":
        q_pe = q_pe.to("meta")
        bad = bad or "q_pe on the meta device"
    elif how == "rope":
        q_pe = torch.cat([q_pe, q_pe[..., :1]], -1) if rope else torch.zeros(T, H, 1, dtype=cdt)
        bad = bad or "a q_pe wider than qk_rope_head_dim"
    elif how == "kv_scale" and kind == "fp8":
        kv_scale = torch.tensor(draw(st.sampled_from([0.0, -1.0, math.nan, math.inf])))
        bad = bad or f"kv_scale {kv_scale}"
    elif how == "cache_width":
        cache = torch.cat([cache, cache[..., :1]], -1)
        values = None
        bad = bad or "a cache row wider than r + rope"
    weights = mb.AbsorbWeights(W_UK, W_UV)
    mode = draw(st.sampled_from(["absorb", "normal", "mixed"])) if layer else "absorb"

    def run():
        batch = s.batch()
        if mode == "mixed":
            use = [draw(st.booleans()) for _ in range(batch.num_reqs)]
            policy: mb.Policy = _Fixed(use)
        else:
            policy = mb.Policy(mode)
        plan = mb.plan(batch, dims, policy, impl=impl)
        if layer:
            return mb.MLAAttention(dims, weights, scale)(q_nope, q_pe, cache, plan, kv_scale)
        return mb.absorbed_attention(q_lat, q_pe, cache, plan, scale, kv_scale)

    out = expect(run, bad, cache)
    if bad is not None:
        return
    sc = dims.default_softmax_scale if scale is None else scale
    if layer:
        q_l = torch.einsum("thn,hnr->thr", q_nope.double(), W_UK.double())
        q = torch.cat([q_l, q_pe.double()], -1)
        o_lat, _ = _oracle_absorbed(s, values, q, r, sc)
        ref = torch.einsum("thr,hrv->thv", o_lat, W_UV.double())
        _close(out, ref, TOL[cdt] * (4 if cdt != torch.float32 else 1), f"MLAAttention {mode}")
        return
    q = torch.cat([q_lat, q_pe], -1).double()
    o_ref, lse_ref = _oracle_absorbed(s, values, q, r, sc)
    _close(out[0], o_ref, TOL[cdt], "absorbed o_lat")
    _close(out[1], lse_ref, 1e-4 if cdt == torch.float32 else 1e-2, "absorbed lse")


class _Fixed(mb.Policy):
    """A policy returning a given per-request choice (a mixed step)."""

    def __init__(self, use_absorbed: list[bool]) -> None:
        super().__init__("cost")
        self._use = list(use_absorbed)

    def choose(self, batch, dims, device_type="cpu", impl="torch", **kw) -> PathChoice:
        return PathChoice(list(self._use))


def fuzz_dsa(draw: Draw, impl: Any) -> None:
    """``write_index_keys`` into every row, then ``indexer_logits``, ``indexer_topk`` (topk 0,
    within or beyond the context) and ``sparse_absorbed_attention`` (indices out of range,
    repeated, -1, k = 0) over a drawn step; NaN / inf in queries and weights."""
    dims = _dims(draw)
    H, r, rope = dims.num_heads, dims.kv_lora_rank, dims.qk_rope_head_dim
    kind, cdt = _kinds(draw)
    s = Step(draw)
    ps = max(s.ps, 1)
    cache, kv_scale, values = _latent_cache(draw, s.num_pages, ps, r, rope, kind, cdt)
    Hi, Di = draw(st.integers(1, 3)), draw(st.sampled_from([8, 16]))
    ikind = draw(st.sampled_from(["fp8", "plain"]))
    lay = (IndexCacheLayout.named("fp8", Di, draw(st.sampled_from([Di, Di // 2])))
           if ikind == "fp8" else IndexCacheLayout("plain", Di, 0, cdt))  # fmt: skip
    icache = torch.zeros(s.num_pages, ps, lay.width, dtype=lay.dtype)
    n = s.num_pages * ps
    keys = _randn(draw, n, Di, specials=(math.inf, -math.inf) if ikind == "fp8" else True)
    keys = keys.to(cdt)
    expect(lambda: mb.write_index_keys(icache, keys, torch.arange(n), lay, impl=impl), None)
    read = index_fp8_dequantized(keys, lay.quant_block_size) if ikind == "fp8" else keys.float()
    T = s.num_tokens
    q_I = _randn(draw, T, Hi, Di).to(cdt)
    w = _randn(draw, T, Hi).abs()
    if draw(st.booleans()):  # any strides: [Hi, T] transposed
        w = w.t().contiguous().t()
    topk = draw(st.sampled_from([1, 2, 3, 40, 0, -1]))
    ix = mb.IndexerDims(Hi, Di, max(topk, 1))
    bad = s.bad

    def plan():
        return mb.plan(s.batch(), dims, mb.Policy("absorb"), impl=impl, indexer=ix)

    lg = expect(lambda: mb.indexer_logits(q_I, w, icache, plan(), lay), bad, icache)
    tbad = bad or (f"topk {topk}" if topk < 1 else None)
    idx = expect(lambda: mb.indexer_topk(q_I, w, icache, plan(), topk, lay), tbad, icache)
    if bad is None:
        keys_i = [read[s.rows(i)] for i in range(len(s.new))]
        ref = reference_indexer_logits(q_I, w, keys_i, s.new)
        mag = reference_indexer_logits(q_I.float().abs(), w.abs(), [k.abs() for k in keys_i],
                                       s.new)  # fmt: skip
        tol = mag * 2.0**-7 + 1e-6  # q and k rounded to bf16 once each, at most
        _check_logits(lg, ref, tol)
        if tbad is None:
            # a NaN ranks below every number, +inf above (both visible)
            ranked = torch.nan_to_num(ref, nan=-1e300, posinf=1e300, neginf=-math.inf)
            check_topk(idx, ranked, topk, torch.where(torch.isfinite(tol), tol, 0.0))
    # the sparse attention over drawn index lists
    k = draw(st.integers(0, 5))
    lens = [p + m for p, m in zip(s.prefix, s.new, strict=True) for _ in range(max(m, 0))]
    rows, sbad = [], None
    for L in lens:
        L = min(L, 2**20)  # a broken step's huge length: its indices still fit int32
        row = []
        for _ in range(k):
            what = draw(st.sampled_from(["in", "in", "in", "repeat", "none", "oob"]))
            if what == "repeat" and row:
                row.append(draw(st.sampled_from(row)))
            elif what == "none" or L == 0:
                row.append(-1)
            elif what == "oob":
                row.append(draw(st.sampled_from([L, L + 5, -2, -(2**31)])))
                sbad = f"index {row[-1]} outside a context of {L}"
            else:
                row.append(draw(st.integers(0, max(L - 1, 0))))
        rows.append(row)
    indices = torch.tensor(rows, dtype=draw(st.sampled_from([torch.int32, torch.int64])))
    indices = indices.view(len(lens), k)
    q_lat = _randn(draw, T, H, r).to(cdt)
    q_pe = _randn(draw, T, H, rope).to(cdt)
    scale = dims.default_softmax_scale
    sbad = bad or sbad
    out = expect(lambda: mb.sparse_absorbed_attention(q_lat, q_pe, cache, plan(), indices, scale,
                                                      kv_scale), sbad, cache, icache)  # fmt: skip
    if sbad is not None:
        return
    c_seqs = [values[s.rows(i), :r] for i in range(len(s.new))]
    p_seqs = [values[s.rows(i), r:] for i in range(len(s.new))]
    o_ref, lse_ref = reference_sparse_attention(q_lat, q_pe, c_seqs, p_seqs, s.new, indices,
                                                scale)  # fmt: skip
    _close(out[0], o_ref, TOL[cdt], "sparse o_lat")
    _close(out[1], lse_ref, 1e-4 if cdt == torch.float32 else 1e-2, "sparse lse")


def _check_logits(lg: torch.Tensor, ref: torch.Tensor, tol: torch.Tensor) -> None:
    """Indexer logits: -inf and NaN exactly where the oracle's are, else within tol."""
    if lg.shape != ref.shape or lg.dtype != torch.float32:
        raise FuzzFailure(f"logits {lg.dtype} {tuple(lg.shape)} vs the oracle's {tuple(ref.shape)}")
    for name, f in (("-inf", torch.isneginf), ("NaN", torch.isnan), ("+inf", torch.isposinf)):
        if not torch.equal(f(lg), f(ref)):
            raise FuzzFailure(f"logits: {name} entries differ from the oracle's:\n{lg}\n{ref}")
    fin = torch.isfinite(ref)
    err = (lg.double() - ref).abs()
    if (err[fin] > tol[fin]).any():
        raise FuzzFailure(f"logits: max error {err[fin].max():.3g}:\n{lg}\n{ref}")


def fuzz_merge(draw: Draw, impl: Any) -> None:
    """``merge_attention_shards``: shards with empty (-inf), NaN and +inf LSEs, NaN in empty
    shards' outputs, zero tokens, wrong ranks; against the float64 merge."""
    S, T, H, D = (draw(st.integers(1, 3)), draw(st.integers(0, 3)), draw(st.integers(1, 2)),
                  draw(st.integers(1, 4)))  # fmt: skip
    o = _randn(draw, S, T, H, D, specials=False)
    lse = _randn(draw, S, T, H, specials=False) * 3
    for _ in range(draw(st.integers(0, 3))):
        if lse.numel():
            at = draw(st.integers(0, lse.numel() - 1))
            lse.view(-1)[at] = draw(st.sampled_from([-math.inf, math.inf, math.nan]))
            o.view(S * T * H, D)[at] = math.nan  # whatever an empty shard's o holds
    bad = None
    how = draw(st.sampled_from(["ok"] * 6 + ["rank", "shape"]))
    if how == "rank":
        o, bad = o[0], "a 3-D o"
    elif how == "shape":
        lse, bad = lse[:, :, :0] if H else lse, "lse of another shape"
    out = expect(lambda: mb.merge_attention_shards(o, lse), bad)
    if bad is not None:
        return
    lse64 = lse.double()
    empty = ~torch.isfinite(lse64)  # NaN and +inf count as empty too (documented)
    ref_lse = torch.logsumexp(lse64.masked_fill(empty, -math.inf), 0)
    wgt = torch.exp(lse64.masked_fill(empty, -math.inf) - ref_lse.nan_to_num(neginf=0.0))
    ref_o = (torch.where(empty[..., None], 0.0, o.double()) * wgt.nan_to_num(0.0)[..., None]).sum(0)
    _close(out[0], ref_o, 1e-5, "merged o")
    _close(out[1], ref_lse, 1e-5, "merged lse")


#: every target, by name
TARGETS: dict[str, Callable[[Draw, Any], None]] = {
    "write_latent": fuzz_write_latent,
    "write_index_keys": fuzz_write_index_keys,
    "absorbed": fuzz_absorbed,
    "dsa": fuzz_dsa,
    "merge": fuzz_merge,
}


def run_target(name: str, impl: str, max_examples: int, database: Any = None,
               derandomize: bool = False) -> None:  # fmt: skip
    """Run target ``name`` on implementation ``impl`` for ``max_examples`` hypothesis
    examples (raises the shrunk finding)."""
    target, kernels = TARGETS[name], _impl(impl)

    phases = [Phase.explicit, Phase.reuse, Phase.generate]
    if not derandomize:  # the long run shrinks a finding; CI reports it as found
        phases.append(Phase.shrink)

    @settings(max_examples=max_examples, deadline=None, database=database, phases=phases,
              derandomize=derandomize, suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(st.data())
    def prop(data: st.DataObject) -> None:
        target(data.draw, kernels)

    with torch.no_grad():
        prop()


def main(argv: list[str] | None = None) -> int:
    """The long run: every target, round after round, until ``--minutes`` are spent; the
    example database (failures replayed first next time) and a log of findings in ``--dir``."""
    ap = argparse.ArgumentParser(prog="python -m mla_backend.testing.fuzz", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--impl", default="torch",
                    help="torch, native (the selected ISA level) or native-<isa>")
    ap.add_argument("--dir", default=".fuzz", help="corpus / failures directory")
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--round", type=int, default=200, help="examples per target and round")
    args = ap.parse_args(argv)
    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    db = DirectoryBasedExampleDatabase(str(folder / "hypothesis"))
    end = time.monotonic() + 60 * args.minutes
    findings = 0
    rounds = 0
    while time.monotonic() < end:
        for name in args.targets.split(","):
            try:
                run_target(name, args.impl, args.round, database=db)
            except Exception as e:  # a finding: logged, kept in the database, run goes on
                findings += 1
                with open(folder / "findings.log", "a") as f:
                    notes = "\n".join(getattr(e, "__notes__", []))  # the drawn case
                    f.write(f"--- {time.strftime('%Y-%m-%dT%H:%M:%S')} {name} {args.impl}\n"
                            f"{type(e).__name__}: {e}\n{notes}\n")  # fmt: skip
                print(f"finding in {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            if time.monotonic() >= end:
                break
        rounds += 1
    print(f"{rounds} rounds of {args.round} examples per target on {args.impl}: "
          f"{findings} findings (log: {folder / 'findings.log'})")  # fmt: skip
    return 1 if findings else 0


if __name__ == "__main__":
    raise SystemExit(main())
