"""Tests for kvrewrite.publish.evaluation on tiny random Llama models (no downloads)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvrewrite.errors import InvalidArgumentError, KVRewriteError
from kvrewrite.publish.evaluation import (
    EvalResult,
    cache_tensor_bytes,
    evaluate,
    kv_cache_bytes_per_token,
    kv_cache_bytes_per_token_formula,
    perplexity_and_agreement,
)

VOCAB = 128


def _config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
    )


def _model(seed: int, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(_config()).to(dtype).eval()


def _tokens(n_seq: int = 5, seq_len: int = 17, seed: int = 123) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n_seq, seq_len), generator=torch.Generator().manual_seed(seed))


def _dense_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(tokens).logits[:, :-1].float()


def test_perplexity_matches_cross_entropy() -> None:
    model = _model(0)
    tokens = _tokens()
    # batch_size 2 over 5 windows also exercises a ragged last batch.
    stats = perplexity_and_agreement(model, tokens, batch_size=2, progress=False)
    logits = _dense_logits(model, tokens)
    ce = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    assert stats.n_tokens == 5 * 16
    assert stats.perplexity == pytest.approx(math.exp(ce.item()), rel=1e-5)
    assert stats.kl_mean is None and stats.top1_agreement is None and stats.baseline_perplexity is None


def test_windows_are_independent() -> None:
    # Each window alone gives the same NLL as inside a batch: no context leaks between windows.
    model = _model(0)
    tokens = _tokens(n_seq=4)
    together = perplexity_and_agreement(model, tokens, batch_size=4, progress=False)
    nll = [math.log(perplexity_and_agreement(model, tokens[i : i + 1], progress=False).perplexity) for i in range(4)]
    assert math.log(together.perplexity) == pytest.approx(sum(nll) / 4, rel=1e-6)


def test_model_against_itself() -> None:
    model = _model(0)
    stats = perplexity_and_agreement(model, _tokens(), baseline=model, batch_size=3, progress=False)
    assert abs(stats.kl_mean) < 1e-6
    assert stats.top1_agreement == 1.0
    assert stats.baseline_perplexity == pytest.approx(stats.perplexity, rel=1e-12)


def test_kl_against_different_model_matches_dense_computation() -> None:
    model, baseline = _model(0), _model(1)
    tokens = _tokens()
    stats = perplexity_and_agreement(model, tokens, baseline=baseline, batch_size=2, progress=False)

    q_logits = _dense_logits(model, tokens).reshape(-1, VOCAB)
    p_logits = _dense_logits(baseline, tokens).reshape(-1, VOCAB)
    kl_dist = torch.distributions.kl_divergence(
        torch.distributions.Categorical(logits=p_logits), torch.distributions.Categorical(logits=q_logits)
    ).mean()
    kl_div = F.kl_div(F.log_softmax(q_logits, -1), F.log_softmax(p_logits, -1), log_target=True, reduction="batchmean")
    top1 = (p_logits.argmax(-1) == q_logits.argmax(-1)).double().mean()
    base_ce = F.cross_entropy(p_logits, tokens[:, 1:].reshape(-1))

    assert stats.kl_mean > 1e-4
    assert stats.kl_mean == pytest.approx(kl_dist.item(), rel=1e-4)
    assert stats.kl_mean == pytest.approx(kl_div.item(), rel=1e-4)
    assert stats.top1_agreement == pytest.approx(top1.item())
    assert stats.baseline_perplexity == pytest.approx(math.exp(base_ce.item()), rel=1e-5)


def test_kl_of_two_peaked_distributions_matches_a_float64_sum() -> None:
    """Random-init models give near-uniform next-token distributions, where KL(p||q) and KL(q||p) almost agree and
    any KL is tiny. Scaling the final norms makes both peaked (entropy far below log V) and different, so the
    reference (a float64 sum written here) is O(1) nats, the two directions differ, and dropping a term shows."""
    model, baseline = _model(0), _model(1)
    with torch.no_grad():
        model.model.norm.weight.mul_(30.0)
        baseline.model.norm.weight.mul_(20.0)
    tokens = _tokens()
    stats = perplexity_and_agreement(model, tokens, baseline=baseline, batch_size=2, progress=False)

    log_q = torch.log_softmax(_dense_logits(model, tokens).double(), -1)
    log_p = torch.log_softmax(_dense_logits(baseline, tokens).double(), -1)
    forward = (log_p.exp() * (log_p - log_q)).sum(-1).mean().item()  # KL(baseline || model), the documented one
    reverse = (log_q.exp() * (log_q - log_p)).sum(-1).mean().item()
    entropy_p = -(log_p.exp() * log_p).sum(-1).mean().item()
    assert entropy_p < 0.7 * math.log(VOCAB) and forward > 1.0  # really peaked, really different
    assert abs(forward / reverse - 1) > 0.05  # the test can tell the direction
    assert stats.kl_mean == pytest.approx(forward, rel=1e-5)


def test_bf16_model_evaluates_in_float32() -> None:
    model = _model(0, torch.bfloat16)
    tokens = _tokens()
    stats = perplexity_and_agreement(model, tokens, progress=False)
    ce = F.cross_entropy(_dense_logits(model, tokens).reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    assert stats.perplexity == pytest.approx(math.exp(ce.item()), rel=1e-5)


def test_progress_bar_runs() -> None:
    stats = perplexity_and_agreement(_model(0), _tokens(n_seq=2), progress=True)
    assert stats.n_tokens == 32


def test_training_mode_is_restored() -> None:
    model = _model(0).train()
    perplexity_and_agreement(model, _tokens(n_seq=1), progress=False)
    assert model.training and all(m.training for m in model.modules())


@pytest.mark.parametrize(
    "tokens",
    [
        torch.zeros(8, dtype=torch.long),  # 1-D
        torch.zeros(2, 1, dtype=torch.long),  # windows too short
        torch.zeros(2, 4, dtype=torch.float32),  # not ids
        torch.full((2, 4), VOCAB, dtype=torch.long),  # out of vocabulary
    ],
)
def test_bad_tokens_raise(tokens: torch.Tensor) -> None:
    with pytest.raises(InvalidArgumentError):
        perplexity_and_agreement(_model(0), tokens, progress=False)


def test_bad_batch_size_raises() -> None:
    with pytest.raises(InvalidArgumentError, match="batch size"):
        perplexity_and_agreement(_model(0), _tokens(), batch_size=0, progress=False)


# ---------------------------------------------------------------------------------------------------------------
# KV cache size
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_bytes_match_formula_on_stock_llama(dtype: torch.dtype) -> None:
    model = _model(0, dtype)
    expected = kv_cache_bytes_per_token_formula(model.config, dtype)
    assert expected == 2 * 2 * 2 * 16 * dtype.itemsize
    assert kv_cache_bytes_per_token(model, seq_len=32) == expected
    assert kv_cache_bytes_per_token(model, seq_len=7, batch_size=3) == expected


def test_formula_uses_config_dtype() -> None:
    config = _config()
    assert kv_cache_bytes_per_token_formula(config) == 2 * 2 * 2 * 16 * 4  # no dtype in config: float32
    config.dtype = torch.bfloat16
    assert kv_cache_bytes_per_token_formula(config) == 2 * 2 * 2 * 16 * 2


class _OddCacheLM(torch.nn.Module):
    """A stand-in for a rewritten model whose attention caches non-stock shapes: K [B,1,S,100], V [B,2,S,48]."""

    def __init__(self) -> None:
        super().__init__()
        self.config = _config()
        self.embed = torch.nn.Embedding(VOCAB, 8)

    def get_input_embeddings(self) -> torch.nn.Embedding:
        return self.embed

    def forward(self, input_ids: torch.Tensor, use_cache: bool = False, past_key_values=None, **_: object):
        b, s = input_ids.shape
        h = self.embed(input_ids)
        for layer_idx in range(self.config.num_hidden_layers):
            keys = h[..., :1].unsqueeze(1).expand(b, 1, s, 100).contiguous()
            values = h[..., :1].unsqueeze(1).expand(b, 2, s, 48).contiguous()
            past_key_values.update(keys, values, layer_idx)
        return SimpleNamespace(logits=h @ self.embed.weight.T, past_key_values=past_key_values)


def test_kv_bytes_measures_non_stock_cache_shapes() -> None:
    model = _OddCacheLM()
    per_token = kv_cache_bytes_per_token(model, seq_len=20, batch_size=2)
    assert per_token == 2 * (1 * 100 + 2 * 48) * 4
    assert per_token != kv_cache_bytes_per_token_formula(model.config)


def test_cache_bytes_count_extra_tensors_and_views_once() -> None:
    cache = DynamicCache(config=_config())
    buf = torch.zeros(1, 2, 10, 32)  # one fused buffer: keys and values are views into it
    layer0, layer1 = cache.layers
    layer0.keys, layer0.values = buf[..., :16], buf[..., 16:]
    layer1.keys = torch.zeros(1, 2, 10, 16)
    layer1.values = layer1.keys  # same tensor twice
    layer1.extra_scales = [torch.zeros(1, 2, 10, dtype=torch.float16)]  # extra state a custom layer might keep
    layer1.step = torch.tensor(10)  # 0-dim bookkeeping: not cache data
    expected = buf.numel() * 4 + layer1.keys.numel() * 4 + 20 * 2
    assert cache_tensor_bytes(cache) == expected


def test_kv_bytes_raises_when_cache_left_empty() -> None:
    class NoCache(_OddCacheLM):
        def forward(self, input_ids: torch.Tensor, **_: object):
            return SimpleNamespace(logits=self.embed(input_ids), past_key_values=None)

    with pytest.raises(KVRewriteError, match="no tensors"):
        kv_cache_bytes_per_token(NoCache(), seq_len=4)


# ---------------------------------------------------------------------------------------------------------------
# evaluate
# ---------------------------------------------------------------------------------------------------------------


def test_evaluate_combines_everything() -> None:
    model, baseline = _model(0), _model(1, torch.bfloat16)
    tokens = _tokens(n_seq=3, seq_len=9)
    result = evaluate(model, tokens, baseline, batch_size=2, progress=False)
    assert isinstance(result, EvalResult)
    stats = perplexity_and_agreement(model, tokens, baseline, progress=False)
    assert result.perplexity == pytest.approx(stats.perplexity, rel=1e-9)
    assert result.kl_mean == pytest.approx(stats.kl_mean, rel=1e-6)
    assert result.kv_bytes_per_token == 512.0
    assert result.baseline_kv_bytes_per_token == 256.0
    assert result.n_tokens == 24
    d = result.as_dict()
    assert set(d) == {
        "perplexity",
        "kl_mean",
        "top1_agreement",
        "kv_bytes_per_token",
        "n_tokens",
        "baseline_perplexity",
        "baseline_kv_bytes_per_token",
    }

    alone = evaluate(model, tokens, progress=False)
    assert alone.kl_mean is None and alone.top1_agreement is None and alone.baseline_kv_bytes_per_token is None


def test_evaluate_many_equals_separate_evaluations() -> None:
    from kvrewrite.publish.evaluation import evaluate, evaluate_many

    base, a, b = _model(0), _model(1), _model(2)
    tokens = _tokens()
    together = evaluate_many({"a": a, "b": b}, tokens, baseline=base, batch_size=2, progress=False)
    for name, model in (("a", a), ("b", b)):
        alone = evaluate(model, tokens, baseline=base, batch_size=3, progress=False)
        got = together[name]
        assert got.perplexity == pytest.approx(alone.perplexity, rel=1e-9)
        assert got.kl_mean == pytest.approx(alone.kl_mean, rel=1e-6)
        assert got.top1_agreement == alone.top1_agreement
        assert got.baseline_perplexity == pytest.approx(alone.baseline_perplexity, rel=1e-9)
        assert got.kv_bytes_per_token == alone.kv_bytes_per_token


class _RecordingLM(torch.nn.Module):
    """A Llama that records the length of every forward's input (what the evaluation fed it)."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        super().__init__()
        self.model, self.config, self.lengths = model, model.config, []

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.get_input_embeddings()

    def forward(self, input_ids: torch.Tensor, **kwargs):
        self.lengths.append(int(input_ids.shape[1]))
        return self.model(input_ids=input_ids, **kwargs)


def test_per_model_chunks_chunk_only_that_model_and_keep_its_numbers() -> None:
    from kvrewrite.publish.evaluation import perplexity_and_agreement_many

    base, a, b = (_RecordingLM(_model(seed)) for seed in (0, 1, 2))
    tokens = _tokens()
    stats = perplexity_and_agreement_many({"a": a, "b": b}, tokens, base, batch_size=5, progress=False, chunks={"b": 4})
    assert base.lengths == [17] and a.lengths == [17]  # whole windows, the baseline once
    assert b.lengths == [4, 4, 4, 4, 1]
    # b's numbers against a dense reference: its chunked prefill through a DynamicCache, scored by hand.
    with torch.no_grad():
        cache = DynamicCache(config=b.config)
        logits = torch.cat(
            [b.model(tokens[:, s : s + 4], past_key_values=cache, use_cache=True).logits for s in range(0, 17, 4)], 1
        )[:, :-1]
        ref = F.log_softmax(base.model(tokens).logits[:, :-1], -1)
    logp = F.log_softmax(logits, -1)
    nll = -logp.gather(-1, tokens[:, 1:, None]).mean()
    assert stats["b"].perplexity == pytest.approx(math.exp(float(nll)), rel=1e-5)
    assert stats["b"].kl_mean == pytest.approx(float((ref.exp() * (ref - logp)).sum(-1).mean()), rel=1e-4, abs=1e-7)
    assert stats["b"].top1_agreement == float((ref.argmax(-1) == logp.argmax(-1)).double().mean())
    # Chunking an exact cache changes nothing: a and b alone, whole, give the same numbers.
    whole = perplexity_and_agreement_many({"a": a, "b": b}, tokens, base, batch_size=5, progress=False)
    assert stats["a"] == whole["a"]
    assert stats["b"].perplexity == pytest.approx(whole["b"].perplexity, rel=1e-5)


@pytest.mark.parametrize("chunks", [{"c": 4}, {"a": 0}])
def test_per_model_chunks_refuse_unknown_models_and_bad_lengths(chunks: dict) -> None:
    from kvrewrite.publish.evaluation import perplexity_and_agreement_many

    with pytest.raises(InvalidArgumentError):
        perplexity_and_agreement_many({"a": _model(1)}, _tokens(), _model(0), progress=False, chunks=chunks)
