"""A transformers cache whose layers hold tiers of one latent: a full-rank recent window, and older tokens.

Every token enters the recent tier with all its latent dims. After each forward, tokens that no later query
reads at full rank (older than the last `window` tokens) move to the aged tier, keeping only each head's
prefix of `aged` ranks: the other dims are dropped, so the cache really holds fewer numbers. With a codec,
aged tokens are coded in blocks (a float16 staging run holds the tokens of an incomplete block).

With token-adaptive dims (policy.adaptive), tokens beyond the window stay in the recent tier as a pool until
`pool` of them have left it; then the share g_l with the highest importance score moves to the important tier
(important ranks) and the rest to the aged tier. Those two tiers interleave positions, so they keep each
token's cache index (int32, counted as held bytes).

Every stored tensor is an attribute of the layer, so kvrewrite.runtime.cache_bytes.cache_tensor_bytes measures what is held.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from kvrewrite.runtime.batch_first_layer import BatchFirstLayer
from kvrewrite.runtime.codecs.cache import encode_append

STORAGE_DTYPE = torch.float16
POSITION_DTYPE = torch.int32


def prefix_columns(block_width: int, ranks: tuple[int, ...]) -> list[int]:
    """Packed column indices that keep the first ranks[g] columns of every head's block of `block_width`."""
    return [g * block_width + i for g, r in enumerate(ranks) for i in range(r)]


class RecentWindowLayer(BatchFirstLayer):
    """What every token-policy layer shares: keys/values (the DynamicLayer fields) are the recent window
    [B, 1, S_recent, n_kv * d] at full rank, in `storage_dtype`; older tokens are the subclass's stored tiers.

    The attention (kvrewrite.runtime.tiers.attention) reads `window`, `beyond_window_ranks` and `stored_tiers(dtype)`, and
    computes only the evidence named in `wanted_evidence` ("recent": attention each recent token received,
    "stored": the same per stored tier, "denominator": each new token's log softmax denominator), handing it to
    `add_scores(recent, stored, denominators)` with None for what was not wanted. `observed_queries`: how many of
    the forward's last queries count (None: all); `evidence_reduce`: "sum" of the attention a token received over
    heads and observed queries, or its "max".
    """

    window_description = "full-rank window"
    wanted_evidence: tuple[str, ...] = ()
    observed_queries: int | None = None
    evidence_reduce: str = "sum"

    def __init__(self, window: int, head_dim: int, storage_dtype: torch.dtype = STORAGE_DTYPE):
        super().__init__()
        self.window, self.head_dim, self.storage_dtype = window, head_dim, storage_dtype
        self.cumulative_length = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append new tokens' full-rank packed latents [B, 1, T, n_kv * d] to the recent window."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        self.keys = torch.cat([self.keys, key_states.to(self.storage_dtype)], dim=-2)
        self.values = torch.cat([self.values, value_states.to(self.storage_dtype)], dim=-2)
        self._appended(key_states.shape[0], key_states.shape[-2])
        return self.keys, self.values

    def _appended(self, batch: int, n: int) -> None:
        """Hook: n tokens joined the recent window."""

    def _columns(self, ranks: tuple[int, ...]) -> torch.Tensor:
        return torch.tensor(prefix_columns(self.head_dim, ranks), dtype=torch.long, device=self.keys.device)

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def reset(self) -> None:
        super().reset()
        self.cumulative_length = 0


class TieredLayer(RecentWindowLayer):
    """Recent window at full rank; older tokens in the aged tier (and, token-adaptive, the important tier)."""

    stored_tensor_names = (
        "keys",
        "values",
        "aged_keys",
        "aged_values",
        "important_keys",
        "important_values",
        "aged_positions",
        "important_positions",
        "recent_scores",
    )
    stored_dict_names = ("coded_keys", "coded_values")

    def __init__(
        self,
        window: int,
        head_dim: int,
        aged_key_ranks: tuple[int, ...],
        aged_value_ranks: tuple[int, ...],
        codec=None,
        storage_dtype: torch.dtype = STORAGE_DTYPE,
        *,
        important_key_ranks=None,
        important_value_ranks=None,
        important_share: float | None = None,
        score: str = "attention",
        pool: int = 64,
    ):
        super().__init__(window, head_dim, storage_dtype)
        self.aged_key_ranks, self.aged_value_ranks = tuple(aged_key_ranks), tuple(aged_value_ranks)
        self.codec = codec
        self.adaptive = important_share is not None
        self.important_key_ranks = tuple(important_key_ranks) if self.adaptive else None
        self.important_value_ranks = tuple(important_value_ranks) if self.adaptive else None
        self.important_share = important_share
        self.score = score
        self.pool = pool if self.adaptive else 0
        # Token-adaptive dims score recent tokens by the attention they receive, or by their own denominators.
        if self.adaptive:
            self.wanted_evidence = ("recent",) if score == "attention" else ("denominator",)
        self.coded_length = 0  # aged tokens held as codec blocks (the rest of the aged tier is the staging run)
        self.aged_keys: torch.Tensor | None = None
        self.aged_values: torch.Tensor | None = None
        self.coded_keys: dict[str, torch.Tensor] | None = None
        self.coded_values: dict[str, torch.Tensor] | None = None
        # Adaptive only: the important tier, each tier's cache indices, and the recent tokens' importance scores.
        self.important_keys: torch.Tensor | None = None
        self.important_values: torch.Tensor | None = None
        self.aged_positions: torch.Tensor | None = None
        self.important_positions: torch.Tensor | None = None
        self.recent_scores: torch.Tensor | None = None

    @property
    def beyond_window_ranks(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Ranks a recent-tier token is read at by queries more than `window` tokens later."""
        if self.adaptive:
            return self.important_key_ranks, self.important_value_ranks
        return self.aged_key_ranks, self.aged_value_ranks

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        batch = key_states.shape[0]

        def empty(width: int) -> torch.Tensor:
            return key_states.new_empty((batch, 1, 0, width), dtype=self.storage_dtype)

        self.keys, self.values = empty(key_states.shape[-1]), empty(value_states.shape[-1])
        self.aged_keys, self.aged_values = empty(sum(self.aged_key_ranks)), empty(sum(self.aged_value_ranks))
        if self.adaptive:
            self.important_keys = empty(sum(self.important_key_ranks))
            self.important_values = empty(sum(self.important_value_ranks))
            self.aged_positions = key_states.new_empty((batch, 0), dtype=POSITION_DTYPE)
            self.important_positions = key_states.new_empty((batch, 0), dtype=POSITION_DTYPE)
            self.recent_scores = key_states.new_zeros((batch, 0), dtype=torch.float32)
        self.is_initialized = True

    # ---- writes --------------------------------------------------------------------------------------------
    def _appended(self, batch: int, n: int) -> None:
        if self.adaptive:
            self.recent_scores = torch.cat([self.recent_scores, self.recent_scores.new_zeros((batch, n))], dim=-1)

    def add_scores(
        self,
        received: torch.Tensor | None,
        received_stored: list[torch.Tensor] | None,
        denominators: torch.Tensor | None,
    ) -> None:
        """One forward's importance evidence (token-adaptive only): attention each recent token received [B, S_recent]
        (summed over heads and queries) with the "attention" score, or the new tokens' own log softmax denominators
        [B, T] (combined over heads) with "denominator". Classified tokens keep their tier."""
        if self.score == "attention":
            self.recent_scores = self.recent_scores + received
        else:
            self.recent_scores = torch.cat([self.recent_scores[:, : -denominators.shape[-1]], denominators], dim=-1)

    def settle(self) -> None:
        """Move every token no later query reads at full rank out of the recent tier (see the module docstring)."""
        beyond = self.keys.shape[-2] - self.window
        moving = (beyond // self.pool) * self.pool if self.adaptive else beyond
        if moving <= 0:
            return
        if self.adaptive:
            self._classify(moving)
        else:
            key_cols = self._columns(self.aged_key_ranks)
            value_cols = self._columns(self.aged_value_ranks)
            self.aged_keys = torch.cat([self.aged_keys, self.keys[..., :moving, :].index_select(-1, key_cols)], dim=-2)
            self.aged_values = torch.cat(
                [self.aged_values, self.values[..., :moving, :].index_select(-1, value_cols)], dim=-2
            )
        self.keys = self.keys[..., moving:, :].contiguous()
        self.values = self.values[..., moving:, :].contiguous()
        if self.adaptive:
            self.recent_scores = self.recent_scores[:, moving:].contiguous()
        if self.codec is not None:
            self._code_full_blocks()

    def _classify(self, moving: int) -> None:
        """Split the oldest `moving` recent tokens, pool by pool, into the important and aged tiers by score."""
        batch = self.keys.shape[0]
        first = self.cumulative_length - self.keys.shape[-2]  # cache index of the oldest recent token
        positions = torch.arange(first, first + moving, device=self.keys.device)
        scores = self.recent_scores[:, :moving]
        if self.score == "attention":
            # Mean over the queries that have read the token so far (older tokens were read by more of them).
            scores = scores / (self.cumulative_length - positions).to(scores.dtype)
        n_important = round(self.important_share * self.pool)
        pools = scores.view(batch, moving // self.pool, self.pool)
        top = (
            pools.topk(n_important, dim=-1).indices
            if n_important
            else pools.new_zeros((batch, moving // self.pool, 0), dtype=torch.long)
        )
        important = torch.zeros_like(pools, dtype=torch.bool).scatter_(-1, top, True).view(batch, moving)
        order = torch.argsort(
            (~important).to(torch.int8), dim=-1, stable=True
        )  # important first, positions kept in order
        n_imp = n_important * (moving // self.pool)
        imp_idx, aged_idx = order[:, :n_imp], order[:, n_imp:]
        tokens_k, tokens_v = self.keys[:, 0, :moving], self.values[:, 0, :moving]  # [B, moving, C]

        def take(tokens: torch.Tensor, index: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
            picked = tokens.gather(1, index[..., None].expand(-1, -1, tokens.shape[-1]))
            return picked.index_select(-1, cols).unsqueeze(1)

        ik, iv = self._columns(self.important_key_ranks), self._columns(self.important_value_ranks)
        ak, av = self._columns(self.aged_key_ranks), self._columns(self.aged_value_ranks)
        self.important_keys = torch.cat([self.important_keys, take(tokens_k, imp_idx, ik)], dim=-2)
        self.important_values = torch.cat([self.important_values, take(tokens_v, imp_idx, iv)], dim=-2)
        pos = positions.to(POSITION_DTYPE)[None].expand(batch, moving)
        self.important_positions = torch.cat([self.important_positions, pos.gather(1, imp_idx)], dim=-1)
        self.aged_keys = torch.cat([self.aged_keys, take(tokens_k, aged_idx, ak)], dim=-2)
        self.aged_values = torch.cat([self.aged_values, take(tokens_v, aged_idx, av)], dim=-2)
        self.aged_positions = torch.cat([self.aged_positions, pos.gather(1, aged_idx)], dim=-1)

    def _code_full_blocks(self) -> None:
        g = self.codec.block_tokens
        n_blocks = self.aged_keys.shape[-2] // g
        if not n_blocks:
            return
        self.coded_keys = encode_append(self.codec, self.coded_keys, self.aged_keys, n_blocks, "key")
        self.coded_values = encode_append(self.codec, self.coded_values, self.aged_values, n_blocks, "value")
        self.aged_keys = self.aged_keys[..., n_blocks * g :, :].contiguous()
        self.aged_values = self.aged_values[..., n_blocks * g :, :].contiguous()
        self.coded_length += n_blocks * g

    # ---- reads ---------------------------------------------------------------------------------------------
    def stored_tiers(self, dtype: torch.dtype) -> list:
        """Every tier but the recent window, as attention reads it (kvrewrite.runtime.tiers.attention.StoredTier)."""
        from kvrewrite.runtime.tiers.attention import StoredTier

        aged_k, aged_v = self.aged_latents(dtype)
        if not self.adaptive:  # the aged tier holds cache indices 0..S_aged-1 in order
            return [StoredTier(aged_k, aged_v, self.aged_key_ranks, self.aged_value_ranks, None)]
        return [
            StoredTier(aged_k, aged_v, self.aged_key_ranks, self.aged_value_ranks, self.aged_positions),
            StoredTier(
                self.important_keys.to(dtype),
                self.important_values.to(dtype),
                self.important_key_ranks,
                self.important_value_ranks,
                self.important_positions,
            ),
        ]

    def aged_latents(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The aged tier as packed [B, 1, S_aged, sum ranks] keys and values (coded blocks decoded, then staging)."""
        keys, values = self.aged_keys.to(dtype), self.aged_values.to(dtype)
        if self.coded_keys is None:
            return keys, values
        decoded = []
        for side, store, staged in (("key", self.coded_keys, keys), ("value", self.coded_values, values)):
            blocks = self.codec.decode(store, side)  # [B, n, G, C]
            batch, n, g, c = blocks.shape
            decoded.append(torch.cat([blocks.reshape(batch, 1, n * g, c).to(dtype), staged], dim=-2))
        return decoded[0], decoded[1]

    def reset(self) -> None:
        super().reset()
        self.coded_length = 0
        for name in (
            "aged_keys",
            "aged_values",
            "coded_keys",
            "coded_values",
            "important_keys",
            "important_values",
            "aged_positions",
            "important_positions",
            "recent_scores",
        ):
            setattr(self, name, None)

    def crop(self, max_length: int) -> None:
        # Aged tokens lost their trailing dims: cropping back into them could not restore full rank.
        super().crop(max_length)
        if self.adaptive and self.recent_scores.shape[-1] > self.keys.shape[-2]:
            self.recent_scores = self.recent_scores[:, : self.keys.shape[-2]]


class TieredCache(Cache):
    """One tiered layer per decoder layer (the policy's kind). CompressedAttention recognises it (`is_tiered`) and attends tier by tier."""

    is_tiered = True

    def __init__(
        self,
        policy,
        head_dim: int,
        layer_codecs: list | None = None,
        storage_dtype: torch.dtype = STORAGE_DTYPE,
        capacity: int | None = None,
    ):
        # The policy builds its own layers (TierPolicy: TieredLayer; EvictionPolicy: EvictingLayer); `capacity`, the
        # longest sequence the cache will hold where the caller knows it (generate()), sizes their buffers.
        super().__init__(layers=policy.make_layers(head_dim, layer_codecs, storage_dtype, capacity))
        self.policy = policy

    def attend(
        self, module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask
    ) -> torch.Tensor:
        """Store the new tokens, attend over every tier, then age what left the window. Returns o_proj's input."""
        from kvrewrite.runtime.tiers.attention import tiered_attention

        layer = self.layers[module.layer_idx]
        layer.update(key.unsqueeze(1), value.unsqueeze(1))
        output = tiered_attention(module, query, layer, attention_mask)
        layer.settle()
        return output
