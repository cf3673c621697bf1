"""Planted-key probes: does a cache policy still answer a question about one line of a context it had to compress
before the question came? The retrieval half of the budget search (kvrewrite.compile.token_budget).

A probe is a calibration window with four labelled key lines planted at spread depths ("The red pass key is 48213.
Remember it. ..."), then a question naming one label. Perplexity on calibration text cannot see this: a policy
that evicts what the newest queries ignore loses a key line and barely moves the next-token loss.

Each probe is read as greedy decoding reads it: the context through the policy's prefill, the question in one
forward, then the answer one token at a time, teacher-forced. The answer's mean NLL is a smooth measure (a few
probes tell policies apart), and a probe counts as answered exactly when every answer token is the argmax: then, and only
then, greedy decoding writes the key.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from kvrewrite.errors import InvalidArgumentError

LABELS = ("red", "blue", "green", "gold")
# The passkey test's wording (Mohtashami & Jaggi 2023); the frontier's passkey prompts use the same lines.
INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there.\n\n"
)
# Where the asked key sits, probe by probe, and where the other three go (the spread depths furthest from it).
ASKED_DEPTHS = (0.15, 0.4, 0.6, 0.85)
OTHER_DEPTHS = (0.05, 0.3, 0.55, 0.8, 0.95)


@dataclass(frozen=True)
class KeyProbe:
    context_ids: tuple[int, ...]  # intro and filler with the four key lines, prefilled as a context
    question_ids: tuple[int, ...]  # the question naming the asked label, fed in one forward after the context
    answer_ids: tuple[int, ...]  # the asked key, as the model would write it after the question
    depth: float  # where the asked key line sits in the filler


@dataclass(frozen=True)
class KeyRecall:
    """What a cache policy kept of the planted keys, over a set of probes."""

    answer_nll: float  # mean NLL per answer token
    answered: int  # probes whose every answer token is the argmax (greedy decoding writes the key)
    probes: int


def _key_name(label: str | None) -> str:
    return "pass key" if label is None else f"{label} pass key"


def key_line(key: str, label: str | None = None) -> str:
    """The planted line: the key stated twice, named by `label` when several keys share a context."""
    name = _key_name(label)
    return f" The {name} is {key}. Remember it. {key} is the {name}. "


def key_question(label: str | None = None) -> str:
    """The question after the context; the key is the next thing the model writes."""
    name = _key_name(label)
    return f"\n\nWhat is the {name}? The {name} is"


def key_probes(tokenizer: Any, windows: torch.Tensor, seed: int = 0) -> list[KeyProbe]:
    """One probe per calibration window [N, L]: its text as filler, four labelled 5-digit keys planted, one asked;
    each probe is L tokens (context and question). The asked key's depth cycles through ASKED_DEPTHS."""
    if windows.dim() != 2:
        raise InvalidArgumentError(f"windows must be [n, length], got {tuple(windows.shape)}")
    enc = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    rng = random.Random(seed)
    length = windows.shape[1]
    intro = enc(INTRO)
    probes = []
    for i, window in enumerate(windows.tolist()):
        labels = list(LABELS)
        rng.shuffle(labels)
        keys = [str(rng.randrange(10000, 100000)) for _ in labels]
        depth = ASKED_DEPTHS[i % len(ASKED_DEPTHS)]
        others = sorted(OTHER_DEPTHS, key=lambda d, a=depth: -abs(d - a))[: len(labels) - 1]
        lines = [(d, enc(key_line(key, label))) for d, label, key in zip([depth, *others], labels, keys)]
        question = enc(key_question(labels[0]))
        filler_length = length - len(intro) - len(question) - sum(len(ids) for _, ids in lines)
        if filler_length < length // 2:
            raise InvalidArgumentError(
                f"key probes need windows of at least {2 * (length - filler_length)} tokens, got {length}"
            )
        filler = window[:filler_length]
        context, start = list(intro), 0
        for cut, ids in sorted((round(d * filler_length), ids) for d, ids in lines):
            context += filler[start:cut] + ids
            start = cut
        context += filler[start:]
        probes.append(KeyProbe(tuple(context), tuple(question), tuple(enc(" " + keys[0])), depth))
    return probes


# prefill(model, cache, ids [1, S]) -> the last context position's logits; None feeds the context `chunk` at a time.
Prefill = Callable[[Any, Any, torch.Tensor], torch.Tensor]


def key_recall(
    model: Any, probes: list[KeyProbe], make_cache: Callable[[], Any], chunk: int, prefill: Prefill | None = None
) -> KeyRecall:
    """Each probe through a fresh cache: context (by `prefill`, or `chunk` tokens per forward), question, then the
    answer one token at a time (each step reads the cache the previous one left, as greedy decoding does)."""
    if not probes:
        raise InvalidArgumentError("key_recall needs at least one probe")
    device = next(model.parameters()).device
    nll, tokens, answered = 0.0, 0, 0
    for probe in probes:
        cache = make_cache()
        context = torch.tensor([probe.context_ids], device=device)
        with torch.no_grad():
            if prefill is not None:
                prefill(model, cache, context)
            else:
                for s in range(0, context.shape[1], chunk):
                    model(context[:, s : s + chunk], past_key_values=cache, use_cache=True)
            step = torch.tensor([probe.question_ids], device=device)
            correct = True
            for target in probe.answer_ids:
                logits = model(step, past_key_values=cache, use_cache=True).logits[0, -1].float()
                nll += F.cross_entropy(logits[None], torch.tensor([target], device=device)).item()
                correct = correct and int(logits.argmax()) == target
                step = torch.tensor([[target]], device=device)
        tokens += len(probe.answer_ids)
        answered += int(correct)
    return KeyRecall(nll / tokens, answered, len(probes))


__all__ = ["INTRO", "KeyProbe", "KeyRecall", "LABELS", "key_line", "key_probes", "key_question", "key_recall"]
