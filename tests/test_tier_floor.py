"""The floor tier (kvrewrite.runtime.tiers.floor): evicted tokens keep a prefix of their latent dims instead of
leaving. Checked against test_tiers' dense per-query reference (which shares nothing with kvrewrite.runtime.tiers):
query t reads keys within the window at full rank, kept ones at the kept ranks and demoted ones at the floor's."""

from __future__ import annotations

import pytest
import torch
from test_tiers import RATE, _head_mask, compiled, dense_reference_logits  # noqa: F401  (compiled: the fixture)
from tiny_models import random_windows

import kvrewrite
from kvrewrite.errors import InvalidArgumentError
from kvrewrite.runtime.cache_bytes import cache_tensor_bytes
from kvrewrite.runtime.codecs.packing import packed_length
from kvrewrite.runtime.tiers.build import make_tiered_cache


def floored_model(directory, window: int, keep: float, floor: dict, bits=None):
    return kvrewrite.load(
        directory, rate=RATE, recent_window=window, kv_codec="none", evict={"keep": keep, "bits": bits, "floor": floor}
    ).eval()


def feed(model, tokens: torch.Tensor, chunk: int, cache):
    """Chunked feeding; returns the logits and, per chunk, each layer's (kept, floor) cache indices and first recent
    index."""
    logits, states = [], []
    with torch.no_grad():
        for s in range(0, tokens.shape[1], chunk):
            logits.append(model(tokens[:, s : s + chunk], past_key_values=cache, use_cache=True).logits)
            states.append(
                [
                    (
                        set(layer.kept_positions[0].tolist()),
                        set(layer.floor_positions[0].tolist()),
                        layer.cumulative_length - layer.keys.shape[-2],
                    )
                    for layer in cache.layers
                ]
            )
    return torch.cat(logits, dim=1), states


@pytest.mark.parametrize("mode", ["latent", "freq"])
def test_floor_cache_equals_dense_reference_chunk_by_chunk(compiled, mode):
    window, chunk, length, keep, floor_k, floor_v = 5, 7, 40, 0.4, 3, 2
    tokens = random_windows(n=1, length=length, seed=31)
    model = floored_model(compiled[mode], window, keep, {"key": floor_k, "value": floor_v, "bits": None})
    cache = make_tiered_cache(model, model.tier_policy, storage_dtype=torch.float32)
    logits, states = feed(model, tokens, chunk, cache)
    key_ranks, value_ranks = model.compression_spec.ranks_for_rate(RATE)
    d = model.compressed_attentions()[0].head_dim

    def masks(layer: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = t + 1
        key_mask, value_mask = torch.ones(n, len(key_ranks[layer]) * d), torch.ones(n, len(key_ranks[layer]) * d)
        floored = set()
        c = t // chunk
        if c:
            _, floored, _ = states[c - 1][layer]
        for j in range(n):
            if j in floored:  # demoted at the previous chunk's settle: each head's first floor dims
                key_mask[j] = _head_mask([min(floor_k, r) for r in key_ranks[layer]], d)
                value_mask[j] = _head_mask([min(floor_v, r) for r in value_ranks[layer]], d)
            elif t - j > window:
                key_mask[j] = _head_mask(key_ranks[layer], d)
                value_mask[j] = _head_mask(value_ranks[layer], d)
        return key_mask, value_mask

    reference = dense_reference_logits(compiled[mode], tokens, window, masks=masks)
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)
    for layer_states in states:  # nothing leaves: kept + floor + recent window hold every token
        for kept, floored, first_recent in layer_states:
            assert len(kept) == round(keep * first_recent)
            assert kept.isdisjoint(floored) and kept | floored == set(range(first_recent))


def test_floor_bytes_equal_the_formula(compiled):
    window, chunk, length, keep, bits, floor_k, floor_v, floor_bits = 6, 8, 64, 0.3, (8, 4), 4, 2, 2
    tokens = random_windows(n=2, length=length, seed=32)
    floor = {"key": floor_k, "value": floor_v, "bits": floor_bits}
    model = floored_model(compiled["latent"], window, keep, floor, bits)
    cache = make_tiered_cache(model, model.tier_policy)
    feed(model, tokens, chunk, cache)
    key_ranks, value_ranks = model.compression_spec.ranks_for_rate(RATE)
    full = 2 * model.compressed_attentions()[0].head_dim * len(key_ranks[0])
    group = model.tier_policy.group_size

    def coded(channels: int, b: int) -> int:
        return packed_length(channels, b) + 4 * -(-channels // group)  # codes, float16 scale and minimum per group

    expected = 0
    widths = set()
    for i, layer in enumerate(cache.layers):
        n_recent, n_kept, n_floor = (
            layer.keys.shape[-2],
            layer.kept_positions.shape[-1],
            layer.floor_positions.shape[-1],
        )
        assert n_recent == window and n_kept == round(keep * (length - window))
        assert n_floor == length - window - n_kept
        fk = [min(floor_k, r) for r in key_ranks[i]]
        fv = [min(floor_v, r) for r in value_ranks[i]]
        per_kept = coded(sum(key_ranks[i]), 8) + coded(sum(value_ranks[i]), 4) + 4  # and an int32 cache index
        per_floor = coded(sum(fk), floor_bits) + coded(sum(fv), floor_bits) + 4
        expected += 2 * (n_recent * full * 2 + n_kept * per_kept + n_floor * per_floor)  # 2 rows
        # float16 per-channel mean and rms, per side and row: the kept tier's and the floor's
        expected += 2 * 2 * 2 * (sum(key_ranks[i]) + sum(value_ranks[i]) + sum(fk) + sum(fv))
        widths |= {r for r in key_ranks[i] + value_ranks[i] + fk + fv if r}
    expected += sum(4 * r * r for r in widths)  # one float32 rotation per block width, shared by the layers
    assert cache_tensor_bytes(cache) == expected


def test_a_floor_with_keys_only_and_generation_run(compiled):
    """A floor without value dims still reads every token's key; generate() runs through it."""
    model = floored_model(compiled["post-rope"], 4, 0.25, {"key": 4, "value": 0, "bits": 4}, bits=4)
    prompt = random_windows(n=1, length=30, seed=33)
    out = model.generate(prompt, max_new_tokens=6, do_sample=False)
    assert out.shape == (1, 36)


def test_bad_floor_settings_are_refused(compiled):
    directory = compiled["freq"]

    def load(floor):
        return floored_model(directory, 4, 0.5, floor)

    with pytest.raises(InvalidArgumentError, match="floor takes a dict"):
        load(8)
    with pytest.raises(InvalidArgumentError, match="floor key"):
        load({"key": -1})
    with pytest.raises(InvalidArgumentError, match="floor bits"):
        load({"key": 4, "bits": 3})
    with pytest.raises(InvalidArgumentError, match="floor takes key"):
        load({"value": 4})
    with pytest.raises(InvalidArgumentError, match="at least one key dim"):
        load({"key": 0, "value": 4})
