"""Write a tiny random model of a supported family, with a word-level tokenizer and a calibration text file.

    python docs/examples/make_tiny_model.py qwen2 /tmp/tiny-qwen2

Random weights: good for seeing what an adapter does (shapes, cache size, exactness), not for quality.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, OPTConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen3Config

VOCAB = 512
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    max_position_embeddings=512,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
CONFIGS = {
    "qwen2": lambda: Qwen2Config(**SHAPE, intermediate_size=256, num_key_value_heads=2, head_dim=32),
    "qwen3": lambda: Qwen3Config(**SHAPE, intermediate_size=256, num_key_value_heads=2, head_dim=32),
    "opt": lambda: OPTConfig(**SHAPE, ffn_dim=256, word_embed_proj_dim=128),
}


def main(family: str, out: Path) -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[family]()).eval()
    with torch.no_grad():  # biases start at zero: give them values so folding them is actually exercised
        for name, param in model.named_parameters():
            if ".self_attn." in name and name.endswith(".bias"):
                param.normal_(0.0, 0.5)
    model.save_pretrained(out)
    # A byte-level BPE trained on the calibration text itself: transformers picks the tokenizer class from the
    # model type (Qwen2Tokenizer for qwen2), and those load any byte-level BPE tokenizer.json.
    rng = random.Random(0)
    words = " ".join(
        rng.choice(["the", "cache", "keys", "values", "rank", "head", "layer", "token", "model", "small"])
        + str(rng.randrange(100))
        for _ in range(20000)
    )
    (out / "calibration.txt").write_text(words + "\n")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        [words],
        trainers.BpeTrainer(
            vocab_size=VOCAB,
            special_tokens=["<pad>", "<s>", "</s>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>").save_pretrained(
        out
    )
    print(f"wrote {family} ({sum(p.numel() for p in model.parameters()):,} parameters) to {out}")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
