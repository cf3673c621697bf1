"""`kvrewrite_llama`: the Llama-family compressed model (built like every family in kvrewrite.modeling.families)."""

from kvrewrite.modeling.families import KVRewriteLlamaConfig, KVRewriteLlamaForCausalLM  # noqa: F401

__all__ = ["KVRewriteLlamaConfig", "KVRewriteLlamaForCausalLM"]
