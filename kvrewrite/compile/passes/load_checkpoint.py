"""Pass 1: resolve the model source, check the architecture is supported, load it in fp32."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoConfig, GenerationConfig

from kvrewrite.adapters import adapter_for
from kvrewrite.compile.layer_streaming import SourceModel
from kvrewrite.compile.passes.context import CompileContext
from kvrewrite.errors import CorruptCheckpointError, ModelSourceError
from kvrewrite.io.checkpoint_io import check_safetensors_files
from kvrewrite.io.output_safety import check_output_location
from kvrewrite.io.source_validation import (
    check_finite_weights,
    check_head_arithmetic,
    check_tensor_shapes,
    read_source_config,
    refuse_custom_code,
)
from kvrewrite.io.sources import resolve_model_source
from kvrewrite.io.tokenizer_loading import load_tokenizer
from kvrewrite.key_modes import resolve_key_mode


class LoadCheckpoint:
    name = "load_checkpoint"
    description = "resolve the model (Hub id, local dir or bundled), check its architecture, open its shards lazily"

    produces = (
        "source_dir",
        "source_revision",
        "source_id",
        "adapter",
        "geometry",
        "config",
        "key_mode",
        "source",
        "tokenizer",
        "generation_config",
        "report.source",
        "report.source_config",
    )

    def run(self, ctx: CompileContext) -> dict:
        resolved = resolve_model_source(ctx.plan.model, revision=ctx.plan.revision)
        if ctx.plan.output is not None:
            # A Hub source's directory is known only now: the output must still not be it, or hold it.
            check_output_location(ctx.plan.output, source=resolved.path, overwrite=ctx.plan.overwrite)
        # Config and code checks first, so a bad or unsupported model fails before any weight is opened.
        read_source_config(resolved.path)
        refuse_custom_code(resolved.path)
        config = load_config(resolved.path)
        check_head_arithmetic(config, resolved.path / "config.json")
        # Fail on an unsupported architecture before reading any weight.
        adapter = adapter_for(config)
        geometry = adapter.geometry(config)
        key_mode = resolve_key_mode(adapter, config, ctx.plan.rope_mode, ctx.plan.objective)
        # A missing/truncated shard or pickle-only weights fail here, naming the file, before any pass reads.
        check_safetensors_files(resolved.path)
        try:
            # Only the shape of the model is built here; weights are read layer by layer as passes need them.
            source = SourceModel.open(resolved.path, config, adapter)
            tokenizer = load_tokenizer(resolved.path)
        except (OSError, ValueError) as exc:
            raise ModelSourceError(f"could not load the model from {resolved.path}: {exc}") from exc
        check_every_weight_present(source)
        check_tensor_shapes(source)
        check_finite_weights(source)
        try:
            generation_config = GenerationConfig.from_pretrained(resolved.path, trust_remote_code=False)
        except (OSError, ValueError):
            generation_config = None  # optional file
        return {
            "source_dir": resolved.path,
            "source_revision": resolved.revision,
            "source_id": resolved.source_id,
            "adapter": adapter,
            "geometry": geometry,
            "config": config,
            "key_mode": key_mode,
            "source": source,
            "tokenizer": tokenizer,
            "generation_config": generation_config,
            "report.source": {
                "model": resolved.source_id,
                "revision": resolved.revision,
                "path": str(resolved.path),
                "parameters": source.num_parameters(),
                "weights_bytes_on_disk": source.checkpoint.total_bytes(),
            },
            "report.source_config": json.loads(config.to_json_string()),
        }


def load_config(path: Path):
    """The source's transformers config, built-in classes only (no code from the model directory ever runs)."""
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise ModelSourceError(f"{path / 'config.json'} cannot be loaded by transformers: {exc}") from None


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
