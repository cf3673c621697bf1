"""A transformers cache whose layers hold tiers of one latent: a full-rank recent window, and older tokens.

Every token enters the recent tier with all its latent dims. After each forward, tokens that no later query
reads at full rank (older than the last `window` tokens) move to the aged tier, keeping only each head's
prefix of `aged` ranks: the other dims are dropped, so the cache really holds fewer numbers. With a codec,
aged tokens are coded in blocks (a float16 staging run holds the tokens of an incomplete block).

With token-adaptive dims (policy.adaptive), tokens beyond the window stay in the recent tier as a pool until
`pool` of them have left it; then the share g_l with the highest importance score moves to the important tier
(important ranks) and the rest to the aged tier. Those two tiers interleave positions, so they keep each
token's cache index (int32, counted as held bytes).

The aged and important tiers, their positions and the coded blocks are prefix views of buffers along the token (or
block) dim, and a settle writes the moving tokens' rows into the room after them (runtime.inplace_cache.append_in_place):
nothing copies a whole tier per step. With a capacity (the longest sequence, as generate() knows it) each buffer is
allocated once with the most rows its tier can hold; without one (a cache built by hand, the frontier's
make_kv_cache()) a buffer holds exactly its rows, so the bytes held are those of the concatenation it replaces. The
recent window (bounded by the window and the pool) and the staging run (under one block) are small and rebuilt.

Every stored tensor, buffers included, is an attribute of the layer, so kvrewrite.runtime.cache_bytes.cache_tensor_bytes
measures what is held.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from kvrewrite.runtime.batch_first_layer import BatchFirstLayer
from kvrewrite.runtime.codecs.cache import encode_append
from kvrewrite.runtime.inplace_cache import append_in_place, is_prefix_view

STORAGE_DTYPE = torch.float16
POSITION_DTYPE = torch.int32


def prefix_columns(block_width: int, ranks: tuple[int, ...]) -> list[int]:
    """Packed column indices that keep the first ranks[g] columns of every head's block of `block_width`."""
    return [g * block_width + i for g, r in enumerate(ranks) for i in range(r)]


def take_columns(x: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """x[..., columns] as a new tensor. Not index_select(-1, ...): on a CPU that ran 5.3x slower on a prompt's
    tokens ([8, 8176, 192] float32, one thread, torch 2.13: benchmarks/results/cpu_decode_limits.json), for the
    same values."""
    return x[..., columns]


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

    def _leave_window(self, n: int) -> None:
        """Drop the window's oldest n tokens (they have been stored beyond it, or evicted)."""
        self.keys = self.keys[..., n:, :].contiguous()
        self.values = self.values[..., n:, :].contiguous()

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
        capacity: int | None = None,
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
        # The longest sequence this cache will hold (None: unknown), and the buffers the stored tiers are prefix views
        # of: by attribute name, and the coded blocks' by the codec's tensor names (encode_append).
        self.capacity = capacity
        self.tier_buffers: dict[str, torch.Tensor] = {}
        self.coded_key_buffers: dict[str, torch.Tensor] = {}
        self.coded_value_buffers: dict[str, torch.Tensor] = {}

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
        self._clear_buffers()
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
            self._append_aged(
                take_columns(self.keys[..., :moving, :], key_cols),
                take_columns(self.values[..., :moving, :], value_cols),
            )
        self._leave_window(moving)
        if self.adaptive:
            self.recent_scores = self.recent_scores[:, moving:].contiguous()

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
            return take_columns(picked, cols).unsqueeze(1)

        ik, iv = self._columns(self.important_key_ranks), self._columns(self.important_value_ranks)
        ak, av = self._columns(self.aged_key_ranks), self._columns(self.aged_value_ranks)
        important_rows, aged_rows = self._capacity_rows()[1:]
        self._append("important_keys", take(tokens_k, imp_idx, ik), -2, important_rows)
        self._append("important_values", take(tokens_v, imp_idx, iv), -2, important_rows)
        pos = positions.to(POSITION_DTYPE)[None].expand(batch, moving)
        self._append("important_positions", pos.gather(1, imp_idx), -1, important_rows)
        self._append_aged(take(tokens_k, aged_idx, ak), take(tokens_v, aged_idx, av))
        self._append("aged_positions", pos.gather(1, aged_idx), -1, aged_rows)

    def _capacity_rows(self) -> tuple[int | None, int | None, int | None]:
        """(tokens beyond the window, important rows, aged rows) a sequence of `capacity` tokens can bring (None
        without a capacity). Token-adaptive tiers fill pool by pool: each full pool adds round(g x pool) important
        tokens and the rest aged ones."""
        if self.capacity is None:
            return None, None, None
        beyond = max(self.capacity - self.window, 0)
        if not self.adaptive:
            return beyond, 0, beyond
        pools, per_pool = beyond // self.pool, round(self.important_share * self.pool)
        return beyond, pools * per_pool, pools * (self.pool - per_pool)

    def _append(self, name: str, rows: torch.Tensor, dim: int, capacity: int | None) -> None:
        """Write `rows` after the tier `name` holds, in place in its buffer where there is room (exact rows without
        a capacity, as a concatenation held)."""
        self.tier_buffers[name], view = append_in_place(
            self.tier_buffers.get(name), getattr(self, name), rows, dim, capacity, grow=False
        )
        setattr(self, name, view)

    def _append_aged(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append tokens [B, 1, n, sum aged ranks] to the aged tier. With a codec, the whole blocks of G among the
        staging run followed by them are coded onto the coded store (in place in its buffers) and the rest, under
        one block, is the new staging run."""
        aged_rows = self._capacity_rows()[2]
        if self.codec is None:
            self._append("aged_keys", keys, -2, aged_rows)
            self._append("aged_values", values, -2, aged_rows)
            return
        g = self.codec.block_tokens
        staged = self.aged_keys.shape[-2]
        n_blocks = (staged + keys.shape[-2]) // g
        staging_rows = None if aged_rows is None else min(g - 1, aged_rows)
        if not n_blocks:
            self._append("aged_keys", keys, -2, staging_rows)
            self._append("aged_values", values, -2, staging_rows)
            return
        block_rows = None if aged_rows is None else aged_rows // g
        coded = n_blocks * g - staged  # how many of the new tokens complete the blocks
        for side, name, new, store, buffers in (
            ("key", "aged_keys", keys, "coded_keys", self.coded_key_buffers),
            ("value", "aged_values", values, "coded_values", self.coded_value_buffers),
        ):
            blocks = new[..., :coded, :] if not staged else torch.cat([getattr(self, name), new[..., :coded, :]], -2)
            coded_store = encode_append(
                self.codec, getattr(self, store), blocks, n_blocks, side, buffers, block_rows, grow=False
            )
            setattr(self, store, coded_store)
            # The rest starts the staging run again: at the start of its buffer where it has one, else exactly.
            buffer = self.tier_buffers.get(name) if self.capacity is not None else None
            setattr(self, name, new[..., :0, :] if buffer is None else buffer.narrow(-2, 0, 0))
            self._append(name, new[..., coded:, :], -2, staging_rows)
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

    # ---- batch and lifetime ----------------------------------------------------------------------------------
    def _clear_buffers(self) -> None:
        self.tier_buffers, self.coded_key_buffers, self.coded_value_buffers = {}, {}, {}

    def _buffered(self):
        """(tensor attribute or coded store name, tensor name within it or None, its token dim, its buffer dict)."""
        for name in self.stored_tensor_names:
            yield name, None, 1 if name.endswith("positions") or name == "recent_scores" else 2, self.tier_buffers
        for name, buffers in (("coded_keys", self.coded_key_buffers), ("coded_values", self.coded_value_buffers)):
            for key in getattr(self, name) or {}:
                yield name, key, 1, buffers

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: each stored tensor's chosen rows, written back into its buffer where it is a view of one."""
        if not self.is_initialized:
            return
        for name, key, dim, buffers in self._buffered():
            held = getattr(self, name) if key is None else getattr(self, name)[key]
            if held is None:
                continue
            chosen = held.index_select(0, beam_idx.to(held.device))
            buffer = buffers.get(name if key is None else key)
            if buffer is not None and is_prefix_view(held, buffer, dim) and chosen.shape == held.shape:
                held.copy_(chosen)
            elif key is None:
                setattr(self, name, chosen)
            else:
                getattr(self, name)[key] = chosen

    def _map_batch(self, fn) -> None:
        # Batch expansion, selection and offloading replace the stored tensors: the next append starts new buffers.
        super()._map_batch(fn)
        self._clear_buffers()

    def reset(self) -> None:
        super().reset()
        self._clear_buffers()
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
