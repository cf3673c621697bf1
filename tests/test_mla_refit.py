"""export-mla --refit (compile/mla/refit.py) on tiny random Llamas: the refitted o_proj is the least-squares solution
of the layer's own rows, an exact (full-width) form keeps its o_proj, the refit lowers the KL to the original on text
it was not fitted on, the export carries it into stock transformers, and what does not combine is refused first."""

from __future__ import annotations

import json

import pytest
import torch

from kvrewrite.compile.mla.export import export_at_share, export_matches_maths, prepare_source
from kvrewrite.compile.mla.form import MLAWidths, compute_mla_layers, mla_reference_model, widths_for_share
from kvrewrite.compile.mla.refit import refit_mla_output
from kvrewrite.compile.passes.collect_statistics import CollectStatistics
from kvrewrite.compile.passes.load_checkpoint import LoadCheckpoint
from kvrewrite.compile.plan import Plan
from kvrewrite.method.mla import full_latent_rank
from tests.test_mla_distill import _kl, _logits
from tests.tiny_models import FixedCalibration, random_windows, save_tiny_llama

# 64 calibration windows: with 16 the refit of the tiny model's 64 o_proj inputs fits the random tokens' noise, and
# does not lower the KL on other random tokens.
WINDOWS, LENGTH = 64, 48


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    src = save_tiny_llama(tmp_path_factory.mktemp("mla_refit") / "src")  # 4 query heads, 2 KV heads, head_dim 16
    return prepare_source(
        Plan(model=str(src), progress=False),
        [LoadCheckpoint(), FixedCalibration(random_windows(WINDOWS, LENGTH)), CollectStatistics()],
    )


@pytest.fixture(scope="module")
def half(prepared):
    """The form at 50% of K+V, and the same refitted on every calibration token against the original model."""
    layers = compute_mla_layers(prepared.ctx, prepared.inputs, widths_for_share(prepared.ctx.geometry, 0.5))
    return layers, refit_mla_output(prepared, layers, "output", WINDOWS * LENGTH, ridge=1e-4)


def test_the_first_layers_o_proj_is_the_least_squares_solution_of_its_rows(prepared, half):
    """Layer 0 reads the embeddings in both models, so its rows are known independently: what the MLA attention feeds
    o_proj, and the original attention's output, over every calibration token; a dense ridge solve must agree."""
    layers, result = half
    ctx = prepared.ctx
    original = ctx.original_model()
    form = mla_reference_model(original, layers)
    rows: dict[str, torch.Tensor] = {}
    hooks = [
        ctx.adapter.output_projection(ctx.adapter.attention(form.model.layers[0])).register_forward_pre_hook(
            lambda _m, args: rows.setdefault("z", args[0])
        ),
        ctx.adapter.output_projection(ctx.adapter.attention(original.model.layers[0])).register_forward_hook(
            lambda _m, _a, out: rows.setdefault("t", out)
        ),
    ]
    with torch.no_grad():
        form(ctx.calibration_tokens)
        original(ctx.calibration_tokens)
    for hook in hooks:
        hook.remove()
    z, t = rows["z"].flatten(0, 1).double(), rows["t"].flatten(0, 1).double()
    gram = z.T @ z
    lam = 1e-4 * gram.diagonal().mean()
    expected = torch.linalg.solve(gram + lam * torch.eye(len(gram), dtype=gram.dtype), z.T @ t).T
    assert torch.allclose(result.layers[0].o_proj, expected, atol=1e-4 * float(expected.abs().max()), rtol=0)
    assert result.tokens == WINDOWS * LENGTH
    assert all(r.relative_error_after <= r.relative_error_before + 1e-9 for r in result.reports)
    for old, new in zip(layers, result.layers):  # nothing but o_proj changes
        for name in ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj"):
            assert torch.equal(getattr(old, name), getattr(new, name)), name
    assert all(new >= old for new, old in zip(result.max_square_norms, prepared.inputs.max_square_norms))


def test_an_exact_form_keeps_its_o_proj_and_its_logits(prepared):
    """Every RoPE component and a full latent: the form is the original, so the least squares give back o_proj (up
    to the ridge) and the logits stay the original's."""
    geo = prepared.ctx.geometry
    n_kv, d = geo.num_key_value_heads, geo.head_dim
    exact = compute_mla_layers(
        prepared.ctx, prepared.inputs, MLAWidths(n_kv, n_kv * d, full_latent_rank(geo, n_kv), 1.0)
    )
    result = refit_mla_output(prepared, exact, "output", WINDOWS * LENGTH, ridge=0.0)
    for old, new in zip(exact, result.layers):
        assert torch.allclose(old.o_proj, new.o_proj, atol=1e-4 * float(old.o_proj.abs().max()), rtol=0)
    original = prepared.ctx.original_model()
    tokens = random_windows(2, 40, seed=11)
    assert torch.allclose(
        _logits(mla_reference_model(original, result.layers), tokens), _logits(original, tokens), atol=1e-3
    )
    assert max(r.relative_error_after for r in result.reports) < 1e-4


def test_the_refit_lowers_kl_on_text_it_was_not_fitted_on_and_the_export_carries_it(prepared, half, tmp_path):
    from transformers import AutoModelForCausalLM

    layers, result = half
    original = prepared.ctx.original_model()
    unseen = random_windows(6, LENGTH, seed=123)
    reference = _logits(original, unseen)
    free = _kl(reference, _logits(mla_reference_model(original, layers), unseen))
    refitted = _kl(reference, _logits(mla_reference_model(original, result.layers), unseen))
    assert refitted < 0.92 * free, (free, refitted)
    summary = export_at_share(
        prepared,
        result.layers,
        tmp_path / "out",
        dtype=torch.float32,
        max_square_norms=result.max_square_norms,
        provenance={"refit": result.provenance()},
    )
    assert export_matches_maths(prepared, result.layers, summary.output, unseen[:2]) < 1e-3
    exported = AutoModelForCausalLM.from_pretrained(summary.output, dtype=torch.float32).eval()
    assert _kl(reference, _logits(exported, unseen)) == pytest.approx(refitted, rel=1e-3)
    marker = json.loads((summary.output / "config.json").read_text())["kvrewrite_mla"]
    assert marker["refit"]["target"] == "model" and len(marker["refit"]["layer_relative_error_after"]) == len(layers)


def test_output_local_fits_against_the_original_layer_on_the_forms_own_inputs(prepared, half):
    """Layer 0's input is the same in both models, so both targets fit it alike; later layers differ."""
    layers, model_target = half
    local = refit_mla_output(prepared, layers, "output-local", WINDOWS * LENGTH, ridge=1e-4)
    assert torch.allclose(local.layers[0].o_proj, model_target.layers[0].o_proj, atol=1e-6)
    assert not torch.allclose(local.layers[-1].o_proj, model_target.layers[-1].o_proj, atol=1e-6)
    assert local.provenance()["target"] == "layer"


def _cli(tmp_path, *extra):
    from typer.testing import CliRunner

    from kvrewrite.cli.app import app

    src = save_tiny_llama(tmp_path / "src")
    out = tmp_path / "mla"
    result = CliRunner().invoke(
        app,
        [
            "export-mla",
            str(src),
            "-o",
            str(out),
            "--calibration",
            "synthetic",
            "--calib-tokens",
            "512",
            "--verify-tokens",
            "32",
            *extra,
        ],
    )
    return result, out


def test_the_cli_refits_an_allocated_export_and_drops_the_rates_it_was_not_fitted_for(tmp_path):
    result, out = _cli(tmp_path, "--kv-share", "0.7", "--layer-widths", "sensitivity", "--refit", "output-local")
    assert result.exit_code == 0, result.output
    marker = json.loads((out / "config.json").read_text())["kvrewrite_mla"]
    assert marker["refit"]["method"] == "output-local" and marker["refit"]["tokens"] == 512
    assert "rate_table" not in marker and "refit: o_proj of" in result.output


def test_a_refit_before_distill_leaves_the_latent_norm_pass_to_the_distillation(tmp_path, monkeypatch):
    """--refit with --distill: the distillation starts from the refitted form, and only its own pass over the
    calibration windows sets the latent-norm bound (the refit's would be overwritten); the marker records both."""
    from kvrewrite.compile.mla import form as mla_form

    passes = []
    measure = mla_form._measure_attention_inputs
    monkeypatch.setattr(mla_form, "_measure_attention_inputs", lambda *a, **k: passes.append(1) or measure(*a, **k))
    result, out = _cli(
        tmp_path,
        "--kv-share",
        "0.5",
        "--refit",
        "output-local",
        "--distill",
        "--calib-tokens",
        "1024",
        "--distill-epochs",
        "1",
    )
    assert result.exit_code == 0, result.output
    marker = json.loads((out / "config.json").read_text())["kvrewrite_mla"]
    assert marker["refit"]["method"] == "output-local" and "distill" in marker
    assert len(passes) == 1


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            (
                "--refit",
                "output",
                "--kv-share",
                "0.7",
                "--layer-widths",
                "sensitivity",
                "--distill",
                "--distill-rates",
                "0.3,0.5",
            ),
            "compiled ranks only",
        ),
        (("--refit", "none", "--refit-tokens", "256"), "--refit-tokens only applies"),
        (
            (
                "--refit",
                "outputs",
            ),
            "--refit must be one of",
        ),
    ],
)
def test_what_does_not_combine_is_refused_before_any_work(tmp_path, extra, message):
    result, out = _cli(tmp_path, *extra)
    assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output
    assert not out.exists()


def test_the_default_refits_a_uniform_export_and_leaves_an_allocated_one_its_rate_table(tmp_path):
    uniform, out = _cli(tmp_path / "uniform", "--kv-share", "0.5")
    assert uniform.exit_code == 0, uniform.output
    assert json.loads((out / "config.json").read_text())["kvrewrite_mla"]["refit"]["method"] == "output-local"
    allocated, out = _cli(tmp_path / "allocated", "--kv-share", "0.7", "--layer-widths", "sensitivity")
    assert allocated.exit_code == 0, allocated.output
    marker = json.loads((out / "config.json").read_text())["kvrewrite_mla"]
    assert "refit" not in marker and "0.30" in marker["rate_table"]
