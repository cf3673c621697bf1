"""Re-scored eviction over the latent cache (kvrewrite.runtime.tiers.eviction) against dense references.

The attention reference is test_tiers' dense per-query computation (it shares nothing with kvrewrite.runtime.tiers): query
t reads keys within the window at full rank, older ones at the kept ranks, and none of the evicted ones. The
scoring reference recomputes a layer's attention probabilities directly from its projected queries and keys.
"""

from __future__ import annotations

import pytest
import torch
from test_tiers import RATE, compiled, dense_reference_logits, window_masks  # noqa: F401  (compiled: the fixture)
from tiny_models import random_windows

import kvrewrite
from kvrewrite.errors import InvalidArgumentError
from kvrewrite.runtime.cache_bytes import cache_tensor_bytes
from kvrewrite.runtime.codecs.packing import packed_length
from kvrewrite.runtime.modeling.attention import CompressedAttention
from kvrewrite.runtime.tiers.build import make_tiered_cache
from kvrewrite.runtime.tiers.eviction import EvictingLayer, decode_tokens, encode_tokens


def evicting_model(directory, window: int, keep: float, bits=None, observed: int = 64):
    return kvrewrite.load(
        directory,
        rate=RATE,
        recent_window=window,
        kv_codec="none",
        evict={"keep": keep, "bits": bits, "observed_queries": observed},
    ).eval()


def feed(model, tokens: torch.Tensor, chunk: int, cache):
    """Chunked feeding; returns the logits and, per chunk, each layer's kept cache indices and first recent index."""
    logits, states = [], []
    with torch.no_grad():
        for s in range(0, tokens.shape[1], chunk):
            logits.append(model(tokens[:, s : s + chunk], past_key_values=cache, use_cache=True).logits)
            states.append(
                [
                    (set(layer.kept_positions[0].tolist()), layer.cumulative_length - layer.keys.shape[-2])
                    for layer in cache.layers
                ]
            )
    return torch.cat(logits, dim=1), states


@pytest.mark.parametrize("mode", ["latent", "freq", "post-rope"])
def test_evicting_cache_equals_dense_reference_chunk_by_chunk(compiled, mode):
    window, chunk, length, keep = 5, 7, 40, 0.5
    tokens = random_windows(n=1, length=length, seed=21)
    model = evicting_model(compiled[mode], window, keep)
    cache = make_tiered_cache(model, model.tier_policy, storage_dtype=torch.float32)
    logits, states = feed(model, tokens, chunk, cache)
    key_ranks, value_ranks = model.compression_spec.ranks_for_rate(RATE)
    d = model.compressed_attentions()[0].head_dim
    masks = window_masks(key_ranks, value_ranks, d, window)

    def dropped(layer: int, t: int) -> torch.Tensor:
        out = torch.zeros(t + 1, dtype=torch.bool)
        c = t // chunk
        if c:  # what the previous chunk's settle left: tokens before the recent window that were not kept
            kept, first_recent = states[c - 1][layer]
            for j in range(first_recent):
                out[j] = j not in kept
        return out

    reference = dense_reference_logits(compiled[mode], tokens, window, masks=masks, dropped=dropped)
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)
    for layer_states in states:  # the budget: round(keep x tokens beyond the window) after every chunk
        for kept, first_recent in layer_states:
            assert len(kept) == round(keep * first_recent)
    assert any(states[-1][0][0] != states[-1][i][0] for i in range(1, len(states[-1])))  # layers choose their own


def test_kept_tokens_are_the_ones_the_newest_queries_attend_to_most(compiled):
    """One forward; the kept set must be the top of an independent dense attention over the last observed queries."""
    window, length, keep, observed = 4, 30, 0.4, 6
    tokens = random_windows(n=2, length=length, seed=22)
    model = evicting_model(compiled["freq"], window, keep, observed=observed)
    captured = {}
    original_project = CompressedAttention.project

    def project(self, hidden_states, position_embeddings=None):
        out = original_project(self, hidden_states, position_embeddings)
        captured[self.layer_idx] = out
        return out

    CompressedAttention.project = project
    try:
        cache = make_tiered_cache(model, model.tier_policy, storage_dtype=torch.float32)
        with torch.no_grad():
            model(tokens, past_key_values=cache, use_cache=True)
    finally:
        CompressedAttention.project = original_project
    key_ranks, _ = model.compression_spec.ranks_for_rate(RATE)
    attn = model.compressed_attentions()[0]
    d, group = attn.head_dim, attn.group_size
    budget = round(keep * (length - window))
    for layer, layer_cache in enumerate(cache.layers):
        query, key, _ = captured[layer]  # freq keys: packed latents, already position-encoded
        received = torch.zeros(2, length)
        for h in range(attn.num_heads):
            g = h // group
            q = query[..., h * d : (h + 1) * d]
            k = key[..., g * d : (g + 1) * d]
            full = q @ k.transpose(-1, -2)
            cut = q[..., : key_ranks[layer][g]] @ k[..., : key_ranks[layer][g]].transpose(-1, -2)
            t, j = torch.arange(length)[:, None], torch.arange(length)[None]
            logits = torch.where(t - j <= window, full, cut) * attn.scaling
            probs = torch.softmax(logits.masked_fill(j > t, float("-inf")), dim=-1)
            received += probs[:, length - observed :].sum(dim=1)
        for row in range(2):
            # Ties (a rank-0 head attends uniformly) go to the older tokens, as the eviction ranks them.
            ranked = received[row, : length - window].sort(descending=True, stable=True).indices
            expected = set(ranked[:budget].tolist())
            assert set(layer_cache.kept_positions[row].tolist()) == expected


def test_settle_keeps_the_top_scored_budget_at_the_kept_ranks():
    window, d, keep = 3, 4, 0.5
    layer = EvictingLayer(window, d, (2,), (1,), keep, storage_dtype=torch.float32)
    gen = torch.Generator().manual_seed(3)
    n = window + 10
    keys, values = torch.randn(2, 1, n, d, generator=gen), torch.randn(2, 1, n, d, generator=gen)
    layer.update(keys, values)
    received = torch.rand(2, n, generator=gen)
    layer.add_scores(received, [torch.zeros(2, 0)], torch.zeros(2, n))
    layer.settle()
    for row in range(2):
        expected = sorted(received[row, :10].topk(5).indices.tolist())
        assert layer.kept_positions[row].tolist() == expected  # in cache order
        torch.testing.assert_close(layer.kept_keys["latents"][row], keys[row, 0, expected, :2])
        torch.testing.assert_close(layer.kept_values["latents"][row], values[row, 0, expected, :1])
    assert layer.keys.shape[-2] == window


@pytest.mark.parametrize("sinks", [0, 2])
def test_sinks_stay_whatever_the_scores_and_the_rest_is_the_top_scored(sinks):
    """Sinks scored lowest at every forward: with `sinks`, positions 0..sinks-1 stay through a settle that moves ten
    tokens and through single-token steps, and the rest of the budget is the top of the scores among the others
    (recomputed here from the scores fed); without, the low scores evict them."""
    window, d, keep = 3, 4, 0.5
    layer = EvictingLayer(window, d, (2,), (1,), keep, storage_dtype=torch.float32, sinks=sinks)
    gen = torch.Generator().manual_seed(5)
    n = window + 10
    layer.update(torch.randn(2, 1, n, d, generator=gen), torch.randn(2, 1, n, d, generator=gen))
    received = torch.rand(2, n, generator=gen) + 1
    received[:, :2] = 0  # the first two tokens: the least read
    layer.add_scores(received, [torch.zeros(2, 0)], torch.zeros(2, n))
    layer.settle()
    scores = {row: dict(enumerate(received[row, :10].tolist())) for row in range(2)}  # position -> latest score
    for step in range(6):
        kept = layer.kept_positions
        fed = torch.rand(2, kept.shape[-1], generator=gen) + 1
        fed = fed.masked_fill(kept < 2, 0.0)
        recent = torch.rand(2, window + 1, generator=gen) + 1
        layer.update(torch.randn(2, 1, 1, d, generator=gen), torch.randn(2, 1, 1, d, generator=gen))
        moving = 10 + step  # the window's oldest token leaves it
        layer.add_scores(recent, [fed], torch.zeros(2, window + 1))
        layer.settle()
        for row in range(2):
            scores[row] = {int(p): float(v) for p, v in zip(kept[row].tolist(), fed[row].tolist())}
            scores[row][moving] = float(recent[row, 0])
    budget = round(keep * (n + 6 - window))
    for row in range(2):
        ranked = sorted((p for p in scores[row] if p >= sinks), key=lambda p: -scores[row][p])
        expected = set(range(sinks)) | set(ranked[: budget - sinks])
        assert set(layer.kept_positions[row].tolist()) == expected
        assert ({0, 1} <= expected) == bool(sinks)


def test_sinks_stay_while_the_budget_is_under_them():
    """Token by token at keep 0.1, the budget reaches 3 only 25 tokens past the window: until then the layer keeps
    the sinks that have left the window (scored lowest), one row each, and nothing else."""
    window, d, sinks = 2, 4, 3
    layer = EvictingLayer(window, d, (2,), (1,), 0.1, storage_dtype=torch.float32, sinks=sinks)
    gen = torch.Generator().manual_seed(7)
    for t in range(12):
        layer.update(torch.randn(1, 1, 1, d, generator=gen), torch.randn(1, 1, 1, d, generator=gen))
        kept = layer.kept_positions
        recent = torch.rand(1, layer.keys.shape[-2], generator=gen) + 1
        recent[:, : max(0, sinks - (t + 1 - layer.keys.shape[-2]))] = 0  # sinks still in the window
        fed = None if kept is None else (torch.rand(1, kept.shape[-1], generator=gen) + 1).masked_fill(kept < sinks, 0)
        layer.add_scores(recent, None if fed is None else [fed], None)
        layer.settle()
        beyond = t + 1 - window
        if beyond > 0:
            assert layer.kept_positions[0].tolist() == list(range(min(sinks, beyond)))


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_per_token_quantization_matches_a_direct_min_max_reference(bits):
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 9, 45, generator=gen) * torch.linspace(0.1, 3, 45)
    group = 16
    stored = encode_tokens(x, bits, group)
    decoded = decode_tokens(stored, 45, bits, group, torch.float32)[:, 0]
    levels = 2**bits - 1
    for start in range(0, 45, group):  # each token's group of channels: its own min and step
        part = x[..., start : start + group]
        low = part.amin(-1, keepdim=True).half().float()
        step = ((part.amax(-1, keepdim=True) - part.amin(-1, keepdim=True)) / levels).clamp_min(1e-4).half().float()
        expected = torch.round((part - low) / step).clamp(0, levels) * step + low
        torch.testing.assert_close(decoded[..., start : start + group], expected, rtol=0, atol=1e-5)
    # Evicting is a gather: the other tokens' stored numbers do not change.
    first_three = encode_tokens(x[:, :3], bits, group)
    for name, tensor in first_three.items():
        assert torch.equal(stored[name][:, :3], tensor)


def test_bytes_held_equal_the_formula(compiled):
    window, chunk, length, keep, bits, group = 6, 8, 64, 0.3, 4, 16
    tokens = random_windows(n=2, length=length, seed=23)
    model = evicting_model(compiled["latent"], window, keep, bits)
    model.tier_policy = type(model.tier_policy)(**{**model.tier_policy.__dict__, "group_size": group})
    cache = make_tiered_cache(model, model.tier_policy)  # float16 window, as served
    feed(model, tokens, chunk, cache)
    key_ranks, value_ranks = model.compression_spec.ranks_for_rate(RATE)
    full = 2 * model.compressed_attentions()[0].head_dim * len(key_ranks[0])
    expected = 0
    for i, layer in enumerate(cache.layers):
        n_recent, n_kept = layer.keys.shape[-2], layer.kept_positions.shape[-1]
        assert n_recent == window and n_kept == round(keep * (length - window))
        per_kept = sum(packed_length(sum(r), bits) + 4 * -(-sum(r) // group) for r in (key_ranks[i], value_ranks[i]))
        expected += 2 * (n_recent * full * 2 + n_kept * (per_kept + 4))  # 2 rows; int32 cache index per kept token
    widths = {r for ranks in key_ranks + value_ranks for r in ranks if r}
    expected += sum(4 * r * r for r in widths)  # one float32 rotation per block width, shared by the layers
    # float16 per-channel mean and rms, per side, layer and row
    expected += sum(2 * 2 * 2 * (sum(k) + sum(v)) for k, v in zip(key_ranks, value_ranks))
    assert cache_tensor_bytes(cache) == expected


def test_quantized_kept_tier_keeps_every_channel_where_per_token_ranges_lose_the_small_ones():
    """Importance-ordered latents with channel offsets: per-token int4 over raw channels rounds the small channels
    to nothing; the kept tier (centred, scaled, turned) reads every channel back to a few percent of its spread."""
    gen = torch.Generator().manual_seed(6)
    d, n = 16, 48
    magnitudes = torch.logspace(1, -2, d).repeat(2)
    x = torch.randn(1, 1, n, 2 * d, generator=gen) * magnitudes + 3 * magnitudes
    layer = EvictingLayer(0, d, (d, d), (d, d), 1.0, bits=4, group_size=d, storage_dtype=torch.float32)
    layer.update(x, x)
    layer.add_scores(torch.ones(1, n), [torch.zeros(1, 0)], torch.zeros(1, n))
    layer.settle()
    spread = (x - x.mean(dim=2, keepdim=True)).norm(dim=2)  # per channel

    def worst_channel_error(read: torch.Tensor) -> float:
        return float(((read - x).norm(dim=2) / spread).max())

    ours = worst_channel_error(layer.stored_tiers(torch.float32)[0].keys)
    plain = worst_channel_error(decode_tokens(encode_tokens(x[:, 0], 4, d), 2 * d, 4, d, torch.float32))
    assert ours < 0.25 and plain > 0.9
    q = layer.rotations[d]
    torch.testing.assert_close(q @ q.T, torch.eye(d), rtol=0, atol=1e-5)


def test_a_reset_cache_takes_its_channel_statistics_from_the_next_sequence(compiled):
    """The centring and scaling of the kept tier belong to the sequence that set them: after reset(), a new sequence
    reads back exactly as it does through a fresh cache."""
    model = evicting_model(compiled["latent"], 4, 0.5, bits=4)
    first, second = random_windows(n=1, length=30, seed=31), random_windows(n=1, length=30, seed=32) * 3 % 90
    reused = model.make_kv_cache()
    feed(model, first, 10, reused)
    reused.reset()
    again, _ = feed(model, second, 10, reused)
    fresh, _ = feed(model, second, 10, model.make_kv_cache())
    torch.testing.assert_close(again, fresh, rtol=0, atol=0)


def test_generate_beam_search_and_an_unpadded_row_unchanged_by_its_batch(compiled):
    model = evicting_model(compiled["latent"], 3, 0.5, bits=4)
    ids = torch.tensor([[0, 0, 5, 6, 7, 8, 9, 10, 11, 12], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]])
    mask = torch.tensor([[0, 0] + [1] * 8, [1] * 10])
    with torch.no_grad():
        batched = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
        alone = model.generate(input_ids=ids[1:], max_new_tokens=6, do_sample=False, pad_token_id=0)
        beams = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=4, num_beams=3, do_sample=False, pad_token_id=0
        )
    assert torch.equal(batched[1], alone[0])
    assert beams.shape == (2, 14)


def test_bad_eviction_settings_are_refused(compiled):
    directory = compiled["freq"]
    with pytest.raises(InvalidArgumentError, match="needs recent_window"):
        kvrewrite.load(directory, rate=RATE, evict={"keep": 0.5})
    with pytest.raises(InvalidArgumentError, match="choose one"):
        kvrewrite.load(
            directory,
            rate=RATE,
            recent_window=4,
            kv_codec="none",
            evict={"keep": 0.5},
            important={"rate": 0.0, "share": 0.5},
        )
    with pytest.raises(InvalidArgumentError, match="no block codec"):
        kvrewrite.load(directory, rate=RATE, recent_window=4, kv_codec="int4", evict={"keep": 0.5})
    with pytest.raises(InvalidArgumentError, match=r"\[0, 1\]"):
        kvrewrite.load(directory, rate=RATE, recent_window=4, kv_codec="none", evict={"keep": 1.5})
    with pytest.raises(InvalidArgumentError, match="bits"):
        kvrewrite.load(directory, rate=RATE, recent_window=4, kv_codec="none", evict={"keep": 0.5, "bits": 3})
    with pytest.raises(InvalidArgumentError, match="takes keep"):
        kvrewrite.load(directory, rate=RATE, recent_window=4, kv_codec="none", evict={"share": 0.5})
    for sinks in (-1, 2.0, True, [1] * 7):
        with pytest.raises(InvalidArgumentError, match="sinks must be a whole number"):
            kvrewrite.load(directory, rate=RATE, recent_window=4, kv_codec="none", evict={"keep": 0.5, "sinks": sinks})
