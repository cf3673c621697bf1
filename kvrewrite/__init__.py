"""kvrewrite: KV-cache compressing compiler for Hugging Face causal LMs."""
