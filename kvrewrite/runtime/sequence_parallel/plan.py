"""Which rank attends for which heads, and which packed columns each rank must receive (checked before any work).

Query heads go to ranks in contiguous, balanced runs (9 heads over 4 ranks: 3, 2, 2, 2). When the world size divides
the KV head count this is exactly a split by KV groups; otherwise a KV head whose group straddles two ranks is sent
to both. Because heads are contiguous and packed in head order, every rank's share of the packed query, key and
value latents is one contiguous column range of each: the payload is sliced, never re-expanded or padded.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvrewrite.errors import InvalidArgumentError, UnsupportedModelError


@dataclass(frozen=True)
class RankShare:
    """One rank's heads in one layer and the column ranges [start, stop) of the packed tensors it receives."""

    heads: tuple[int, int]  # query heads [first, stop)
    kv_heads: tuple[int, int]  # KV heads [first, stop) its query heads read
    query_columns: tuple[int, int]
    key_columns: tuple[int, int]
    value_columns: tuple[int, int]
    output_columns: tuple[int, int]  # its part of o_proj's packed input

    @property
    def widths(self) -> tuple[int, int, int]:
        return tuple(stop - start for start, stop in (self.query_columns, self.key_columns, self.value_columns))

    @property
    def output_width(self) -> int:
        return self.output_columns[1] - self.output_columns[0]


def head_runs(num_heads: int, world_size: int) -> list[tuple[int, int]]:
    """Contiguous, balanced runs of query heads, one per rank (the first num_heads % world_size get one more)."""
    base, extra = divmod(num_heads, world_size)
    runs, start = [], 0
    for rank in range(world_size):
        stop = start + base + (1 if rank < extra else 0)
        runs.append((start, stop))
        start = stop
    return runs


def token_runs(length: int, world_size: int) -> list[tuple[int, int]]:
    """Contiguous, balanced runs of prompt positions, one per rank."""
    return head_runs(length, world_size)


def query_head_columns(attn, head: int) -> tuple[int, int]:
    """Columns [start, stop) of one query head in the layer's packed query (as the key mode projects it)."""
    if attn.mode.rebuilds_keys:  # latent: the whole pre-RoPE query, rotated at attention time
        return head * attn.head_dim, (head + 1) * attn.head_dim
    if attn.mode.shared_key_block:  # crosshead: every head scores against the one shared block
        width = attn.key_ranks[0]
        return head * width, (head + 1) * width
    group = head // attn.group_size
    width = attn.key_ranks[group]
    start = attn.layout.query_offsets[group] + (head - group * attn.group_size) * width
    return start, start + width


def output_head_columns(attn, head: int) -> tuple[int, int]:
    group = head // attn.group_size
    width = attn.value_ranks[group]
    start = attn.layout.output_offsets[group] + (head - group * attn.group_size) * width
    return start, start + width


def layer_shares(attn, world_size: int) -> list[RankShare]:
    """Every rank's share of one CompressedAttention layer at its current ranks."""
    shares = []
    ko, vo = attn.layout.key_offsets, attn.layout.value_offsets
    for first, stop in head_runs(attn.num_heads, world_size):
        kv_first, kv_stop = first // attn.group_size, (stop - 1) // attn.group_size + 1
        keys = (0, ko[-1]) if attn.mode.shared_key_block else (ko[kv_first], ko[kv_stop])
        shares.append(
            RankShare(
                heads=(first, stop),
                kv_heads=(kv_first, kv_stop),
                query_columns=(query_head_columns(attn, first)[0], query_head_columns(attn, stop - 1)[1]),
                key_columns=keys,
                value_columns=(vo[kv_first], vo[kv_stop]),
                output_columns=(output_head_columns(attn, first)[0], output_head_columns(attn, stop - 1)[1]),
            )
        )
    return shares


def check_world_size(model, world_size: int, prompt_length: int) -> None:
    """Refuse, before any work, a world size or prompt the sequence-parallel prefill cannot run."""
    if world_size < 1:
        raise InvalidArgumentError(f"sequence-parallel prefill needs at least 1 process, got {world_size}")
    attentions = model.compressed_attentions() if hasattr(model, "compressed_attentions") else None
    if not attentions:
        raise UnsupportedModelError(
            f"{type(model).__name__} is not a kvrewrite compressed model; load it with kvrewrite.load(dir) "
            "(rate=0.0 gives the full-rank rewrite, i.e. the original model's attention)"
        )
    heads = attentions[0].num_heads
    if world_size > heads:
        raise InvalidArgumentError(
            f"{world_size} processes but the model has only {heads} query heads: every process attends for at "
            f"least one head (use at most {heads} processes)"
        )
    if prompt_length < world_size:
        raise InvalidArgumentError(
            f"a {prompt_length}-token prompt cannot be split over {world_size} processes (at least one token each)"
        )
    adapter = model.kvrewrite_adapter
    if adapter.features(model.config).sliding_layers:
        raise UnsupportedModelError(
            f"{adapter.family} has sliding-window layers; the sequence-parallel prefill attends causally over the "
            "whole prompt and does not implement windows"
        )
    if getattr(model, "tier_policy", None) is not None:
        raise UnsupportedModelError("token tiers (recent_window=) keep their own cache; load without recent_window")
