"""Pass 1: resolve the model source, check the architecture is supported, load it in fp32."""

from __future__ import annotations

import json

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from kvrewrite.adapters import adapter_for
from kvrewrite.checkpoint_io import check_safetensors_files
from kvrewrite.errors import CorruptCheckpointError, ModelSourceError
from kvrewrite.layer_streaming import SourceModel
from kvrewrite.passes.context import CompileContext
from kvrewrite.sources import resolve_model_source


class LoadCheckpoint:
    name = "load_checkpoint"
    description = "resolve the model (Hub id, local dir or bundled), check its architecture, open its shards lazily"

    def run(self, ctx: CompileContext) -> None:
        resolved = resolve_model_source(ctx.plan.model, revision=ctx.plan.revision)
        ctx.source_dir, ctx.source_revision = resolved.path, resolved.revision
        config = AutoConfig.from_pretrained(resolved.path)
        # Fail on an unsupported architecture before reading any weight.
        ctx.adapter = adapter_for(config)
        ctx.geometry = ctx.adapter.geometry(config)
        ctx.config = config
        ctx.key_mode = ctx.adapter.resolve_key_mode(config, ctx.plan.rope_mode, ctx.plan.objective)
        # A missing/truncated shard or pickle-only weights fail here, naming the file, before any pass reads.
        check_safetensors_files(resolved.path)
        try:
            # Only the shape of the model is built here; weights are read layer by layer as passes need them.
            ctx.source = SourceModel.open(resolved.path, config, ctx.adapter)
            ctx.tokenizer = AutoTokenizer.from_pretrained(resolved.path)
        except OSError as exc:
            raise ModelSourceError(f"could not load the model from {resolved.path}: {exc}") from exc
        check_every_weight_present(ctx.source)
        try:
            ctx.generation_config = GenerationConfig.from_pretrained(resolved.path)
        except OSError:
            ctx.generation_config = None  # optional file
        ctx.report["source"] = {
            "model": resolved.source_id,
            "revision": resolved.revision,
            "path": str(resolved.path),
            "parameters": ctx.source.num_parameters(),
            "weights_bytes_on_disk": ctx.source.checkpoint.total_bytes(),
        }
        ctx.report["source_config"] = json.loads(config.to_json_string())


def check_every_weight_present(source: SourceModel) -> None:
    """Every weight the config needs must be in the shards (a stock load would fill a missing one randomly)."""
    missing = []
    for name in source.skeleton.state_dict():
        try:
            source.tensor_name(name)
        except CorruptCheckpointError:
            missing.append(name)
    if missing:
        listed = ", ".join(missing[:6]) + (" ..." if len(missing) > 6 else "")
        raise CorruptCheckpointError(
            f"the checkpoint in {source.directory} lacks weights its config needs (missing keys: {listed}); "
            "transformers would fill them with random values. Re-download the model or fix its shards"
        )


def load_fp32_model(path):
    """The original model, for what needs it whole (synthetic calibration text, Fisher gradients, evaluation baselines): safetensors only, and every weight present.

    transformers would fill a missing weight (say a layer's k_proj) with random values and only warn; a compile on
    such a model would be silently wrong, so a missing or mis-shaped weight is an error here.
    """
    check_safetensors_files(path)
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, use_safetensors=True,
                                                       output_loading_info=True)
    problems = {kind: sorted(str(k) for k in info.get(kind) or []) for kind in ("missing_keys", "mismatched_keys")}
    if any(problems.values()):
        listed = "; ".join(f"{kind.replace('_', ' ')}: {', '.join(keys[:6])}{' ...' if len(keys) > 6 else ''}"
                           for kind, keys in problems.items() if keys)
        raise CorruptCheckpointError(
            f"the checkpoint in {path} lacks weights its config needs ({listed}); transformers would fill them with "
            "random values. Re-download the model or fix its shards"
        )
    return model.eval()
