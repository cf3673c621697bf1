"""The MLA export is a list of passes run by the per-head compiler's `run_pass` (compile/mla/passes/): their
declarations are consistent, and on tiny random Llamas each branch of the export sets exactly what the passes
declare, in the pipeline's order, and writes the marker sections they reported."""

from __future__ import annotations

import json

import pytest

from kvrewrite.compile.mla.api import run_mla_export
from kvrewrite.compile.mla.passes.context import MLAContext
from kvrewrite.compile.mla.passes.pipeline import mla_passes
from kvrewrite.compile.mla.plan import MLAPlan
from kvrewrite.compile.passes.base import context_fields
from tests.tiny_models import save_tiny_llama

# The one field two passes produce: the single-rate refit and the per-rate refits are alternatives (a plan with
# per-rate refits runs no single-rate one: its statistics plan says refit=none).
ALTERNATIVES = {"report.refit": {"refit_output", "refit_rates"}}
VERIFIED = {
    "full_width_diff": "verify",
    "export_diff": "verify",
    "rate_diffs": "verify",
    "latent_norm_errors": "verify",
}
SMALL = {"calibration": "synthetic", "calib_tokens": 512, "verify_tokens": 32, "progress": False}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("mla_passes") / "src")  # 4 query heads, 2 KV heads, head_dim 16


def test_the_pipeline_declarations_are_consistent():
    """Every declared key is an MLAContext field or a marker section, none of the fields export_mla sets itself; each
    is produced by one pass (but the two alternative refits' section), and refined only after a pass produced it."""
    fields = context_fields(MLAContext)
    assert not fields & set(MLAContext.pipeline_fields)
    produced: dict[str, set[str]] = {}
    for step in mla_passes():
        for key in step.produces:
            assert key in fields or key.startswith("report."), key
            assert key not in produced or {*produced[key], step.name} <= ALTERNATIVES.get(key, set()), key
            produced.setdefault(key, set()).add(step.name)
        for key in step.refines:
            assert key in fields and key in produced, f"{step.name} refines {key} before any pass produced it"
    # Every result field of the context is some pass's: nothing reaches MLAExport but through a declaration.
    assert fields == {key for key in produced if not key.startswith("report.")}
    assert [step.name for step in mla_passes()] == [
        "form",
        "allocate",
        "refit_output",
        "distill",
        "refit_rates",
        "export",
        "verify",
    ]


@pytest.mark.parametrize(
    "options, expected",
    [
        (
            {"kv_share": 0.5},  # uniform: the default output-local refit
            {
                "layers": "form > refit_output",
                "norms": "form > refit_output",
                "served_rates": "form > refit_output",
                "refit": "refit_output",
                "report.refit": "refit_output",
            },
        ),
        (
            {"kv_share": 0.7, "layer_widths": "sensitivity", "serve_rates": (0.3, 0.5)},  # the table, training-free
            {
                "layers": "form > allocate",
                "norms": "form",
                "served_rates": "form > allocate",
                "probed": "form",
                "report.allocation": "allocate",
            },
        ),
        (
            {"kv_share": 0.7, "serve_rates": (0.3, 0.5), "serve_rates_by": "refit"},  # uniform, one o_proj per rate
            {
                "layers": "form > refit_rates",
                "norms": "form > refit_rates",
                "served_rates": "form > refit_rates",
                "rate_refit": "refit_rates",
                "report.refit": "refit_rates",
            },
        ),
        (
            {
                "kv_share": 0.7,
                "layer_widths": "sensitivity",
                "distill": True,
                "distill_rates": (0.3, 0.5),
                "distill_epochs": 1,
                "calib_tokens": 1024,  # two windows: one to train on, one to validate on
                "refit_rates": (0.3, 0.4),
            },
            {
                "layers": "form > allocate > distill > refit_rates",
                "norms": "form > distill > refit_rates",
                "served_rates": "form > allocate > distill > refit_rates",
                "probed": "form",
                "report.allocation": "allocate",
                "distilled": "distill",
                "report.distill": "distill",
                "rate_refit": "refit_rates",
                "report.refit": "refit_rates",
            },
        ),
    ],
    ids=["uniform-refit", "allocated-table", "refit-rates", "nested-distill-refit-rates"],
)
def test_each_branch_sets_what_its_passes_declare_in_order(tmp_path, source, options, expected):
    ctx = run_mla_export(str(source), MLAPlan(output=tmp_path / "mla", **{**SMALL, **options}))
    assert dict(ctx.provenance) == {**expected, "summary": "export", **VERIFIED}
    declared = {step.name: set(step.produces) | set(step.refines) for step in mla_passes()}
    for key, chain in ctx.provenance.items():
        assert all(key in declared[name] for name in chain.split(" > ")), (key, chain)
        if not key.startswith("report."):
            assert key in ("norms", "served_rates", "latent_norm_errors") or getattr(ctx, key) is not None, key
    assert (ctx.latent_norm_errors is not None) == ("distilled" in ctx.provenance)
    # The marker holds exactly the sections the passes reported, beside the source and the position-free queries.
    marker = json.loads((tmp_path / "mla" / "config.json").read_text())["kvrewrite_mla"]
    sections = {key for key in marker if key in ("allocation", "refit", "distill")}
    assert sections == set(ctx.report)
    assert all(marker[key] == json.loads(json.dumps(ctx.report[key])) for key in sections)
    assert set(marker.get("rate_table") or {}) == set(ctx.served_rates or {})
