"""Checks on a source model before any pass reads it: its config, whether it needs custom code, the shape and the
values of every tensor. Each failure names the file (and the tensor) instead of crashing minutes later."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from safetensors import safe_open

from kvrewrite.errors import CorruptCheckpointError, KVRewriteWarning, ModelSourceError, UnsupportedModelError

# Buffers some older checkpoints store although no model reads them.
_HARMLESS_EXTRA_SUFFIXES = ("rotary_emb.inv_freq", "attn.bias", "attn.masked_bias")


def read_source_config(directory: Path) -> dict:
    """config.json as a dict: valid JSON, a supported model_type, and not an already compressed checkpoint."""
    from kvrewrite.adapters.registry import supported_model_types

    path = Path(directory) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ModelSourceError(f"{path} is not UTF-8 text ({exc}); re-download the model") from None
    except ValueError as exc:
        raise ModelSourceError(f"{path} is not valid JSON ({exc}); re-download the model or fix the file") from None
    if not isinstance(config, dict):
        raise ModelSourceError(f"{path} holds a JSON {type(config).__name__}, not an object; re-download the model")
    if "kvrewrite" in config:
        table = [f"{float(r):g}" for r in (config["kvrewrite"].get("rate_table") or {})]
        rates = (
            ", ".join(table) if len(table) <= 6 else f"{table[0]} to {table[-1]}, {len(table)} rates"
        ) or "its compiled rate"
        raise UnsupportedModelError(
            f"{directory} is already a kvrewrite checkpoint (compressed from "
            f"{config['kvrewrite'].get('source_model', 'another model')}); compressing it again is not supported. "
            f"It serves other rates without recompiling: kvrewrite.load({str(directory)!r}, rate=...) with a rate "
            f"of its table ({rates}); to compile differently, compress the original model"
        )
    model_type = config.get("model_type")
    if model_type not in supported_model_types():
        what = f"model type {model_type!r}" if model_type else "no model_type"
        raise UnsupportedModelError(
            f"{path} has {what}, which kvrewrite does not support; supported model types: "
            f"{', '.join(supported_model_types())} (docs/adapters.md)"
        )
    return config


def refuse_custom_code(directory: Path) -> None:
    """Refuse a source whose tokenizer exists only as code shipped with the model.

    kvrewrite passes trust_remote_code=False everywhere, so such code never runs; this turns transformers'
    refusal deep inside a pass into a message up front. A config auto_map is harmless here: every supported
    model_type has a built-in transformers class, which is what gets loaded.
    """
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    path = Path(directory) / "tokenizer_config.json"
    if not path.is_file():
        return
    try:
        tok_config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ModelSourceError(f"{path} is not valid JSON ({exc}); re-download the model or fix the file") from None
    if not isinstance(tok_config, dict) or "auto_map" not in tok_config:
        return
    name = tok_config.get("tokenizer_class")
    if not name or tokenizer_class_from_name(str(name)) is None:
        raise ModelSourceError(
            f"{path} asks for custom tokenizer code ({name or 'no built-in tokenizer_class'}, auto_map "
            f"{tok_config['auto_map']}); kvrewrite never runs code shipped with a model. Use a revision with a "
            "built-in tokenizer class, or save the tokenizer as tokenizer.json"
        )


def check_head_arithmetic(config, path: Path) -> None:
    """Head counts that the attention can actually be built from (else a reshape fails deep in a pass)."""
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if not isinstance(heads, int) or heads <= 0:
        raise ModelSourceError(f"{path}: num_attention_heads is {heads!r}; it must be a positive integer")
    if not isinstance(kv_heads, int) or kv_heads <= 0 or heads % kv_heads:
        raise ModelSourceError(
            f"{path}: num_key_value_heads ({kv_heads!r}) must be a positive integer that divides "
            f"num_attention_heads ({heads}); fix config.json"
        )


def check_tensor_shapes(source) -> None:
    """Every stored tensor has the shape config.json implies (naming file and tensor), and no tensor is unused."""
    expected = {name: tuple(t.shape) for name, t in source.skeleton.state_dict().items()}
    stored_for = {}
    for name in expected:
        stored_for.setdefault(source.tensor_name(name), name)
    weight_map = source.checkpoint.weight_map
    by_file: dict[str, list[str]] = {}
    for stored in stored_for:
        by_file.setdefault(weight_map[stored], []).append(stored)
    for filename, names in sorted(by_file.items()):
        path = source.directory / filename
        with safe_open(str(path), framework="pt") as f:
            for stored in names:
                got = tuple(f.get_slice(stored).get_shape())
                want = expected[stored_for[stored]]
                if got != want:
                    raise CorruptCheckpointError(
                        f"{path}: tensor {stored!r} has shape {list(got)} but {source.directory / 'config.json'} "
                        f"needs {list(want)}; the weights do not belong to this config. Re-download the model "
                        "or fix config.json"
                    )
    extra = sorted(n for n in weight_map if n not in stored_for and not n.endswith(_HARMLESS_EXTRA_SUFFIXES))
    if extra:
        listed = ", ".join(f"{n} ({weight_map[n]})" for n in extra[:6]) + (" ..." if len(extra) > 6 else "")
        warnings.warn(
            f"{source.directory} has {len(extra)} tensor(s) that config.json does not use, ignored: {listed}",
            KVRewriteWarning,
            stacklevel=2,
        )


def check_finite_weights(source) -> None:
    """No NaN or Inf in any weight (they would surface as a failed eigendecomposition minutes later)."""
    weight_map = source.checkpoint.weight_map
    by_file: dict[str, list[str]] = {}
    for stored in sorted({source.tensor_name(n) for n in source.skeleton.state_dict()}):
        by_file.setdefault(weight_map[stored], []).append(stored)
    for filename, names in sorted(by_file.items()):
        with safe_open(str(source.directory / filename), framework="pt") as f:
            for stored in names:  # one tensor at a time: peak memory is the largest tensor, not the model
                tensor = f.get_tensor(stored)
                bad = int((~torch.isfinite(tensor)).sum()) if tensor.is_floating_point() else 0
                if bad:
                    raise CorruptCheckpointError(
                        f"{source.directory / filename}: tensor {stored!r} has {bad} non-finite value(s) (NaN or Inf) "
                        f"of {tensor.numel()}; the weights are damaged. Re-download the model"
                    )
