"""The CPU block decode of absorbed MLA (kernels.cpu_decode_mla) against a dense float64 reference, and in a model."""

from __future__ import annotations

import pytest
import torch
from test_mla_runtime import ids, left_padded, stock_and_ours, tiny_config
from transformers import StaticCache

import kvrewrite.runtime.mla.attention as mla_attention
from kvrewrite.runtime.kernels import cpu_decode_mla
from kvrewrite.runtime.kernels.cpu_decode_mla import MIN_BLOCK_SLOTS, block_slots, mla_block_decode
from kvrewrite.runtime.kernels.reference import boolean_mask

RANK, ROPE, HEADS = 24, 8, 4
# bf16: the scores are rounded to bf16 by the GEMM, as on the dense path (whose worst error on these inputs is as
# large: about 0.03 at scores of magnitude ~10).
TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=5e-2, rtol=2e-2)}


def dense_reference(q_rows, rows, allowed, rank):
    """softmax(q . [c | k_pe]) over the slots, masked slots at finfo.min, then the weighted sum of c; in float64."""
    q, k = q_rows.double(), rows.double()
    scores = torch.bmm(q, k.mT).masked_fill(~allowed[:, None, :], torch.finfo(torch.float64).min)
    return torch.bmm(torch.softmax(scores, dim=-1), k[..., :rank])


def dense_latent_decode(q_rows, rows, allowed, rank):
    """The CPU decode before the block path (two reads of the rows), for the whole-model before/after check."""
    scores = torch.bmm(q_rows, rows.mT).float()
    scores = scores.masked_fill_(~allowed[:, None, :], torch.finfo(scores.dtype).min)
    return torch.bmm(torch.softmax(scores, dim=-1).to(rows.dtype), rows[..., :rank])


def inputs(batch, length, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q_rows = torch.randn(batch, HEADS, RANK + ROPE, generator=g) * 0.5
    rows = torch.randn(batch, length, RANK + ROPE, generator=g)
    return q_rows.to(dtype), rows.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("length", [1, 7, 16, 17, 50, 101])  # below, at, just past and many times one block
@pytest.mark.parametrize("batch", [1, 3])
def test_block_decode_equals_dense_reference(dtype, length, batch):
    q_rows, rows = inputs(batch, length, dtype)
    allowed = torch.ones(1, length, dtype=torch.bool)
    got = mla_block_decode(q_rows, rows, allowed, RANK, slots=16)
    assert got.dtype == dtype and got.shape == (batch, HEADS, RANK)
    torch.testing.assert_close(got.double(), dense_reference(q_rows, rows, allowed, RANK), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_left_padding_and_an_unfilled_static_tail_get_no_weight(dtype):
    """Row 0 left-padded by 21 slots, every row with a StaticCache-style tail of 30 unfilled (masked) slots that
    hold large values: any weight on them would show."""
    batch, filled, capacity = 3, 45, 75
    q_rows, rows = inputs(batch, capacity, dtype)
    rows[:, filled:] = 100.0
    rows[0, :21] = -100.0
    allowed = torch.zeros(batch, capacity, dtype=torch.bool)
    allowed[:, :filled] = True
    allowed[0, :21] = False
    got = mla_block_decode(q_rows, rows, allowed, RANK, slots=16)
    want = dense_reference(q_rows, rows, allowed, RANK)
    torch.testing.assert_close(got.double(), want, **TOLERANCE[dtype])
    alone = mla_block_decode(q_rows[:1], rows[:1, 21:filled].contiguous(), allowed[:1, 21:filled], RANK, slots=16)
    torch.testing.assert_close(got[:1], alone, **TOLERANCE[dtype])


def test_a_fully_masked_row_averages_every_slot_as_the_dense_path_does():
    q_rows, rows = inputs(2, 37, torch.float32)
    allowed = torch.ones(2, 37, dtype=torch.bool)
    allowed[1] = False
    got = mla_block_decode(q_rows, rows, allowed, RANK, slots=16)
    assert torch.isfinite(got).all()
    want = rows[1, :, :RANK].mean(dim=0).expand(HEADS, RANK)
    torch.testing.assert_close(got[1], want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, dense_latent_decode(q_rows, rows, allowed, RANK), atol=1e-5, rtol=1e-5)


def test_float64_stays_float64():
    q_rows, rows = inputs(2, 41, torch.float64)
    allowed = torch.ones(1, 41, dtype=torch.bool)
    got = mla_block_decode(q_rows, rows, allowed, RANK, slots=16)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, dense_reference(q_rows, rows, allowed, RANK), atol=1e-12, rtol=1e-12)


def test_block_slots():
    # SmolLM2-shaped fp32 rows (192 wide) at batch 8: about 2 MB of rows per block.
    assert block_slots(8, 192, 4) == 320
    assert block_slots(1, 192, 4) % 64 == 0 and block_slots(1, 192, 4) > 2000
    assert block_slots(512, 576, 2) == MIN_BLOCK_SLOTS


def test_layer_decode_equals_the_unabsorbed_float64_formula():
    """_absorbed at q_len 1 on CPU (the block path) against stock's formula: per-head keys and values rebuilt from the
    latents by kv_b_proj, everything in float64."""
    config = tiny_config()
    _, ours = stock_and_ours(config)
    attn = ours.model.layers[0].self_attn
    batch, length = 3, 29
    g = torch.Generator().manual_seed(3)
    q_nope = torch.randn(batch, 1, HEADS, config.qk_nope_head_dim, generator=g)
    q_pe = torch.randn(batch, HEADS, 1, ROPE, generator=g)
    rows = torch.randn(batch, 1, length, RANK + ROPE, generator=g)
    allowed = torch.ones(batch, 1, 1, length, dtype=torch.bool)
    allowed[1, ..., :6] = False
    got = attn._absorbed(q_nope, q_pe, rows, allowed)  # [B, 1, H, d_v]

    w_uk, w_uv = (w.double() for w in attn.absorbed_weights())
    latent, k_pe = rows[:, 0].double().split([RANK, ROPE], dim=-1)
    k_nope = torch.einsum("hnr,bsr->bhsn", w_uk, latent)
    values = torch.einsum("hvr,bsr->bhsv", w_uv, latent)
    scores = torch.einsum("bhn,bhsn->bhs", q_nope[:, 0].double(), k_nope)
    scores = (scores + torch.einsum("bhd,bsd->bhs", q_pe[:, :, 0].double(), k_pe)) * attn.scaling
    scores = scores.masked_fill(~allowed[:, 0], torch.finfo(torch.float64).min)
    want = torch.einsum("bhs,bhsv->bhv", torch.softmax(scores, dim=-1), values)
    torch.testing.assert_close(got[:, 0].double(), want, atol=2e-5, rtol=2e-5)


@pytest.fixture
def tiny_blocks(monkeypatch):
    """Blocks of 5 slots, so that the tiny model's caches span several blocks (the online merge runs)."""
    monkeypatch.setattr(cpu_decode_mla, "BLOCK_BYTES", 1)
    monkeypatch.setattr(cpu_decode_mla, "MIN_BLOCK_SLOTS", 5)
    calls = []
    real = mla_attention.mla_block_decode
    monkeypatch.setattr(mla_attention, "mla_block_decode", lambda *a: calls.append(a[1].shape) or real(*a))
    return calls


def test_greedy_generate_is_token_for_token_what_the_dense_path_gives(tiny_blocks, monkeypatch):
    config = tiny_config()
    _, ours = stock_and_ours(config)
    x, mask = left_padded(config, length=14, row=0, pad=4)
    kwargs = dict(
        attention_mask=mask, max_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True
    )
    with torch.no_grad():
        after = ours.generate(x, **kwargs)
        assert tiny_blocks and all(shape[1] > 5 for shape in tiny_blocks)  # the block path ran, over several blocks
        monkeypatch.setattr(mla_attention, "mla_block_decode", dense_latent_decode)
        before = ours.generate(x, **kwargs)
    assert torch.equal(after.sequences, before.sequences)
    torch.testing.assert_close(torch.stack(after.logits), torch.stack(before.logits), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_static_cache_decode_equals_one_shot(tiny_blocks, attn):
    """A StaticCache's unfilled slots (masked) sit in the blocks past the filled ones. Eager: its mask spans the
    static capacity; sdpa: transformers passes no mask for the prefill into the empty cache, meaning SDPA's top-left
    causal alignment, which keeps the unfilled slots out."""
    config = tiny_config(attn=attn)
    _, ours = stock_and_ours(config)
    x = ids(batch=2, length=16)
    with torch.no_grad():
        one_shot = ours(x).logits
        cache = StaticCache(config=config, max_cache_len=32)
        steps = [ours(x[:, :9], past_key_values=cache, use_cache=True).logits]
        for t in range(9, 16):
            position = torch.tensor([t])
            steps.append(ours(x[:, t : t + 1], past_key_values=cache, use_cache=True, cache_position=position).logits)
    assert tiny_blocks
    torch.testing.assert_close(torch.cat(steps, dim=1), one_shot, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("q_len, kv_len", [(1, 9), (5, 5), (4, 11)])
def test_a_missing_mask_means_what_sdpa_is_causal_computes(q_len, kv_len):
    """transformers leaves the mask out where it relies on SDPA's `is_causal` (top-left aligned; off for one query):
    boolean_mask(None) must let through exactly what SDPA attends to."""
    g = torch.Generator().manual_seed(0)
    query = torch.randn(1, 1, q_len, 8, generator=g, dtype=torch.float64)
    keys = torch.randn(1, 1, kv_len, 8, generator=g, dtype=torch.float64)
    values = torch.randn(1, 1, kv_len, 8, generator=g, dtype=torch.float64)
    want = torch.nn.functional.scaled_dot_product_attention(query, keys, values, is_causal=q_len > 1)
    allowed = boolean_mask(None, q_len, kv_len, query.device)
    got = torch.nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=allowed)
    torch.testing.assert_close(got, want)
