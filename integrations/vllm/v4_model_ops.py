"""torch implementations of the non-attention ``torch.ops._C`` kernels of vLLM 0.32's DeepSeek-V4
CPU model that only vLLM's AVX512-BF16 library defines (served where they are absent, and in
place of vLLM's when MLA_ABSORB is selected: ``plugin.supply_v4``): the grouped output GEMM
(``convert_weight_packed`` / ``bmm_cpu``), the manifold-constrained hyper-connections
(``hc_pre_fused_cpu`` / ``hc_post_fused_cpu`` / ``hc_head_fused_cpu``) and the MoE routers
(``biased_topk_cpu`` / ``hash_topk_cpu``).

Each function takes the op's arguments in the schema's order (:data:`SCHEMAS`, the strings of
vLLM's AVX512-BF16 ``_C`` library) and returns what the kernel returns, so it can be registered
under ``torch.ops._C`` as it is. Semantics are those of vLLM's callers and eager references
(``model_executor/kernels/mhc/{cpu,torch}.py``, ``fused_moe/router/cpu_router.py``,
``models/deepseek_v4/cpu/cpu_sparse.py``) and of the C++ kernels they stand for; arithmetic in
float32, results in the dtypes the callers read. What a kernel would not serve, or what these do
not serve, raises ``ValueError`` naming the value. Only torch is imported.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: op name -> schema, as vLLM's AVX512-BF16 ``_C`` library defines them
SCHEMAS: dict[str, str] = {
    "convert_weight_packed": "convert_weight_packed(Tensor! weight) -> Tensor",
    "bmm_cpu": (
        "bmm_cpu(Tensor(a!) out, Tensor mat1, Tensor mat2, bool is_vnni, Tensor? scale) -> ()"
    ),
    "hc_pre_fused_cpu": (
        "hc_pre_fused_cpu(Tensor x, Tensor hc_fn, Tensor hc_scale, Tensor hc_base, int hc_mult, "
        "int sinkhorn_iters, float rms_eps, float hc_eps) -> (Tensor, Tensor, Tensor)"
    ),
    "hc_post_fused_cpu": (
        "hc_post_fused_cpu(Tensor x, Tensor residual, Tensor post, Tensor comb) -> Tensor"
    ),
    "hc_head_fused_cpu": (
        "hc_head_fused_cpu(Tensor x, Tensor hc_fn, Tensor hc_scale, Tensor hc_base, "
        "float hc_eps, float norm_eps) -> Tensor"
    ),
    "biased_topk_cpu": (
        "biased_topk_cpu(Tensor hidden_states, Tensor gating_output, Tensor correction_bias, "
        "int topk, bool renormalize, str scoring_func, int num_fused_shared_experts, "
        "float? routed_scaling_factor, bool apply_routed_scaling_factor_on_output) "
        "-> (Tensor, Tensor)"
    ),
    "hash_topk_cpu": (
        "hash_topk_cpu(Tensor gating_output, Tensor tid2eid, int topk, str scoring_func, "
        "int num_fused_shared_experts, int num_experts, float routed_scaling_factor) "
        "-> (Tensor, Tensor)"
    ),
}

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


# ------------------------------------------------------------------ grouped GEMM (wo_a)


def convert_weight_packed(weight: torch.Tensor) -> torch.Tensor:
    """Pack a linear weight ``[N, K]`` or a stack of them ``[B, N, K]`` for :func:`bmm_cpu`.

    The AVX512-BF16 kernel returns a VNNI-blocked copy; this module's packed form is the plain
    row-major ``[..., N, K]`` layout, returned as a new contiguous tensor of the same dtype (a
    copy, never the argument: a custom op's output must not alias its input). Only
    :func:`bmm_cpu` of this module reads it; the AVX512 library's other consumers of packed
    weights (``weight_packed_linear``, ``fused_experts_cpu``, ...) are absent where these are.
    """
    _require(
        weight.dim() in (2, 3),
        f"convert_weight_packed: weight must be [N, K] or [B, N, K], got shape {_shape(weight)}",
    )
    return weight.clone(memory_format=torch.contiguous_format)


def bmm_cpu(
    out: torch.Tensor,
    mat1: torch.Tensor,
    mat2: torch.Tensor,
    is_vnni: bool,
    scale: torch.Tensor | None,
) -> None:
    """Batched ``out[b] = mat1[b] @ mat2[b]^T`` written into ``out`` (which may be a strided
    view, e.g. a transpose, as vLLM's AMX MLA passes it).

    ``mat1 [B, M, K]``, ``mat2 [B, N, K]`` (a linear weight per batch, packed by
    :func:`convert_weight_packed` when ``is_vnni``, else raw; both are the same layout here),
    ``out [B, M, N]`` in ``mat1``'s dtype (bf16 / fp16 / fp32). ``scale``: ``None``, or the
    per-tensor dequantization scale of an fp8 ``mat2`` (one element, vLLM passes a 0-dim float32
    tensor): ``out = mat1 @ (mat2 * scale)^T``. Accumulation in float32, one rounding to
    ``out``'s dtype. DeepSeek-V4's ``_o_proj`` calls it with the attention output grouped
    ``[groups, tokens, heads_per_group * head_dim]`` and ``wo_a`` packed as
    ``[groups, o_lora_rank, heads_per_group * head_dim]``. Unlike the AVX512 kernel, any ``N``
    is served (that one requires a multiple of 32).
    """
    del is_vnni  # packed and raw weights share one layout here
    for name, t in (("out", out), ("mat1", mat1), ("mat2", mat2)):
        _require(t.dim() == 3, f"bmm_cpu: {name} must be 3-D, got shape {_shape(t)}")
    b, m, k = mat1.shape
    n = mat2.shape[1]
    _require(
        mat2.shape[0] == b and mat2.shape[2] == k,
        f"bmm_cpu: mat2 shape {_shape(mat2)} does not match mat1 shape {_shape(mat1)} "
        "(mat2 must be [B, N, K])",
    )
    _require(
        _shape(out) == (b, m, n),
        f"bmm_cpu: out shape {_shape(out)} must be {(b, m, n)} ([B, M, N])",
    )
    _require(mat1.dtype in _FLOATS, f"bmm_cpu: mat1 dtype {mat1.dtype} is not served")
    _require(
        out.dtype == mat1.dtype,
        f"bmm_cpu: out dtype {out.dtype} must equal mat1 dtype {mat1.dtype}",
    )
    w = mat2.float()
    if scale is not None:
        _require(
            scale.numel() == 1,
            f"bmm_cpu: scale must hold one per-tensor value, got shape {_shape(scale)}",
        )
        w = w * scale.float().reshape(())
    else:
        _require(
            mat2.dtype in _FLOATS,
            f"bmm_cpu: mat2 dtype {mat2.dtype} needs a scale (an fp8 weight is dequantized by it)",
        )
    out.copy_(torch.bmm(mat1.float(), w.transpose(1, 2)))


# ------------------------------------------------------------------ hyper-connections (mHC)


def _check_streams(op: str, x: torch.Tensor) -> None:
    _require(x.dim() == 3, f"{op}: x must be [T, hc_mult, hidden], got shape {_shape(x)}")
    _require(x.dtype in _FLOATS, f"{op}: x dtype {x.dtype} is not served")


def _rms_scaled_mixes(x: torch.Tensor, hc_fn: torch.Tensor, eps: float) -> torch.Tensor:
    """``(x_flat / rms(x_flat)) @ hc_fn^T`` in float32, x_flat = the token's hc_mult streams
    concatenated (the weight-free RMSNorm over ``hc_mult * hidden`` values)."""
    flat = x.reshape(x.shape[0], x.shape[1] * x.shape[2]).float()
    inv_rms = torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)
    return (flat @ hc_fn.float().t()) * inv_rms


def _collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """``sum_i pre[t, i] * x[t, i, :]`` in float32, returned in x's dtype."""
    return (pre.unsqueeze(-1) * x.float()).sum(1).to(x.dtype)


def hc_pre_fused_cpu(
    x: torch.Tensor,
    hc_fn: torch.Tensor,
    hc_scale: torch.Tensor,
    hc_base: torch.Tensor,
    hc_mult: int,
    sinkhorn_iters: int,
    rms_eps: float,
    hc_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC pre block: the mixing weights of ``hc_mult`` residual streams and the collapsed input
    of the next sub-layer (vLLM's ``mhc_pre_torch`` with ``hc_pre_eps == hc_sinkhorn_eps ==
    hc_eps``, post multiplier 2; transformers' ``DeepseekV4HyperConnection``).

    ``x [T, hc_mult, hidden]`` (bf16 / fp16 / fp32), ``hc_fn [(2 + hc_mult) * hc_mult,
    hc_mult * hidden]``, ``hc_scale [3]``, ``hc_base [(2 + hc_mult) * hc_mult]`` (float32).
    ``mixes = rmsnorm(x_flat, rms_eps) @ hc_fn^T`` splits into pre (hc_mult), post (hc_mult),
    comb (hc_mult x hc_mult), each ``* hc_scale[i] + hc_base[part]``:

    * ``pre = sigmoid(.) + hc_eps``; ``layer_input = sum_i pre_i * x_i`` ``[T, hidden]``, x's dtype
    * ``post = 2 * sigmoid(.)`` ``[T, hc_mult]`` float32
    * ``comb = softmax(., -1) + hc_eps``, divided by its column sums ``+ hc_eps``, then
      ``sinkhorn_iters - 1`` rounds of row then column division (each sum ``+ hc_eps``):
      ``[T, hc_mult, hc_mult]`` float32, ``comb[t, i, j]``: stream i's share in output stream j.

    Returns ``(layer_input, post, comb)``; vLLM's ``mhc_pre_cpu`` reshapes them.
    """
    op = "hc_pre_fused_cpu"
    _check_streams(op, x)
    _require(
        x.shape[1] == hc_mult,
        f"{op}: hc_mult={hc_mult} does not match x's {x.shape[1]} streams (x {_shape(x)})",
    )
    _require(sinkhorn_iters >= 1, f"{op}: sinkhorn_iters={sinkhorn_iters} must be >= 1")
    t, hc, d = x.shape
    mix = (2 + hc) * hc
    _require(
        _shape(hc_fn) == (mix, hc * d),
        f"{op}: hc_fn shape {_shape(hc_fn)} must be {(mix, hc * d)}",
    )
    _require(hc_scale.numel() == 3, f"{op}: hc_scale must hold 3 values, got {_shape(hc_scale)}")
    _require(hc_base.numel() == mix, f"{op}: hc_base must hold {mix} values, got {_shape(hc_base)}")
    scale = hc_scale.float().reshape(3)
    base = hc_base.float().reshape(mix)
    mixes = _rms_scaled_mixes(x, hc_fn, rms_eps)
    pre = torch.sigmoid(mixes[:, :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2.0 * torch.sigmoid(mixes[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    comb = mixes[:, 2 * hc :].reshape(t, hc, hc) * scale[2] + base[2 * hc :].reshape(1, hc, hc)
    comb = torch.softmax(comb, dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return _collapse(x, pre), post.contiguous(), comb.contiguous()


def hc_post_fused_cpu(
    x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """mHC post block: the sub-layer's output expanded into the streams plus the mixed
    residual streams (vLLM's ``mhc_post_torch``; the post-mix of transformers'
    ``DeepseekV4DecoderLayer``).

    ``x [T, hidden]``, ``residual [T, hc_mult, hidden]`` (same dtype, bf16 / fp16 / fp32),
    ``post [T, hc_mult]``, ``comb [T, hc_mult, hc_mult]`` (float32, as :func:`hc_pre_fused_cpu`
    returns them). ``out[t, j] = post[t, j] * x[t] + sum_i comb[t, i, j] * residual[t, i]``
    (comb consumed transposed: column j mixes into output stream j), float32 arithmetic,
    returned ``[T, hc_mult, hidden]`` in x's dtype.
    """
    op = "hc_post_fused_cpu"
    _require(x.dim() == 2, f"{op}: x must be [T, hidden], got shape {_shape(x)}")
    _check_streams(op, residual)
    _require(
        x.dtype == residual.dtype,
        f"{op}: residual dtype {residual.dtype} must equal x dtype {x.dtype}",
    )
    t, hc, d = residual.shape
    _require(
        _shape(x) == (t, d), f"{op}: x shape {_shape(x)} does not match residual {_shape(residual)}"
    )
    _require(_shape(post) == (t, hc), f"{op}: post shape {_shape(post)} must be {(t, hc)}")
    _require(_shape(comb) == (t, hc, hc), f"{op}: comb shape {_shape(comb)} must be {(t, hc, hc)}")
    mixed = torch.einsum("tij,tid->tjd", comb.float(), residual.float())
    return (mixed + post.float().unsqueeze(-1) * x.float().unsqueeze(1)).to(x.dtype)


def hc_head_fused_cpu(
    x: torch.Tensor,
    hc_fn: torch.Tensor,
    hc_scale: torch.Tensor,
    hc_base: torch.Tensor,
    hc_eps: float,
    norm_eps: float,
) -> torch.Tensor:
    """The final collapse of the ``hc_mult`` streams before the model's last norm
    (transformers' ``DeepseekV4HyperHead``). Note the order: ``hc_eps`` before ``norm_eps``
    (vLLM's wrapper ``kernels/mhc/cpu.py: hc_head_fused_cpu`` swaps its own
    ``(rms_norm_eps, hc_eps)``).

    ``x [T, hc_mult, hidden]`` (bf16 / fp16 / fp32), ``hc_fn [hc_mult, hc_mult * hidden]``,
    ``hc_scale`` one value, ``hc_base [hc_mult]`` (float32).
    ``pre = sigmoid(rmsnorm(x_flat, norm_eps) @ hc_fn^T * hc_scale + hc_base) + hc_eps``;
    returns ``sum_i pre_i * x_i`` ``[T, hidden]`` in x's dtype.
    """
    op = "hc_head_fused_cpu"
    _check_streams(op, x)
    t, hc, d = x.shape
    _require(
        _shape(hc_fn) == (hc, hc * d), f"{op}: hc_fn shape {_shape(hc_fn)} must be {(hc, hc * d)}"
    )
    _require(hc_scale.numel() == 1, f"{op}: hc_scale must hold 1 value, got {_shape(hc_scale)}")
    _require(hc_base.numel() == hc, f"{op}: hc_base must hold {hc} values, got {_shape(hc_base)}")
    mixes = _rms_scaled_mixes(x, hc_fn, norm_eps)
    pre = torch.sigmoid(mixes * hc_scale.float().reshape(()) + hc_base.float().reshape(hc))
    return _collapse(x, pre + hc_eps)


# ------------------------------------------------------------------ MoE routers


def _sqrtsoftplus_scores(op: str, scoring_func: str, gating_output: torch.Tensor) -> torch.Tensor:
    _require(
        scoring_func == "sqrtsoftplus",
        f"{op}: scoring_func={scoring_func!r} is not served (only 'sqrtsoftplus', DeepSeek-V4's)",
    )
    _require(
        gating_output.dim() == 2,
        f"{op}: gating_output must be [T, num_experts], got shape {_shape(gating_output)}",
    )
    return F.softplus(gating_output.float()).sqrt()


def _no_fused_shared(op: str, num_fused_shared_experts: int) -> None:
    _require(
        num_fused_shared_experts == 0,
        f"{op}: num_fused_shared_experts={num_fused_shared_experts} is not served (vLLM's CPU "
        "DeepSeek-V4 never fuses shared experts into routing)",
    )


def biased_topk_cpu(
    hidden_states: torch.Tensor,
    gating_output: torch.Tensor,
    correction_bias: torch.Tensor,
    topk: int,
    renormalize: bool,
    scoring_func: str,
    num_fused_shared_experts: int,
    routed_scaling_factor: float | None,
    apply_routed_scaling_factor_on_output: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4's bias-corrected ("noaux_tc") top-k routing.

    ``hidden_states`` only gives the token count ``T``; ``gating_output [T, E]`` router logits
    (any float dtype), ``correction_bias [E]``. ``scores = sqrt(softplus(logits))`` in float32;
    the experts are ``torch.topk(scores + correction_bias, topk, sorted=False)`` (the call of
    transformers' ``DeepseekV4TopKRouter``, so exact ties resolve as there; the AVX512 kernel's
    ``std::partial_sort`` resolves them its own unspecified way), listed by descending biased
    score; the weights are the *unbiased* scores of those experts (the bias steers selection
    only). ``renormalize``: weights divided by their sum, then times ``routed_scaling_factor``
    when ``apply_routed_scaling_factor_on_output``; without ``renormalize`` the raw scores are
    returned unscaled (as the kernel does). Returns ``(weights [T, topk] float32,
    ids [T, topk] int32)``.
    """
    op = "biased_topk_cpu"
    scores = _sqrtsoftplus_scores(op, scoring_func, gating_output)
    _no_fused_shared(op, num_fused_shared_experts)
    t, e = scores.shape
    _require(
        hidden_states.shape[0] == t,
        f"{op}: hidden_states has {hidden_states.shape[0]} tokens, gating_output {t}",
    )
    _require(
        correction_bias.numel() == e,
        f"{op}: correction_bias shape {_shape(correction_bias)} must hold {e} values",
    )
    _require(1 <= topk <= e, f"{op}: topk={topk} must be in [1, {e}] (num_experts)")
    _require(
        not (renormalize and apply_routed_scaling_factor_on_output)
        or routed_scaling_factor is not None,
        f"{op}: routed_scaling_factor=None with apply_routed_scaling_factor_on_output=True "
        "(the kernel would scale every weight by 0)",
    )
    biased = scores + correction_bias.float().reshape(e)
    ids = torch.topk(biased, topk, dim=-1, sorted=False).indices
    order = torch.sort(biased.gather(1, ids), dim=-1, descending=True, stable=True).indices
    ids = ids.gather(1, order)
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
        if apply_routed_scaling_factor_on_output:
            weights = weights * routed_scaling_factor
    return weights.contiguous(), ids.to(torch.int32)


def hash_topk_cpu(
    gating_output: torch.Tensor,
    tid2eid: torch.Tensor,
    topk: int,
    scoring_func: str,
    num_fused_shared_experts: int,
    num_experts: int,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4's hash routing (its first MoE layers): the experts come from a fixed table.

    ``gating_output [T, num_experts]`` router logits (any float dtype); ``tid2eid [T, topk]``
    int32, the table's rows of this step's tokens (vLLM's caller indexes
    ``hash_indices_table[input_ids]``). ``ids = tid2eid`` (in the table's order);
    ``weights = scores[ids]`` with ``scores = sqrt(softplus(logits))`` in float32, divided by
    their sum and times ``routed_scaling_factor`` (rows whose sum is 0 are left unscaled, as in
    the kernel). Returns ``(weights [T, topk] float32, ids [T, topk] int32)``.
    """
    op = "hash_topk_cpu"
    scores = _sqrtsoftplus_scores(op, scoring_func, gating_output)
    _no_fused_shared(op, num_fused_shared_experts)
    t, e = scores.shape
    _require(
        e == num_experts,
        f"{op}: num_experts={num_experts} does not match gating_output's {e} columns",
    )
    _require(
        _shape(tid2eid) == (t, topk),
        f"{op}: tid2eid shape {_shape(tid2eid)} must be {(t, topk)} ([T, topk])",
    )
    _require(tid2eid.dtype == torch.int32, f"{op}: tid2eid dtype {tid2eid.dtype} must be int32")
    if tid2eid.numel():
        lo, hi = int(tid2eid.min()), int(tid2eid.max())
        _require(
            0 <= lo and hi < e,
            f"{op}: tid2eid holds expert ids in [{lo}, {hi}], outside [0, {e})",
        )
    ids = tid2eid.long()
    weights = scores.gather(1, ids)
    total = weights.sum(dim=-1, keepdim=True)
    scaled = weights / total.clamp(min=torch.finfo(torch.float32).tiny) * routed_scaling_factor
    weights = torch.where(total > 0, scaled, weights)
    return weights.contiguous(), tid2eid.contiguous().clone()
