"""A randomly initialised Llama of any size, written to safetensors shards one tensor at a time.

The model is never materialised: its shape comes from a meta-device skeleton, and each tensor is drawn,
written into the current shard and dropped (peak memory: one shard). Used by the layer-streaming tests
(tiny) and by benchmarks/big_model_memory.py (3B).
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, PreTrainedTokenizerFast

from kvrewrite.compile.layer_streaming import empty_model
from kvrewrite.io.checkpoint_io import ShardWriter

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")


def word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """Whitespace words w3 .. w{vocab_size-1} plus three special tokens."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIAL_TOKENS), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def random_words(n: int, vocab_size: int, seed: int = 0) -> str:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(len(SPECIAL_TOKENS), vocab_size, (n,), generator=g)
    return " ".join(f"w{i}" for i in ids.tolist())


def write_random_llama(
    directory: Path,
    config: LlamaConfig,
    *,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_size: int = 2 * 10**9,
    seed: int = 0,
    std: float = 0.02,
    qk_scale: float = 4.0,
) -> Path:
    """Write config, tokenizer and random weights (norms 1, linear weights N(0, std^2)) as HF shards.

    q/k weights are scaled by qk_scale so attention is not uniform (random init gives near-flat scores).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    skeleton = empty_model(config)
    names = dict(skeleton.state_dict())
    if config.tie_word_embeddings:
        names.pop("lm_head.weight", None)
    g = torch.Generator().manual_seed(seed)
    writer = ShardWriter(directory, {}, max_shard_size)
    for name, meta in names.items():
        if name.endswith("norm.weight"):
            tensor = torch.ones(meta.shape, dtype=dtype)
        else:
            scale = std * (qk_scale if name.endswith(("q_proj.weight", "k_proj.weight")) else 1.0)
            tensor = (torch.randn(meta.shape, generator=g) * scale).to(dtype)
        writer.add(name, tensor)
        del tensor
    writer.finish()
    config.dtype = dtype
    config.save_pretrained(directory)
    word_tokenizer(config.vocab_size).save_pretrained(directory)
    return directory
