"""The state that flows through the pass pipeline: each pass reads some fields and fills others."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvrewrite.adapters.base import ArchitectureAdapter, AttentionGeometry
from kvrewrite.compile.folded_weights import FoldedWeights
from kvrewrite.compile.layer_streaming import SourceModel
from kvrewrite.compile.plan import Plan
from kvrewrite.spec import CompressionSpec
from kvrewrite.method.statistics import CalibrationStatistics


@dataclass
class CompileContext:
    plan: Plan
    # load_checkpoint
    source_dir: Path | None = None
    source_revision: str | None = None
    source: SourceModel | None = None  # config, lazily read weights, meta-device skeleton
    config: Any = None  # the original model's transformers config
    generation_config: Any = None
    tokenizer: Any = None
    adapter: ArchitectureAdapter | None = None
    geometry: AttentionGeometry | None = None
    key_mode: str | None = None  # resolved against the adapter before any work
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
    # compute_transforms (--rope-mode auto): (objective, mode) -> per-layer probe KL. They depend only on
    # the statistics, so compile_variants' variants share this dict (dataclasses.replace keeps the object).
    key_mode_probes: dict = field(default_factory=dict)
    # measure_sensitivity: (layer, "key"|"value") -> weight on that side's relative error
    sensitivity: dict | None = None
    # measure_sensitivity: (layer, "key"|"value") -> measured (predicted relative error, KL) points
    sensitivity_curves: dict | None = None
    # allocate_ranks
    allocation: Any = None  # RankAllocation
    rank_solver: Any = None  # rate -> RankAllocation with the same items/order
    # the compiled rate: plan.target_rate, or with a quality budget the largest rate within it
    target_rate: float | None = None
    # fold_weights
    spec: CompressionSpec | None = None
    folded: FoldedWeights | None = None  # folds one layer at a time, on demand
    # fit_kv_codec: trained codec tables (CSR dictionaries, TaDA bit widths), written to kv_codec.safetensors
    codec_tables: dict = field(default_factory=dict)
    # verify
    verification: dict = field(default_factory=dict)
    # emit
    output_dir: Path | None = None
    # timings and notes for compress_report.json
    report: dict = field(default_factory=dict)
    # The whole original model in fp32, loaded only where something needs it whole (synthetic calibration
    # text generation, evaluation baselines); the compile passes themselves stream layers.
    model: Any = None

    def original_model(self):
        if self.model is None:
            from kvrewrite.compile.passes.load_checkpoint import load_fp32_model

            self.model = load_fp32_model(self.source.directory)
        return self.model
