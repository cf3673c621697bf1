"""Building the compressed config and model from an original config, a spec and folded weights."""

from __future__ import annotations

import json

import torch

from kvrewrite.modeling.llama import KVRewriteLlamaConfig, KVRewriteLlamaForCausalLM
from kvrewrite.spec import CompressionSpec

# Keys of the original config that must not be carried over.
_DROP_KEYS = ("model_type", "architectures", "transformers_version", "quantization_config", "_name_or_path", "auto_map", "dtype", "torch_dtype")

AUTO_MAP = {
    "AutoConfig": "modeling_kvrewrite.KVRewriteLlamaConfig",
    "AutoModelForCausalLM": "modeling_kvrewrite.KVRewriteLlamaForCausalLM",
}


def compressed_config(original_config, spec: CompressionSpec, dtype: torch.dtype = torch.float32) -> KVRewriteLlamaConfig:
    data = json.loads(original_config.to_json_string())
    for key in _DROP_KEYS:
        data.pop(key, None)
    config = KVRewriteLlamaConfig(**data, kvrewrite=spec.to_dict())
    config.architectures = ["KVRewriteLlamaForCausalLM"]
    config.auto_map = dict(AUTO_MAP)
    config.dtype = dtype
    return config
