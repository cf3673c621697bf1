"""`kvrewrite_llama`: the Llama-family compressed model (built like every family in kvrewrite.modeling.families).

Kept for checkpoints written before the families module: their `modeling_kvrewrite.py` stub (auto_map, format
version 1, still loadable) imports `kvrewrite.modeling.llama`, so removing this module would break them.
"""

from kvrewrite.modeling.families import KVRewriteLlamaConfig, KVRewriteLlamaForCausalLM  # noqa: F401

__all__ = ["KVRewriteLlamaConfig", "KVRewriteLlamaForCausalLM"]
