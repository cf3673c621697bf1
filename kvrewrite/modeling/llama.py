"""Stable import path of format-1 checkpoint stubs (written before the families module), which import this module."""

from kvrewrite.runtime.modeling.families import KVRewriteLlamaConfig, KVRewriteLlamaForCausalLM  # noqa: F401

__all__ = ["KVRewriteLlamaConfig", "KVRewriteLlamaForCausalLM"]
