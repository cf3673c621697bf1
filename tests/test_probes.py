"""Truncation probes (kvrewrite.compile.probes): a full-rank rewrite computing as if sliced, only inside the block."""

from __future__ import annotations

import pytest
import torch
from tiny_models import random_windows, save_tiny_llama, tiny_pipeline
from transformers import AutoConfig

import kvrewrite
from kvrewrite.adapters import adapter_for
from kvrewrite.compile.passes.pipeline import run_pipeline
from kvrewrite.compile.plan import Plan
from kvrewrite.compile.probes import truncated, truncated_by_rows, truncated_model
from kvrewrite.errors import InvalidArgumentError

MODES = ["freq", "post-rope", "latent", "crosshead"]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    root = tmp_path_factory.mktemp("probes")
    src = save_tiny_llama(root / "src", seed=0, num_kv_heads=2, num_heads=4)
    out = {}
    for mode in MODES:
        plan = Plan(
            model=str(src), output=root / mode, progress=False, target_rate=0.5, rope_mode=mode, allocation="greedy"
        )
        run_pipeline(plan, tiny_pipeline())
        out[mode] = root / mode
    out["src"] = src
    return out


def probe_ranks(mode: str) -> tuple[list[int], list[int]]:
    return ([10, 0] if mode == "crosshead" else [6, 4]), [10, 2]  # crosshead: one shared key block


@pytest.mark.parametrize("mode", MODES)
def test_truncation_equals_the_model_sliced_to_those_ranks(compiled, mode):
    full = kvrewrite.load(compiled[mode], rate=0.0)
    sliced = kvrewrite.load(compiled[mode], rate=0.0)
    keys, values = probe_ranks(mode)
    sliced.model.layers[1].self_attn.set_ranks(keys, values)
    tokens = random_windows(2, 24, seed=8)
    with torch.no_grad():
        untouched = full(tokens).logits
        with truncated(full.model.layers[1].self_attn, keys, values):
            probed = full(tokens).logits
        expected = sliced(tokens).logits
        after = full(tokens).logits
    assert (probed - expected).abs().max().item() < 1e-5
    assert (probed - untouched).abs().max().item() > 1e-4  # the probe did cut something
    assert torch.equal(after, untouched)  # and is gone after the block


def test_whole_model_truncation_equals_a_rate_slice(compiled):
    rate_model = kvrewrite.load(compiled["latent"])  # the compiled rate, sliced by the loader
    full = kvrewrite.load(compiled["latent"], rate=0.0)
    attns = [layer.self_attn for layer in rate_model.model.layers]
    tokens = random_windows(2, 24, seed=3)
    adapter = adapter_for(AutoConfig.from_pretrained(compiled["src"]))
    with torch.no_grad(), truncated_model(full, adapter, [a.key_ranks for a in attns], [a.value_ranks for a in attns]):
        probed = full(tokens).logits
    with torch.no_grad():
        assert (probed - rate_model(tokens).logits).abs().max().item() < 1e-5
    assert all("project" not in layer.self_attn.__dict__ for layer in full.model.layers)


def test_the_hook_is_removed_when_the_block_raises(compiled):
    full = kvrewrite.load(compiled["freq"], rate=0.0)
    attn = full.model.layers[0].self_attn
    tokens = random_windows(1, 16, seed=1)
    with torch.no_grad():
        before = full(tokens).logits
        with pytest.raises(RuntimeError, match="inside the probe"):
            with truncated(attn, [2, 2], [2, 2]):
                raise RuntimeError("inside the probe")
        assert "project" not in attn.__dict__
        assert torch.equal(full(tokens).logits, before)
        # Nested blocks: leaving the inner one restores the outer truncation, not the plain projection.
        with truncated(attn, [4, 4], [4, 4]):
            outer = full(tokens).logits
            with truncated(attn, [2, 2], [2, 2]):
                pass
            assert torch.equal(full(tokens).logits, outer)
        assert torch.equal(full(tokens).logits, before)


def test_truncation_by_rows_runs_each_block_as_its_own_truncation(compiled):
    """Two rank sets in one batch: each block's rows equal the whole model truncated to that block's ranks."""
    full = kvrewrite.load(compiled["latent"], rate=0.0)
    spec_model = kvrewrite.load(compiled["latent"])
    adapter = adapter_for(AutoConfig.from_pretrained(compiled["src"]))
    compiled_ranks = (
        [a.key_ranks for a in (l.self_attn for l in spec_model.model.layers)],
        [a.value_ranks for a in (l.self_attn for l in spec_model.model.layers)],
    )
    narrow = ([[2] * len(k) for k in compiled_ranks[0]], [[3] * len(v) for v in compiled_ranks[1]])
    tokens = random_windows(2, 24, seed=5)
    with torch.no_grad():
        with truncated_by_rows(full, adapter, [compiled_ranks, narrow], rows_per_block=2):
            both = full(tokens.repeat(2, 1)).logits
        separate = []
        for ranks in (compiled_ranks, narrow):
            with truncated_model(full, adapter, *ranks):
                separate.append(full(tokens).logits)
    assert (both[:2] - separate[0]).abs().max().item() < 1e-5
    assert (both[2:] - separate[1]).abs().max().item() < 1e-5
    assert (separate[0] - separate[1]).abs().max().item() > 1e-3  # the two blocks really differ
    assert all("project" not in layer.self_attn.__dict__ for layer in full.model.layers)
    with pytest.raises(InvalidArgumentError, match="blocks of 2"), torch.no_grad():
        with truncated_by_rows(full, adapter, [compiled_ranks, narrow], rows_per_block=2):
            full(tokens)  # 2 rows, not 2 blocks of 2
    assert all("project" not in layer.self_attn.__dict__ for layer in full.model.layers)
