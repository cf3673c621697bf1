"""The MLA form's position-free queries scored by each head's expected rotation (compile/mla/rope_response.py), checked
against a dense computation of the source's rotated scores."""

from __future__ import annotations

import pytest
import torch

from kvrewrite.compile.mla.form import MLAWidths, compute_mla_layers, source_scaling
from kvrewrite.compile.mla.rope_response import (
    attention_by_distance,
    expected_rotation,
    measure_rope_response,
    rotary_frequencies,
)
from kvrewrite.method.mla import full_latent_rank
from tests.test_mla_export import _prepared
from tests.tiny_models import random_windows

DISTANCES = 12


@pytest.fixture(scope="module")
def gqa(tmp_path_factory):
    return _prepared(tmp_path_factory.mktemp("gqa_response"))  # 4 query heads, 2 KV heads, head_dim 16


def _distance_weights(layers: int, heads: int) -> torch.Tensor:
    """A different made-up attention distance distribution per layer and head (the response's input)."""
    generator = torch.Generator().manual_seed(3)
    return torch.rand(layers, heads, DISTANCES, generator=generator, dtype=torch.float64) ** 3


def _rotate_pairs(x: torch.Tensor, first: torch.Tensor, second: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """x with each pair (x[first[p]], x[second[p]]) rotated by angles[p]."""
    out = x.clone()
    a, b = x[first], x[second]
    out[first], out[second] = a * angles.cos() - b * angles.sin(), b * angles.cos() + a * angles.sin()
    return out


def _weighted_scores(gqa, layers, weights, x_query, x_key, layer=0):
    """Per query head: the attention-weighted mean over distances of (the source's rotated score, the MLA form's
    score), both computed densely with the query at position DISTANCES and the key DISTANCES - delta before it."""
    ctx, geo = gqa.ctx, gqa.ctx.geometry
    d, half, n_q = geo.head_dim, geo.head_dim // 2, geo.num_attention_heads
    proj, _ = ctx.source.attention_weights(layer)
    theta = rotary_frequencies(ctx.original_model())
    form = layers[layer]
    d_r, r = form.qk_rope_head_dim, form.kv_lora_rank
    q_all = (form.q_proj @ x_query).view(n_q, d + d_r)
    latent, k_pe = (form.kv_a_proj_with_mqa @ x_key).split([r, d_r])
    kv = (form.kv_b_proj @ latent).view(n_q, d + d)
    scale = source_scaling(ctx.adapter, ctx.config, geo) * (d + d_r) ** 0.5  # what mla_layer folds into q rows
    hf_first, hf_second = torch.arange(half), torch.arange(half) + half
    pe_first, pe_second = torch.arange(0, d_r, 2), torch.arange(1, d_r, 2)
    source, ours = torch.zeros(n_q, dtype=torch.float64), torch.zeros(n_q, dtype=torch.float64)
    for h in range(n_q):
        g = h // geo.group_size
        q_h = proj.q_weight.double()[h * d : (h + 1) * d] @ x_query
        k_g = proj.k_weight.double()[g * d : (g + 1) * d] @ x_key
        w = weights[layer, h] / weights[layer, h].sum()
        for delta in range(DISTANCES):
            n, m = DISTANCES, DISTANCES - delta
            source[h] += w[delta] * (
                _rotate_pairs(q_h, hf_first, hf_second, n * theta) @ _rotate_pairs(k_g, hf_first, hf_second, m * theta)
            )
            kept = _rotate_pairs(q_all[h, d:], pe_first, pe_second, n * theta[form.pair_frequency]) @ _rotate_pairs(
                k_pe, pe_first, pe_second, m * theta[form.pair_frequency]
            )
            ours[h] += w[delta] * (q_all[h, :d] @ kv[h, :d] + kept) / scale
    return source, ours


def test_the_expected_rotation_scores_dropped_components_as_their_mean_rotated_score(gqa):
    """Full latent, one RoPE component kept: under a head's distance distribution, the position-free score with the
    measured response equals the mean of the source's truly rotated score; unrotated (the old form) it does not."""
    ctx, geo = gqa.ctx, gqa.ctx.geometry
    weights = _distance_weights(geo.num_layers, geo.num_attention_heads)
    response = expected_rotation(weights, rotary_frequencies(ctx.original_model()))
    widths = MLAWidths(1, geo.head_dim, full_latent_rank(geo, 1), 1.0)
    with_response = compute_mla_layers(ctx, gqa.inputs, widths, rope_response=response)
    unrotated = compute_mla_layers(ctx, gqa.inputs, widths)
    generator = torch.Generator().manual_seed(7)
    x_query, x_key = torch.randn(2, geo.hidden_size, generator=generator, dtype=torch.float64)
    for layer in range(geo.num_layers):
        source, ours = _weighted_scores(gqa, with_response, weights, x_query, x_key, layer)
        torch.testing.assert_close(ours, source, rtol=1e-9, atol=1e-9)
        _, old = _weighted_scores(gqa, unrotated, weights, x_query, x_key, layer)
        assert (old - source).abs().max() > 1e-3 * source.abs().max()


def test_attention_by_distance_holds_every_query_once(gqa):
    """Each query's probabilities sum to one, so the mass over distances is the query count; the model's attention
    implementation is restored afterwards."""
    model = gqa.ctx.original_model()
    before = model.config._attn_implementation
    hooks_before = sum(len(m._forward_hooks) for m in model.modules())
    windows = random_windows(3, 20, seed=2)
    mass = attention_by_distance(model, windows)
    assert sum(len(m._forward_hooks) for m in model.modules()) == hooks_before  # the per-layer readers are removed
    geo = gqa.ctx.geometry
    assert mass.shape == (geo.num_layers, geo.num_attention_heads, 20)
    torch.testing.assert_close(mass.sum(-1), torch.full_like(mass[..., 0], 3 * 20.0))
    # Against the stock model's probabilities summed pair by pair.
    model.set_attn_implementation("eager")
    expected = torch.zeros_like(mass)
    with torch.no_grad():
        for window in windows.split(1):
            for layer, probs in enumerate(model(input_ids=window, output_attentions=True).attentions):
                for n in range(20):
                    for m in range(n + 1):
                        expected[layer, :, n - m] += probs[0, :, n, m].double()
    model.set_attn_implementation(before)
    torch.testing.assert_close(mass, expected)
    assert model.config._attn_implementation == before
    response = expected_rotation(mass, rotary_frequencies(model))
    assert response.abs().max() <= 1 + 1e-12
    # Distance 0 is the only one with no rotation: a head attending to itself alone responds with exactly 1.
    own = torch.zeros_like(mass)
    own[..., 0] = 1.0
    torch.testing.assert_close(
        expected_rotation(own, rotary_frequencies(model)),
        torch.ones(*mass.shape[:2], geo.head_dim // 2, dtype=torch.complex128),
    )


def test_the_cli_scores_position_free_queries_by_expected_rotation_by_default_records_it_and_refuses_an_unknown_choice(
    tmp_path,
):
    import json

    from typer.testing import CliRunner

    from kvrewrite.cli.app import app
    from kvrewrite.compile.mla.export import DEFAULT_POSITION_FREE_QUERIES
    from kvrewrite.runtime.mla.checkpoint import MLA_MARKER
    from tests.tiny_models import save_tiny_llama

    src = save_tiny_llama(tmp_path / "src")
    common = [
        "export-mla",
        str(src),
        "--kv-share",
        "0.5",
        "--calibration",
        "synthetic",
        "--calib-tokens",
        "512",
        "--verify-tokens",
        "32",
    ]
    result = CliRunner().invoke(app, [*common, "-o", str(tmp_path / "mla")])  # the default
    assert result.exit_code == 0, result.output
    marker = json.loads((tmp_path / "mla" / "config.json").read_text())[MLA_MARKER]
    assert marker["position_free_queries"] == "expected-rotation" == DEFAULT_POSITION_FREE_QUERIES
    refused = CliRunner().invoke(app, [*common, "-o", str(tmp_path / "bad"), "--position-free-queries", "rotated"])
    assert refused.exit_code == 2 and "--position-free-queries" in refused.output and not (tmp_path / "bad").exists()


def test_the_rotation_is_read_from_whole_calibration_windows_holding_the_token_budget(gqa):
    """Windows keep their own length; the budget sets how many; the attention sink is left out unless asked for."""
    model = gqa.ctx.original_model()
    windows = random_windows(5, 24, seed=3)
    frequencies = rotary_frequencies(model)
    torch.testing.assert_close(
        measure_rope_response(model, windows, n_tokens=48),
        expected_rotation(attention_by_distance(model, windows[:2], skip_first_key=True), frequencies),
    )
    torch.testing.assert_close(
        measure_rope_response(model, windows, n_tokens=10),  # fewer tokens than a window
        expected_rotation(attention_by_distance(model, windows[:1], skip_first_key=True), frequencies),
    )
    with_sink = measure_rope_response(model, windows, n_tokens=48, skip_first_key=False)
    torch.testing.assert_close(with_sink, expected_rotation(attention_by_distance(model, windows[:2]), frequencies))
    assert (with_sink - measure_rope_response(model, windows, n_tokens=48)).abs().max() > 1e-3


def test_skipping_the_first_key_removes_exactly_its_mass(gqa):
    """Without the attention sink, each distance loses what query n = distance gave to the window's first token."""
    model = gqa.ctx.original_model()
    windows = random_windows(2, 16, seed=4)
    full = attention_by_distance(model, windows)
    skipped = attention_by_distance(model, windows, skip_first_key=True)
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    sink = torch.zeros_like(full)
    with torch.no_grad():
        for window in windows.split(1):
            for layer, probs in enumerate(model(input_ids=window, output_attentions=True).attentions):
                sink[layer] += probs[0, :, :, 0].double()  # query n reads key 0 at distance n
    model.set_attn_implementation(previous)
    torch.testing.assert_close(full - skipped, sink)
    assert (skipped[..., -1] == 0).all()  # the longest distance is only ever to the first key
