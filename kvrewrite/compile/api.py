"""Python API: `kvrewrite.compress(...)` runs the compiler (the command line's `compress` calls it);
`kvrewrite.compress_variants(...)` compiles several configurations from one statistics pass (sweeps, the demo);
`kvrewrite.load(...)` loads their output."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from kvrewrite.compile.passes.context import CompileContext
from kvrewrite.compile.passes.pipeline import compile_variants, run_pipeline
from kvrewrite.compile.plan import Plan
from kvrewrite.errors import InvalidArgumentError
from kvrewrite.spec import CompressionSpec


@dataclass
class CompileResult:
    output_dir: Path
    spec: CompressionSpec
    report: dict


def compress(
    model: str | Plan, target_rate: float | None = None, output: str | Path | None = None, *, on_pass=None, **options
) -> CompileResult:
    """Rewrite `model` (Hub id, local dir, or "smollm2-135m") so its KV cache keeps (1 - target_rate) of its elements
    (default: the Plan's, half), any other Plan field a keyword; or compile a `Plan` as it stands (what
    `kvrewrite compress` does: it builds and checks the plan first). on_pass: called with each pass just before it
    runs (the command line prints its progress)."""
    if isinstance(model, Plan):
        given = [name for name, value in (("target_rate", target_rate), ("output", output)) if value is not None]
        if given or options:
            raise InvalidArgumentError(
                f"compress(plan) compiles the plan as it stands; set {', '.join(sorted([*given, *options]))} in the "
                "Plan instead"
            )
        plan = model
    else:
        rate = {} if target_rate is None else {"target_rate": target_rate}
        plan = Plan(model=model, output=Path(output) if output else None, **rate, **options)
    plan.refuse_idle_tuning()
    ctx = run_pipeline(plan, on_pass=on_pass)
    report = {**ctx.report, "verification": ctx.verification}
    return CompileResult(output_dir=ctx.output_dir, spec=ctx.spec, report=report)


@dataclass(frozen=True)
class CompiledVariants:
    """What `compress_variants` compiled: one CompileResult per variant name, and the statistics they share."""

    results: dict[str, CompileResult]
    _statistics: CompileContext = dataclasses.field(repr=False, compare=False)

    @property
    def statistics_report(self) -> dict:
        """The shared passes' report sections (calibration tokens and text, their timings)."""
        return self._statistics.report

    @property
    def tokenizer(self) -> Any:
        """The source's tokenizer, for evaluating the variants."""
        return self._statistics.tokenizer

    @property
    def calibration_tokens(self) -> Any:
        """The calibration windows the statistics ran on."""
        return self._statistics.calibration_tokens

    def original_model(self):
        """The source model in fp32 (the evaluation baseline), loaded once and shared with the compile's own use."""
        return self._statistics.original_model()


def compress_variants(
    plan: Plan,
    variants: dict[str, dict],
    output_root: str | Path,
    *,
    on_pass: Callable[[str, Any], None] | None = None,
) -> CompiledVariants:
    """Compile `plan` once per variant into output_root/<name>, each variant a dict of Plan fields that override the
    plan's (`{"greedy": {"allocation": "greedy"}, "post": {"rope_mode": "post-rope"}}`).

    The statistics (source, calibration windows, Grams) depend only on the model and the corpus, so they are collected
    once and every variant's rewrite starts from them: a sweep over allocations, key modes or refits costs one
    statistics pass, not one per variant. Each variant's output equals `compress` of its own plan. on_pass: called with
    ("shared" or the variant's name, pass) just before each pass runs."""
    from kvrewrite.extras import require_package

    if not variants:
        raise InvalidArgumentError("compress_variants needs at least one variant (name -> Plan field overrides)")
    fields = {f.name for f in dataclasses.fields(Plan)}
    for name, overrides in variants.items():
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise InvalidArgumentError(f"variant {name!r}: {', '.join(unknown)} are not Plan fields")
        variant = dataclasses.replace(plan, **overrides)
        variant.refuse_idle_tuning()
        for module, feature in variant.optional_packages():  # before any work
            require_package(module, feature)
    shared, compiled = compile_variants(plan, variants, Path(output_root), on_pass=on_pass)
    results = {
        name: CompileResult(
            output_dir=ctx.output_dir, spec=ctx.spec, report={**ctx.report, "verification": ctx.verification}
        )
        for name, ctx in compiled.items()
    }
    return CompiledVariants(results=results, _statistics=shared)
