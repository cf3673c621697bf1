"""Architecture adapters, registered by model type."""

from kvrewrite.adapters.base import ArchitectureAdapter, AttentionGeometry
from kvrewrite.adapters.llama import LlamaAdapter
from kvrewrite.adapters.registry import adapter_for, register_adapter, supported_model_types

register_adapter(LlamaAdapter())

__all__ = ["ArchitectureAdapter", "AttentionGeometry", "adapter_for", "register_adapter", "supported_model_types"]
