"""--distill-rates: one checkpoint distilled for several rates at once (nested), serving every one of them."""

from __future__ import annotations

import re

import pytest
import torch
from test_distill import checkpoint_tensors, count_changes_outside_ranks
from tiny_models import random_windows, save_tiny_llama, tiny_pipeline
from transformers import AutoModelForCausalLM

import kvrewrite
from kvrewrite.compile.passes.pipeline import run_pipeline
from kvrewrite.compile.plan import Plan
from kvrewrite.errors import InvalidArgumentError
from kvrewrite.publish.evaluation import perplexity_and_agreement

CALIB = random_windows(64, 48, seed=5)
GRID = (0.0, 0.25, 0.5, 0.6, 0.7, 0.8)  # the test trains 0.6 to 0.8 (0.5 and below stay out)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    root = tmp_path_factory.mktemp("nested")
    src = save_tiny_llama(root / "src", seed=7, num_kv_heads=2, num_heads=4, layers=3)
    common = dict(
        model=str(src),
        progress=False,
        target_rate=0.7,
        allocation="uniform",
        rate_grid=GRID,
        distill_tokens=int(CALIB.numel()),
    )
    plans = {
        "none": Plan(output=root / "none", **common),
        "nested": Plan(
            output=root / "nested", distill=True, distill_rates=(0.6, 0.8), distill_epochs=6, distill_lr=3e-4, **common
        ),
    }
    return src, {name: run_pipeline(plan, tiny_pipeline(CALIB)) for name, plan in plans.items()}


def test_every_rate_of_the_nested_checkpoint_loads_and_lowers_kl_on_unseen_text(compiled):
    src, contexts = compiled
    nested = contexts["nested"]
    assert list(nested.spec.rate_table) == ["0.60", "0.70", "0.80"]  # the grid from 0.6 to 0.8
    report = nested.report["distill"]
    assert report["nested_rates"] == ["0.60", "0.70", "0.80"]
    assert set(report["windows_per_rate"]) == set(report["nested_rates"])  # every rate was drawn
    original = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    held_out = random_windows(8, 48, seed=11)
    for rate in (0.6, 0.7, 0.8):
        kl = {
            name: perplexity_and_agreement(
                kvrewrite.load(contexts[name].output_dir, rate=rate), held_out, original, progress=False
            ).kl_mean
            for name in ("none", "nested")
        }
        assert kl["nested"] < 0.9 * kl["none"], (rate, kl)  # measured: 0.79-0.84
    with pytest.raises(InvalidArgumentError, match="rate table"):
        kvrewrite.load(nested.output_dir, rate=0.5)  # outside the trained range: not served


def test_dims_beyond_the_largest_trained_rank_stay_bit_for_bit(compiled):
    """Every rank any trained rate reads (the largest: at the smallest rate, 0.6) may change; the rest may not."""
    _, contexts = compiled
    before, after = checkpoint_tensors(contexts["none"].output_dir), checkpoint_tensors(contexts["nested"].output_dir)
    spec = contexts["nested"].spec
    key_ranks, value_ranks = spec.ranks_for_rate(0.6)
    changed = count_changes_outside_ranks(before, after, spec.head_dim, 2, key_ranks, value_ranks)
    assert changed >= 3 * 4


def test_full_rank_stays_exact_without_distillation(compiled):
    """The plain compile still reproduces the original at rate 0 (the nested option changes nothing there)."""
    src, contexts = compiled
    original = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    windows = random_windows(2, 48, seed=12)
    with torch.no_grad():
        diff = (
            (kvrewrite.load(contexts["none"].output_dir, rate=0.0)(windows).logits - original(windows).logits)
            .abs()
            .max()
        )
    assert diff < 1e-4


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(distill_rates=(0.3, 0.7)), "`distill=True`"),
        (dict(distill=True, distill_rates=(0.3, 0.7), refit="output"), "leave `refit` at none"),
        (dict(distill=True, distill_rates=(0.3, 0.33)), "not in the `rate_grid`"),
        (dict(distill=True, distill_rates=(0.6, 0.7)), "must lie within"),
    ],
)
def test_bad_nested_settings_are_refused(kwargs, needle):
    with pytest.raises(InvalidArgumentError, match=re.escape(needle)):
        Plan(model="x", target_rate=0.5, **kwargs)


def test_card_says_one_file_serves_every_trained_rate(compiled):
    from kvrewrite.publish.model_card import render_model_card

    _, contexts = compiled
    card = str(render_model_card(contexts["nested"].output_dir))
    assert "distilled for the rates 0.60 to 0.80 together" in card
    assert "nested distillation" not in str(render_model_card(contexts["none"].output_dir))
