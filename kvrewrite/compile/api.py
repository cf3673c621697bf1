"""Python API: `kvrewrite.compress(...)` runs the compiler; `kvrewrite.load(...)` loads its output."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvrewrite.compile.passes.pipeline import run_pipeline
from kvrewrite.compile.plan import Plan
from kvrewrite.spec import CompressionSpec


@dataclass
class CompileResult:
    output_dir: Path
    spec: CompressionSpec
    report: dict


def compress(model: str, target_rate: float = 0.5, output: str | Path | None = None, **options) -> CompileResult:
    """Rewrite `model` (Hub id, local dir, or "smollm2-135m") so its KV cache keeps (1 - target_rate) of its elements."""
    plan = Plan(model=model, target_rate=target_rate, output=Path(output) if output else None, **options)
    ctx = run_pipeline(plan)
    report = {**ctx.report, "verification": ctx.verification}
    return CompileResult(output_dir=ctx.output_dir, spec=ctx.spec, report=report)
