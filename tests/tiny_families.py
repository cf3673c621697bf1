"""Tiny random checkpoints of every supported family, built from the transformers config classes (no downloads)."""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_models import VOCAB, word_tokenizer
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    OPTConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=HEADS * HEAD_DIM,
    num_hidden_layers=2,
    num_attention_heads=HEADS,
    max_position_embeddings=256,
    tie_word_embeddings=True,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
ROPE = dict(intermediate_size=96, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM)

TINY_CONFIGS = {
    "llama": lambda: LlamaConfig(**COMMON, **ROPE, attention_bias=True),
    "mistral": lambda: MistralConfig(**COMMON, **ROPE, sliding_window=None),
    "qwen2": lambda: Qwen2Config(**COMMON, **ROPE),
    # Layer 1 attends over a 12-token window (Qwen2's max_window_layers rule); tests use longer sequences.
    "qwen2-sliding": lambda: Qwen2Config(
        **COMMON, **ROPE, use_sliding_window=True, sliding_window=12, max_window_layers=1
    ),
    "qwen3": lambda: Qwen3Config(**COMMON, **ROPE),
    "phi3": lambda: Phi3Config(**COMMON, **ROPE),
    # One sliding (12-token window, its own RoPE table) and one full-attention layer; score scale 1/sqrt(24).
    "gemma3": lambda: Gemma3TextConfig(
        **COMMON,
        **ROPE,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=12,
        query_pre_attn_scalar=24,
    ),
    "opt": lambda: OPTConfig(**COMMON, ffn_dim=96, word_embed_proj_dim=HEADS * HEAD_DIM, dropout=0.0),
    "gpt2": lambda: GPT2Config(
        vocab_size=VOCAB,
        n_embd=HEADS * HEAD_DIM,
        n_layer=2,
        n_head=HEADS,
        n_positions=256,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    ),
}


def save_tiny_family(directory: Path, family: str, seed: int = 0) -> Path:
    """A random model of `family` with sharpened q/k and random (non-zero) biases and norm weights."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(TINY_CONFIGS[family]()).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".self_attn." not in name and ".attn." not in name:
                continue
            if name.endswith("c_attn.weight"):  # GPT-2 Conv1D [in, q | k | v]
                param[:, : 2 * HEADS * HEAD_DIM].mul_(4.0)
            elif name.endswith("c_attn.bias"):
                param.copy_(torch.randn_like(param) * 0.5)
            # Random init gives near-uniform attention; sharpen q/k so attention patterns matter in tests.
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(4.0)
            elif name.endswith("qkv_proj.weight"):
                param[: (HEADS + KV_HEADS) * HEAD_DIM].mul_(4.0)  # the q and k rows of [q; k; v]
            elif name.endswith(".bias"):
                param.copy_(torch.randn_like(param) * 0.5)  # biases init to zero: make them matter
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                param.copy_(1.0 + 0.5 * torch.randn_like(param))
    model.save_pretrained(directory)
    word_tokenizer().save_pretrained(directory)
    return directory
