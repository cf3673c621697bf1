"""The pass contract (compile/passes/base.py): a pass returns exactly the results it declares, and replaces what
another pass set only where it declares the refinement."""

from __future__ import annotations

import dataclasses

import pytest

from kvrewrite.compile.passes.base import CONTEXT_FIELDS, PassContractError, run_pass
from kvrewrite.compile.passes.context import CompileContext
from kvrewrite.compile.passes.pipeline import default_pipeline, run_pipeline, statistics_passes
from kvrewrite.compile.plan import Plan


class Step:
    """A stand-in pass returning fixed results."""

    description = "test pass"

    def __init__(self, name: str, results: dict, produces=(), refines=()):
        self.name, self.results, self.produces, self.refines = name, results, tuple(produces), tuple(refines)

    def run(self, ctx):
        return None if self.results is None else dict(self.results)


def fresh(tmp_path=None) -> CompileContext:
    return CompileContext(
        plan=Plan(model="nowhere", progress=False, output=None if tmp_path is None else tmp_path / "out")
    )


def test_results_are_applied_to_a_new_context():
    ctx = fresh()
    after = run_pass(
        ctx, Step("a", {"target_rate": 0.4, "report.note": {"x": 1}}, produces=("target_rate", "report.note"))
    )
    assert after.target_rate == 0.4 and after.report == {"note": {"x": 1}}
    assert ctx.target_rate is None and ctx.report == {}  # the context before is untouched
    assert after.provenance == {"target_rate": "a", "report.note": "a"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        after.target_rate = 0.5


def test_an_undeclared_result_is_refused():
    with pytest.raises(PassContractError, match="returned 'spec', which it does not declare"):
        run_pass(fresh(), Step("sneaky", {"target_rate": 0.4, "spec": object()}, produces=("target_rate",)))
    with pytest.raises(PassContractError, match="returned 'report.extra'"):
        run_pass(fresh(), Step("sneaky", {"report.extra": 1}, produces=("report.other",)))


def test_overwriting_another_pass_result_is_refused():
    ctx = run_pass(fresh(), Step("first", {"target_rate": 0.4}, produces=("target_rate",)))
    with pytest.raises(PassContractError, match="sets 'target_rate', already set by pass first"):
        run_pass(ctx, Step("second", {"target_rate": 0.5}, produces=("target_rate",)))
    ctx = run_pass(fresh(), Step("first", {"report.section": 1}, produces=("report.section",)))
    with pytest.raises(PassContractError, match="already set by pass first"):
        run_pass(ctx, Step("second", {"report.section": 2}, produces=("report.section",)))


def test_a_declared_refinement_replaces_and_is_recorded():
    ctx = run_pass(fresh(), Step("first", {"target_rate": 0.4}, produces=("target_rate",)))
    ctx = run_pass(ctx, Step("second", {"target_rate": 0.5}, refines=("target_rate",)))
    assert ctx.target_rate == 0.5 and ctx.provenance["target_rate"] == "first > second"
    with pytest.raises(PassContractError, match="refines 'spec', which no earlier pass set"):
        run_pass(ctx, Step("third", {"spec": object()}, refines=("spec",)))


def test_pipeline_only_fields_and_unknown_names_cannot_be_declared():
    for key in ("plan", "report", "provenance", "memo", "no_such_field"):
        with pytest.raises(PassContractError, match="neither a context field"):
            run_pass(fresh(), Step("bad", {}, produces=(key,)))
    with pytest.raises(PassContractError, match="not a mapping"):
        run_pass(fresh(), Step("none", None))


def test_run_pipeline_refuses_a_pass_breaking_the_contract(tmp_path):
    passes = [
        Step("first", {"target_rate": 0.4}, produces=("target_rate",)),
        Step("second", {"target_rate": 0.5}, produces=("target_rate",)),
    ]
    with pytest.raises(PassContractError, match="already set by pass first"):
        run_pipeline(fresh(tmp_path).plan, passes)


def test_default_pipeline_declarations_are_consistent():
    """Every field is produced by one pass only; a refinement always follows the pass that produced the field."""
    produced: dict[str, str] = {}
    for step in default_pipeline():
        for key in step.produces:
            assert key not in produced, f"{key} produced by {produced.get(key)} and {step.name}"
            assert key in CONTEXT_FIELDS or key.startswith("report."), key
            produced[key] = step.name
        for key in getattr(step, "refines", ()):
            assert key in produced, f"{step.name} refines {key} before any pass produced it"
    # The statistics passes produce nothing a rewrite pass produces: compile_variants' variants share them.
    shared = {key for step in statistics_passes() for key in step.produces}
    assert {"statistics", "calibration_tokens", "source"} <= shared
    assert not shared & {key for step in default_pipeline()[len(statistics_passes()) :] for key in step.produces}
