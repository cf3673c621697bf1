"""Quality and KV-cache-size metrics for any Hugging Face causal LM.

Quality is measured against the data (perplexity) and, when a baseline model is given, against the baseline's
next-token distributions (KL divergence and top-1 agreement). Cache size is measured on the tensors a real forward
pass leaves in the cache, so a rewritten attention that stores differently shaped keys/values is measured as it is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from transformers import DynamicCache
from transformers.cache_utils import Cache

from kvrewrite.errors import InvalidArgumentError, KVRewriteError
from kvrewrite.runtime.cache_bytes import cache_tensor_bytes


@dataclass
class QualityStats:
    """Data-quality part of an evaluation (everything but the cache size)."""

    perplexity: float
    baseline_perplexity: float | None  # the baseline's own perplexity on the same windows; None without baseline
    kl_mean: float | None  # mean KL(baseline || model) of next-token distributions, nats/token
    top1_agreement: float | None  # share of positions where the argmax matches the baseline's
    n_tokens: int  # number of predicted tokens evaluated


@dataclass
class EvalResult:
    perplexity: float
    kl_mean: float | None  # mean KL(baseline || model) of next-token distributions, nats/token; None without baseline
    top1_agreement: float | None  # share of positions where argmax matches the baseline's
    kv_bytes_per_token: float  # measured on the real cache tensors
    n_tokens: int  # number of predicted tokens evaluated
    baseline_perplexity: float | None = None
    baseline_kv_bytes_per_token: float | None = None  # measured the same way on the baseline, for ratios

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------------


def _model_device(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


@contextlib.contextmanager
def _eval_mode(*models: torch.nn.Module | None) -> Iterator[None]:
    """Disable dropout for the measurement, then restore each submodule's own training flag."""
    saved = [(m, m.training) for model in models if model is not None for m in model.modules()]
    for model in models:
        if model is not None:
            model.eval()
    try:
        yield
    finally:
        for m, training in saved:
            m.training = training


# Chunk length of the chunked-prefill protocol, used automatically when a model stores a lossy (codec) cache.
CODEC_EVAL_CHUNK = 64


def default_chunk(models: Iterable[torch.nn.Module | None]) -> int | None:
    """CODEC_EVAL_CHUNK if any model codes its cache (a one-shot forward would never read it), else None."""
    return CODEC_EVAL_CHUNK if any(_needs_chunks(m) for m in models if m is not None) else None


def _needs_chunks(model: torch.nn.Module) -> bool:
    # A tiered model's coded or token-adaptive tiers change only when tokens settle after a forward.
    policy = getattr(model, "tier_policy", None)
    return getattr(model, "kv_codec", None) is not None or (policy is not None and policy.changes_between_forwards)


def new_kv_cache(model: torch.nn.Module) -> Cache:
    """The cache the model generates with: its own (e.g. a KV-codec cache) if it makes one, else a DynamicCache."""
    make = getattr(model, "make_kv_cache", None)
    return make() if callable(make) else DynamicCache(config=model.config)


def _logits(model: torch.nn.Module, input_ids: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """One forward without a cache, or (chunk given) a chunked prefill in which every chunk attends to the
    previous chunks through the model's cache: the protocol that makes a lossy cache (a KV codec) count."""
    if chunk is None:
        out = model(input_ids=input_ids, use_cache=False)
        logits = getattr(out, "logits", None)
        return out[0] if logits is None else logits
    cache = new_kv_cache(model)
    pieces = []
    for start in range(0, input_ids.shape[1], chunk):
        out = model(input_ids=input_ids[:, start : start + chunk], past_key_values=cache, use_cache=True)
        pieces.append(out.logits)
    return torch.cat(pieces, dim=1)


def _vocab_limit(model: torch.nn.Module) -> int | None:
    get_emb = getattr(model, "get_input_embeddings", None)
    emb = get_emb() if callable(get_emb) else None
    return getattr(emb, "num_embeddings", None)


def _validate_tokens(token_seqs: torch.Tensor, models: Iterable[torch.nn.Module | None]) -> None:
    if not isinstance(token_seqs, torch.Tensor) or token_seqs.dim() != 2:
        raise InvalidArgumentError(
            "evaluation tokens must be a 2-D LongTensor [n_windows, seq_len]; reshape the token stream into windows"
        )
    if token_seqs.dtype not in (torch.int64, torch.int32):
        raise InvalidArgumentError(f"evaluation tokens must be integer ids, got dtype {token_seqs.dtype}")
    n_seq, seq_len = token_seqs.shape
    if n_seq < 1 or seq_len < 2:
        raise InvalidArgumentError(
            f"evaluation needs at least one window of at least 2 tokens, got shape {tuple(token_seqs.shape)}; "
            "use more evaluation text or a longer window"
        )
    if int(token_seqs.min()) < 0:
        raise InvalidArgumentError("evaluation tokens contain negative ids; check the tokenizer output")
    for model in models:
        limit = _vocab_limit(model) if model is not None else None
        if limit is not None and int(token_seqs.max()) >= limit:
            raise InvalidArgumentError(
                f"token id {int(token_seqs.max())} is outside the model's vocabulary of {limit}; "
                "tokenize the evaluation text with this model's tokenizer"
            )


def _progress(enabled: bool) -> Progress:
    # stderr, so a command that prints JSON results to stdout stays machine-readable.
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        disable=not enabled,
        transient=True,
    )


# ----------------------------------------------------------------------------------------------------------------
# quality
# ----------------------------------------------------------------------------------------------------------------


def perplexity_and_agreement(
    model: torch.nn.Module,
    token_seqs: torch.LongTensor,
    baseline: torch.nn.Module | None = None,
    *,
    batch_size: int = 4,
    progress: bool = True,
    chunk: int | None = None,
) -> QualityStats:
    """Perplexity of `model` on independent windows, plus KL/top-1 against `baseline` computed in the same pass.

    Each row of `token_seqs` ([n_windows, seq_len]) is one window with no context from the others; every position
    but the last predicts the next token, so n_tokens = n_windows * (seq_len - 1). Sums are accumulated in float64;
    log-softmax is taken in float32 regardless of the model dtype.
    """
    stats = perplexity_and_agreement_many(
        {"model": model}, token_seqs, baseline, batch_size=batch_size, progress=progress, chunk=chunk
    )
    return stats["model"]


def perplexity_and_agreement_many(
    models: dict[str, torch.nn.Module],
    token_seqs: torch.LongTensor,
    baseline: torch.nn.Module | None = None,
    *,
    batch_size: int = 4,
    progress: bool = True,
    chunk: int | None = None,
    chunks: Mapping[str, int | None] | None = None,
) -> dict[str, QualityStats]:
    """perplexity_and_agreement for several models in one pass: the baseline runs once per batch, not once per model.

    chunk: evaluate by chunked prefill through each model's cache (see _logits); the baseline uses the same protocol.
        None: default_chunk(), i.e. chunked exactly when some model has a KV codec.
    chunks: per-model chunk lengths that override `chunk` (None: one forward), so that a model whose cache acts
        between forwards is chunked while the others, and the baseline, run whole; `chunk`'s default then looks only
        at the models not named here. Chunking never changes a model whose cache is exact (the original's logits
        are the same either way), so the baseline runs once for all of them.
    """
    overrides = dict(chunks or {})
    unknown = sorted(set(overrides) - set(models))
    if unknown:
        raise InvalidArgumentError(f"chunks names models that are not evaluated: {', '.join(unknown)}")
    if chunk is None:
        chunk = default_chunk((*(m for name, m in models.items() if name not in overrides), baseline))
    for value in (chunk, *overrides.values()):
        if value is not None and value < 1:
            raise InvalidArgumentError(f"chunk must be >= 1, got {value}")
    if batch_size < 1:
        raise InvalidArgumentError(f"batch size must be >= 1, got {batch_size}")
    if not models:
        raise InvalidArgumentError("no models to evaluate")
    _validate_tokens(token_seqs, (*models.values(), baseline))
    n_seq, seq_len = token_seqs.shape
    device = _model_device(next(iter(models.values())))
    base_device = _model_device(baseline) if baseline is not None else device

    def zeros(dtype=torch.float64):
        return torch.zeros((), dtype=dtype, device=device)

    # Running sums stay on the device as float64 tensors so the loop never waits on a .item() sync.
    nll_sum = {name: zeros() for name in models}
    kl_sum = {name: zeros() for name in models}
    agree = {name: zeros(torch.int64) for name in models}
    base_nll_sum = zeros()
    with torch.inference_mode(), _eval_mode(*models.values(), baseline), _progress(progress) as bar:
        task = bar.add_task("evaluating", total=n_seq)
        for start in range(0, n_seq, batch_size):
            batch = token_seqs[start : start + batch_size].long()
            targets = batch[:, 1:].to(device)
            base_logp = None
            if baseline is not None:
                base_logits = _logits(baseline, batch.to(base_device), chunk)[:, :-1].to(device)
                base_logp = torch.log_softmax(base_logits.float(), dim=-1)
                base_nll_sum -= base_logp.gather(-1, targets.unsqueeze(-1)).double().sum()
            for name, model in models.items():
                # Each model runs on its own device; sums live on the first model's device.
                logits = _logits(model, batch.to(_model_device(model)), overrides.get(name, chunk))[:, :-1].to(device)
                if base_logp is not None and base_logp.shape != logits.shape:
                    raise InvalidArgumentError(
                        f"baseline logits have shape {tuple(base_logp.shape)} but {name}'s have "
                        f"{tuple(logits.shape)}; compare models that share a tokenizer and vocabulary"
                    )
                # One window at a time keeps the float32 [seq, vocab] temporaries small for large vocabularies.
                for row in range(logits.shape[0]):
                    logp = torch.log_softmax(logits[row].float(), dim=-1)
                    nll_sum[name] -= logp.gather(-1, targets[row].unsqueeze(-1)).double().sum()
                    if base_logp is None:
                        continue
                    ref = base_logp[row]
                    p = ref.exp()
                    # p * (log p - log q), with 0 where p == 0 so a -inf model logit cannot produce 0 * inf = nan.
                    kl = torch.where(p > 0, p * (ref - logp), torch.zeros_like(p)).sum(-1)
                    kl_sum[name] += kl.double().sum()
                    agree[name] += (ref.argmax(-1) == logp.argmax(-1)).sum()
            bar.advance(task, batch.shape[0])

    n_tokens = n_seq * (seq_len - 1)
    results = {}
    for name in models:
        perplexity = math.exp(nll_sum[name].item() / n_tokens)
        if baseline is None:
            results[name] = QualityStats(perplexity, None, None, None, n_tokens)
        else:
            results[name] = QualityStats(
                perplexity=perplexity,
                baseline_perplexity=math.exp(base_nll_sum.item() / n_tokens),
                kl_mean=kl_sum[name].item() / n_tokens,
                top1_agreement=agree[name].item() / n_tokens,
                n_tokens=n_tokens,
            )
    return results


# ----------------------------------------------------------------------------------------------------------------
# cache size
# ----------------------------------------------------------------------------------------------------------------


def continuation_nll(
    model: torch.nn.Module, windows: torch.Tensor, context: int, make_cache, chunk: int | None = None, prefill=None
) -> tuple[float, int, float]:
    """Summed NLL of each window's tokens after `context`, their count, and cache bytes held per token (after the
    window, mean over windows): the window is fed through `make_cache()`'s cache `chunk` tokens at a time (one
    forward without), so a cache that codes or evicts between forwards is read as decoding would read it.

    prefill(model, cache, ids [1, context]) -> the last context position's logits [1, vocab]: how the context goes
    in (default: fed like the rest)."""
    total, count, held = 0.0, 0, []
    for window in windows:
        ids = window[None]
        cache = make_cache()
        step = chunk or ids.shape[1]
        with torch.no_grad():
            pieces, first = [], 0
            if prefill is not None:
                pieces.append(prefill(model, cache, ids[:, :context])[:, None])
                first = context
            pieces += [
                model(ids[:, s : s + step], past_key_values=cache, use_cache=True).logits
                for s in range(first, ids.shape[1], step)
            ]
            logits = torch.cat(pieces, dim=1)[0, (context - 1 if prefill is None else 0) : -1].float()
        targets = ids[0, context:]
        total += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
        count += targets.numel()
        held.append(cache_tensor_bytes(cache) / ids.shape[1])
    return total, count, sum(held) / len(held)


def kv_cache_bytes_per_token(model: torch.nn.Module, seq_len: int = 256, *, batch_size: int = 1) -> float:
    """Cache bytes per token, measured on the tensors left in a fresh cache after one forward pass.

    The cache is the one the model generates with (new_kv_cache): a codec cache holds packed codes, scales,
    sparse parts and its full-precision residual window, all of which are counted.

    Uses random token ids (fixed seed); the cache layout does not depend on the token values.
    """
    if seq_len < 1 or batch_size < 1:
        raise InvalidArgumentError(f"seq_len and batch_size must be >= 1, got {seq_len} and {batch_size}")
    config = model.config
    text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    vocab = _vocab_limit(model) or getattr(text_config, "vocab_size", None)
    if not vocab:
        raise InvalidArgumentError("cannot tell the model's vocabulary size; its config has no vocab_size")
    device = _model_device(model)
    tokens = torch.randint(0, int(vocab), (batch_size, seq_len), generator=torch.Generator().manual_seed(0))
    cache = new_kv_cache(model)
    with torch.inference_mode(), _eval_mode(model):
        out = model(input_ids=tokens.to(device), use_cache=True, past_key_values=cache)
    returned = getattr(out, "past_key_values", None)
    measured = returned if isinstance(returned, Cache) else cache
    total = cache_tensor_bytes(measured)
    if total == 0:
        raise KVRewriteError(
            f"{type(model).__name__} left no tensors in the KV cache after a forward with use_cache=True; "
            "check that its attention calls past_key_values.update(...)"
        )
    return total / (batch_size * seq_len)


def _config_dtype(config: Any) -> torch.dtype | None:
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."), None)
    return dtype if isinstance(dtype, torch.dtype) else None


def kv_cache_bytes_per_token_formula(config: Any, dtype: torch.dtype | None = None) -> float:
    """Bytes per token of the stock full-attention layout: 2 (K and V) * layers * kv_heads * head_dim * dtype size.

    `dtype` defaults to the config's dtype, else float32. Ignores sliding windows (it is the per-token cost of
    a full-attention layer).
    """
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    n_heads = int(text.num_attention_heads)
    n_kv = int(getattr(text, "num_key_value_heads", None) or n_heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // n_heads)
    dtype = dtype or _config_dtype(text) or torch.float32
    return float(2 * int(text.num_hidden_layers) * n_kv * head_dim * dtype.itemsize)


# ----------------------------------------------------------------------------------------------------------------
# everything together
# ----------------------------------------------------------------------------------------------------------------


def evaluate(
    model: torch.nn.Module,
    token_seqs: torch.LongTensor,
    baseline: torch.nn.Module | None = None,
    *,
    batch_size: int = 4,
    progress: bool = True,
    chunk: int | None = None,
) -> EvalResult:
    """Perplexity (and KL/top-1 against `baseline`) on `token_seqs`, plus the measured KV-cache bytes per token.

    The cache is measured with one window of the evaluation length, so sliding-window caches are sized as used.
    """
    return evaluate_many({"model": model}, token_seqs, baseline, batch_size=batch_size, progress=progress, chunk=chunk)[
        "model"
    ]


def evaluate_many(
    models: dict[str, torch.nn.Module],
    token_seqs: torch.LongTensor,
    baseline: torch.nn.Module | None = None,
    *,
    batch_size: int = 4,
    progress: bool = True,
    chunk: int | None = None,
    chunks: Mapping[str, int | None] | None = None,
) -> dict[str, EvalResult]:
    """evaluate() for several models sharing one pass over the data (and one baseline forward per batch);
    `chunk` and `chunks` as in perplexity_and_agreement_many."""
    stats = perplexity_and_agreement_many(
        models, token_seqs, baseline, batch_size=batch_size, progress=progress, chunk=chunk, chunks=chunks
    )
    seq_len = int(token_seqs.shape[1])
    base_bytes = kv_cache_bytes_per_token(baseline, seq_len) if baseline is not None else None
    return {
        name: EvalResult(
            perplexity=st.perplexity,
            kl_mean=st.kl_mean,
            top1_agreement=st.top1_agreement,
            kv_bytes_per_token=kv_cache_bytes_per_token(models[name], seq_len),
            n_tokens=st.n_tokens,
            baseline_perplexity=st.baseline_perplexity,
            baseline_kv_bytes_per_token=base_bytes,
        )
        for name, st in stats.items()
    }
