"""--balance-values ALPHA (compile/passes/balance_values.py): the value-latent balancing folded in at compile time.
Same logits as the compile without it at several rates; v_proj rows / o_proj columns scaled per dim as the runtime
function computes; lower o_proj-weighted int2 value error; bad alpha refused before any work; the CLI option."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from test_value_balance import _weighted_int2_error
from tiny_models import random_windows, save_tiny_llama, tiny_pipeline
from typer.testing import CliRunner

import kvrewrite
from kvrewrite.cli.app import app
from kvrewrite.compile.passes.pipeline import run_pipeline
from kvrewrite.compile.plan import Plan
from kvrewrite.errors import InvalidArgumentError
from kvrewrite.runtime.codecs.value_balance import balance_value_latents

ALPHA = 0.5


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """The same tiny model compiled without and with --balance-values 0.5."""
    root = tmp_path_factory.mktemp("balance_values_pass")
    src = save_tiny_llama(root / "src", seed=0, num_kv_heads=2, num_heads=4)
    out = {}
    for name, alpha in (("plain", 0.0), ("balanced", ALPHA)):
        plan = Plan(
            model=str(src), output=root / name, progress=False, target_rate=0.5, kv_codec="none", balance_values=alpha
        )
        run_pipeline(plan, tiny_pipeline(random_windows(8, 64)))
        out[name] = root / name
    return out


@pytest.mark.parametrize("rate", [0.0, 0.3, None, 0.7])
def test_balanced_compile_has_the_same_logits(compiled, rate):
    plain = kvrewrite.load(compiled["plain"], rate=rate, kv_codec="none")
    balanced = kvrewrite.load(compiled["balanced"], rate=rate, kv_codec="none")
    tokens = random_windows(2, 40, seed=3)
    with torch.no_grad():
        reference, logits = plain(tokens).logits, balanced(tokens).logits
    assert (logits - reference).abs().max().item() < 1e-4 * reference.abs().max().item()


def test_balanced_compile_scales_value_rows_and_o_proj_columns_per_dim(compiled):
    """The compiled weights are the plain compile's with the runtime function applied at full rank (rate 0)."""
    plain = kvrewrite.load(compiled["plain"], rate=0.0, kv_codec="none")
    balanced = kvrewrite.load(compiled["balanced"], rate=0.0, kv_codec="none")
    expected = copy.deepcopy(plain)
    balance_value_latents(expected, ALPHA)
    for p, b, e in zip(plain.model.layers, balanced.model.layers, expected.model.layers):
        p, b, e = p.self_attn, b.self_attn, e.self_attn
        assert not torch.allclose(b.v_proj.weight, p.v_proj.weight)
        assert not torch.allclose(b.o_proj.weight, p.o_proj.weight)
        torch.testing.assert_close(b.v_proj.weight, e.v_proj.weight, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(b.o_proj.weight, e.o_proj.weight, rtol=1e-5, atol=1e-7)
        # Per dim: row j of v_proj is the plain row times one positive scale s_j.
        ratio = (b.v_proj.weight.double() / p.v_proj.weight.double()).detach()
        s = ratio.median(dim=1).values
        assert bool((s > 0).all()) and float(s.max() / s.min()) > 1.01
        torch.testing.assert_close(
            b.v_proj.weight.double(), p.v_proj.weight.double() * s[:, None], rtol=1e-5, atol=1e-7
        )
        # q/k untouched.
        assert torch.equal(b.q_proj.weight, p.q_proj.weight) and torch.equal(b.k_proj.weight, p.k_proj.weight)


def test_balanced_compile_lowers_the_o_proj_weighted_int2_value_error(compiled):
    tokens = random_windows(4, 64, seed=5)
    errors = {
        name: _weighted_int2_error(kvrewrite.load(path, rate=0.0, kv_codec="none"), tokens, group_size=16)
        for name, path in compiled.items()
    }
    assert errors["balanced"] < errors["plain"]


def test_report_records_alpha_and_the_exactness_check(compiled):
    report = json.loads((compiled["balanced"] / "compress_report.json").read_text())
    section = report["value_balance"]
    assert section["alpha"] == ALPHA
    assert section["full_rank_max_abs_logit_diff"] < 1e-4
    assert "value_balance" not in json.loads((compiled["plain"] / "compress_report.json").read_text())


@pytest.mark.parametrize("alpha", [-0.1, 2.5, float("nan"), "x"])
def test_bad_alpha_is_refused_before_any_work(tmp_path, alpha):
    with pytest.raises(InvalidArgumentError, match="balance_values"):
        Plan(model="does-not-exist", output=tmp_path / "out", balance_values=alpha)
    assert not (tmp_path / "out").exists()


def test_cli_offers_balance_values():
    result = CliRunner().invoke(app, ["compress", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    assert "--balance-values" in result.output


def test_cli_refuses_a_bad_alpha(tmp_path):
    result = CliRunner().invoke(app, ["compress", "does-not-exist", "--balance-values", "3", "-o", str(tmp_path / "o")])
    assert result.exit_code != 0
    assert "--balance-values" in result.output
    assert not (tmp_path / "o").exists()


def test_balancing_composes_with_the_output_refit(tmp_path):
    """With --refit output the balancing runs on the refitted o_proj (it runs after the refit): same logits at the
    compiled rate as the refitted compile without it, and the refit's override columns are balanced too."""
    src = save_tiny_llama(tmp_path / "src", seed=1, num_kv_heads=2, num_heads=4)
    outputs = {}
    for name, alpha in (("plain", 0.0), ("balanced", ALPHA)):
        plan = Plan(
            model=str(src),
            output=tmp_path / name,
            progress=False,
            target_rate=0.5,
            kv_codec="int2",
            refit="output",
            refit_tokens=256,
            balance_values=alpha,
        )
        run_pipeline(plan, tiny_pipeline(random_windows(8, 64)))
        outputs[name] = kvrewrite.load(tmp_path / name, kv_codec="none")
    tokens = random_windows(2, 40, seed=4)
    with torch.no_grad():
        reference, logits = outputs["plain"](tokens).logits, outputs["balanced"](tokens).logits
    assert (logits - reference).abs().max().item() < 1e-4 * reference.abs().max().item()
    p, b = outputs["plain"].model.layers[0].self_attn, outputs["balanced"].model.layers[0].self_attn
    assert not torch.allclose(b.o_proj.weight, p.o_proj.weight)
