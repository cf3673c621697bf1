"""Pass 1: resolve the model source, check the architecture is supported, load it in fp32."""

from __future__ import annotations

import json

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from kvrewrite.adapters import adapter_for
from kvrewrite.errors import ModelSourceError
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
        try:
            # Only the shape of the model is built here; weights are read layer by layer as passes need them.
            ctx.source = SourceModel.open(resolved.path, config, ctx.adapter)
            ctx.tokenizer = AutoTokenizer.from_pretrained(resolved.path)
        except OSError as exc:
            raise ModelSourceError(f"could not load the model from {resolved.path}: {exc}") from exc
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


def load_fp32_model(path):
    """The whole original model in fp32, for what needs it whole (generation, evaluation baselines)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()
