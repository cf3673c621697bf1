"""Architecture adapters, registered by model type (one file per family)."""

from kvrewrite.adapters.base import ArchitectureAdapter, AttentionFeatures, AttentionGeometry, Projections
from kvrewrite.adapters.gemma3 import Gemma3Adapter
from kvrewrite.adapters.gpt2 import GPT2Adapter
from kvrewrite.adapters.llama import LlamaAdapter
from kvrewrite.adapters.opt import OPTAdapter
from kvrewrite.adapters.phi3 import Phi3Adapter
from kvrewrite.adapters.qwen2 import Qwen2Adapter
from kvrewrite.adapters.qwen3 import Qwen3Adapter
from kvrewrite.adapters.registry import adapter_for, all_adapters, register_adapter, supported_model_types

for _adapter in (
    LlamaAdapter(),
    Qwen2Adapter(),
    Qwen3Adapter(),
    Phi3Adapter(),
    OPTAdapter(),
    GPT2Adapter(),
    Gemma3Adapter(),
):
    register_adapter(_adapter)

__all__ = [
    "ArchitectureAdapter",
    "AttentionFeatures",
    "AttentionGeometry",
    "Projections",
    "adapter_for",
    "all_adapters",
    "register_adapter",
    "supported_model_types",
]
