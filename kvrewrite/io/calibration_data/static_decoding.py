"""Sampling many texts at once from a causal LM with a preallocated (static) KV cache, on the model's own device.

Each text is defined on its own, whatever batch it runs in: the next token of text ``i`` at step ``t`` is drawn
with random numbers that are a hash of ``(seed, i, t)``, after a repetition penalty over that text's own tokens
(its prompt and what it generated so far; never another row's padding). So a text comes out the same in a batch of
256 rows on a GPU as alone on a CPU (up to the floating-point rounding of the logits), and the batch size is a
speed setting, not part of what the texts are. The random numbers are integer arithmetic on tensors, identical on
every device.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

__all__ = ["SamplingSettings", "DecodedRow", "sample_next_tokens", "decode_batch", "text_uniforms"]

_MASK32 = 0xFFFFFFFF


@dataclass(frozen=True)
class SamplingSettings:
    """How the next token is drawn: temperature, then the nucleus (top_p) searched inside the top_k candidates."""

    temperature: float
    top_p: float
    top_k: int
    repetition_penalty: float


@dataclass(frozen=True)
class DecodedRow:
    """The tokens one row generated, and whether it stopped at an end-of-sequence token (which is not included)."""

    tokens: list[int]
    ended: bool


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x * constant) mod 2^32 for int64 tensors holding 32-bit values, in two 16-bit halves so nothing overflows."""
    low = x * (constant & 0xFFFF)
    high = ((x * (constant >> 16)) & 0xFFFF) << 16
    return (low + high) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Wellons' lowbias32) with good avalanche: every input bit changes half the output bits."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def text_uniforms(seed: int, text_ids: torch.Tensor, steps: torch.Tensor, width: int) -> torch.Tensor:
    """Uniform numbers in (0, 1), ``[rows, width]``: row r's are a hash of (seed, text_ids[r], steps[r], column).

    Pure integer arithmetic, so the same on CPU and CUDA and independent of which other rows are in the batch.
    """
    device = text_ids.device
    base = _mix32(torch.tensor([seed & _MASK32], dtype=torch.int64, device=device))
    base = _mix32(base ^ ((seed >> 32) & _MASK32))
    state = _mix32(base ^ (text_ids.to(torch.int64) & _MASK32))
    state = _mix32(state ^ (steps.to(torch.int64) & _MASK32))
    columns = torch.arange(width, dtype=torch.int64, device=device)
    bits = _mix32(state[:, None] ^ _mix32((columns + 0x9E3779B9) & _MASK32)[None, :])
    # 24 bits: exactly representable in float32; the half step keeps u away from 0 and 1.
    return ((bits >> 8).to(torch.float64) + 0.5) / float(1 << 24)


def sample_next_tokens(
    scores: torch.Tensor, settings: SamplingSettings, seed: int, text_ids: torch.Tensor, steps: torch.Tensor
) -> torch.Tensor:
    """The next token of each row ``[rows]`` from its (already repetition-penalised) logits ``[rows, vocab]``.

    Temperature, then top-k, then the smallest prefix of the top-k whose probability reaches top_p (at least the
    best token), then one draw from what is left by an exponential race: argmax p_j / E_j with E_j = -log u_j is
    a draw with probabilities p_j, and u comes from :func:`text_uniforms` (no torch RNG is touched).
    """
    logits = scores.float() / settings.temperature
    k = min(settings.top_k, logits.shape[-1]) if settings.top_k > 0 else logits.shape[-1]
    values, indices = torch.topk(logits, k, dim=-1)  # sorted, largest first
    probs = torch.softmax(values, dim=-1)
    probs = probs.masked_fill((probs.cumsum(dim=-1) - probs) > settings.top_p, 0.0)
    race = -torch.log(text_uniforms(seed, text_ids.to(scores.device), steps.to(scores.device), k))
    choice = (probs.double() / race).argmax(dim=-1, keepdim=True)
    return indices.gather(-1, choice).squeeze(-1)


def penalise_repeats(scores: torch.Tensor, history: torch.Tensor, penalty: float) -> torch.Tensor:
    """transformers' repetition penalty: the logit of every token in a row's `history` ``[rows, length]`` divided by
    `penalty` if positive, else multiplied (a token repeated in the history is penalised once)."""
    if penalty == 1.0:
        return scores
    picked = scores.gather(1, history)
    return scores.scatter(1, history, torch.where(picked < 0, picked * penalty, picked / penalty))


def _accepts(model: Any, name: str) -> bool:
    return name in inspect.signature(type(model).forward).parameters


def _shared_prefix_length(prompts: Sequence[Sequence[int]]) -> int:
    """How many leading tokens all prompts share, leaving every prompt at least one token of its own to prefill
    (the logits of a row's last prompt token draw its first new token)."""
    first = prompts[0]
    limit = min(len(p) for p in prompts) - 1
    length = 0
    while length < limit and all(p[length] == first[length] for p in prompts):
        length += 1
    return length


def _prefill_shared_prefix(model: Any, prefix: torch.Tensor, cache: Any, rows: int, extra: dict[str, Any]) -> None:
    """Runs ``prefix`` [len] once, in one row, and writes its keys and values into cache slots [0, len) of every row."""
    from transformers import DynamicCache

    slots = torch.arange(len(prefix), device=prefix.device)
    alone = DynamicCache()
    model(
        input_ids=prefix[None],
        attention_mask=torch.ones_like(prefix)[None],
        position_ids=slots[None],
        past_key_values=alone,
        cache_position=slots,
        use_cache=True,
        **extra,
    )
    for index, layer in enumerate(alone.layers):
        keys, values = layer.keys, layer.values
        cache.update(
            keys.expand(rows, *keys.shape[1:]), values.expand(rows, *values.shape[1:]), index, {"cache_position": slots}
        )


def decode_batch(
    model: Any,
    prompts: Sequence[Sequence[int]],
    text_ids: Sequence[int],
    *,
    seed: int,
    settings: SamplingSettings,
    max_new_tokens: int,
    eos_ids: Sequence[int],
    pad_id: int,
    on_step: Callable[[int], None] | None = None,
) -> list[DecodedRow]:
    """Generate up to ``max_new_tokens`` for every prompt at once, on ``model``'s device and in its dtype.

    The tokens every prompt starts with (a chat template's system turn) run once, in one
    row, and their keys and values are copied into every row: the prefill then computes only what differs. The
    rest of each prompt is left-padded to one width after that shared prefix; every row gets its own positions
    (counted from its first real token) and an attention mask that hides its padding, so a row computes what it
    would alone. Keys and values go to a transformers ``StaticCache`` allocated once for prompt width +
    max_new_tokens positions and written in place. Stops when every row has produced an end-of-sequence token.
    ``on_step(n)`` gets the rows still generating after each step (for a progress bar).
    """
    from transformers import StaticCache

    device = next(model.parameters()).device
    rows = len(prompts)
    shared = _shared_prefix_length(prompts)
    width = max(len(p) for p in prompts)  # cache slots of the prompts: the shared prefix, then each row's rest
    total = width + max_new_tokens
    ids = torch.full((rows, width - shared), pad_id, dtype=torch.long)
    mask = torch.zeros((rows, total), dtype=torch.long)
    mask[:, :shared] = 1
    prefix = torch.tensor(list(prompts[0][:shared]), dtype=torch.long)
    # The tokens the repetition penalty looks at: a row's padding repeats its first prompt token, so only the row's
    # own tokens are penalised (a repeat is penalised once).
    history = torch.zeros((rows, total), dtype=torch.long)
    for r, prompt in enumerate(prompts):
        rest = torch.tensor(list(prompt[shared:]), dtype=torch.long)
        ids[r, ids.shape[1] - len(rest) :] = rest
        mask[r, width - len(rest) : width] = 1
        history[r, :width] = prompt[0]
        history[r, width - len(rest) : width] = rest
    history[:, :shared] = prefix
    ids, mask, history, prefix = ids.to(device), mask.to(device), history.to(device), prefix.to(device)
    positions = (mask[:, :width].cumsum(-1) - 1).clamp(min=0)[:, shared:]
    texts = torch.tensor(list(text_ids), dtype=torch.long, device=device)
    eos = torch.tensor(sorted(set(eos_ids)) or [-1], dtype=torch.long, device=device)

    cache = StaticCache(config=model.config, max_cache_len=total)
    extra = {"logits_to_keep": 1} if _accepts(model, "logits_to_keep") else {}
    if shared:
        _prefill_shared_prefix(model, prefix, cache, rows, extra)
    generated = torch.empty((rows, max_new_tokens), dtype=torch.long, device=device)
    finished = torch.zeros(rows, dtype=torch.bool, device=device)
    step_tensor = torch.zeros(rows, dtype=torch.long, device=device)
    inputs, length = ids, width  # the first forward fills slots [shared, width)
    steps_done = 0
    for step in range(max_new_tokens):
        out = model(
            input_ids=inputs,
            attention_mask=mask[:, :length],
            position_ids=positions,
            past_key_values=cache,
            cache_position=torch.arange(length - inputs.shape[1], length, device=device),
            use_cache=True,
            **extra,
        )
        scores = penalise_repeats(out.logits[:, -1, :].float(), history[:, :length], settings.repetition_penalty)
        token = sample_next_tokens(scores, settings, seed, texts, step_tensor.fill_(step))
        generated[:, step] = token
        steps_done = step + 1
        live = int((~finished).sum())  # rows that produced a real token this step
        finished |= torch.isin(token, eos)
        history[:, length] = token
        if on_step is not None:
            on_step(live)
        if bool(finished.all()):
            break
        mask[:, length] = 1
        length += 1
        positions = positions[:, -1:] + 1
        inputs = token[:, None]
    decoded = []
    eos_set = set(int(e) for e in eos_ids)
    for row in generated[:, :steps_done].tolist():
        cut = next((i for i, t in enumerate(row) if t in eos_set), len(row))
        decoded.append(DecodedRow(tokens=row[:cut], ended=cut < len(row)))
    return decoded
