"""Token tiers: a full-rank recent window over the compressed latents, older tokens at their rate's ranks.

The reference is a dense, per-query computation that shares nothing with kvrewrite.runtime.tiers: for query t, every
key/value latent j with t - j > window gets its dims beyond the aged ranks zeroed (which is the rank
truncation, see the probe tests), and the module's ordinary one-query attention runs over them.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import random_windows, save_tiny_llama, tiny_pipeline

import kvrewrite
from kvrewrite.compile.passes.pipeline import run_pipeline
from kvrewrite.compile.plan import Plan
from kvrewrite.errors import InvalidArgumentError
from kvrewrite.runtime.cache_bytes import cache_tensor_bytes
from kvrewrite.runtime.modeling.attention import CompressedAttention
from kvrewrite.runtime.tiers import TieredCache
from kvrewrite.runtime.tiers.build import make_tiered_cache

MODES = ("latent", "freq", "post-rope")
RATE = 0.5


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiers")
    src = save_tiny_llama(root / "src", seed=5, num_kv_heads=2, num_heads=4)
    out = {}
    for mode in MODES:
        plan = Plan(model=str(src), output=root / mode, progress=False, target_rate=RATE, rope_mode=mode)
        run_pipeline(plan, tiny_pipeline())
        out[mode] = root / mode
    return out


def _head_mask(ranks, d: int) -> torch.Tensor:
    return torch.cat([(torch.arange(d) < r).float() for r in ranks])


def window_masks(key_ranks, value_ranks, d: int, window: int):
    """masks(layer, t) for dense_reference_logits: keys/values more than `window` tokens before query t read at the
    given per-layer, per-KV-head ranks, the rest at full rank."""

    def masks(layer: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        aged = (t - torch.arange(t + 1) > window)[:, None]
        return (
            torch.where(aged, _head_mask(key_ranks[layer], d), 1.0),
            torch.where(aged, _head_mask(value_ranks[layer], d), 1.0),
        )

    return masks


def dense_reference_logits(
    directory, tokens: torch.Tensor, window: int, attention_mask=None, masks=None, dropped=None
) -> torch.Tensor:
    """Logits of the full-rank model in which query t reads keys/values older than `window` truncated to RATE's ranks.

    masks(layer, t) -> (key_mask, value_mask) [t + 1, C] overrides which dims query t reads of each token;
    dropped(layer, t) -> bool [t + 1] marks tokens query t must not read at all (evicted).
    """
    model = kvrewrite.load(directory, rate=0.0).eval()
    key_ranks, value_ranks = model.compression_spec.ranks_for_rate(RATE)
    d = model.compressed_attentions()[0].head_dim

    masks = masks or window_masks(key_ranks, value_ranks, d, window)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs):
        query, key, value = self.project(hidden_states, position_embeddings)
        outputs = []
        for t in range(query.shape[1]):
            key_mask, value_mask = masks(self.layer_idx, t)
            k, v = key[:, : t + 1] * key_mask, value[:, : t + 1] * value_mask
            mask = attention_mask[..., t : t + 1, : t + 1] if attention_mask is not None else None
            if dropped is not None:
                keep = ~dropped(self.layer_idx, t)[None, None, None, :]
                mask = keep if mask is None else (mask.bool() if mask.dtype == torch.bool else mask > -1) & keep
            outputs.append(self.attend(query[:, t : t + 1], k.unsqueeze(1), v.unsqueeze(1), mask, past_len=t))
        return self.o_proj(torch.cat(outputs, dim=1)), None

    original = CompressedAttention.forward
    CompressedAttention.forward = forward
    try:
        with torch.no_grad():
            return model(tokens, attention_mask=attention_mask).logits
    finally:
        CompressedAttention.forward = original


def tiered_model(directory, window: int, codec=None):
    return kvrewrite.load(directory, rate=RATE, recent_window=window, kv_codec=codec).eval()


def run_chunks(model, tokens: torch.Tensor, chunk: int, cache) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat(
            [
                model(tokens[:, s : s + chunk], past_key_values=cache, use_cache=True).logits
                for s in range(0, tokens.shape[1], chunk)
            ],
            dim=1,
        )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("window", [0, 5, 16])
def test_tiered_attention_equals_dense_reference(compiled, mode, window):
    tokens = random_windows(n=2, length=40, seed=1)
    reference = dense_reference_logits(compiled[mode], tokens, window)
    model = tiered_model(compiled[mode], window)
    cache = make_tiered_cache(model, model.tier_policy, storage_dtype=torch.float32)
    with torch.no_grad():
        one_shot = model(tokens, past_key_values=cache, use_cache=True).logits
    torch.testing.assert_close(one_shot, reference, rtol=1e-4, atol=1e-4)
    # The window matters: the same model with every token at the aged ranks differs.
    truncated = kvrewrite.load(compiled[mode], rate=RATE).eval()
    with torch.no_grad():
        assert (truncated(tokens).logits - reference).abs().max() > 1e-3


@pytest.mark.parametrize("mode", MODES)
def test_cached_decoding_equals_one_shot(compiled, mode):
    tokens = random_windows(n=2, length=36, seed=2)
    model = tiered_model(compiled[mode], window=6)
    one_shot = run_chunks(model, tokens, 36, make_tiered_cache(model, model.tier_policy, torch.float32))
    for chunk in (1, 5, 16):
        chunked = run_chunks(model, tokens, chunk, make_tiered_cache(model, model.tier_policy, torch.float32))
        torch.testing.assert_close(chunked, one_shot, rtol=1e-4, atol=1e-4)


def test_aged_tokens_truncate_exactly_and_bytes_match_formula(compiled):
    window, length = 7, 30
    tokens = random_windows(n=2, length=length, seed=3)
    model = tiered_model(compiled["freq"], window)
    cache = make_tiered_cache(model, model.tier_policy)  # float16 storage, as served
    run_chunks(model, tokens, 4, cache)
    # Layer 0's full-rank latents (its input is the embeddings, the same in both models), from a plain cache
    # of the full-rank model.
    full = kvrewrite.load(compiled["freq"], rate=0.0).eval()
    from transformers import DynamicCache

    plain = DynamicCache(config=full.config)
    with torch.no_grad():
        full(tokens, past_key_values=plain, use_cache=True)
    policy, d = model.tier_policy, model.compressed_attentions()[0].head_dim
    expected_bytes = 0
    for i, layer in enumerate(cache.layers):
        keys = plain.layers[i].keys
        values = plain.layers[i].values
        keys = keys if keys.shape[1] == 1 else keys.permute(0, 3, 2, 1)  # COLUMNS storage -> [B, 1, S, C]
        values = values if values.shape[1] == 1 else values.permute(0, 3, 2, 1)
        assert layer.keys.shape[-2] == window and layer.aged_keys.shape[-2] == length - window
        if i == 0:
            torch.testing.assert_close(layer.keys.float(), keys[..., -window:, :].half().float())
            key_cols = [g * d + c for g, r in enumerate(policy.aged_key_ranks[i]) for c in range(r)]
            value_cols = [g * d + c for g, r in enumerate(policy.aged_value_ranks[i]) for c in range(r)]
            assert len(key_cols) < keys.shape[-1] and len(value_cols) < values.shape[-1]
            torch.testing.assert_close(layer.aged_keys.float(), keys[..., : length - window, key_cols].half().float())
            torch.testing.assert_close(
                layer.aged_values.float(), values[..., : length - window, value_cols].half().float()
            )
        full_elements = 2 * len(policy.aged_key_ranks[i]) * d
        expected_bytes += (
            2
            * tokens.shape[0]
            * (
                window * full_elements
                + (length - window) * (sum(policy.aged_key_ranks[i]) + sum(policy.aged_value_ranks[i]))
            )
        )
    assert cache_tensor_bytes(cache) == expected_bytes
    assert cache.get_seq_length() == length


def test_generate_left_padding_and_beam_search(compiled):
    model = tiered_model(compiled["latent"], window=4)
    ids = torch.tensor([[0, 0, 5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16, 17, 18]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1] * 8])
    with torch.no_grad():
        batched = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
        alone = model.generate(input_ids=ids[:1, 2:], max_new_tokens=6, do_sample=False, pad_token_id=0)
        beams = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=4, num_beams=3, do_sample=False, pad_token_id=0
        )
    assert torch.equal(batched[0, 2:], alone[0])  # left padding changes nothing
    assert beams.shape == (2, 12)


def test_aged_tier_codec_bytes_and_error(compiled):
    window, length = 8, 8 + 64
    tokens = random_windows(n=1, length=length, seed=4)
    plain = tiered_model(compiled["latent"], window)
    coded = tiered_model(compiled["latent"], window, codec="int4")
    plain_cache, coded_cache = make_tiered_cache(plain, plain.tier_policy), make_tiered_cache(coded, coded.tier_policy)
    a, b = run_chunks(plain, tokens, 8, plain_cache), run_chunks(coded, tokens, 8, coded_cache)
    assert cache_tensor_bytes(coded_cache) < 0.6 * cache_tensor_bytes(plain_cache)
    assert coded_cache.layers[0].coded_length > 0
    assert 0 < (a - b).abs().max() < 0.5 * (a.max() - a.min())


def test_bad_tier_settings_are_refused(compiled):
    with pytest.raises(InvalidArgumentError, match="recent window"):
        kvrewrite.load(compiled["freq"], rate=RATE, recent_window=-1)
    model = kvrewrite.load(compiled["freq"], rate=RATE)
    with pytest.raises(InvalidArgumentError, match="full rank"):
        with torch.no_grad():
            model(
                torch.tensor([[5, 6]]),
                past_key_values=TieredCache(
                    tiered_model(compiled["freq"], 2).tier_policy, model.compressed_attentions()[0].head_dim
                ),
            )


def test_eval_reports_tiered_rows_with_bytes_measured_at_the_window_length(compiled):
    from kvrewrite.publish.checkpoint_eval import evaluate_checkpoint

    rows = evaluate_checkpoint(compiled["latent"], tokens=96, seq_len=48, progress=False, recent_windows=[8])
    tiered = rows[1]
    assert tiered["name"].endswith("+W=8")
    d = 16
    spec = kvrewrite.load(compiled["latent"]).compression_spec
    key_ranks, value_ranks = spec.ranks_for_rate(RATE)
    aged = sum(sum(k) + sum(v) for k, v in zip(key_ranks, value_ranks))
    full = 2 * spec.num_layers * spec.num_key_value_heads * d
    assert tiered["kv_bytes_per_token"] == pytest.approx(2 * (8 * full + 40 * aged) / 48)  # float16, 48-token windows
    # On token windows the tiny model can read, the full-rank window brings the model closer to the original.
    from kvrewrite.io.source_model import load_fp32_model
    from kvrewrite.publish.evaluation import evaluate_many

    original = load_fp32_model(spec.source_model)
    results = evaluate_many(
        {"plain": kvrewrite.load(compiled["latent"]), "tiered": tiered_model(compiled["latent"], 8)},
        random_windows(n=4, length=48, seed=6),
        baseline=original,
        progress=False,
    )
    assert 0 < results["tiered"].kl_mean < results["plain"].kl_mean


IMPORTANT_RATE, SHARE, POOL = 0.25, 0.25, 8


def adaptive_model(directory, window: int, score: str = "attention"):
    important = {"rate": IMPORTANT_RATE, "share": SHARE, "score": score, "pool": POOL}
    return kvrewrite.load(directory, rate=RATE, recent_window=window, important=important).eval()


def prefill_then_step(model, tokens: torch.Tensor, length: int):
    """Prefill tokens[:, :length] into a float32 tiered cache in one forward, then decode the rest in one step."""
    cache = make_tiered_cache(model, model.tier_policy, torch.float32)
    with torch.no_grad():
        prefill = model(tokens[:, :length], past_key_values=cache, use_cache=True).logits
        step = model(tokens[:, length:], past_key_values=cache, use_cache=True).logits
    return prefill, step, cache


@pytest.mark.parametrize("mode", ["latent", "freq"])
@pytest.mark.parametrize("score", ["attention", "denominator"])
def test_token_adaptive_dims_equal_dense_reference(compiled, mode, score):
    """Prefill L tokens (tokens beyond the window are read at the important ranks until classified), then one
    decode step reads each classified token at its tier's ranks: both against the dense per-query reference."""
    window, length = 4, 4 + 3 * POOL + 5
    tokens = random_windows(n=2, length=length + 1, seed=7)
    model = adaptive_model(compiled[mode], window, score)
    prefill, step, cache = prefill_then_step(model, tokens, length)
    spec = model.compression_spec
    aged_k, aged_v = spec.ranks_for_rate(RATE)
    imp_k, imp_v = spec.ranks_for_rate(IMPORTANT_RATE)
    d = model.compressed_attentions()[0].head_dim
    for layer in cache.layers:  # classification of the prefill: round(g * pool) per full pool
        assert layer.important_positions.shape == (2, 3 * round(SHARE * POOL))
        assert layer.aged_positions.shape == (2, 3 * POOL - 3 * round(SHARE * POOL))
        held = torch.sort(torch.cat([layer.important_positions, layer.aged_positions], dim=-1), dim=-1).values
        assert torch.equal(held, torch.arange(3 * POOL, dtype=held.dtype).expand(2, -1))

    # Classification may differ per batch row; compare row by row with that row's assignment.
    for row in range(2):

        def row_masks(layer: int, t: int, row=row):
            n = t + 1
            key_mask, value_mask = torch.ones(n, 2 * d), torch.ones(n, 2 * d)
            layer_cache = cache.layers[layer]
            for j in range(n):
                if t - j <= window:
                    continue
                aged = t == length and bool((layer_cache.aged_positions[row] == j).any())
                kr, vr = (aged_k[layer], aged_v[layer]) if aged else (imp_k[layer], imp_v[layer])
                key_mask[j], value_mask[j] = _head_mask(kr, d), _head_mask(vr, d)
            return key_mask, value_mask

        reference = dense_reference_logits(compiled[mode], tokens[row : row + 1], window, masks=row_masks)
        torch.testing.assert_close(prefill[row], reference[0, :length], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(step[row], reference[0, length:], rtol=1e-4, atol=1e-4)


def test_evaluation_feeds_chunks_to_policies_that_change_between_forwards(compiled):
    from kvrewrite.publish.evaluation import CODEC_EVAL_CHUNK, default_chunk

    assert default_chunk([tiered_model(compiled["freq"], 4)]) is None  # exact in one forward
    assert default_chunk([adaptive_model(compiled["freq"], 4)]) == CODEC_EVAL_CHUNK
    assert default_chunk([tiered_model(compiled["freq"], 4, codec="int4")]) == CODEC_EVAL_CHUNK


def test_token_adaptive_bytes_match_formula(compiled):
    window, length = 4, 4 + 2 * POOL + 3
    model = adaptive_model(compiled["latent"], window)
    cache = make_tiered_cache(model, model.tier_policy)
    run_chunks(model, random_windows(n=1, length=length, seed=8), 5, cache)
    spec = model.compression_spec
    aged_k, aged_v = spec.ranks_for_rate(RATE)
    imp_k, imp_v = spec.ranks_for_rate(IMPORTANT_RATE)
    full = 2 * spec.num_key_value_heads * spec.head_dim
    n_imp = 2 * round(SHARE * POOL)
    expected = 0
    for i, layer in enumerate(cache.layers):
        n_recent = layer.keys.shape[-2]
        assert n_recent == length - 2 * POOL
        elements = (
            n_recent * full
            + n_imp * (sum(imp_k[i]) + sum(imp_v[i]))
            + (2 * POOL - n_imp) * (sum(aged_k[i]) + sum(aged_v[i]))
        )
        expected += 2 * elements + 4 * 2 * POOL + 4 * n_recent  # float16 latents, int32 positions, float32 scores
    assert cache_tensor_bytes(cache) == expected


@pytest.mark.parametrize("score", ["attention", "denominator"])
def test_classification_keeps_the_top_scored_share_of_each_pool(score):
    from kvrewrite.runtime.tiers import TieredLayer

    window, pool, share, d = 3, 8, 0.375, 4
    layer = TieredLayer(
        window,
        d,
        (2,),
        (1,),
        important_key_ranks=(3,),
        important_value_ranks=(2,),
        important_share=share,
        score=score,
        pool=pool,
    )
    gen = torch.Generator().manual_seed(0)
    n = window + 2 * pool + 1
    keys, values = torch.randn(2, 1, n, d, generator=gen), torch.randn(2, 1, n, d, generator=gen)
    layer.update(keys, values)
    received, denominators = torch.rand(2, n, generator=gen), torch.randn(2, n, generator=gen)
    layer.add_scores(received, [], denominators)
    layer.settle()
    k = round(share * pool)
    if score == "attention":  # mean over the queries that read each token: n - j of them after one forward
        evidence = received / (n - torch.arange(n)).float()
    else:
        evidence = denominators
    for row in range(2):
        expected = set()
        for start in range(0, 2 * pool, pool):
            expected |= set((start + evidence[row, start : start + pool].topk(k).indices).tolist())
        assert set(layer.important_positions[row].tolist()) == expected
        important = sorted(expected)
        torch.testing.assert_close(layer.important_keys[row, 0].float(), keys[row, 0, important, :3].half().float())
        aged = sorted(set(range(2 * pool)) - expected)
        torch.testing.assert_close(layer.aged_values[row, 0].float(), values[row, 0, aged, :1].half().float())
    assert layer.keys.shape[-2] == n - 2 * pool  # the window plus the unclassified rest of the pool


def test_crop_works_within_the_window_only(compiled):
    model = tiered_model(compiled["freq"], window=6)
    cache = make_tiered_cache(model, model.tier_policy)
    run_chunks(model, random_windows(n=1, length=20, seed=10), 20, cache)
    cache.crop(16)  # keep 16 tokens: drop the last 4, all inside the full-rank window
    assert cache.get_seq_length() == 16 and cache.layers[0].keys.shape[-2] == 2
    cache.crop(-1)  # negative: remove that many
    assert cache.get_seq_length() == 15 and cache.layers[0].keys.shape[-2] == 1
    with pytest.raises(InvalidArgumentError, match="full-rank window holds 1"):
        cache.crop(10)


def test_frozen_score_eviction_is_refused_pointing_to_rescored_eviction(compiled):
    """One eviction: important= evict_rest (each pool's unimportant tokens dropped) is gone; asking for it names evict=."""
    important = {"rate": 0.0, "share": 0.2, "evict_rest": True}
    with pytest.raises(InvalidArgumentError, match=r"evict_rest was replaced by re-scored eviction: pass evict="):
        kvrewrite.load(compiled["latent"], rate=0.0, recent_window=4, important=important)


def test_folded_keys_of_a_no_rope_family_equal_dense_reference(tmp_path):
    from tiny_families import save_tiny_family

    src = save_tiny_family(tmp_path / "opt-src", "opt", seed=2)
    run_pipeline(Plan(model=str(src), output=tmp_path / "opt", progress=False, target_rate=RATE), tiny_pipeline())
    model = tiered_model(tmp_path / "opt", window=5)
    assert model.compressed_attentions()[0].key_mode == "folded"
    tokens = random_windows(n=2, length=30, seed=12)
    with torch.no_grad():
        tiered = model(
            tokens, past_key_values=make_tiered_cache(model, model.tier_policy, torch.float32), use_cache=True
        ).logits
    torch.testing.assert_close(tiered, dense_reference_logits(tmp_path / "opt", tokens, 5), rtol=1e-4, atol=1e-4)
