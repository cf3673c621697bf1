"""Tiny random Llama checkpoints and a fixed-token calibration pass for fast unit tests."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from kvrewrite.compile.passes.allocate_ranks import AllocateRanks
from kvrewrite.compile.passes.balance_values import BalanceValues
from kvrewrite.compile.passes.collect_fisher import CollectFisher
from kvrewrite.compile.passes.collect_statistics import CollectStatistics
from kvrewrite.compile.passes.compute_transforms import ComputeTransforms
from kvrewrite.compile.passes.distill_attention import DistillAttention
from kvrewrite.compile.passes.emit import Emit
from kvrewrite.compile.passes.fit_kv_codec import FitKVCodec
from kvrewrite.compile.passes.fold_weights import FoldWeights
from kvrewrite.compile.passes.load_checkpoint import LoadCheckpoint
from kvrewrite.compile.passes.measure_sensitivity import MeasureSensitivity
from kvrewrite.compile.passes.refit_output import RefitOutput
from kvrewrite.compile.passes.sequential_statistics import SequentialStatistics
from kvrewrite.compile.passes.verify import Verify

VOCAB = 96


def tiny_llama_config(num_kv_heads: int = 2, num_heads: int = 4, head_dim: int = 16, layers: int = 2) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=num_heads * head_dim,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def word_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def save_tiny_llama(directory: Path, seed: int = 0, **config_kwargs) -> Path:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(**config_kwargs)).eval()
    # Random init gives near-uniform attention; sharpen q/k so attention patterns matter in tests.
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
            layer.self_attn.k_proj.weight.mul_(4.0)
    model.save_pretrained(directory)
    word_tokenizer().save_pretrained(directory)
    return directory


def random_windows(n: int = 8, length: int = 48, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n, length), generator=g)


class FixedCalibration:
    name = "build_calibration"
    description = "fixed random token windows (tests)"

    produces = ("calibration_tokens", "report.calibration")

    def __init__(self, tokens: torch.Tensor):
        self.tokens = tokens

    def run(self, ctx) -> dict:
        return {
            "calibration_tokens": self.tokens,
            "report.calibration": {"source": "test", "tokens": int(self.tokens.numel())},
        }


def compile_tiny_modes(root: Path, modes: tuple[str, ...], seed: int = 0, **config_kwargs) -> dict[str, Path]:
    """A tiny random Llama under root/src compiled at p = 0.5 once per key mode into root/<mode>: {mode: directory}."""
    from kvrewrite.compile.passes.pipeline import run_pipeline
    from kvrewrite.compile.plan import Plan

    src = save_tiny_llama(root / "src", seed=seed, **config_kwargs)
    for mode in modes:
        plan = Plan(model=str(src), output=root / mode, progress=False, target_rate=0.5, rope_mode=mode)
        run_pipeline(plan, tiny_pipeline())
    return {mode: root / mode for mode in modes}


def tiny_pipeline(tokens: torch.Tensor | None = None) -> list:
    return [
        LoadCheckpoint(),
        FixedCalibration(random_windows() if tokens is None else tokens),
        CollectStatistics(),
        CollectFisher(),
        ComputeTransforms(),
        MeasureSensitivity(),
        AllocateRanks(),
        SequentialStatistics(),
        FoldWeights(),
        Verify(),
        RefitOutput(),
        DistillAttention(),
        BalanceValues(),
        FitKVCodec(),
        Emit(),
    ]


def one_shot_and_cached_logits(model, tokens: torch.Tensor, prefix: int = 20):
    """Logits of one forward over tokens, and of prefilling `prefix` tokens into a DynamicCache then decoding the rest
    one token at a time; also returns that cache (what the model really stores)."""
    from transformers import DynamicCache

    with torch.no_grad():
        one_shot = model(tokens).logits
        cache = DynamicCache(config=model.config)
        first = model(tokens[:, :prefix], past_key_values=cache, use_cache=True).logits
        steps = [
            model(tokens[:, t : t + 1], past_key_values=cache, use_cache=True).logits
            for t in range(prefix, tokens.shape[1])
        ]
    return one_shot, torch.cat([first, *steps], dim=1), cache
