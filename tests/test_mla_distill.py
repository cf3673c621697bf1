"""export-mla --distill (compile/mla/distill.py) on tiny random Llamas: it lowers the KL to the original on text it was
not trained on, the DeepSeek-V3 export and our absorbed runtime carry the trained weights, only the MLA weights
change, the latent-norm neutralisation still holds, and an exact (full-width) form is left as it is."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from kvrewrite.compile.mla.deepseek_v3_export import TRANSFORMERS_LATENT_NORM_EPS
from kvrewrite.compile.mla.distill import distill_mla_layers, measured_latent_norm_errors
from kvrewrite.compile.mla.export import export_at_share
from kvrewrite.compile.mla.form import compute_mla_layers, mla_reference_model, widths_for_share
from kvrewrite.compile.plan import Plan
from kvrewrite.method.mla import balance_latent_gauge
from tests.test_mla_export import _stock_logits_in_fresh_process
from tests.tiny_models import random_windows, save_tiny_llama

WINDOWS, LENGTH = 16, 48
DISTILL = {
    "distill": True,
    "distill_tokens": WINDOWS * LENGTH,
    "distill_epochs": 8.0,
    "distill_lr": 1e-3,
    "batch_size": 2,
}


def _prepared(tmp_path, seed: int = 0, **config):
    src = save_tiny_llama(tmp_path / "src", seed=seed, **config)
    return prepared_from_windows(Plan(model=str(src), progress=False, **DISTILL))


def prepared_from_windows(plan):
    from kvrewrite.compile.mla.export import prepare_source
    from kvrewrite.compile.passes.collect_statistics import CollectStatistics
    from kvrewrite.compile.passes.load_checkpoint import LoadCheckpoint
    from tests.tiny_models import FixedCalibration

    return prepare_source(
        plan, [LoadCheckpoint(), FixedCalibration(random_windows(WINDOWS, LENGTH)), CollectStatistics()]
    )


def _kl(reference: torch.Tensor, logits: torch.Tensor) -> float:
    return float(
        F.kl_div(
            F.log_softmax(logits, -1).flatten(0, 1),
            F.log_softmax(reference, -1).flatten(0, 1),
            log_target=True,
            reduction="batchmean",
        )
    )


def _logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    """The tiny GQA model at 50% of K+V: training-free and distilled forms, both exported (float32)."""
    tmp = tmp_path_factory.mktemp("mla_distill")
    prepared = _prepared(tmp)
    layers = compute_mla_layers(prepared.ctx, prepared.inputs, widths_for_share(prepared.ctx.geometry, 0.5))
    result = distill_mla_layers(prepared, layers, progress=False)
    free = export_at_share(prepared, layers, tmp / "free", dtype=torch.float32)
    trained = export_at_share(
        prepared, result.layers, tmp / "distilled", dtype=torch.float32, max_square_norms=result.max_square_norms
    )
    return prepared, layers, result, free, trained


def test_distillation_lowers_kl_on_text_it_was_not_trained_on(distilled):
    from transformers import AutoModelForCausalLM

    prepared, _, result, free, trained = distilled
    assert result.report.kept_epoch > 0 and result.report.validation_kl_after < result.report.validation_kl_before
    unseen = random_windows(6, LENGTH, seed=123)  # neither training nor validation windows
    reference = _logits(prepared.ctx.original_model(), unseen)
    kls = {
        name: _kl(
            reference, _logits(AutoModelForCausalLM.from_pretrained(summary.output, dtype=torch.float32).eval(), unseen)
        )
        for name, summary in (("free", free), ("distilled", trained))
    }
    assert kls["distilled"] < 0.95 * kls["free"], kls


def test_the_distilled_export_loads_in_stock_transformers_and_matches_our_runtime_and_maths(distilled, tmp_path):
    import kvrewrite

    prepared, _, result, _, trained = distilled
    tokens = random_windows(2, 40, seed=5)
    stock, info = _stock_logits_in_fresh_process(trained.output, tokens, tmp_path)
    assert info["class"] == "DeepseekV3ForCausalLM"
    ours = kvrewrite.load(trained.output).eval()
    with torch.no_grad():
        assert (ours(tokens).logits - stock).abs().max() < 1e-4
        prefill = ours(tokens[:1, :32], use_cache=True)
        step = ours(tokens[:1, 32:33], past_key_values=prefill.past_key_values, use_cache=True).logits
    assert (step[:, -1] - stock[:1, 32]).abs().max() < 1e-4
    maths = _logits(mla_reference_model(prepared.ctx.original_model(), result.layers), tokens)
    assert (maths - stock).abs().max() < 1e-4


def test_only_the_mla_weights_change(distilled):
    from safetensors.torch import load_file

    _, layers, result, free, trained = distilled
    before = {k: v for f in sorted(free.output.glob("*.safetensors")) for k, v in load_file(f).items()}
    after = {k: v for f in sorted(trained.output.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert before.keys() == after.keys()
    trainable = ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "kv_a_layernorm")
    for name in before:
        if any(f".self_attn.{part}." in name for part in trainable):
            assert before[name].shape == after[name].shape
        else:
            assert torch.equal(before[name], after[name]), name
    for old, new in zip(layers, result.layers):
        for part in ("q_proj", "kv_b_proj", "o_proj"):
            assert not torch.equal(getattr(old, part), getattr(new, part)), part
        assert (old.kv_lora_rank, old.qk_rope_head_dim, old.pair_frequency.tolist()) == (
            new.kv_lora_rank,
            new.qk_rope_head_dim,
            new.pair_frequency.tolist(),
        )


def test_the_latent_norm_neutralisation_still_holds_after_training(distilled):
    """The bound is re-derived from the trained latent rows and the larger of the original's and the distilled form's
    attention inputs; every calibration token's measured latent stays within it, through the real RMSNorm too."""
    prepared, _, result, _, trained = distilled
    eps = TRANSFORMERS_LATENT_NORM_EPS
    assert all(b >= a for a, b in zip(prepared.inputs.max_square_norms, result.max_square_norms))
    errors = measured_latent_norm_errors(result, trained.neutralisers, eps)
    assert all(0 < e <= n.relative_error_bound * (1 + 1e-6) for e, n in zip(errors, trained.neutralisers))
    # Through the stock norm on the distilled form's own layer-0 inputs (the embeddings' normed rows).
    model = mla_reference_model(prepared.ctx.original_model(), result.layers)
    layer, norm = result.layers[0], trained.neutralisers[0]
    captured = []
    handle = model.model.layers[0].self_attn.register_forward_pre_hook(
        lambda _m, args, kwargs: captured.append(kwargs["hidden_states"].double()), with_kwargs=True
    )
    with torch.no_grad():
        model(prepared.ctx.calibration_tokens[:4])
    handle.remove()
    c = captured[0].reshape(-1, captured[0].shape[-1]) @ layer.kv_a_proj_with_mqa[: layer.kv_lora_rank].T
    scaled = norm.scale * c
    normed = norm.norm_weight * scaled / (scaled.square().mean(-1, keepdim=True) + eps).sqrt()
    assert float(((normed - c).norm(dim=-1) / c.norm(dim=-1)).max()) <= norm.relative_error_bound * (1 + 1e-6)


def test_balancing_the_latent_gauge_changes_no_output(distilled):
    _, layers, _, _, _ = distilled
    layer = layers[0]
    balanced = balance_latent_gauge(layer)
    r = layer.kv_lora_rank
    assert torch.allclose(
        balanced.kv_b_proj @ balanced.kv_a_proj_with_mqa[:r],
        layer.kv_b_proj @ layer.kv_a_proj_with_mqa[:r],
        rtol=1e-10,
        atol=1e-12,
    )
    assert torch.equal(balanced.kv_a_proj_with_mqa[r:], layer.kv_a_proj_with_mqa[r:])
    assert torch.allclose(balanced.kv_a_proj_with_mqa[:r].norm(dim=1), balanced.kv_b_proj.norm(dim=0), rtol=1e-10)


def test_an_exact_full_width_form_is_not_trained_and_stays_the_original(tmp_path):
    """One KV head, every value kept: the form is the original. --distill trains nothing there (Adam's
    normalised steps would only add noise), and the export still reproduces the original."""
    prepared = _prepared(tmp_path, num_kv_heads=1)
    layers = compute_mla_layers(prepared.ctx, prepared.inputs, widths_for_share(prepared.ctx.geometry, 1.0))
    result = distill_mla_layers(prepared, layers, progress=False)
    assert result.report is None and all(a is b for a, b in zip(result.layers, layers))
    export_at_share(
        prepared, result.layers, tmp_path / "mla", dtype=torch.float32, max_square_norms=result.max_square_norms
    )
    tokens = random_windows(2, 40, seed=5)
    stock, _ = _stock_logits_in_fresh_process(tmp_path / "mla", tokens, tmp_path)
    assert (stock - _logits(prepared.ctx.original_model(), tokens)).abs().max() < 1e-4


def test_bad_distill_tokens_are_refused(distilled):
    from kvrewrite.errors import InvalidArgumentError

    prepared, layers, _, _, _ = distilled
    for tokens, message in ((10 * WINDOWS * LENGTH, "more than"), (LENGTH, "two")):
        plan = dataclasses.replace(prepared.ctx.plan, distill_tokens=tokens)
        ctx = dataclasses.replace(prepared.ctx, plan=plan)
        with pytest.raises(InvalidArgumentError, match=message):
            distill_mla_layers(dataclasses.replace(prepared, ctx=ctx), layers, progress=False)


def test_the_cli_distills_and_names_bad_options(tmp_path):
    from typer.testing import CliRunner

    from kvrewrite.cli.app import app

    src = save_tiny_llama(tmp_path / "src")
    base = [
        "export-mla",
        str(src),
        "--kv-share",
        "0.5",
        "--calibration",
        "synthetic",
        "--calib-tokens",
        "1024",
        "--verify-tokens",
        "32",
    ]
    out = tmp_path / "mla"
    result = CliRunner().invoke(
        app, [*base, "-o", str(out), "--distill", "--distill-epochs", "1", "--distill-lr", "1e-3"]
    )
    assert result.exit_code == 0, result.output
    assert "distill: validation KL" in result.output and "neutralisation re-derived" in result.output
    marker = json.loads((out / "config.json").read_text())["kvrewrite_mla"]
    assert marker["format_version"] == 1 and marker["distill"]["epochs"] == 1.0 and marker["distill"]["tokens"] == 1024
    for extra, message in (
        (["--distill-tokens", "512"], "only apply with --distill"),
        (["--distill", "--distill-tokens", "4096"], "more than --calib-tokens"),
        (["--distill", "--distill-epochs", "0"], "--distill-epochs must be in (0, 100]"),
        (["--distill", "--distill-lr", "2"], "--distill-lr must be in (0, 1)"),
    ):
        bad = CliRunner().invoke(app, [*base, "-o", str(tmp_path / "bad"), *extra])
        assert bad.exit_code == 2 and message in bad.output, (extra, bad.output)
        assert not (tmp_path / "bad").exists()


def test_nested_distillation_lowers_kl_at_every_rate_of_one_allocated_export(tmp_path):
    """--distill-rates on a --layer-widths sensitivity export: one training over every rate of its table; the file
    loaded at each trained rate (kvrewrite.load(dir, rate=p)) has lower KL on unseen text than the same export before
    training at that rate, and the marker keeps exactly the trained rates."""
    import kvrewrite
    from kvrewrite.compile.mla.distill import distill_provenance
    from kvrewrite.compile.mla.export import allocated_at_share, probe_full_form

    src = save_tiny_llama(tmp_path / "src")
    plan = Plan(model=str(src), progress=False, distill_rates=(0.5, 0.6), target_rate=0.5, **DISTILL)
    prepared = prepared_from_windows(plan)
    form = allocated_at_share(prepared, probe_full_form(prepared), 0.5)
    trained_keys = ("0.50", "0.55", "0.60")
    table = {k: form.rate_table[k] for k in trained_keys}
    result = distill_mla_layers(prepared, form.layers, progress=False, rate_table=table, named_rates=("0.50", "0.60"))
    assert result.rates == trained_keys and result.report.kept_epoch > 0
    assert set(result.report.windows_per_rate) == set(trained_keys)
    export_at_share(prepared, form.layers, tmp_path / "free", dtype=torch.float32, rate_table=table)
    export_at_share(
        prepared,
        result.layers,
        tmp_path / "nested",
        dtype=torch.float32,
        max_square_norms=result.max_square_norms,
        rate_table=table,
        provenance=distill_provenance(result, prepared.ctx.plan),
    )
    marker = json.loads((tmp_path / "nested" / "config.json").read_text())["kvrewrite_mla"]
    assert sorted(marker["rate_table"]) == list(trained_keys) and marker["distill"]["nested_rates"] == list(
        trained_keys
    )
    unseen = random_windows(6, LENGTH, seed=321)
    reference = _logits(prepared.ctx.original_model(), unseen)
    ratios = []
    for key in trained_keys:
        before = _kl(reference, _logits(kvrewrite.load(tmp_path / "free", rate=float(key)).eval(), unseen))
        after = _kl(reference, _logits(kvrewrite.load(tmp_path / "nested", rate=float(key)).eval(), unseen))
        assert after < before, (key, before, after)
        ratios.append(after / before)
    assert sum(ratios) / len(ratios) < 0.96, ratios  # measured 0.94 (0.97, 0.90, 0.95)
    assert set(result.report.validation_kl_by_rate_after) == {"0.50", "0.60"}
