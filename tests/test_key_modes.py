"""Key modes beyond one fixed mode: cross-head RoPE-commuting keys, mixed modes per layer, --rope-mode auto."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny_models import random_windows, save_tiny_llama, tiny_pipeline
from transformers import AutoModelForCausalLM, DynamicCache

import kvrewrite
from kvrewrite.compile.passes.base import run_pass
from kvrewrite.compile.passes.compute_transforms import LayerTransforms
from kvrewrite.compile.passes.pipeline import run_pipeline
from kvrewrite.compile.plan import Plan
from kvrewrite.key_modes import key_transform
from kvrewrite.method.key_transforms import frequency_pair_energy
from kvrewrite.publish.evaluation import kv_cache_bytes_per_token
from kvrewrite.runtime.kernels.cache_layout import packed_view


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("src") / "gqa", seed=2, num_kv_heads=2, num_heads=4, layers=3)


def statistics_context(src, **options):
    plan = Plan(model=str(src), progress=False, **options)
    ctx = kvrewrite.compile.passes.context.CompileContext(plan=plan)
    for step in tiny_pipeline()[:3]:  # load, calibration tokens, Grams
        ctx = run_pass(ctx, step)
    return ctx


def test_crosshead_error_never_exceeds_frequency_selection(source):
    """Selecting whole pairs per head is one complex-linear map per frequency, so the optimal one is no worse."""
    ctx = statistics_context(source)
    geo = ctx.geometry
    for stats in ctx.statistics.layers:
        cross = key_transform("crosshead", "optimal", stats, geo).spectrum[0].double() ** 2
        # Independent reference: every (head, pair) energy^2 from the per-head Grams, the best kept first.
        pair = (
            torch.cat(
                [
                    frequency_pair_energy(stats.gram("query_pre", g), stats.gram("key_pre", g)) ** 2
                    for g in range(geo.num_key_value_heads)
                ]
            )
            .sort(descending=True)
            .values
        )
        assert torch.isclose(cross.sum(), pair.sum(), rtol=1e-6)  # same metric: equal totals at rank 0
        for kept_pairs in range(pair.numel() + 1):
            removed_freq = pair[kept_pairs:].sum()
            removed_cross = cross[2 * kept_pairs :].sum()
            assert removed_cross <= removed_freq * (1 + 1e-6) + 1e-9


def test_mixed_key_modes_per_layer_are_exact_and_cache_what_the_spec_says(source, tmp_path):
    ctx = statistics_context(source, output=tmp_path / "out", target_rate=0.5, allocation="greedy")
    pipeline = tiny_pipeline()
    steps = pipeline[[s.name for s in pipeline].index("compute_transforms") :]  # compute transforms .. emit
    ctx = run_pass(ctx, steps[0])  # default transforms; then give each layer another key mode
    modes = ["crosshead", "freq", "latent"]
    ctx = dataclasses.replace(
        ctx,
        transforms=[
            LayerTransforms(key=key_transform(m, "optimal", stats, ctx.geometry), value=t.value)
            for m, stats, t in zip(modes, ctx.statistics.layers, ctx.transforms)
        ],
    )
    for step in steps[1:]:
        ctx = run_pass(ctx, step)
    assert [layer.key_mode for layer in ctx.spec.layers] == modes
    assert ctx.verification["full_rank_max_abs_logit_diff"] < 1e-4

    original = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    full = kvrewrite.load(tmp_path / "out", rate=0.0)
    model = kvrewrite.load(tmp_path / "out")
    tokens = random_windows(2, 30, seed=5)
    with torch.no_grad():
        assert (full(tokens).logits - original(tokens).logits).abs().max().item() < 1e-4
        one_shot = model(tokens).logits
        cache = DynamicCache(config=model.config)
        prefix = model(tokens[:, :18], past_key_values=cache, use_cache=True).logits
        steps_out = [model(tokens[:, t : t + 1], past_key_values=cache, use_cache=True).logits for t in range(18, 30)]
    assert (torch.cat([prefix, *steps_out], dim=1) - one_shot).abs().max().item() < 1e-4
    crosshead_layer = ctx.spec.layers[0]
    assert crosshead_layer.key_ranks[1:] == [0]  # one shared key block
    for layer, spec in zip(cache.layers, ctx.spec.layers):
        assert packed_view(layer.keys).shape == (2, 1, 30, sum(spec.key_ranks))
    measured = kv_cache_bytes_per_token(model, seq_len=24)
    assert measured == ctx.spec.kept_elements_per_token * 4
    assert abs(measured / kv_cache_bytes_per_token(original, seq_len=24) - 0.5) <= 0.02


@pytest.mark.parametrize(
    "prefer,allowed",
    [("quality", {"freq", "post-rope", "latent", "crosshead"}), ("zero-overhead", {"freq", "post-rope", "crosshead"})],
)
def test_auto_chooses_per_layer_by_measured_kl(source, tmp_path, prefer, allowed):
    plan = Plan(model=str(source), output=tmp_path / "out", progress=False, rope_mode="auto", prefer=prefer)
    ctx = run_pipeline(plan, tiny_pipeline())
    choice = ctx.report["key_mode_choice"]
    assert set(choice["candidates"]) == allowed
    assert [layer.key_mode for layer in ctx.spec.layers] == choice["chosen"]
    for layer, mode in enumerate(choice["chosen"]):  # cost weight 0: the smallest measured KL wins
        assert choice["probe_kl"][mode][layer] == min(kl[layer] for kl in choice["probe_kl"].values())
    assert ctx.verification["full_rank_max_abs_logit_diff"] < 1e-4
    if prefer != "quality":
        return
    # A prohibitive cost weight leaves only the modes of zero runtime cost.
    costly = run_pipeline(
        Plan(
            model=str(source),
            output=tmp_path / "costly",
            progress=False,
            rope_mode="auto",
            prefer=prefer,
            key_mode_cost=1e9,
        ),
        tiny_pipeline(),
    )
    assert set(costly.report["key_mode_choice"]["chosen"]) <= {"freq", "crosshead"}
