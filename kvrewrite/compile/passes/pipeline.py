"""The compiler: an ordered list of passes over one context. Reads like the method."""

from __future__ import annotations

import dataclasses
import json
import resource
import time
import warnings
from pathlib import Path

from kvrewrite.compile.passes.allocate_ranks import AllocateRanks
from kvrewrite.compile.passes.balance_values import BalanceValues
from kvrewrite.compile.passes.base import run_pass
from kvrewrite.compile.passes.build_calibration import BuildCalibration
from kvrewrite.compile.passes.collect_fisher import CollectFisher
from kvrewrite.compile.passes.collect_statistics import CollectStatistics
from kvrewrite.compile.passes.compute_transforms import ComputeTransforms
from kvrewrite.compile.passes.context import CompileContext
from kvrewrite.compile.passes.distill_attention import DistillAttention
from kvrewrite.compile.passes.emit import Emit, output_dir_for
from kvrewrite.compile.passes.fit_kv_codec import FitKVCodec
from kvrewrite.compile.passes.fold_weights import FoldWeights
from kvrewrite.compile.passes.load_checkpoint import LoadCheckpoint
from kvrewrite.compile.passes.measure_sensitivity import MeasureSensitivity
from kvrewrite.compile.passes.refit_output import RefitOutput
from kvrewrite.compile.passes.sequential_statistics import SequentialStatistics
from kvrewrite.compile.passes.verify import Verify
from kvrewrite.compile.plan import Plan
from kvrewrite.errors import KVRewriteWarning
from kvrewrite.io.checkpoint_io import estimated_output_bytes
from kvrewrite.io.output_safety import check_output_location, recover_leftovers
from kvrewrite.io.sources import local_source_dir


def statistics_passes() -> list:
    """The part that depends only on the model and the corpus (shareable between configurations)."""
    return [
        LoadCheckpoint(),  # source -> fp32 model, adapter
        BuildCalibration(),  # corpus -> token windows
        CollectStatistics(),  # windows -> Gram matrices per layer and head
    ]


def rewrite_passes() -> list:
    """The part that depends on the objective, key mode and allocation."""
    return [
        CollectFisher(),  # (--value-metric fisher) loss-gradient second moments at each attention output
        ComputeTransforms(),  # Grams -> key-side and value-side transforms
        MeasureSensitivity(),  # (sensitivity allocation) end-to-end KL per layer and side
        AllocateRanks(),  # target rate (given, or the largest within a quality budget) -> ranks per head, rate table
        SequentialStatistics(),  # (--sequential-statistics) Grams and transforms again, on the compressed prefix
        FoldWeights(),  # transforms -> rewritten q/k/v/o weights, spec
        Verify(),  # full-rank equivalence, compiled-rank error
        RefitOutput(),  # (--refit output) o_proj refitted by least squares at the compiled ranks
        DistillAttention(),  # (--distill) attention weights trained against the original's next-token distribution
        BalanceValues(),  # (--balance-values) value latents rescaled per dim, exactly (after o_proj's last change)
        FitKVCodec(),  # (--kv-codec) codec tables fitted on the compiled model's calibration latents
        Emit(),  # checkpoint directory, written atomically
    ]


def default_pipeline() -> list:
    return statistics_passes() + rewrite_passes()


def describe(passes: list) -> list[tuple[str, str]]:
    return [(p.name, p.description) for p in passes]


def prepare_output(out: Path, plan: Plan) -> None:
    """Before any work: finish or remove what interrupted runs left at `out`, then check the location is safe
    (not the source, not holding it, writable, room for the weights)."""
    for note in recover_leftovers(out):
        warnings.warn(note, KVRewriteWarning, stacklevel=2)
    source = local_source_dir(plan.model)
    need = estimated_output_bytes(source, plan.compute_dtype(local_config(source))) if source is not None else None
    check_output_location(out, source=source, overwrite=plan.overwrite, need_bytes=need)


def local_config(source: Path | None) -> dict | None:
    """config.json of a source already on disk, as a dict, for what is decided before it is loaded (`dtype=auto`'s
    dtype); None where it is not on disk or not readable (load_checkpoint reports why, naming the file)."""
    try:
        return json.loads((Path(source) / "config.json").read_text(encoding="utf-8")) if source is not None else None
    except (OSError, ValueError):
        return None


def compile_variants(
    plan: Plan, variants: dict[str, dict], output_root: Path, on_pass=None
) -> tuple[CompileContext, dict[str, CompileContext]]:
    """Collect statistics once, then compile every variant (plan overrides) into output_root/<name>.

    Every variant starts from the shared statistics context: its rewrite-side fields are simply unset there (the
    passes return results instead of writing into a context), so nothing needs resetting between variants."""
    for name in variants:
        prepare_output(Path(output_root) / name, plan)  # before minutes of work, not after
    shared = CompileContext(plan=plan, report={"timings_s": {}})
    for step in statistics_passes():
        if on_pass is not None:
            on_pass("shared", step)
        t0 = time.perf_counter()
        shared = run_pass(shared, step)
        timings = {**shared.report["timings_s"], step.name: round(time.perf_counter() - t0, 3)}
        shared = dataclasses.replace(shared, report={**shared.report, "timings_s": timings})
    compiled = {}
    for name, overrides in variants.items():
        variant_plan = dataclasses.replace(plan, output=Path(output_root) / name, **overrides)
        ctx = dataclasses.replace(shared, plan=variant_plan)
        t0 = time.perf_counter()
        for step in rewrite_passes():
            if on_pass is not None:
                on_pass(name, step)
            ctx = run_pass(ctx, step)
        ctx = dataclasses.replace(ctx, report={**ctx.report, "variant_compile_s": round(time.perf_counter() - t0, 1)})
        compiled[name] = ctx
    return shared, compiled


def _peak_device_memory(device: str) -> dict:
    """The most GPU memory torch held at once so far, on a CUDA compile device (nothing on the CPU)."""
    if not device.startswith("cuda"):
        return {}
    import torch

    return {"peak_device_memory_mib": round(torch.cuda.max_memory_allocated(torch.device(device)) / 2**20, 1)}


def run_pipeline(plan: Plan, passes: list | None = None, on_pass=None) -> CompileContext:
    from kvrewrite.extras import require_package

    for module, feature in plan.optional_packages():  # refused before any work, not at the first import mid-run
        require_package(module, feature)
    # A bad output is refused before minutes of work, not after (Emit checks again: it may appear meanwhile).
    prepare_output(output_dir_for(plan), plan)
    ctx = CompileContext(plan=plan)
    timings = {}
    start = time.perf_counter()
    for step in passes if passes is not None else default_pipeline():
        if on_pass is not None:
            on_pass(step)
        t0 = time.perf_counter()
        ctx = run_pass(ctx, step)
        timings[step.name] = round(time.perf_counter() - t0, 3)
        # Updated after every pass so the report that Emit writes holds everything before it.
        ctx = dataclasses.replace(
            ctx,
            report={
                **ctx.report,
                "timings_s": {**timings, "total": round(time.perf_counter() - start, 3)},
                "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                **_peak_device_memory(plan.device),
            },
        )
    return ctx
