"""Every figure in a generated model card's measured sections is a value of the files it was generated from
(kvrewrite.publish.card_figures, with the same matching as tools/doc_numbers.py)."""

from __future__ import annotations

import json

import pytest
from tiny_models import save_tiny_llama, tiny_pipeline
from typer.testing import CliRunner

from kvrewrite.cli.app import app
from kvrewrite.compile.passes.pipeline import run_pipeline
from kvrewrite.compile.plan import Plan
from kvrewrite.publish.card_figures import measured_text, unsourced_card_figures
from kvrewrite.publish.eval_results import EVAL_RESULTS_FILE
from kvrewrite.publish.model_card import REPORT_FILE, render_model_card


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    """A tiny compiled checkpoint on which `kvrewrite eval` has run (eval_results.json and the report are real)."""
    root = tmp_path_factory.mktemp("card")
    out = root / "tiny-p50"
    run_pipeline(
        Plan(model=str(save_tiny_llama(root / "src")), output=out, target_rate=0.5, progress=False), tiny_pipeline()
    )
    result = CliRunner().invoke(app, ["eval", str(out), "--rates", "0.3,0.5", "--tokens", "256", "--seq-len", "64"])
    assert result.exit_code == 0, result.output
    # The tiny random model's figures are degenerate (ppl = vocab size, KL 0), which any leaf would match; the
    # rows are replaced by distinct, realistic ones in the same format, so an edit has somewhere to fail.
    evaluation = json.loads((out / EVAL_RESULTS_FILE).read_text())
    base = {
        "name": "tiny (original)",
        "baseline": True,
        "rate": 0.0,
        "perplexity": 24.524238,
        "kl_mean": None,
        "top1_agreement": None,
        "kv_bytes_per_token": 46080.0,
    }
    evaluation["rows"] = [base] + [
        {
            "name": f"tiny-p50 p={rate:.2f}",
            "rate": rate,
            "perplexity": ppl,
            "kl_mean": kl,
            "top1_agreement": top1,
            "kv_bytes_per_token": 46080.0 * (1 - rate),
            "baseline_perplexity": base["perplexity"],
            "baseline_kv_bytes_per_token": 46080.0,
        }
        for rate, ppl, kl, top1 in ((0.3, 26.887471, 0.103301, 0.821429), (0.5, 34.196196, 0.36172, 0.67478))
    ]
    (out / EVAL_RESULTS_FILE).write_text(json.dumps(evaluation))
    return out


def sources(ckpt):
    return (json.loads((ckpt / EVAL_RESULTS_FILE).read_text()), json.loads((ckpt / REPORT_FILE).read_text()))


def test_a_generated_card_has_only_sourced_figures(evaluated):
    card = render_model_card(evaluated).text
    evaluation, report = sources(evaluated)
    text = measured_text(card)
    # The section was found and holds the table rows, the calibration line and the compile cost.
    assert "| model |" not in text and evaluation["rows"][1]["name"] in text and " MiB" in text
    assert unsourced_card_figures(card, evaluation, report) == []


def test_an_edited_card_figure_fails(evaluated):
    card = render_model_card(evaluated).text
    evaluation, report = sources(evaluated)
    row = evaluation["rows"][2]
    line = next(l for l in card.splitlines() if l.startswith(f"| {row['name']} |"))
    printed = f"| {row['kl_mean']:.4f} |"
    wrong = f"{row['kl_mean'] * 1.3 + 0.01:.4f}"  # a plausible value no field holds
    assert line.count(printed) == 1
    problems = unsourced_card_figures(card.replace(line, line.replace(printed, f"| {wrong} |")), evaluation, report)
    assert len(problems) == 1 and wrong in problems[0]


def test_a_card_from_other_results_fails(evaluated):
    """The card of one evaluation does not pass against another (here: every perplexity 10% higher)."""
    card = render_model_card(evaluated).text
    evaluation, report = sources(evaluated)
    other = json.loads(json.dumps(evaluation))
    for r in other["rows"]:
        r["kl_mean"] = None if r["kl_mean"] is None else r["kl_mean"] * 1.3 + 0.01
    problems = unsourced_card_figures(card, other, report)
    # Every compressed row's printed KL is now unsourced.
    assert len(problems) >= len(evaluation["rows"]) - 1 and all("is in neither" in p for p in problems)
