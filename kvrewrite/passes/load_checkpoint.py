"""Pass 1: resolve the model source, check the architecture is supported, load it in fp32."""

from __future__ import annotations

import json

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from kvrewrite.adapters import adapter_for
from kvrewrite.errors import ModelSourceError
from kvrewrite.passes.context import CompileContext
from kvrewrite.sources import resolve_model_source


class LoadCheckpoint:
    name = "load_checkpoint"
    description = "resolve the model (Hub id, local dir or bundled), check its architecture, load it in fp32"

    def run(self, ctx: CompileContext) -> None:
        resolved = resolve_model_source(ctx.plan.model, revision=ctx.plan.revision)
        ctx.source_dir, ctx.source_revision = resolved.path, resolved.revision
        config = AutoConfig.from_pretrained(resolved.path)
        # Fail on an unsupported architecture before reading any weight.
        ctx.adapter = adapter_for(config)
        ctx.geometry = ctx.adapter.geometry(config)
        ctx.key_mode = ctx.adapter.resolve_key_mode(config, ctx.plan.rope_mode, ctx.plan.objective)
        try:
            ctx.model = load_fp32_model(resolved.path)
            ctx.tokenizer = AutoTokenizer.from_pretrained(resolved.path)
        except OSError as exc:
            raise ModelSourceError(f"could not load the model from {resolved.path}: {exc}") from exc
        ctx.report["source"] = {"model": resolved.source_id, "revision": resolved.revision, "path": str(resolved.path)}
        ctx.report["source_config"] = json.loads(config.to_json_string())


def load_fp32_model(path):
    """The original model, as the verify and eval steps use it."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()
