"""Python API: `kvrewrite.compress(...)` runs the compiler (the command line's `compress` calls it); `kvrewrite.load(...)`
loads its output."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvrewrite.compile.passes.pipeline import run_pipeline
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
    ctx = run_pipeline(plan, on_pass=on_pass)
    report = {**ctx.report, "verification": ctx.verification}
    return CompileResult(output_dir=ctx.output_dir, spec=ctx.spec, report=report)
