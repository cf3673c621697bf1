"""Fast attention paths (torch rank buckets, Triton decode/prefill kernels) against the torch reference."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvrewrite.runtime.kernels.buckets import BucketedAttention, plan_buckets
from kvrewrite.runtime.kernels.cache_layout import COLUMNS, packed_view, to_storage
from kvrewrite.runtime.kernels.reference import PackedLayout, packed_attention
from kvrewrite.runtime.kernels.scheduling import head_work, lpt_decode_schedule, prefill_row_blocks, prefill_tasks

# (key ranks, value ranks, group size): GQA and MHA, equal ranks (one bucket), all different,
# evenly spaced repeats, a rank-0 value head, and windows that must shift left at the row end.
RANK_MIXES = [
    ((8, 8, 8), (8, 8, 8), 3),
    ((4, 10, 6), (12, 2, 6), 2),
    ((16, 8, 16, 8), (8, 16, 8, 16), 1),
    ((6, 12), (0, 14), 2),
    ((32, 32, 8), (16, 16, 40), 3),
    ((6,), (14,), 4),
]
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 2e-2}


def _inputs(layout: PackedLayout, batch: int, q_len: int, kv_len: int, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ks, vs = sum(layout.key_ranks), sum(layout.value_ranks)
    query = torch.randn(batch, q_len, ks * layout.group_size, generator=g)
    key = torch.randn(batch, 1, kv_len, ks, generator=g)
    value = torch.randn(batch, 1, kv_len, vs, generator=g)
    # Causal, with request 1 left-padded by 3 tokens (HF's boolean mask layout [B, 1, T, S]).
    mask = torch.ones(batch, 1, q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
    mask[1, ..., :3] = False
    return query.to(dtype), key.to(dtype), value.to(dtype), mask


def _compare(out, query, key, value, mask, layout, dtype, scaling=0.3):
    ref = packed_attention(query.double(), key.double(), value.double(), mask, scaling, layout)
    attended = mask[:, 0].any(-1)  # rows with no allowed key are padding: their output is unused
    diff = (out.double() - ref)[attended]
    assert out.shape == ref.shape and out.dtype == dtype
    assert diff.abs().max().item() < TOLERANCE[dtype]


@pytest.mark.parametrize("ranks", RANK_MIXES)
@pytest.mark.parametrize("q_len", [1, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("route", ["block-diagonal", "windowed", "columns", "columns-prefill"])
def test_rank_buckets_match_reference(ranks, q_len, dtype, route):
    layout = PackedLayout(*ranks)
    query, key, value, mask = _inputs(layout, 2, q_len, 11, dtype)
    runner = BucketedAttention(layout, decode_rows=0 if route in ("windowed", "columns-prefill") else 10_000)
    attend_key, attend_value = key, value
    if route.startswith("columns"):  # the cache's column-major memory order, seen through the packed view
        attend_key = packed_view(to_storage(key[:, 0].contiguous(), COLUMNS).contiguous())
        attend_value = packed_view(to_storage(value[:, 0].contiguous(), COLUMNS).contiguous())
        assert (attend_key.stride(-2), attend_key.shape) == (1, key.shape) and torch.equal(attend_key, key)
    _compare(runner(query, attend_key, attend_value, mask, 0.3), query, key, value, mask, layout, dtype)


def test_column_decode_reads_each_head_in_place():
    """The column-major decode route hands GEMMs views of the cache storage, never a copy of it."""
    layout = PackedLayout((16, 8, 0), (8, 0, 24), 3)
    query, key, value, mask = _inputs(layout, 2, 1, 9, torch.float32)
    stored_key = to_storage(key[:, 0].contiguous(), COLUMNS).contiguous()
    stored_value = to_storage(value[:, 0].contiguous(), COLUMNS).contiguous()
    storages = {stored_key.untyped_storage().data_ptr(), stored_value.untyped_storage().data_ptr()}
    seen = []
    originals = torch.bmm, torch.baddbmm

    def spy(original):
        def call(*args, **kwargs):
            seen.extend(t.untyped_storage().data_ptr() for t in args if isinstance(t, torch.Tensor) and t.dim() == 3)
            return original(*args, **kwargs)

        return call

    torch.bmm, torch.baddbmm = spy(torch.bmm), spy(torch.baddbmm)
    try:
        out = BucketedAttention(layout)(query, packed_view(stored_key), packed_view(stored_value), mask, 0.3)
    finally:
        torch.bmm, torch.baddbmm = originals
    _compare(out, query, key, value, mask, layout, torch.float32)
    # Two heads have value columns (rank-0 value head skipped): 2 key GEMMs + 2 value GEMMs on the storage.
    assert sum(ptr in storages for ptr in seen) == 4


def test_buckets_group_equal_ranks_and_read_the_cache_in_place():
    layout = PackedLayout((16, 8, 16, 8), (8, 16, 8, 16), 1)
    buckets = plan_buckets(layout)
    assert [b.heads for b in buckets] == [(0, 2), (1, 3)]
    assert all(b.windowed for b in buckets)
    # The strided view SDPA reads must alias the cache storage (no copy of the cache per step).
    runner = BucketedAttention(layout, decode_rows=0)
    query, key, value, mask = _inputs(layout, 2, 1, 9, torch.float32)
    seen = []
    original = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        seen.append((k.untyped_storage().data_ptr(), v.untyped_storage().data_ptr()))
        return original(q, k, v, **kwargs)

    torch.nn.functional.scaled_dot_product_attention = spy
    try:
        runner(query, key, value, mask, 0.3)
    finally:
        torch.nn.functional.scaled_dot_product_attention = original
    assert seen == [(key.untyped_storage().data_ptr(), value.untyped_storage().data_ptr())] * 2


def test_lpt_schedule_is_near_optimal_and_complete():
    # ZACK Fig. 12-style: 7 tasks of mixed cost over 3 workers.
    costs = {(0, h): c for h, c in enumerate([9.0, 8.0, 7.0, 5.0, 4.0, 3.0, 2.0])}
    plan = lpt_decode_schedule(costs, 3)
    assert sorted(plan.tasks) == sorted(costs)
    best = min(
        max(sum(c for c, w in zip(costs.values(), assign) if w == k) for k in range(3))
        for assign in itertools.product(range(3), repeat=len(costs))
    )
    assert plan.makespan <= best * 4 / 3
    round_robin = max(sum(list(costs.values())[k::3]) for k in range(3))
    assert plan.makespan < round_robin
    for w in range(3):  # each worker runs its tasks longest first
        mine = [costs[t] for t in plan.tasks[plan.starts[w] : plan.starts[w + 1]]]
        assert mine == sorted(mine, reverse=True)


def test_prefill_row_blocks_carry_equal_work():
    key_ranks, value_ranks = (8, 24, 56), (40, 24, 8)
    rows = prefill_row_blocks(512, key_ranks, value_ranks, base_rows=32, multiple=8)
    work = [r * head_work(k, v) for r, k, v in zip(rows, key_ranks, value_ranks)]
    assert max(work) / min(work) < 1.25  # equal up to rounding rows down to the multiple
    assert rows[0] > rows[2]  # the light head gets taller blocks
    tasks = prefill_tasks(2, 100, key_ranks, value_ranks, 32, 8)
    for b, h in itertools.product(range(2), range(3)):  # every row of every (request, head) exactly once
        covered = sorted((s, e) for bb, hh, s, e in tasks if (bb, hh) == (b, h))
        assert covered[0][0] == 0 and covered[-1][1] == 100
        assert all(e1 == s2 for (_, e1), (s2, _) in zip(covered, covered[1:]))


@pytest.mark.parametrize("ranks", RANK_MIXES[:5])
@pytest.mark.parametrize("q_len", [1, 5], ids=["decode", "prefill"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernels_match_reference(ranks, q_len, dtype):
    # Skipped here, not for the module: the float64 oracle tests below need no triton and must run without it.
    triton_attention = pytest.importorskip("kvrewrite.runtime.kernels.triton_attention", reason="triton not installed")
    layout = PackedLayout(*ranks)
    query, key, value, mask = _inputs(layout, 2, q_len, 37, dtype, seed=1)
    # 3 workers for 2 x H tasks: some workers run several tasks (the LPT loop), prefill base rows 2 so
    # heads split into several row blocks.
    runner = triton_attention.TritonPackedAttention(layout, workers=3, base_rows=2)
    _compare(runner(query, key, value, mask, 0.3), query, key, value, mask, layout, dtype)


def _dense_float64(query, key, value, mask, scaling, layout):
    """Per query head, softmax(q k^T * scaling) v in float64 with plain torch ops (independent of the kernels)."""
    ko, vo = layout.key_offsets, layout.value_offsets
    g = layout.group_size
    outs, q_at = [], 0
    for h, rk in enumerate(layout.key_ranks):
        k, v = key[:, 0, :, ko[h] : ko[h + 1]], value[:, 0, :, vo[h] : vo[h + 1]]
        for _ in range(g):
            q = query[..., q_at : q_at + rk]
            q_at += rk
            scores = (q @ k.transpose(-1, -2) * scaling).masked_fill(~mask[:, 0], float("-inf"))
            outs.append(torch.softmax(scores, dim=-1) @ v)
    return torch.cat(outs, dim=-1)


@pytest.mark.parametrize("ranks", RANK_MIXES)
@pytest.mark.parametrize("route", ["reference", "block-diagonal", "windowed", "columns"])
def test_float64_attention_stays_float64(ranks, route):
    """The compile's full-rank check runs rewrites in float64: no path may round through float32."""
    layout = PackedLayout(*ranks)
    query, key, value, mask = _inputs(layout, 2, 6, 11, torch.float64)
    if route == "reference":
        out = packed_attention(query, key, value, mask, 0.3, layout)
    else:
        runner = BucketedAttention(layout, decode_rows=0 if route == "windowed" else 10_000)
        attend_key, attend_value = key, value
        if route == "columns":
            attend_key = packed_view(to_storage(key[:, 0].contiguous(), COLUMNS).contiguous())
            attend_value = packed_view(to_storage(value[:, 0].contiguous(), COLUMNS).contiguous())
        out = runner(query, attend_key, attend_value, mask, 0.3)
    attended = mask[:, 0].any(-1)
    expected = _dense_float64(query, key, value, mask, 0.3, layout)
    assert out.dtype == torch.float64
    assert (out - expected)[attended].abs().max().item() < 1e-12


@pytest.mark.parametrize("ranks", [RANK_MIXES[0], RANK_MIXES[2], RANK_MIXES[3]], ids=["equal", "mixed", "rank0-value"])
@pytest.mark.parametrize("q_len", [1, 3])
def test_column_decode_without_padding_matches_reference(ranks, q_len):
    """No padding, causal only (HF's boolean mask, or None): at q_len 1 nothing is masked and the route skips the
    additive mask; at q_len 3 the causal part still needs it. None means what transformers means by it, SDPA's
    is_causal: top-left aligned for several queries (a prefill into an empty StaticCache), every key for one."""
    layout = PackedLayout(*ranks)
    query, key, value, _ = _inputs(layout, 2, q_len, 11, torch.float32)
    causal = torch.ones(2, 1, q_len, 11, dtype=torch.bool).tril(11 - q_len)
    top_left = torch.ones(2, 1, q_len, 11, dtype=torch.bool).tril(0 if q_len > 1 else 10)
    stored_key = packed_view(to_storage(key[:, 0].contiguous(), COLUMNS).contiguous())
    stored_value = packed_view(to_storage(value[:, 0].contiguous(), COLUMNS).contiguous())
    runner = BucketedAttention(layout)
    for mask, meaning in ((None, top_left), (causal, causal)):
        out = runner(query, stored_key, stored_value, mask, 0.3)
        _compare(out, query, key, value, meaning, layout, torch.float32)
