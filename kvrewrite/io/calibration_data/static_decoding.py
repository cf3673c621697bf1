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


def _keep_rows(cache: Any, rows: torch.Tensor, length: int, config: Any) -> Any:
    """A new static cache of the same size holding only ``rows`` of ``cache``'s first ``length`` slots."""
    from transformers import StaticCache

    kept = StaticCache(config=config, max_cache_len=cache.layers[0].max_cache_len)
    slots = torch.arange(length, device=rows.device)
    for index, layer in enumerate(cache.layers):
        keys, values = layer.keys[rows, :, :length], layer.values[rows, :, :length]
        kept.update(keys, values, index, {"cache_position": slots})
    return kept


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
    kept_tokens: Callable[[list[int]], int] | None = None,
    tokens_wanted: int | None = None,
) -> list[DecodedRow]:
    """Generate up to ``max_new_tokens`` for every prompt at once, on ``model``'s device and in its dtype.

    The tokens every prompt starts with (a chat template's system turn) run once, in one
    row, and their keys and values are copied into every row: the prefill then computes only what differs. The
    rest of each prompt is left-padded to one width after that shared prefix; every row gets its own positions
    (counted from its first real token) and an attention mask that hides its padding, so a row computes what it
    would alone. Keys and values go to a transformers ``StaticCache`` allocated once for prompt width +
    max_new_tokens positions and written in place. Stops when every row has produced an end-of-sequence token.
    ``on_step(n)`` gets the rows still generating after each step (for a progress bar).

    Rows that have ended leave the batch (their cache rows are dropped once an eighth of the batch has ended), so
    a step computes only rows still writing. With ``kept_tokens`` (how many tokens the caller keeps of an ended
    row) and ``tokens_wanted``, a row also stops as soon as the rows before it have all ended and keep that many
    tokens between them: the caller would drop its text. Only the rows before that cut are returned.
    """
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer

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
    compactable = all(type(layer) is StaticLayer for layer in cache.layers)
    extra = {"logits_to_keep": 1} if _accepts(model, "logits_to_keep") else {}
    if shared:
        _prefill_shared_prefix(model, prefix, cache, rows, extra)
    # Rows of the batch tensors below are the rows still in the batch; `batch_rows` maps them to prompt indices.
    generated = torch.zeros((rows, max_new_tokens), dtype=torch.long, device=device)  # every prompt's tokens
    written = torch.zeros(rows, dtype=torch.long, device=device)  # per prompt, up to and with its end-of-sequence
    batch_rows = torch.arange(rows, device=device)
    finished = torch.zeros(rows, dtype=torch.bool, device=device)
    step_tensor = torch.zeros(rows, dtype=torch.long, device=device)
    ended_tokens: dict[int, int] = {}  # prompt index -> tokens the caller keeps of it, for the ended rows
    cut = rows  # prompts from `cut` on are not needed
    inputs, length = ids, width  # the first forward fills slots [shared, width)
    eos_set = set(int(e) for e in eos_ids)
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
        token = sample_next_tokens(scores, settings, seed, texts, step_tensor[: len(texts)].fill_(step))
        writing = ~finished  # an ended row still in the batch writes nothing of its own
        live = int(writing.sum())  # rows that produced a real token this step
        generated[batch_rows[writing], step] = token[writing]
        written[batch_rows[writing]] = step + 1
        ended_now = torch.isin(token, eos) & writing
        finished |= ended_now
        if kept_tokens is not None and tokens_wanted is not None and bool(ended_now.any()):
            for r in batch_rows[ended_now].tolist():
                ended_tokens[r] = kept_tokens(generated[r, : int(written[r]) - 1].tolist())
            cut = _rows_needed(ended_tokens, tokens_wanted, cut)
        history[:, length] = token
        if on_step is not None:
            on_step(live)
        needed = ~finished & (batch_rows < cut)
        if not bool(needed.any()):
            break
        mask[:, length] = 1
        length += 1
        positions = positions[:, -1:] + 1
        inputs = token[:, None]
        dropped = len(batch_rows) - int(needed.sum())
        # A copy of the cache per eighth of the batch that ends; full-length layers only (a sliding-window layer
        # keeps its slots in another order).
        if compactable and dropped and dropped * 8 >= len(batch_rows):
            cache = _keep_rows(cache, needed.nonzero().squeeze(-1), length - 1, model.config)
            batch_rows, mask, history = batch_rows[needed], mask[needed], history[needed]
            positions, texts, inputs = positions[needed], texts[needed], inputs[needed]
            finished = finished[needed]
    decoded = []
    for r, count in enumerate(written[:cut].tolist()):
        row = generated[r, :count].tolist()  # a row writes nothing after its end-of-sequence token
        ended = bool(row) and row[-1] in eos_set
        decoded.append(DecodedRow(tokens=row[:-1] if ended else row, ended=ended))
    return decoded


def _rows_needed(ended_tokens: dict[int, int], tokens_wanted: int, cut: int) -> int:
    """The first prompt index whose text the caller drops: every row before it has ended and they keep
    ``tokens_wanted`` tokens between them (``cut`` when that is not yet known)."""
    total = 0
    for r in range(cut):
        if r not in ended_tokens:
            return cut
        total += ended_tokens[r]
        if total >= tokens_wanted:
            return r + 1
    return cut
