"""Building the compressed config and model from an original config, a spec and folded weights."""

from __future__ import annotations

import json

import torch

from kvrewrite.adapters import adapter_for
from kvrewrite.runtime.modeling.families import COMPRESSED_FAMILIES
from kvrewrite.spec import CompressionSpec

# Keys of the original config that must not be carried over.
_DROP_KEYS = (
    "model_type",
    "architectures",
    "transformers_version",
    "quantization_config",
    "_name_or_path",
    "auto_map",
    "dtype",
    "torch_dtype",
)


def compressed_classes(original_config) -> tuple[type, type]:
    """The (config, model) classes of the compressed family of an original model's config."""
    return COMPRESSED_FAMILIES[adapter_for(original_config).compressed_model_type]


def auto_map(original_config) -> dict[str, str]:
    config_class, model_class = compressed_classes(original_config)
    return {
        "AutoConfig": f"modeling_kvrewrite.{config_class.__name__}",
        "AutoModelForCausalLM": f"modeling_kvrewrite.{model_class.__name__}",
    }


def compressed_config(original_config, spec: CompressionSpec, dtype: torch.dtype = torch.float32):
    config_class, model_class = compressed_classes(original_config)
    data = json.loads(original_config.to_json_string())
    for key in _DROP_KEYS:
        data.pop(key, None)
    config = config_class(**data, kvrewrite=spec.to_dict())
    config.architectures = [model_class.__name__]
    config.auto_map = auto_map(original_config)
    config.dtype = dtype
    return config
