"""Prefill scored by reconstruction: which context tokens an evicting cache keeps, decided by how much the model
needs each one to repeat the context, before any question is asked (KVzip's idea, over our latent cache).

Re-scored eviction keeps what the newest queries read. Over a long context those are filler queries, so a fact
that only a later question needs (a pass key) is evicted before the question arrives. Here the context is first
held whole (every token in the recent window at full rank); then the model is fed a repeat instruction and the
context again, teacher-forced, and every context token is scored by the most attention any head gave it while the
model reproduced the context. The aim: a token the copy cannot do without (a random number, a name said once)
outscores filler the model can predict or copy from any of its repeats (measured on passkey prompts in
docs/results/frontier.md). The repeat is then cut off the cache,
and each layer settles once: the kept tier keeps its budget of the highest-scored tokens, the rest go to the floor
(or are dropped without one). Later tokens are re-scored by the newest queries as usual.

It costs a second pass over the context at prefill (the repeat reads the held context at full rank), and the
full context is held until it ends; the bytes after it are the policy's.
"""

from __future__ import annotations

import torch

from kvrewrite.errors import InvalidArgumentError
from kvrewrite.runtime.tiers.eviction import EvictingLayer

# The instruction fed between the context and its repeat (KVzip's "repeat the previous context").
REPEAT_INSTRUCTION = "\n\nRepeat the text above exactly:\n"


def _forward(model, ids: torch.Tensor, cache, start: int, keep_logits: int = 1) -> torch.Tensor:
    positions = torch.arange(start, start + ids.shape[1], device=ids.device).unsqueeze(0).expand(ids.shape[0], -1)
    out = model(
        input_ids=ids, past_key_values=cache, position_ids=positions, use_cache=True, logits_to_keep=keep_logits
    )
    return out.logits


def prefill_scored_by_reconstruction(
    model, cache, context_ids: torch.Tensor, repeat_ids: torch.Tensor, chunk: int = 512
) -> torch.Tensor:
    """Prefill `context_ids` [B, S] into an evicting `cache` (a new sequence), keeping the tokens the context's
    reconstruction needs most; returns the last context position's logits [B, vocab].

    repeat_ids [B, R] or [R]: the tokenized REPEAT_INSTRUCTION (or another instruction to repeat the text)."""
    layers = getattr(cache, "layers", None)
    if not layers or not all(isinstance(layer, EvictingLayer) for layer in layers):
        raise InvalidArgumentError(
            "prefill scored by reconstruction needs an evicting cache: load the model with evict={'keep': ...}"
        )
    if context_ids.dim() != 2 or context_ids.shape[1] == 0:
        raise InvalidArgumentError(
            f"context_ids must be [batch, tokens] with tokens > 0, got {tuple(context_ids.shape)}"
        )
    if repeat_ids.dim() == 1:
        repeat_ids = repeat_ids.unsqueeze(0)
    repeat_ids = repeat_ids.to(context_ids.device).expand(context_ids.shape[0], -1)
    n = context_ids.shape[1]
    for layer in layers:
        layer.hold()
    try:
        logits = None
        for start in range(0, n, chunk):
            logits = _forward(model, context_ids[:, start : start + chunk], cache, start)
        for layer in layers:
            layer.collect(n)
        repeat = torch.cat([repeat_ids, context_ids], dim=1)
        for start in range(0, repeat.shape[1], chunk):
            _forward(model, repeat[:, start : start + chunk], cache, n + start)
        cache.crop(n)
        for layer in layers:  # repeated phrases pool their split attention into one copy (pool_repeats)
            layer.pool_repeated_evidence(context_ids)
    finally:
        for layer in layers:
            layer.release()
    return logits[:, -1]


def repeat_instruction_ids(directory) -> torch.Tensor:
    """REPEAT_INSTRUCTION in the checkpoint's own tokenizer (read once, at load)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory), trust_remote_code=False)
    except (OSError, ValueError) as exc:
        raise InvalidArgumentError(
            f"evict= prefill_score='reconstruction' needs the checkpoint's tokenizer to word its repeat instruction; "
            f"none could be read from {directory}: {exc}"
        ) from exc
    return torch.tensor(tokenizer(REPEAT_INSTRUCTION, add_special_tokens=False)["input_ids"], dtype=torch.long)


def prefill_for_generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None):
    """The cache generate() continues from: every prompt token but the last, prefilled and scored by reconstruction."""
    if attention_mask is not None and not bool(attention_mask.all()):
        raise InvalidArgumentError(
            "evict= prefill_score='reconstruction' takes unpadded prompts (one prompt, or prompts of one length)"
        )
    cache = model.make_kv_cache()
    with torch.no_grad():
        prefill_scored_by_reconstruction(model, cache, input_ids[:, :-1], model.repeat_instruction_ids)
    return cache
