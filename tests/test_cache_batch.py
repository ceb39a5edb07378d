"""Paged latent cache writes (slot mapping, padding, fp8) and batch validation errors."""

from __future__ import annotations

import pytest
import torch

import mla_backend as mb
from mla_backend.testing.cases import DIMS, make_case


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, mb.FP8_DTYPE])
@pytest.mark.parametrize("page_size", [1, 5, 16])
def test_write_latent_slots_and_padding(dtype: torch.dtype, page_size: int) -> None:
    cache = torch.zeros(6, page_size, 10, dtype=dtype)
    slots = torch.tensor([3, -1, 6 * page_size - 1, 0, -1])
    c_kv, k_pe = torch.randn(5, 8), torch.randn(5, 2)
    scale = torch.tensor(0.01) if dtype == mb.FP8_DTYPE else None
    mb.write_latent(cache, c_kv, k_pe, slots, scale)
    flat = cache.view(-1, 10).float() * (scale if scale is not None else 1)
    rows = torch.cat([c_kv, k_pe], -1)
    tol = {torch.float32: 0, torch.bfloat16: 1e-2, torch.float16: 1e-3, mb.FP8_DTYPE: 0.07}[dtype]
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            torch.testing.assert_close(flat[s], rows[t], atol=tol * 4, rtol=tol)
    written = {s for s in slots.tolist() if s >= 0}
    untouched = [i for i in range(flat.shape[0]) if i not in written]
    assert flat[untouched].abs().sum() == 0  # padding never lands anywhere


def test_cache_validation_names_values() -> None:
    with pytest.raises(ValueError, match=r"\[num_pages, page_size, 10\]"):
        mb.write_latent(
            torch.zeros(2, 4, 9),
            torch.zeros(1, 8),
            torch.zeros(1, 2),
            torch.zeros(1, dtype=torch.long),
        )
    with pytest.raises(ValueError, match="int8"):
        mb.write_latent(
            torch.zeros(2, 4, 10, dtype=torch.int8),
            torch.zeros(1, 8),
            torch.zeros(1, 2),
            torch.zeros(1, dtype=torch.long),
        )
    with pytest.raises(ValueError, match="kv_scale"):
        mb.write_latent(
            torch.zeros(2, 4, 10),
            torch.zeros(1, 8),
            torch.zeros(1, 2),
            torch.zeros(1, dtype=torch.long),
            torch.tensor(1.0),
        )


def test_batch_validation_names_values() -> None:
    bt = torch.zeros(2, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="page_size=0"):
        mb.MLABatch.build([0, 0], [1, 1], bt, 0)
    with pytest.raises(ValueError, match="needs 4 pages"):
        mb.MLABatch.build([60, 0], [1, 1], bt, 16)
    with pytest.raises(ValueError, match="3 requests but new_lens has 2"):
        mb.MLABatch.build([0, 0, 0], [1, 1], bt, 16)
    with pytest.raises(ValueError, match=r"\[1, 2\]"):
        mb.MLABatch.build([0, 0], [1, 2], bt, 16, mb.Phase.DECODE)
    with pytest.raises(ValueError, match="float32"):
        mb.MLABatch.build([0], [1], torch.zeros(1, 1), 16)


def test_plan_parts_and_rows() -> None:
    """A split step: each path's part holds its requests, rows and int32 index tensors."""
    bt = torch.arange(12, dtype=torch.int32).view(3, 4)
    b = mb.MLABatch.build(torch.tensor([0, 5, 9]), [3, 1, 2], bt, 4)
    assert b.cu_new == [0, 3, 4, 6] and b.kv_lens == [3, 6, 11]
    d = mb.MLADims(2, 8, 4, 2, 4)

    class Split(mb.Policy):
        def choose(self, batch, dims, device_type="cpu", impl="torch"):
            return mb.PathChoice([False, True, True])

    p = mb.plan(b, d, Split(), impl="torch")
    assert p.mode == "mixed" and p.uses_normal and p.num_tokens == 6
    assert p.normal.reqs == (0,) and p.absorbed.reqs == (1, 2)
    assert p.absorbed.rows.tolist() == [3, 4, 5] and p.normal.rows.tolist() == [0, 1, 2]
    assert p.absorbed.prefix_lens == (5, 9) and p.absorbed.cu_new == (0, 1, 3)
    assert p.absorbed.kv_lens_t.dtype == torch.int32
    assert p.absorbed.kv_lens_t.tolist() == [6, 11]
    assert torch.equal(p.absorbed.block_table, bt[[1, 2]])
    assert p.absorbed.pages == ((4, 5), (8, 9, 10)) and p.max_page_id == 10
    for part in (p.step, p.absorbed, p.normal):  # every index tensor holds its host data
        assert part.prefix_lens_t.tolist() == list(part.prefix_lens)
        assert part.new_lens_t.tolist() == list(part.new_lens)
        assert part.cu_new_t.tolist() == list(part.cu_new)
        assert part.kv_lens_t.tolist() == list(part.kv_lens)
        w = part.work
        blocks = list(zip(w.q_block_req.tolist(), w.q_block_start.tolist(), strict=True))
        assert blocks == [  # each request's new tokens cut into blocks of block_q, in order
            (i, q0) for i, n in enumerate(part.new_lens) for q0 in range(0, n, w.block_q)
        ]
    whole = mb.plan(b, d, mb.Policy("absorb"), impl="torch")
    assert whole.absorbed is whole.step and whole.step.rows is None and whole.normal is None


def test_plan_refresh_in_place() -> None:
    """refresh_ copies a new step's lengths and pages into the same tensors (CUDA-graph
    replay reads fixed addresses)."""
    d = mb.MLADims(2, 8, 4, 2, 4)
    bt = torch.tensor([[3, 1, 0], [2, 0, 0]], dtype=torch.int32)
    p = mb.plan(mb.MLABatch.build([4, 1], [1, 1], bt, 4, mb.Phase.DECODE), d, impl="torch")
    ptr = p.step.kv_lens_t.data_ptr()
    bt2 = torch.tensor([[3, 1, 5], [2, 4, 0]], dtype=torch.int32)
    p.refresh_(mb.MLABatch.build([8, 4], [1, 1], bt2, 4, mb.Phase.DECODE))
    assert p.step.kv_lens_t.data_ptr() == ptr and p.step.kv_lens_t.tolist() == [9, 5]
    assert p.step.block_table.tolist() == [[3, 1, 5], [2, 4, 0]] and p.max_page_id == 5
    with pytest.raises(ValueError, match="new_lens"):
        p.refresh_(mb.MLABatch.build([8, 4], [2, 1], bt2, 4))


def test_attention_rejects_bad_inputs() -> None:
    bt = torch.zeros(1, 2, dtype=torch.int32)
    d = mb.MLADims(1, 8, 4, 2, 4)
    b = mb.plan(mb.MLABatch.build([0], [2], bt, 4), d)
    cache = torch.zeros(3, 4, 10)
    with pytest.raises(ValueError, match="int64"):
        mb.absorbed_attention(
            torch.zeros(2, 1, 8, dtype=torch.int64), torch.zeros(2, 1, 2), cache, b, 1.0
        )
    with pytest.raises(ValueError, match="3 tokens|2 tokens"):
        mb.absorbed_attention(torch.zeros(3, 1, 8), torch.zeros(3, 1, 2), cache, b, 1.0)
    with pytest.raises(ValueError, match="page size 4 != the plan's page_size 8"):
        mb.absorbed_attention(
            torch.zeros(2, 1, 8),
            torch.zeros(2, 1, 2),
            cache,
            mb.plan(mb.MLABatch.build([0], [2], bt, 8), d),
            1.0,
        )
    with pytest.raises(ValueError, match="MLAPlan .* got PlanPart"):
        mb.absorbed_attention(torch.zeros(2, 1, 8), torch.zeros(2, 1, 2), cache, b.step, 1.0)
    with pytest.raises(ValueError, match="MLA_BACKEND_IMPL='cuda'"):
        mb.plan(mb.MLABatch.build([0], [2], bt, 4), d, impl="cuda")


def test_batch_positions() -> None:
    b = mb.MLABatch.build([0, 5, 2], [2, 1, 3], torch.zeros(3, 4, dtype=torch.int32), 4)
    assert b.positions().tolist() == [0, 1, 5, 2, 3, 4]


def _small_case():
    return make_case(DIMS["tiny"], [5, 2], [3, 1], 4)


def test_out_of_range_page_ids_rejected_on_both_paths() -> None:
    case = _small_case()
    num_pages = case.kv_cache.shape[0]
    q_lat = mb.absorb_q(case.q_nope, case.weights)
    for bad in (num_pages, -1):
        bt = case.batch.block_table.clone()
        bt[0, 1] = bad  # a page request 0 uses (8 tokens at page size 4)
        b = mb.MLABatch.build(case.batch.prefix_lens, case.batch.new_lens, bt, 4)
        if bad < 0:  # caught once, at plan time, from the host block table
            with pytest.raises(ValueError, match=f"page id {bad}"):
                mb.plan(b, case.dims)
            continue
        p = mb.plan(b, case.dims)
        with pytest.raises(ValueError, match=f"page id {bad} .* {num_pages} pages"):
            mb.absorbed_attention(q_lat, case.q_pe, case.kv_cache, p, 1.0)
        with pytest.raises(ValueError, match=f"page id {bad}"):
            mb.normal_attention(case.q_nope, case.q_pe, case.kv_cache, p, case.weights, 1.0)


def test_normal_path_rejects_mismatched_inputs() -> None:
    case = _small_case()
    w, b = case.weights, case.plan("normal")
    with pytest.raises(ValueError, match="queries have 1 heads but the plan's dims have 2"):
        mb.normal_attention(case.q_nope[:, :1], case.q_pe[:, :1], case.kv_cache, b, w, 1.0)
    with pytest.raises(ValueError, match="does not match the weights"):
        mb.normal_attention(case.q_nope[..., :-1], case.q_pe, case.kv_cache, b, w, 1.0)
    with pytest.raises(ValueError, match="5 tokens but the plan describes 4"):
        mb.normal_attention(
            torch.cat([case.q_nope, case.q_nope[:1]]),
            torch.cat([case.q_pe, case.q_pe[:1]]),
            case.kv_cache,
            b,
            w,
            1.0,
        )
    with pytest.raises(ValueError, match="float64"):
        mb.normal_attention(case.q_nope.double(), case.q_pe.double(), case.kv_cache, b, w, 1.0)
    with pytest.raises(ValueError, match="page size 4 != the plan's page_size 8"):
        mb.normal_attention(
            case.q_nope,
            case.q_pe,
            case.kv_cache,
            mb.plan(
                mb.MLABatch.build(
                    case.batch.prefix_lens, case.batch.new_lens, case.batch.block_table, 8
                ),
                case.dims,
            ),
            w,
            1.0,
        )


def test_more_bad_inputs_name_the_value() -> None:
    cache = torch.zeros(2, 4, 10, dtype=mb.FP8_DTYPE)
    with pytest.raises(ValueError, match=r"kv_scale of shape \(4,\)"):
        mb.write_latent(
            cache,
            torch.zeros(1, 8),
            torch.zeros(1, 2),
            torch.zeros(1, dtype=torch.long),
            torch.ones(4),
        )
    with pytest.raises(ValueError, match="float32"):
        mb.write_latent(torch.zeros(2, 4, 10), torch.zeros(1, 8), torch.zeros(1, 2), torch.zeros(1))
    bt = torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="1.5"):
        mb.MLABatch.build([1.5], [1], bt, 4)
    with pytest.raises(ValueError, match="IDLE"):
        mb.MLABatch.build([0], [1], bt, 4, mb.Phase.IDLE)
    with pytest.raises(ValueError, match="None"):
        mb.Policy(None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'8k'"):
        mb.Policy("cost", chunked_prefix_threshold="8k")  # type: ignore[arg-type]
    d = mb.MLADims(2, 8, 4, 2, 4)
    w = mb.split_kv_b_proj(torch.zeros(16, 8), d)
    with pytest.raises(ValueError, match="W_UV shape"):
        mb.MLAAttention(mb.MLADims(2, 8, 4, 2, 6), mb.AbsorbWeights(w.W_UK, w.W_UV))
    with pytest.raises(ValueError, match="'factor'"):
        mb.yarn_softmax_scale(d, {"type": "yarn"})


def test_impl_choice_follows_the_environment(monkeypatch) -> None:
    """get_impl resolves a choice once per process, yet a changed MLA_BACKEND_IMPL (or a bad
    value) is honoured on the next call."""
    from mla_backend.selection import ENV_VAR, get_impl, impl_name

    cpu = torch.device("cpu")
    monkeypatch.setenv(ENV_VAR, "torch")
    assert get_impl(cpu).name == "torch"
    monkeypatch.delenv(ENV_VAR)
    auto = get_impl(cpu)
    assert auto.name == impl_name(cpu) and get_impl(cpu) is auto
    monkeypatch.setenv(ENV_VAR, "torch")
    assert get_impl(cpu).name == "torch"
    monkeypatch.setenv(ENV_VAR, "bogus")
    with pytest.raises(ValueError, match="MLA_BACKEND_IMPL='bogus'"):
        get_impl(cpu)
