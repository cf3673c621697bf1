"""The protocols: continuation perplexity and passkey retrieval, run through a method's own cache.

Every forward passes logical ``position_ids`` and lets transformers derive ``cache_position`` from the cache's
length, as kvpress's pipeline does: after a press evicts tokens the cache is shorter than the text, RoPE must still
see the true positions while the causal mask follows the cache.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .cache_bytes import cache_bytes
from .inputs import PasskeyPrompt
from .methods import Method


@dataclass
class WindowScore:
    nll_sum: float  # summed negative log-likelihood of the scored continuation tokens
    n_scored: int
    bytes_held: int  # cache bytes at the end of the window
    tokens: int  # tokens fed through the cache


def _forward(model: Any, ids: torch.Tensor, cache: Any, start: int, keep_logits: int | None = None) -> tuple:
    positions = torch.arange(start, start + ids.shape[1]).unsqueeze(0)
    extra = {"logits_to_keep": keep_logits} if keep_logits else {}
    out = model(input_ids=ids, past_key_values=cache, position_ids=positions, use_cache=True, **extra)
    return out.logits, out.past_key_values


def _prefill(model: Any, method: Method, ids: torch.Tensor, cache: Any) -> tuple[torch.Tensor, Any]:
    """Feeds the context; returns the last position's logits and the cache."""
    if method.prefill is not None:
        return method.prefill(model, ids, cache)
    step = method.prefill_chunk or ids.shape[1]
    logits = None
    for start in range(0, ids.shape[1], step):
        logits, cache = _forward(model, ids[:, start : start + step], cache, start, keep_logits=1)
    return logits[:, -1], cache


def continuation_window(model: Any, method: Method, window: torch.Tensor, n_ctx: int, chunk: int) -> WindowScore:
    """Prefill ``window[:n_ctx]``, then feed the rest ``chunk`` tokens at a time and score every next token."""
    ids = window.unsqueeze(0)
    n = ids.shape[1]
    nll, scored = 0.0, 0
    with torch.inference_mode(), method.enter(model):
        last, cache = _prefill(model, method, ids[:, :n_ctx], method.new_cache(model))
        nll += F.cross_entropy(last.float(), ids[:, n_ctx]).item()
        scored += 1
        for start in range(n_ctx, n, chunk):
            piece = ids[:, start : start + chunk]
            logits, cache = _forward(model, piece, cache, start)
            targets = ids[0, start + 1 : start + 1 + piece.shape[1]]
            logits = logits[0, : targets.shape[0]].float()
            nll += F.cross_entropy(logits, targets, reduction="sum").item()
            scored += targets.shape[0]
        held = cache_bytes(cache)
    return WindowScore(nll, scored, held, n)


def perplexity(scores: list[WindowScore]) -> float:
    return math.exp(sum(s.nll_sum for s in scores) / sum(s.n_scored for s in scores))


_KEY = re.compile(r"\d{5}")


def passkey(
    model: Any, tokenizer: Any, method: Method, prompt: PasskeyPrompt, max_new_tokens: int = 8
) -> tuple[str, int, int]:
    """Greedy answer to one passkey prompt; returns (answer text, cache bytes at the end, tokens fed)."""
    context = torch.tensor([prompt.context_ids])
    question = torch.tensor([prompt.question_ids])
    generated: list[int] = []
    with torch.inference_mode(), method.enter(model):
        _, cache = _prefill(model, method, context, method.new_cache(model))
        pos = context.shape[1]
        logits, cache = _forward(model, question, cache, pos, keep_logits=1)
        pos += question.shape[1]
        for _ in range(max_new_tokens):
            token = int(logits[0, -1].argmax())
            generated.append(token)
            if len(generated) == max_new_tokens:
                break
            logits, cache = _forward(model, torch.tensor([[token]]), cache, pos)
            pos += 1
        held = cache_bytes(cache)
    return tokenizer.decode(generated, skip_special_tokens=True), held, pos


def passkey_correct(answer: str, key: str) -> bool:
    """Exact match: the first 5-digit number in the answer is the key."""
    found = _KEY.search(answer)
    return found is not None and found.group(0) == key
