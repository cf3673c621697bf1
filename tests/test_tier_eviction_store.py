"""The evicting cache's in-place store (kvrewrite.runtime.tiers.kept_store) and its code-space reads, against
independent references.

- A decode step's attention output against a dense float64 softmax over exactly the tokens the cache holds: the
  kept tokens decoded here from their codes (unpacked, scaled, turned back and un-centred in float64), rotated at
  their stored positions, and the recent window.
- The whole run against the store as it was before it was written in place (`CacheOrderedLayer` below: kept in
  cache order, every settle a concatenation and a gather of the kept rows): the same tokens kept after every
  forward, the same codes for each of them (compared sorted by position), the same greedy tokens from generate().
"""

from __future__ import annotations

import pytest
import torch
from test_tier_eviction import evicting_model
from test_tiers import RATE, compiled  # noqa: F401  (compiled: the fixture)
from tiny_models import random_windows

import kvrewrite
from kvrewrite.runtime.cache_bytes import cache_tensor_bytes
from kvrewrite.runtime.codecs.packing import packed_length
from kvrewrite.runtime.tiers.attention import tiered_attention
from kvrewrite.runtime.tiers.build import make_tiered_cache
from kvrewrite.runtime.tiers.eviction import (
    EvictingLayer,
    _top_mask,
    decode_head_blocks,
    decode_tokens,
    encode_tokens,
)
from kvrewrite.runtime.tiers.kept_store import take_rows

BITS = (8, 4)


class CacheOrderedLayer(EvictingLayer):
    """The kept tier as it was stored before in-place writes: in cache order, every settle appending the moving
    tokens with a concatenation, then gathering the top-scored budget (a stable sort over the store in that order, so
    that among equal scores the older tokens stay)."""

    def _admit(self, moving, kept_scores, moving_scores, budget):
        store = self._store("kept")
        scores = kept_scores
        if moving is not None:
            store = {name: torch.cat([store[name], moving[name]], dim=1) for name in store}
            scores = (
                None if kept_scores is None or moving_scores is None else torch.cat([kept_scores, moving_scores], -1)
            )
        positions = store["positions"]
        if positions.shape[-1] > budget:
            if scores is None or scores.shape[-1] != positions.shape[-1]:
                scores = positions.float()
            top = scores.sort(dim=-1, descending=True, stable=True).indices[:, :budget]
            if self.floor_key_ranks is not None:
                stays = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, top, True)
                self._demote(take_rows(store, (~stays).nonzero()[:, 1].view(scores.shape[0], -1)))
            store = take_rows(store, top.sort(dim=-1).values)
        self._set_store("kept", store)
        self.kept_buffers = {}


def cache_pair(model, capacity: int | None = None, storage_dtype=torch.float32):
    """(in-place cache, cache-ordered reference) built alike."""
    ours = make_tiered_cache(model, model.tier_policy, storage_dtype=storage_dtype, capacity=capacity)
    reference = make_tiered_cache(model, model.tier_policy, storage_dtype=storage_dtype)
    for layer in reference.layers:
        layer.__class__ = CacheOrderedLayer
    return ours, reference


def kept_by_position(layer: EvictingLayer) -> list[dict[str, torch.Tensor]]:
    """Per batch row, every kept-tier tensor's rows sorted by cache index (the store's order is free)."""
    rows = []
    store = layer._store("kept")
    for b in range(layer.kept_positions.shape[0]):
        order = layer.kept_positions[b].argsort()
        rows.append({name: tensor[b, order] for name, tensor in store.items()})
    return rows


def assert_same_kept(ours, reference) -> None:
    for mine, theirs in zip(ours.layers, reference.layers):
        for a, b in zip(kept_by_position(mine), kept_by_position(theirs)):
            assert a.keys() == b.keys()
            for name in a:
                assert torch.equal(a[name], b[name]), name


def step_through(model, tokens: torch.Tensor, caches, prefill: int, mask=None, check=None, chunk: int = 1):
    """Prefill `prefill` tokens in one forward, then `chunk` tokens per forward, through every cache; `check` after
    each forward."""
    logits = [[] for _ in caches]
    n = tokens.shape[1]
    with torch.no_grad():
        for start, stop in [(0, prefill)] + [(t, min(t + chunk, n)) for t in range(prefill, n, chunk)]:
            for i, cache in enumerate(caches):
                extra = {} if mask is None else {"attention_mask": mask[:, :stop]}
                out = model(tokens[:, start:stop], past_key_values=cache, use_cache=True, **extra)
                logits[i].append(out.logits)
            if check is not None:
                check(*caches)
    return [torch.cat(chunks, dim=1) for chunks in logits]


# ---- the store against the cache-ordered one ------------------------------------------------------------------
@pytest.mark.parametrize("mode,chunk", [("latent", 1), ("freq", 1), ("latent", 5)])
def test_decode_keeps_the_same_tokens_and_codes_as_the_cache_ordered_store(compiled, mode, chunk):
    model = evicting_model(compiled[mode], 4, 0.5, bits=BITS, observed=8)
    tokens = random_windows(n=2, length=48, seed=41)
    ours, reference = cache_pair(model, capacity=64)
    out, expected = step_through(model, tokens, (ours, reference), prefill=20, check=assert_same_kept, chunk=chunk)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    # The point of the store: rows out of cache order after in-place replacement, in buffers allocated once.
    assert any(not bool((layer.kept_positions.diff(dim=-1) > 0).all()) for layer in ours.layers)


def test_greedy_generate_equals_the_cache_ordered_store_with_left_padding(compiled):
    model = evicting_model(compiled["latent"], 3, 0.5, bits=BITS, observed=8)
    ids = random_windows(n=2, length=24, seed=42)
    ids[0, :5] = 0
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    outputs = []
    for use_reference in (False, True):
        ours, reference = cache_pair(model, storage_dtype=torch.float16)
        with torch.no_grad():
            outputs.append(
                model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    past_key_values=reference if use_reference else ours,
                    max_new_tokens=12,
                    do_sample=False,
                    pad_token_id=0,
                )
            )
    assert torch.equal(outputs[0], outputs[1])


def test_generate_sizes_the_store_once_and_matches_an_unsized_cache(compiled):
    """generate() passes its max length: the kept tier is allocated once at its largest budget, and decoding writes
    into it in place; the tokens equal those of a cache built without a capacity."""
    model = evicting_model(compiled["latent"], 3, 0.5, bits=BITS, observed=8)
    ids = random_windows(n=1, length=20, seed=43)
    sized = {}
    original = EvictingLayer._write

    def recording(self, tier, rows, slots, new, chosen=None):
        original(self, tier, rows, slots, new, chosen)
        sized.setdefault(id(self), set()).add(self.kept_buffers["key.codes"].data_ptr())

    with torch.no_grad():
        plain = model.generate(
            input_ids=ids, past_key_values=model.make_kv_cache(), max_new_tokens=10, do_sample=False, pad_token_id=0
        )
        EvictingLayer._write = recording
        try:
            generated = model.generate(input_ids=ids, max_new_tokens=10, do_sample=False, pad_token_id=0)
        finally:
            EvictingLayer._write = original
    assert torch.equal(generated, plain)
    assert sized and all(len(pointers) == 1 for pointers in sized.values())  # never reallocated


def test_a_store_that_outgrows_its_room_and_a_crop(compiled):
    """A capacity too small for the sequence: the store grows (copied once) and reads the same; crop then cuts the
    recent window only, and decoding goes on alike."""
    model = evicting_model(compiled["latent"], 4, 0.5, bits=BITS, observed=8)
    tokens = random_windows(n=2, length=40, seed=44)
    ours, reference = cache_pair(model, capacity=16)
    out, expected = step_through(model, tokens[:, :30], (ours, reference), prefill=12, check=assert_same_kept)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    assert ours.layers[0].kept_buffers["key.codes"].shape[1] > round(0.5 * (16 - 4))
    for cache in (ours, reference):
        cache.crop(28)
    out, expected = step_through(model, tokens[:, 28:], (ours, reference), prefill=1, check=assert_same_kept)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


def test_reset_and_beam_reorder_start_new_buffers(compiled):
    model = evicting_model(compiled["freq"], 4, 0.5, bits=BITS, observed=8)
    first, second = random_windows(n=2, length=30, seed=45), random_windows(n=2, length=30, seed=46)
    ours, reference = cache_pair(model, capacity=40)
    step_through(model, first, (ours, reference), prefill=10)
    for cache in (ours, reference):
        cache.reset()
    assert all(not layer.kept_buffers for layer in ours.layers)
    out, expected = step_through(model, second, (ours, reference), prefill=10, check=assert_same_kept)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    for cache in (ours, reference):
        cache.reorder_cache(torch.tensor([1, 0]))
    assert_same_kept(ours, reference)
    more = random_windows(n=2, length=6, seed=47)
    out, expected = step_through(model, more, (ours, reference), prefill=1, check=assert_same_kept)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


def test_floor_demotes_the_same_tokens_from_an_unordered_store(compiled):
    model = kvrewrite.load(
        compiled["latent"],
        rate=RATE,
        recent_window=4,
        kv_codec="none",
        evict={"keep": 0.3, "bits": list(BITS), "observed_queries": 8, "floor": {"key": 2, "value": 2, "bits": 4}},
    ).eval()
    tokens = random_windows(n=2, length=36, seed=48)
    ours, reference = cache_pair(model, capacity=48)

    def same_floor(mine, theirs):
        assert_same_kept(mine, theirs)
        for a, b in zip(mine.layers, theirs.layers):
            order_a, order_b = a.floor_positions.argsort(dim=-1), b.floor_positions.argsort(dim=-1)
            store_a, store_b = a._store("floor"), b._store("floor")
            for name in store_a:
                index_a = order_a.view(*order_a.shape, *([1] * (store_a[name].dim() - 2))).expand_as(store_a[name])
                index_b = order_b.view(*order_b.shape, *([1] * (store_b[name].dim() - 2))).expand_as(store_b[name])
                assert torch.equal(store_a[name].gather(1, index_a), store_b[name].gather(1, index_b)), name

    out, expected = step_through(model, tokens, (ours, reference), prefill=12, check=same_floor)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


def test_ties_at_the_threshold_keep_the_older_tokens():
    scores = torch.tensor([[0.5, 0.1, 0.5, 0.5, 0.9, 0.5]])
    positions = torch.tensor([[7, 2, 3, 9, 1, 5]])
    stays = _top_mask(scores, positions, 3)
    # 0.9 (position 1), then of the four at 0.5 the two oldest: positions 3 and 5.
    assert set(stays.nonzero()[:, 1].tolist()) == {4, 2, 5}


# ---- bytes -----------------------------------------------------------------------------------------------------
def test_without_a_capacity_decoding_holds_exactly_the_kept_rows(compiled):
    """The frontier builds its caches with make_kv_cache() and counts the bytes they hold: without a capacity the
    stores hold their rows and nothing more, step after step, as when every settle concatenated."""
    window, keep, group = 4, 0.5, 64
    model = evicting_model(compiled["latent"], window, keep, bits=BITS, observed=8)
    tokens = random_windows(n=2, length=40, seed=49)
    cache = model.make_kv_cache()
    reference = make_tiered_cache(model, model.tier_policy)  # the store kept in order, concatenated every settle
    for layer in reference.layers:
        layer.__class__ = CacheOrderedLayer
    key_ranks = cache.layers[0].kept_key_ranks
    d = model.compressed_attentions()[0].head_dim

    def formula(cache, ordered):
        assert cache_tensor_bytes(cache) == cache_tensor_bytes(ordered)
        total = 0
        for layer in cache.layers:
            n_recent, n_kept = layer.keys.shape[-2], layer.kept_positions.shape[-1]
            assert n_kept == round(keep * (layer.cumulative_length - n_recent))
            per_kept = sum(
                packed_length(sum(r), bits) + 4 * -(-sum(r) // group)
                for r, bits in ((layer.kept_key_ranks, BITS[0]), (layer.kept_value_ranks, BITS[1]))
            )
            total += 2 * (n_recent * 2 * d * len(key_ranks) * 2 + n_kept * (per_kept + 4))
            total += 2 * 2 * 2 * (sum(layer.kept_key_ranks) + sum(layer.kept_value_ranks))  # mean and rms
            for buffer in layer.kept_buffers.values():
                assert buffer.shape[1] == n_kept
        widths = {r for layer in cache.layers for r in layer.kept_key_ranks + layer.kept_value_ranks if r}
        total += sum(4 * r * r for r in widths)
        assert cache_tensor_bytes(cache) == total

    step_through(model, tokens, (cache, reference), prefill=12, check=formula)


@pytest.mark.parametrize("bits", [8, 4, 2, None])
@pytest.mark.parametrize("ranks,group", [((16, 16, 32), 16), ((5, 11, 0, 16), 8)])
def test_head_blocks_are_the_heads_columns_of_the_decoded_store(bits, ranks, group):
    gen = torch.Generator().manual_seed(51)
    x = torch.randn(2, 7, sum(ranks), generator=gen)
    stored = encode_tokens(x, bits, group)
    whole = decode_tokens(stored, sum(ranks), bits, group, torch.float32)
    blocks = decode_head_blocks(stored, ranks, bits, group, torch.float32)
    start = 0
    for r, block in zip(ranks, blocks):
        assert torch.equal(block, whole[..., start : start + r])
        start += r


# ---- one decode step against a dense float64 softmax -----------------------------------------------------------
def _codes(stored: dict[str, torch.Tensor], bits: int, channels: int) -> torch.Tensor:
    packed = stored["codes"].long()
    if bits == 8:
        return packed[..., :channels]
    per_byte = 8 // bits
    parts = [(packed >> (bits * i)) & ((1 << bits) - 1) for i in range(per_byte)]  # first code in the low bits
    return torch.stack(parts, dim=-1).flatten(-2)[..., :channels]


def _latents(layer: EvictingLayer, side: str, bits: int) -> torch.Tensor:
    """[B, S, C] float64 latents of the kept tier, decoded here: codes x scale + minimum per group, each head's
    block turned back by its rotation's transpose, scaled by the channel rms and shifted by the mean."""
    ranks = layer.kept_key_ranks if side == "key" else layer.kept_value_ranks
    stored = layer.kept_keys if side == "key" else layer.kept_values
    channels = sum(ranks)
    codes = _codes(stored, bits, channels).double()
    group = layer.group_size
    index = torch.arange(channels) // group
    y = codes * stored["scale"].double()[..., index] + stored["low"].double()[..., index]
    blocks, start = [], 0
    for r in ranks:
        block = y[..., start : start + r]
        blocks.append(block @ layer.rotations[r].double().T if r else block)
        start += r
    x = torch.cat(blocks, dim=-1)
    return (
        x * layer.channel_stats[side + "_rms"].double()[:, None] + layer.channel_stats[side + "_mean"].double()[:, None]
    )


def _rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    angle = positions.double()[..., None] * inv_freq.double()
    cos, sin = torch.cat([angle.cos(), angle.cos()], -1), torch.cat([angle.sin(), angle.sin()], -1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


@pytest.mark.parametrize(
    "mode,rate,group",
    # RATE's ranks split the channel groups (each head's block decoded from the whole store); at rate 0 with a group
    # per head, every head's block is decoded on its own.
    [("latent", RATE, 64), ("freq", RATE, 64), ("latent", 0.0, 16), ("freq", 0.0, 16)],
)
def test_a_decode_step_reads_exactly_the_kept_tokens_as_a_dense_softmax(compiled, mode, rate, group):
    window = 4
    evict = {"keep": 0.5, "bits": list(BITS), "observed_queries": 8, "group_size": group}
    model = kvrewrite.load(compiled[mode], rate=rate, recent_window=window, kv_codec="none", evict=evict).eval()
    tokens = random_windows(n=2, length=36, seed=50)
    cache = make_tiered_cache(model, model.tier_policy, storage_dtype=torch.float32, capacity=48)
    step_through(model, tokens, (cache,), prefill=16)
    # A layer whose kept rows are out of cache order (one whose heads score every token alike keeps them in order).
    index = next(i for i, lay in enumerate(cache.layers) if not bool((lay.kept_positions.diff(dim=-1) > 0).all()))
    attn, layer = model.compressed_attentions()[index], cache.layers[index]
    d, heads, group = attn.head_dim, attn.num_heads, attn.group_size
    gen = torch.Generator().manual_seed(7)
    batch, channels = 2, attn.num_kv_heads * d
    key, value = torch.randn(batch, 1, channels, generator=gen), torch.randn(batch, 1, channels, generator=gen)
    query = torch.randn(batch, 1, heads * d, generator=gen)
    with torch.no_grad():
        layer.update(key.unsqueeze(1), value.unsqueeze(1))
        out = tiered_attention(attn, query, layer, None)

    kv_len = layer.get_seq_length()
    kept_pos = layer.kept_positions.long()  # [B, S]
    kept_k, kept_v = _latents(layer, "key", BITS[0]), _latents(layer, "value", BITS[1])
    recent_k, recent_v = layer.keys[:, 0].double(), layer.values[:, 0].double()  # [B, R, C], full rank
    recent_pos = torch.arange(kv_len - recent_k.shape[1], kv_len)
    assert kv_len - 1 - recent_pos[0] <= window  # every recent token is read at full rank by this query
    inv_freq = attn._rotary[0].inv_freq
    expected = torch.zeros(batch, heads * d, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            g = h // group
            q = query[b, 0, h * d : (h + 1) * d].double()
            rk, rv = layer.kept_key_ranks[g], layer.kept_value_ranks[g]
            k_start, v_start = sum(layer.kept_key_ranks[:g]), sum(layer.kept_value_ranks[:g])
            xk = kept_k[b, :, k_start : k_start + rk]
            xv = torch.nn.functional.pad(kept_v[b, :, v_start : v_start + rv], (0, d - rv))
            rk_full, rv_full = recent_k[b, :, g * d : (g + 1) * d], recent_v[b, :, g * d : (g + 1) * d]
            if mode == "latent":
                up = attn.k_up[g].double()
                q_rot = _rope(q, torch.tensor(kv_len - 1), inv_freq)
                kept_scores = _rope(xk @ up[:rk], kept_pos[b], inv_freq) @ q_rot
                recent_scores = _rope(rk_full @ up, recent_pos, inv_freq) @ q_rot
            else:  # keys are position-encoded latents: the query's dims beyond the kept ranks meet zeros
                kept_scores = xk @ q[:rk]
                recent_scores = rk_full @ q
            probs = torch.softmax(torch.cat([kept_scores, recent_scores]) * attn.scaling, dim=0)
            expected[b, h * d : (h + 1) * d] = probs @ torch.cat([xv, rv_full])
    torch.testing.assert_close(out[:, 0].double(), expected, rtol=1e-4, atol=1e-5)
