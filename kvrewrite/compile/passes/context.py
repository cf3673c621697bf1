"""The state that flows through the pass pipeline: a frozen record of what the passes have produced so far.

A pass never assigns to the context: it returns its results (passes/base.py, `run_pass`), and the pipeline makes
the next context with `dataclasses.replace`. Each field below names the pass that produces it; `provenance`
records which pass set it in this run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch

from kvrewrite.adapters.base import ArchitectureAdapter, AttentionGeometry
from kvrewrite.compile.folded_weights import FoldedWeights
from kvrewrite.compile.layer_streaming import SourceModel
from kvrewrite.compile.plan import Plan
from kvrewrite.method.statistics import CalibrationStatistics
from kvrewrite.spec import CompressionSpec


@dataclass
class SharedMemo:
    """Caches, not results: filled on first use and shared by every context derived from one (dataclasses.replace
    keeps the object, so compile_variants' variants share it). Nothing here is a pass's output."""

    # The whole original model in fp32, loaded only where something needs it whole (synthetic calibration text,
    # Fisher gradients, refit, distillation, evaluation baselines); the compile passes themselves stream layers.
    model: Any = None
    # (--rope-mode auto) (objective, mode) -> per-layer probe KL. They depend only on the statistics.
    key_mode_probes: dict = field(default_factory=dict)


@dataclass(frozen=True)
class CompileContext:
    plan: Plan
    # load_checkpoint
    source_dir: Path | None = None
    source_revision: str | None = None
    source_id: str | None = None  # the model as the user named it (Hub id, path, bundled name): the spec's source_model
    source: SourceModel | None = None  # config, lazily read weights, meta-device skeleton
    config: Any = None  # the original model's transformers config
    generation_config: Any = None
    tokenizer: Any = None
    adapter: ArchitectureAdapter | None = None
    geometry: AttentionGeometry | None = None
    key_mode: str | None = None  # resolved against the adapter before any work (compute_transforms refines it)
    # build_calibration
    calibration_tokens: torch.Tensor | None = None
    # calibration windows held back from the statistics (quality budget search only)
    budget_tokens: torch.Tensor | None = None
    # collect_statistics
    statistics: CalibrationStatistics | None = None
    # collect_fisher: per layer [hidden, hidden] right factor on o_proj's output (None: identity)
    output_metric: list | None = None
    # compute_transforms
    transforms: list | None = None  # list[LayerTransforms]
    # measure_sensitivity: (layer, "key"|"value") -> weight on that side's relative error
    sensitivity: dict | None = None
    # measure_sensitivity: (layer, "key"|"value") -> measured (predicted relative error, KL) points
    sensitivity_curves: dict | None = None
    # allocate_ranks
    allocation: Any = None  # RankAllocation
    rank_solver: Any = None  # rate -> RankAllocation with the same items/order
    # the compiled rate: plan.target_rate, or with a quality budget the largest rate within it
    target_rate: float | None = None
    rate_table: dict | None = None  # rate key -> {"key": ranks, "value": ranks}; the spec's rate table
    # fold_weights (refit_output / distill_attention refine the spec, its rate table and the folded weights)
    spec: CompressionSpec | None = None
    folded: FoldedWeights | None = None  # folds one layer at a time, on demand
    # fit_kv_codec: trained codec tables (CSR dictionaries, TaDA bit widths), written to kv_codec.safetensors
    codec_tables: dict = field(default_factory=dict)
    # verify (refit_output / distill_attention re-measure the compiled-rank figures)
    verification: dict = field(default_factory=dict)
    # emit
    output_dir: Path | None = None
    # Sections of compress_report.json: each pass returns its own as "report.<section>" results; the pipeline adds
    # timings. Never mutated in place (every update is a new dict), so contexts may share it.
    report: dict = field(default_factory=dict)
    # field (or "report.<section>") -> the pass that set it; kept by the pipeline (run_pass), read by no pass.
    provenance: Mapping[str, str] = field(default_factory=dict, repr=False)
    memo: SharedMemo = field(default_factory=SharedMemo, repr=False, compare=False)

    def original_model(self):
        if self.memo.model is None:
            from kvrewrite.io.source_model import load_fp32_model

            self.memo.model = load_fp32_model(self.source.directory)
        return self.memo.model


# Fields only the pipeline sets: a pass may not return them.
PIPELINE_FIELDS = ("plan", "report", "provenance", "memo")
