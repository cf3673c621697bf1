"""Sequence-parallel prefill of a kvrewrite model: every rank runs the stock model forward on its slice of the
prompt with each compressed attention swapped for the Ulysses exchange (attention.SequenceParallelAttention),
then the cache's packed latents are gathered so decoding proceeds as usual."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from kvrewrite.errors import InvalidArgumentError
from kvrewrite.runtime.kernels.cache_layout import to_storage
from kvrewrite.runtime.sequence_parallel.attention import SequenceParallelAttention
from kvrewrite.runtime.sequence_parallel.collectives import CountingCollectives
from kvrewrite.runtime.sequence_parallel.plan import check_world_size, layer_shares, token_runs

CACHE_ON = ("first", "all", "none")


@dataclass
class PrefillResult:
    next_token_logits: torch.Tensor  # [B, vocab]: the prompt's last position, on every rank
    tokens: tuple[int, int]  # this rank's prompt positions [start, stop)
    logits: torch.Tensor | None  # [B, stop - start, vocab] with all_logits=True, else None
    cache: object | None  # the whole prompt's cache (as a single-process prefill builds it) where cache_on says
    collectives: CountingCollectives  # every collective call with its bytes


@contextmanager
def _swapped_attention(attentions, stand_ins) -> Iterator[None]:
    for attn, stand_in in zip(attentions, stand_ins):
        attn.forward = stand_in.forward  # an instance attribute: nn.Module.__call__ finds it first
    try:
        yield
    finally:
        for attn in attentions:
            attn.__dict__.pop("forward", None)


def prefill(
    model,
    input_ids: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    cache_on: str = "first",
    all_logits: bool = False,
    query_chunk: int = 1024,
) -> PrefillResult:
    """Prefill `input_ids` [B, S] (the whole prompt, the same on every rank) across the ranks of `group`.

    Every rank must call it (a collective). Rank r runs the model on positions token_runs(S, N)[r]; attention
    exchanges the packed latents (two all-to-alls per layer). cache_on: "first" (rank 0 gets the full cache),
    "all" (every rank), "none". Without an initialised process group it runs in this one process.
    """
    if cache_on not in CACHE_ON:
        raise InvalidArgumentError(f"cache_on must be one of {', '.join(CACHE_ON)}, got {cache_on!r}")
    if input_ids.dim() != 2:
        raise InvalidArgumentError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}")
    comm = CountingCollectives(group)
    world, me = comm.world_size, comm.rank
    batch, length = input_ids.shape
    check_world_size(model, world, length)
    attentions = model.compressed_attentions()
    tokens = token_runs(length, world)
    start, stop = tokens[me]
    local_latents: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    stand_ins = [
        SequenceParallelAttention(a, layer_shares(a, world), tokens, comm, local_latents, query_chunk)
        for a in attentions
    ]
    positions = torch.arange(start, stop, device=input_ids.device)[None].expand(batch, -1)
    with torch.no_grad(), _swapped_attention(attentions, stand_ins):
        out = model(
            input_ids=input_ids[:, start:stop],
            position_ids=positions,
            use_cache=False,
            logits_to_keep=0 if all_logits else 1,
        )
    # A copy: broadcast writes into it, and [:, -1] of a batch of one is a view of this rank's own logits.
    last = comm.broadcast("last_logits", out.logits[:, -1].clone(), source=world - 1)
    cache = _gather_cache(model, attentions, local_latents, tokens, comm, cache_on) if cache_on != "none" else None
    return PrefillResult(last, (start, stop), out.logits if all_logits else None, cache, comm)


def _gather_cache(model, attentions, local_latents, tokens, comm: CountingCollectives, cache_on: str):
    """One all-to-all carrying every layer's packed key/value latents of each rank's tokens to the cache holders."""
    world, me = comm.world_size, comm.rank
    holders = {0} if cache_on == "first" else set(range(world))
    batch = next(iter(local_latents.values()))[0].shape[0]
    widths = [(a.layout.key_offsets[-1], a.layout.value_offsets[-1]) for a in attentions]
    per_token = sum(k + v for k, v in widths)
    mine = torch.cat([t.reshape(batch, -1) for i in range(len(attentions)) for t in local_latents[i]], dim=1)
    empty = mine.new_empty(0)
    pieces = [mine if r in holders else empty for r in range(world)]
    received = comm.exchange(
        "cache", None, pieces, [batch * (stop - start) * per_token if me in holders else 0 for start, stop in tokens]
    )
    if me not in holders:
        return None
    # Per source rank: [B, its tokens * per_token] laid out layer by layer (keys then values, token-major).
    per_rank = [piece.view(batch, -1) for piece in received]
    cache = model.make_kv_cache()
    offsets = [0] * world
    for i, (attn, (k_width, v_width)) in enumerate(zip(attentions, widths)):
        keys, values = [], []
        for r, (start, stop) in enumerate(tokens):
            n = stop - start
            keys.append(per_rank[r][:, offsets[r] : offsets[r] + n * k_width].view(batch, n, k_width))
            offsets[r] += n * k_width
            values.append(per_rank[r][:, offsets[r] : offsets[r] + n * v_width].view(batch, n, v_width))
            offsets[r] += n * v_width
        key, value = torch.cat(keys, dim=1), torch.cat(values, dim=1)
        order = attn.cache_order(cache, key.device)
        cache.update(to_storage(key, order), to_storage(value, order), i)
    return cache


def greedy_continue(model, result: PrefillResult, steps: int) -> torch.Tensor:
    """Greedy decoding from a prefill's cache (on a rank that holds it): the next `steps` tokens [B, steps]."""
    if result.cache is None:
        raise InvalidArgumentError("this rank holds no cache (prefill with cache_on='all', or decode on rank 0)")
    generated = [result.next_token_logits.argmax(-1)]
    with torch.no_grad():
        for _ in range(steps - 1):
            out = model(input_ids=generated[-1][:, None], past_key_values=result.cache, use_cache=True)
            generated.append(out.logits[:, -1].argmax(-1))
    return torch.stack(generated, dim=1)
