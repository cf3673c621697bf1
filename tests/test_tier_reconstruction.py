"""Prefill scored by reconstruction (kvrewrite.runtime.tiers.reconstruction) against a dense reference: the kept
tokens must be the top of the max attention, over heads and repeat queries, recomputed directly from the layers'
projected queries and keys of the context and its teacher-forced repeat."""

from __future__ import annotations

import pytest
import torch
from test_tiers import RATE, compiled  # noqa: F401  (compiled: the fixture)
from tiny_models import random_windows

import kvrewrite
from kvrewrite.errors import InvalidArgumentError
from kvrewrite.runtime.modeling.attention import CompressedAttention
from kvrewrite.runtime.tiers.build import make_tiered_cache
from kvrewrite.runtime.tiers.reconstruction import prefill_scored_by_reconstruction


def pooled_by_hand(scores: torch.Tensor, ids: torch.Tensor, ngram: int) -> torch.Tensor:
    """pool_repeats' rule written out over Python tuples: per row, each n-gram said more than once raises every
    token of its best-scored occurrence (scored at its last token, the first of equals) to at least the sum of its
    occurrences' scores."""
    out = scores.clone()
    for row in range(scores.shape[0]):
        copies: dict[tuple, list[int]] = {}
        for end in range(ngram - 1, scores.shape[1]):
            copies.setdefault(tuple(ids[row, end - ngram + 1 : end + 1].tolist()), []).append(end)
        for ends in copies.values():
            if len(ends) > 1:
                best = max(ends, key=lambda e: (float(scores[row, e]), -e))
                total = sum(float(scores[row, e]) for e in ends)
                for position in range(best - ngram + 1, best + 1):
                    out[row, position] = max(float(out[row, position]), total)
    return out


@pytest.mark.parametrize(
    "share,pool,sinks",
    [
        (1.0, 0, 0),
        (0.5, 0, 0),
        (1.0, 3, 0),
        (0.5, 2, 0),
        ([1.0, 0.0], 0, 0),
        ([0.25, 1.0], 3, 0),
        ([0.5, 0.0], 3, 2),
        ([1.0, 0.5], 0, [0, 3]),
    ],
)
def test_kept_tokens_are_the_ones_the_repeat_attends_to_most(compiled, share, pool, sinks):
    """share 1: the kept tokens are the top of the repeat's max attention; share 0.5: half the budget is that top,
    the rest the tokens the context's own queries read most (summed over heads) among the others; a list: each
    layer its own share. pool n: first the repeated n-grams of the context (planted here) give their summed
    attention to their best copy. sinks s: the first s tokens come first in the reconstruction's ranking, and stay
    where its share is 0; a list: each layer its own count."""
    window, length, keep = 4, 24, 0.3
    tokens = random_windows(n=2, length=length + 3, seed=41)
    context, repeat = tokens[:, :length].clone(), tokens[0, length:]
    if pool:  # a 5-token phrase said twice, and a 4-token one three times in the second row
        context[:, 12:17] = context[:, 3:8]
        context[1, 18:22] = context[1, 8:12]
    floor = {"key": 2, "value": 2, "bits": None}
    evict = {"keep": keep, "floor": floor, "reconstruction_share": share, "sinks": sinks}
    if pool:
        evict |= {"prefill_score": "reconstruction", "pool_repeats": pool}
    model = kvrewrite.load(compiled["freq"], rate=RATE, recent_window=window, kv_codec="none", evict=evict).eval()
    captured: dict[int, list] = {}
    original_project = CompressedAttention.project

    def project(self, hidden_states, position_embeddings=None):
        out = original_project(self, hidden_states, position_embeddings)
        captured.setdefault(self.layer_idx, []).append(out)
        return out

    CompressedAttention.project = project
    try:
        cache = make_tiered_cache(model, model.tier_policy, storage_dtype=torch.float32)
        with torch.no_grad():
            last = prefill_scored_by_reconstruction(model, cache, context, repeat)
    finally:
        CompressedAttention.project = original_project
    with torch.no_grad():  # the returned logits are a plain prefill's
        plain = model(context, past_key_values=make_tiered_cache(model, model.tier_policy, torch.float32)).logits
    torch.testing.assert_close(last, plain[:, -1], rtol=1e-4, atol=1e-4)

    key_ranks, _ = model.compression_spec.ranks_for_rate(RATE)
    attn = model.compressed_attentions()[0]
    d, group = attn.head_dim, attn.group_size
    beyond = length - window
    budget = round(keep * beyond)
    for layer, layer_cache in enumerate(cache.layers):
        (q0, k0, _), (q1, k1, _) = captured[layer]  # the context forward, then the repeat's
        key = torch.cat([k0, k1], dim=1)  # freq keys: packed latents, already position-encoded
        received, read = torch.zeros(2, length), torch.zeros(2, length)
        for h in range(attn.num_heads):
            g = h // group
            for queries, keys, first in ((q1, key, length), (q0, k0, 0)):  # the repeat's, then the context's
                q = queries[..., h * d : (h + 1) * d]
                k = keys[..., g * d : (g + 1) * d]
                full = q @ k.transpose(-1, -2)
                cut = q[..., : key_ranks[layer][g]] @ k[..., : key_ranks[layer][g]].transpose(-1, -2)
                t, j = torch.arange(first, first + q.shape[1])[:, None], torch.arange(k.shape[1])[None]
                logits = torch.where(t - j <= window, full, cut) * attn.scaling
                probs = torch.softmax(logits.masked_fill(j > t, float("-inf")), dim=-1)[..., :length]
                if first:
                    received = torch.maximum(received, probs.amax(dim=1))
                else:  # every context query is observed (fewer than observed_queries)
                    read = read + probs.sum(dim=1)
        chosen = round((share[layer] if isinstance(share, list) else share) * budget)
        if pool:
            pooled = pooled_by_hand(received, context, pool)
            assert (pooled > received).any()  # the planted phrases changed some scores
            received = pooled
        for row in range(2):
            kept = layer_cache.kept_positions[row].long()
            demoted = layer_cache.floor_positions[row].long()
            assert len(kept) == budget and set(kept.tolist()) | set(demoted.tolist()) == set(range(beyond))
            # The kept tokens: the reconstruction's top `chosen`, then the context's most read among the rest (among
            # equal scores the older tokens, as the eviction ranks ties: a stable sort in cache order).
            layer_sinks = sinks[layer] if isinstance(sinks, list) else sinks
            ranked = received[row, :beyond].clone()
            ranked[:layer_sinks] = float("inf")
            first = set(ranked.sort(descending=True, stable=True).indices[:chosen].tolist())
            first |= set(range(layer_sinks))
            rest = read[row, :beyond].clone()
            rest[list(first)] = float("-inf")
            expected = first | set(rest.sort(descending=True, stable=True).indices[: budget - len(first)].tolist())
            assert set(kept.tolist()) == expected
        assert layer_cache.keys.shape[-2] == window and layer_cache.get_seq_length() == length
        assert not layer_cache.holding and layer_cache.evidence_reduce == "sum"


def test_repeated_ngrams_pool_into_their_best_copy():
    from kvrewrite.runtime.tiers.repeated_evidence import pool_repeated_ngrams

    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 4, (3, 40), generator=generator)  # four token ids: many repeats at every n
    scores = torch.rand(3, 40, generator=generator)
    scores[1, 10:20] = 0.5  # equal scores: the first copy takes the sum
    for ngram in (1, 2, 3, 5):
        torch.testing.assert_close(pool_repeated_ngrams(scores, ids, ngram), pooled_by_hand(scores, ids, ngram))
    # A phrase said twice: its best copy rises whole, its first token too, to the sum over the copies.
    phrase_ids = torch.tensor([[9, 1, 2, 3, 9, 9, 1, 2, 3]])
    phrase = torch.tensor([[0.0, 0.1, 0.2, 0.3, 0.0, 0.0, 0.2, 0.2, 0.2]])
    pooled = pool_repeated_ngrams(phrase, phrase_ids, 3)
    torch.testing.assert_close(pooled[0, 1:4], torch.tensor([0.5, 0.5, 0.5]))  # (1, 2, 3): 0.3 + 0.2
    torch.testing.assert_close(pooled[0, 6:], phrase[0, 6:])  # the other copy keeps its own
    once = torch.arange(40).expand(3, 40)  # nothing repeats: nothing changes
    assert torch.equal(pool_repeated_ngrams(scores, once, 2), scores)
    assert torch.equal(pool_repeated_ngrams(scores[:, :2], ids[:, :2], 3), scores[:, :2])  # shorter than an n-gram


def test_reconstruction_prefill_needs_an_evicting_cache(compiled):
    model = kvrewrite.load(compiled["freq"], rate=RATE, recent_window=4, kv_codec="none").eval()
    cache = make_tiered_cache(model, model.tier_policy)
    tokens = random_windows(n=1, length=10, seed=42)
    with pytest.raises(InvalidArgumentError, match="evicting cache"):
        prefill_scored_by_reconstruction(model, cache, tokens, tokens[0, :2])


def test_generate_prefills_the_prompt_scored_by_reconstruction(compiled):
    """generate() with prefill_score='reconstruction' equals a greedy loop written out by hand over a cache
    prefilled by prefill_scored_by_reconstruction."""
    evict = {"keep": 0.3, "bits": (8, 4), "prefill_score": "reconstruction"}
    model = kvrewrite.load(compiled["latent"], rate=RATE, recent_window=4, kv_codec="none", evict=evict).eval()
    prompt = random_windows(n=1, length=30, seed=43)
    out = model.generate(prompt, max_new_tokens=6, do_sample=False)

    cache = model.make_kv_cache()
    tokens = prompt
    with torch.no_grad():
        prefill_scored_by_reconstruction(model, cache, prompt[:, :-1], model.repeat_instruction_ids)
        step = prompt[:, -1:]
        for _ in range(6):
            logits = model(step, past_key_values=cache, use_cache=True).logits
            step = logits[:, -1:].argmax(-1)
            tokens = torch.cat([tokens, step], dim=1)
    assert torch.equal(out, tokens)
    # The prompt's kept tokens were chosen by the repeat, not as plain re-scored eviction chooses them.
    plain = kvrewrite.load(
        compiled["latent"], rate=RATE, recent_window=4, kv_codec="none", evict={**evict, "prefill_score": "newest"}
    ).eval()
    plain_cache = plain.make_kv_cache()
    with torch.no_grad():
        plain(prompt[:, :-1], past_key_values=plain_cache, use_cache=True)
        scored = model.make_kv_cache()
        prefill_scored_by_reconstruction(model, scored, prompt[:, :-1], model.repeat_instruction_ids)
    assert any(
        a.kept_positions.tolist() != b.kept_positions.tolist() for a, b in zip(scored.layers, plain_cache.layers)
    )


def test_bad_prefill_scores_are_refused(compiled):
    with pytest.raises(InvalidArgumentError, match="prefill_score"):
        kvrewrite.load(
            compiled["freq"], rate=RATE, recent_window=4, kv_codec="none", evict={"keep": 0.5, "prefill_score": "x"}
        )
    for share in (1.5, -0.1, "half", True, [0.5], [0.5, 0.5, 0.5], [0.5, 1.2], []):
        with pytest.raises(InvalidArgumentError, match="reconstruction_share"):
            kvrewrite.load(
                compiled["freq"],
                rate=RATE,
                recent_window=4,
                kv_codec="none",
                evict={"keep": 0.5, "prefill_score": "reconstruction", "reconstruction_share": share},
            )
    for pool, score, message in (
        (-1, "reconstruction", "whole number >= 0"),
        (2.5, "reconstruction", "whole"),
        (3, "newest", "needs prefill_score='reconstruction'"),
    ):
        with pytest.raises(InvalidArgumentError, match=message):
            kvrewrite.load(
                compiled["freq"],
                rate=RATE,
                recent_window=4,
                kv_codec="none",
                evict={"keep": 0.5, "prefill_score": score, "pool_repeats": pool},
            )
    model = kvrewrite.load(
        compiled["freq"],
        rate=RATE,
        recent_window=4,
        kv_codec="none",
        evict={"keep": 0.5, "prefill_score": "reconstruction"},
    ).eval()
    prompts = random_windows(n=2, length=12, seed=44)
    mask = torch.ones_like(prompts)
    mask[0, :3] = 0
    with pytest.raises(InvalidArgumentError, match="unpadded"):
        model.generate(prompts, attention_mask=mask, max_new_tokens=2)
