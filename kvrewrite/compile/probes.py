"""Truncation probes: a full-rank rewrite computing exactly as if sliced to smaller ranks, switched on for a block.

Zeroing every head's latent key/value dims beyond a rank is exactly the truncation to that rank (the dims are
prefix-ordered by importance), so one full-rank model serves every probed rank: the sensitivity probes, the
quality-budget search, the key-mode choice and the distillation (whose masked dims then get zero gradient).
The switch lives here, on the compile side, not in the shipped attention module: `truncated` wraps the
attention's `project` (where the cached key and value latents are final: after any q/k norm, RoPE pairing or
post-RoPE map, so a hook on k_proj could not do it) for the duration of a `with` block, and always unwraps it.
`truncated_by_rows` runs several truncations in one batch (each block of rows at its own ranks), for a fit over all
of them at once. `probe_kls` measures the KL of one probed layer at a time, layer-streamed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from kvrewrite.compile.layer_streaming import StreamedModel
from kvrewrite.errors import InvalidArgumentError
from kvrewrite.progress import progress_bar

ProbeRanks = tuple[list[int], list[int]]  # (key ranks, value ranks) of one layer while it is probed


def _keep_mask(widths: list[int], keep: list[int], like: torch.Tensor) -> torch.Tensor:
    """1 on each block's first `keep` dims, 0 on the rest (blocks of `widths` dims, as packed)."""
    return torch.cat([(torch.arange(w) < r).to(like.dtype) for w, r in zip(widths, keep)]).to(like.device)


@contextlib.contextmanager
def _masking(
    attention: nn.Module, masks: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
) -> Iterator[nn.Module]:
    """Inside the block, `attention`'s key and value latents are multiplied by masks(key, value); always unwrapped."""
    shadowed = attention.__dict__.get("project")  # a truncation already in force (nested blocks)
    project = attention.project

    def probed(hidden_states: torch.Tensor, position_embeddings=None):
        query, key, value = project(hidden_states, position_embeddings)
        key_mask, value_mask = masks(key, value)
        return query, key * key_mask, value * value_mask

    attention.project = probed
    try:
        yield attention
    finally:
        if shadowed is None:
            del attention.project
        else:
            attention.project = shadowed


def truncated(attention: nn.Module, key_ranks: list[int], value_ranks: list[int]) -> contextlib.AbstractContextManager:
    """Inside the block, `attention` (a CompressedAttention at full rank) caches and attends with every head's latent
    dims beyond key_ranks / value_ranks zeroed: the same numbers as the model sliced to those ranks (set_ranks).
    Block widths are the current ranks: head_dim per head, or [n_kv * d, 0, ...] for crosshead keys."""
    return _masking(
        attention,
        lambda key, value: (
            _keep_mask(attention.key_ranks, key_ranks, key),
            _keep_mask(attention.value_ranks, value_ranks, value),
        ),
    )


@contextlib.contextmanager
def truncated_by_rows(
    model: nn.Module, adapter, blocks: list[tuple[list[list[int]], list[list[int]]]], rows_per_block: int
) -> Iterator[nn.Module]:
    """Several truncations of one full-rank model in one forward: batch rows [i * rows_per_block, (i + 1) *
    rows_per_block) run at blocks[i] = (key ranks, value ranks) per layer, in every layer (each row as
    truncated_model with those ranks computes it)."""
    with contextlib.ExitStack() as stack:
        for idx, layer in enumerate(adapter.decoder_layers(model)):
            attention = adapter.attention(layer)

            def masks(key: torch.Tensor, value: torch.Tensor, attention=attention, idx=idx):
                if key.shape[0] != len(blocks) * rows_per_block:
                    raise InvalidArgumentError(
                        f"truncated_by_rows: a batch of {key.shape[0]} rows, expected "
                        f"{len(blocks)} blocks of {rows_per_block}"
                    )
                key_mask = torch.stack([_keep_mask(attention.key_ranks, keys[idx], key) for keys, _ in blocks])
                value_mask = torch.stack(
                    [_keep_mask(attention.value_ranks, values[idx], value) for _, values in blocks]
                )
                return (
                    key_mask.repeat_interleave(rows_per_block, 0)[:, None],
                    value_mask.repeat_interleave(rows_per_block, 0)[:, None],
                )

            stack.enter_context(_masking(attention, masks))
        yield model


def truncating(adapter, layer_ranks: list[ProbeRanks]) -> Callable[[int, nn.Module], contextlib.AbstractContextManager]:
    """An on_layer for StreamedModel.forward/walk: layer i runs truncated to layer_ranks[i]."""
    return lambda idx, layer: truncated(adapter.attention(layer), *layer_ranks[idx])


@contextlib.contextmanager
def truncated_model(
    model: nn.Module, adapter, key_ranks: list[list[int]], value_ranks: list[list[int]]
) -> Iterator[nn.Module]:
    """A whole full-rank rewritten model computing as at the given ranks (and passing gradients only there)."""
    with contextlib.ExitStack() as stack:
        for layer, keys, values in zip(adapter.decoder_layers(model), key_ranks, value_ranks):
            stack.enter_context(truncated(adapter.attention(layer), list(keys), list(values)))
        yield model


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """Next-token log-probabilities in float32 (a `head` for StreamedModel.forward)."""
    return F.log_softmax(logits.float(), dim=-1)


def probe_kls(
    original: StreamedModel,
    rewritten: StreamedModel,
    layer_probes: list[dict[str, ProbeRanks]],
    tokens: torch.Tensor,
    progress: bool = True,
    label: str = "measuring sensitivity",
    reference: torch.Tensor | None = None,
) -> dict[tuple[int, str], float]:
    """(layer, probe name) -> KL to the original of the rewrite with only that layer truncated to that probe's ranks.

    layer_probes[i]: probe name -> (key ranks, value ranks) for layer i; every other layer runs at full
    rank (exact). Layer-streamed: every probe is a hidden-state stream that leaves the reference stream at
    its layer and then runs through the rewritten layers, so all probes share one pass over the weights.
    Cost: about layers x probes layer-forwards of the probe tokens; memory: one hidden-state stream per
    probe plus the reference. `reference`: the original's log-probabilities for `tokens` if already known.
    """
    streams: dict[tuple[int, str], torch.Tensor] = {}  # carried by the rewritten walk, one entry per started probe
    with torch.inference_mode(), progress_bar(label, len(layer_probes) + 1, progress) as bar:
        hidden = original.embed_batches([tokens])  # the reference stream, carried by the original walk
        rewritten.layer_inputs(hidden[0])

        @contextlib.contextmanager
        def start_probes(idx: int, layer: nn.Module):
            yield  # the probes started earlier run through this layer first, then this layer's own start
            for name, ranks in layer_probes[idx].items():
                with truncated(rewritten.adapter.attention(layer), *ranks):
                    streams[(idx, name)] = rewritten.run_layer(layer, hidden[0], rewritten.layer_inputs(hidden[0]))

        reference_layers = original.walk(hidden)
        for idx in rewritten.walk(streams, start_probes):  # the rewritten layer idx runs before the original's
            if idx + 1 < len(layer_probes) or reference is None:  # the last layer's output only feeds the reference
                next(reference_layers)
            bar.advance()
        if reference is None:
            with original.output_head() as head:
                reference = log_probs(head(hidden[0]))
        kls = {}
        with rewritten.output_head() as head:
            for key, stream in streams.items():
                logp = log_probs(head(stream))
                kls[key] = float((reference.exp() * (reference - logp)).sum(-1).mean())
        bar.advance()
    return kls
