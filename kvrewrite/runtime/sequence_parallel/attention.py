"""One compressed attention layer run Ulysses-style: the sequence is split over ranks, the heads are split for attention.

Each rank projects its own tokens with the layer's own `project` (so RoPE, q/k norms and the key mode's packed
latents are exactly the single-process ones), ships every other rank the column ranges of the packed q, k and v
latents that rank's heads read (plan.RankShare), attends causally over the whole sequence for its heads, and ships
each rank's tokens back; o_proj then runs on the rank's own tokens.
"""

from __future__ import annotations

import torch

from kvrewrite.runtime.kernels.reference import causal_mask, grouped_attention
from kvrewrite.runtime.sequence_parallel.collectives import CountingCollectives
from kvrewrite.runtime.sequence_parallel.plan import RankShare


def causal_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float, chunk: int
) -> torch.Tensor:
    """query [B, n, S, r], key [B, 1, S, r], value [B, 1, S, rv] -> [B, n, S, rv], causal, `chunk` query rows at a time.

    Rows are chunked so long prompts never hold an S x S score matrix; a chunk only reads the keys it may see.
    """
    length = query.shape[-2]
    outputs = []
    for start in range(0, length, chunk):
        stop = min(length, start + chunk)
        allowed = causal_mask(stop - start, stop, start, query.device)  # rows start..stop-1 of the prompt
        outputs.append(
            grouped_attention(query[:, :, start:stop], key[:, :, :stop], value[:, :, :stop], allowed, scaling)
        )
    return torch.cat(outputs, dim=2)


def attend_share(
    attn, share: RankShare, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, chunk: int
) -> torch.Tensor:
    """Attention of one rank's query heads over the whole sequence, from the column ranges it received.

    query/key/value [B, S, width] are this rank's columns of the packed latents; returns its columns of o_proj's
    packed input [B, S, share.output_width].
    """
    batch, length, _ = query.shape
    group_size, mode = attn.group_size, attn.mode
    first, stop = share.heads
    kv_first, kv_stop = share.kv_heads
    ko, vo = attn.layout.key_offsets, attn.layout.value_offsets
    if mode.rebuilds_keys:  # latent: rotate queries and rebuilt keys by their position in the prompt
        positions = torch.arange(length, device=query.device)[None].expand(batch, length)
        cos, sin = attn._rotary[0](query, positions)
    outputs, column = [], 0
    for g in range(kv_first, kv_stop):
        heads = min(stop, (g + 1) * group_size) - max(first, g * group_size)
        width = (
            attn.head_dim if mode.rebuilds_keys else attn.key_ranks[0] if mode.shared_key_block else attn.key_ranks[g]
        )
        q = query[..., column : column + heads * width].view(batch, length, heads, width).transpose(1, 2)
        column += heads * width
        k = key if mode.shared_key_block else key[..., ko[g] - ko[kv_first] : ko[g + 1] - ko[kv_first]]
        k, v = k.unsqueeze(1), value[..., vo[g] - vo[kv_first] : vo[g + 1] - vo[kv_first]].unsqueeze(1)
        if mode.rebuilds_keys:
            q = attn._apply_rope(q, cos, sin)
            k = mode.rebuild_keys(attn, k, g, cos, sin)
        out = causal_attention(q, k, v, attn.scaling, chunk)
        outputs.append(out.transpose(1, 2).reshape(batch, length, heads * attn.value_ranks[g]))
    return torch.cat(outputs, dim=-1)


class SequenceParallelAttention:
    """Stands in for one CompressedAttention's forward during a sequence-parallel prefill."""

    def __init__(
        self,
        attn,
        shares: list[RankShare],
        tokens: list[tuple[int, int]],
        comm: CountingCollectives,
        local_latents: dict,
        chunk: int,
    ):
        self.attn, self.shares, self.tokens, self.comm = attn, shares, tokens, comm
        self.local_latents, self.chunk = local_latents, chunk

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs):
        attn, comm, me = self.attn, self.comm, self.comm.rank
        batch, local_length, _ = hidden_states.shape
        query, key, value = attn.project(hidden_states, position_embeddings)
        self.local_latents[attn.layer_idx] = (key, value)  # this rank's tokens of the cache

        # First all-to-all: the packed latents of my tokens, each rank's column ranges, as they are.
        pieces = [
            torch.cat(
                (
                    query[..., slice(*s.query_columns)],
                    key[..., slice(*s.key_columns)],
                    value[..., slice(*s.value_columns)],
                ),
                dim=-1,
            )
            for s in self.shares
        ]
        widths = self.shares[me].widths
        received = comm.exchange(
            "qkv", attn.layer_idx, pieces, [batch * (stop - start) * sum(widths) for start, stop in self.tokens]
        )
        full = torch.cat(
            [piece.view(batch, stop - start, sum(widths)) for piece, (start, stop) in zip(received, self.tokens)], dim=1
        )
        q, k, v = full.split(widths, dim=-1)

        out = attend_share(attn, self.shares[me], q, k, v, self.chunk)

        # Second all-to-all: every rank gets its tokens' rows of my heads' outputs; heads are in rank order.
        pieces = [out[:, start:stop] for start, stop in self.tokens]
        received = comm.exchange(
            "output", attn.layer_idx, pieces, [batch * local_length * s.output_width for s in self.shares]
        )
        packed = torch.cat(
            [piece.view(batch, local_length, s.output_width) for piece, s in zip(received, self.shares)], dim=-1
        )
        return attn.o_proj(packed), None
