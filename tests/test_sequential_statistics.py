"""--sequential-statistics: each layer's Grams measured after the already-compressed layers before it (GPTQ-style)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import random_windows, save_tiny_llama, tiny_pipeline
from transformers import AutoModelForCausalLM

import kvrewrite
from kvrewrite.compile.passes.pipeline import run_pipeline
from kvrewrite.compile.plan import Plan
from kvrewrite.errors import InvalidArgumentError

CALIB = random_windows(8, 48, seed=3)
MODES = ["latent", "freq", "crosshead"]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("seq") / "src", seed=4, num_kv_heads=2, num_heads=4, layers=3)


def compile_tiny(src, out, **options):
    plan = Plan(model=str(src), output=out, progress=False, **{"target_rate": 0.5, **options})
    return run_pipeline(plan, tiny_pipeline(CALIB))


def key_grams_on_inputs(model, src, layers: int) -> list[torch.Tensor]:
    """Per layer: the ORIGINAL layer's k_proj Gram (float64, summed over CALIB's tokens) on the attention inputs that
    `model` gives that layer (the input after its own input norm, which the rewrite leaves unchanged)."""
    original = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    seen, handles = {}, []
    for idx, layer in enumerate(model.model.layers):
        handles.append(
            layer.self_attn.register_forward_pre_hook(
                lambda _m, args, kwargs, i=idx: seen.__setitem__(i, kwargs["hidden_states"]), with_kwargs=True
            )
        )
    with torch.no_grad():
        model(input_ids=CALIB, use_cache=False)
    for handle in handles:
        handle.remove()
    grams = []
    for idx in range(layers):
        k = (seen[idx].double() @ original.model.layers[idx].self_attn.k_proj.weight.double().T).reshape(-1, 2, 16)
        grams.append(torch.einsum("ngi,ngj->gij", k, k))
    return grams


@pytest.mark.parametrize("mode", MODES)
def test_sequential_compile_is_exact_at_full_rank(source, tmp_path, mode):
    ctx = compile_tiny(source, tmp_path / "out", rope_mode=mode, sequential_statistics="keep-ranks")
    assert ctx.verification["full_rank_max_abs_logit_diff"] < 1e-4
    full = kvrewrite.load(tmp_path / "out", rate=0.0)
    original = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    tokens = random_windows(2, 40, seed=11)  # not the calibration tokens
    with torch.no_grad():
        assert (full(tokens).logits - original(tokens).logits).abs().max().item() < 1e-4


@pytest.mark.parametrize(
    ("option", "mode"), [("keep-ranks", "latent"), ("keep-ranks", "freq"), ("reallocate", "latent")]
)
def test_grams_are_measured_on_the_compressed_prefix(source, tmp_path, option, mode):
    plain = compile_tiny(source, tmp_path / "plain", rope_mode=mode)
    sequential = compile_tiny(source, tmp_path / "seq", rope_mode=mode, sequential_statistics=option)
    assert sequential.provenance["statistics"] == "collect_statistics > sequential_statistics"
    layers = len(plain.statistics.layers)
    # Layer 0 sees the embeddings either way; every later layer sees a compressed prefix.
    for kind, gram in plain.statistics.layers[0].grams.items():
        assert torch.allclose(sequential.statistics.layers[0].grams[kind], gram, rtol=1e-10, atol=1e-10), kind
    for idx in range(1, layers):
        a, b = plain.statistics.layers[idx].grams["key_pre"], sequential.statistics.layers[idx].grams["key_pre"]
        assert (a - b).norm() > 1e-3 * a.norm(), idx
    # The non-sequential Grams are the original model's; the sequential ones are exactly what the original layer
    # computes on the hidden states of the compiled checkpoint at its compiled rate (keep-ranks: the same ranks
    # that the pass truncated to).
    original = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    for ctx, model in ((plain, original), (sequential, kvrewrite.load(tmp_path / "seq", rate=0.5))):
        if ctx is sequential and option == "reallocate":
            continue  # re-allocated ranks differ from the ones the prefix was truncated to
        for idx, gram in enumerate(key_grams_on_inputs(model, source, layers)):
            torch.testing.assert_close(
                ctx.statistics.layers[idx].grams["key_pre"], gram, rtol=1e-4, atol=1e-4 * gram.abs().max().item()
            )
    report = sequential.report["sequential_statistics"]
    assert report["mode"] == option and report["key_gram_relative_change"][0] == 0.0
    assert all(c > 0 for c in report["key_gram_relative_change"][1:])


def test_off_changes_nothing(source, tmp_path):
    plain = compile_tiny(source, tmp_path / "plain")
    off = compile_tiny(source, tmp_path / "off", sequential_statistics="off")
    assert "sequential_statistics" not in off.report
    for a, b in zip(plain.transforms, off.transforms):
        assert torch.equal(a.key.spectrum, b.key.spectrum) and torch.equal(a.value.down, b.value.down)


def test_sequential_statistics_refuses_kmeans_and_unknown_modes():
    with pytest.raises(InvalidArgumentError, match="reduce=kmeans"):
        Plan(model="m", sequential_statistics="keep-ranks", reduce="kmeans")
    with pytest.raises(InvalidArgumentError, match="sequential_statistics"):
        Plan(model="m", sequential_statistics="yes")
