"""Re-scored eviction over the latent cache: a full-rank recent window, and beyond it only the tokens attention
still reads, re-scored at every forward, held at a rate's ranks and optionally at a few bits per number.

Every token enters the recent window at full rank in float16. Once it is older than the window it joins the
kept tier: its latent is cut to the kept ranks (a prefix of every head's importance-ordered dims). After every
forward the layer keeps `keep` x (tokens seen beyond the window) of them: those that received the most attention
from that forward's last `observed_queries` queries, summed over heads. Scores are not accumulated: every kept
token is re-scored by the newest queries each time, TOVA's rule (one query per generation step), so a token that
matters later survives and one that stopped mattering goes, unlike a score frozen when the token left the window.

With `bits`, kept tokens are quantized per token (asymmetric min/max over groups of `group_size` channels), so one
token's numbers never depend on another's and evicting a token never re-quantizes the others. Per-token
ranges alone do badly on these latents: their channels carry offsets and magnitudes that differ by orders of
magnitude (importance order). So before quantizing, each channel is centred and scaled by its mean and rms over
the tokens in the window at the first settle (stored per layer and batch row, float16), and each head's block is
turned by a fixed random orthogonal matrix (as QuaRot does for KV caches) that spreads the rest evenly; decoding
undoes both. tests/test_tier_eviction.py holds the effect on latents with offsets and magnitudes falling along the
block: per-token 4-bit ranges lose the small channels (worst channel error > 90% of its spread), the code space
keeps every channel under 25%. Keys still need more bits than values when coded per token: on the frontier
benchmark (docs/frontier.md) 4-bit keys cost 4.4 points of 2K-4K perplexity more than 8-bit keys at equal bytes.

The kept tier interleaves positions, so it stores each token's cache index (int32), and its rows are in no order:
a token that enters it takes the row an evicted token frees (tiers/kept_store.py), so a decode step writes the rows
that change and never copies the whole store. Attention reads the stored codes as they are coded: the centring,
scaling and turning are moved onto the query side (the key latent is x = (y R^T) rms + mean per head, so
q.x = (q M^T).y + q.mean with M = R^T diag(rms), and latent keys fold M into k_up) and onto the weighted value sum
(sum p x = (sum p y) M + mean sum p), instead of being undone on every stored token at every forward.

Everything held is a tensor attribute of the layer (the rotations are shared by the layers of a cache), so
kvrewrite.runtime.cache_bytes.cache_tensor_bytes measures it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrewrite.errors import InvalidArgumentError
from kvrewrite.runtime.codecs.kivi import kivi_decode, kivi_encode
from kvrewrite.runtime.codecs.packing import META_DTYPE, SUPPORTED_BITS, packed_length, unpack_bits
from kvrewrite.runtime.tiers.cache import POSITION_DTYPE, STORAGE_DTYPE, RecentWindowLayer, take_columns
from kvrewrite.runtime.tiers.floor import (
    DEFAULT_FLOOR_BITS,
    FloorPolicy,
    coded_token_bytes,
    floor_columns,
    floor_policy,
)
from kvrewrite.runtime.tiers.kept_settle import settle_in_kernel
from kvrewrite.runtime.tiers.kept_store import capacity_rows, joined_rows, reserve_rows, take_rows, write_rows

DEFAULT_OBSERVED_QUERIES = 64  # scoring queries per forward: a 64-token chunk, or the last 64 of a long prefill
DEFAULT_GROUP_SIZE = 64  # channels per (scale, minimum) pair, as transformers' QuantizedCache defaults
PREFILL_SCORES = ("newest", "reconstruction")


@dataclass(frozen=True)
class EvictionPolicy:
    """window: tokens a query reads at full rank besides itself; kept_*: per layer, per KV head ranks of the kept
    tokens beyond it; keep: per layer, the share of the tokens beyond the window that stay cached."""

    window: int
    kept_key_ranks: tuple[tuple[int, ...], ...]
    kept_value_ranks: tuple[tuple[int, ...], ...]
    keep: tuple[float, ...]
    bits: int | tuple[int | None, int | None] | None = None  # both sides, or (key bits, value bits); None: float16
    group_size: int = DEFAULT_GROUP_SIZE
    observed_queries: int = DEFAULT_OBSERVED_QUERIES
    floor: FloorPolicy | None = None  # what an evicted token keeps (None: it is dropped); see tiers/floor.py
    # How generate() chooses a prompt's kept tokens: "newest" (re-scored at every prefill forward, like any later
    # one) or "reconstruction" (the whole prompt scored by how much repeating it needs each token; tiers/reconstruction.py).
    prefill_score: str = "newest"
    # With prefill_score "reconstruction": the share of a prompt's kept budget its reconstruction chooses (one for
    # every layer, or one per layer); the rest goes to the tokens the prompt's own last queries read most (what
    # "newest" keeps of a one-chunk prompt).
    reconstruction_share: float | tuple[float, ...] = 1.0
    # With prefill_score "reconstruction": context n-grams of this length that repeat give the sum of their scores
    # to their best-scored copy (tiers/repeated_evidence.py); 0: off.
    pool_repeats: int = 0
    # The first `sinks` cache positions always stay in the kept tier, inside the keep budget (or above it, while
    # the budget is under the sinks): StreamingLLM's attention sinks, where attention parks its unused weight. One
    # count for every layer, or one per layer.
    sinks: int | tuple[int, ...] = 0

    def __post_init__(self) -> None:
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 0:
            raise InvalidArgumentError(f"recent window must be a whole number of tokens >= 0, got {self.window!r}")
        if not (len(self.kept_key_ranks) == len(self.kept_value_ranks) == len(self.keep)):
            raise InvalidArgumentError(f"evict: keep needs one share per layer ({len(self.kept_key_ranks)})")
        if any(not 0 <= k <= 1 for k in self.keep):
            raise InvalidArgumentError(f"evict: keep shares must lie in [0, 1], got {list(self.keep)}")
        sides = self.bits if isinstance(self.bits, tuple) else (self.bits, self.bits)
        if len(sides) != 2 or any(b is not None and b not in SUPPORTED_BITS for b in sides):
            raise InvalidArgumentError(
                f"evict: bits must be one of {SUPPORTED_BITS}, None, or a (key, value) pair of them; got {self.bits!r}"
            )
        if self.group_size < 1 or self.observed_queries < 1:
            raise InvalidArgumentError("evict: group_size and observed_queries must be >= 1")
        if self.prefill_score not in PREFILL_SCORES:
            raise InvalidArgumentError(
                f"evict: prefill_score must be one of {', '.join(PREFILL_SCORES)}, got {self.prefill_score!r}"
            )
        shares = self.reconstruction_share
        if isinstance(shares, list):
            object.__setattr__(self, "reconstruction_share", shares := tuple(shares))
        numbers = shares if isinstance(shares, tuple) else (shares,)
        if (isinstance(shares, tuple) and len(shares) != len(self.keep)) or not all(
            isinstance(s, (int, float)) and not isinstance(s, bool) and 0 <= s <= 1 for s in numbers
        ):
            raise InvalidArgumentError(
                f"evict: reconstruction_share must be a number in [0, 1], or a list of them with one per layer "
                f"({len(self.keep)}), got {shares!r}"
            )
        pool = self.pool_repeats
        if isinstance(pool, bool) or not isinstance(pool, int) or pool < 0:
            raise InvalidArgumentError(f"evict: pool_repeats must be a whole number >= 0, got {pool!r}")
        if pool and self.prefill_score != "reconstruction":
            raise InvalidArgumentError(
                "evict: pool_repeats pools the reconstruction's scores: it needs prefill_score 'reconstruction'"
            )
        if isinstance(self.sinks, list):
            object.__setattr__(self, "sinks", tuple(self.sinks))
        counts = self.sinks if isinstance(self.sinks, tuple) else (self.sinks,)
        if (isinstance(self.sinks, tuple) and len(counts) != len(self.keep)) or not all(
            isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts
        ):
            raise InvalidArgumentError(
                f"evict: sinks must be a whole number of tokens >= 0, or a list of them with one per layer "
                f"({len(self.keep)}), got {self.sinks!r}"
            )
        if self.floor is not None and len(self.floor.key_ranks) != len(self.keep):
            raise InvalidArgumentError(f"evict: the floor needs ranks for every layer ({len(self.keep)})")

    @property
    def num_layers(self) -> int:
        return len(self.kept_key_ranks)

    @property
    def reconstruction_shares(self) -> tuple[float, ...]:
        """reconstruction_share per layer."""
        share = self.reconstruction_share
        return share if isinstance(share, tuple) else (share,) * len(self.keep)

    @property
    def layer_sinks(self) -> tuple[int, ...]:
        """sinks per layer."""
        return self.sinks if isinstance(self.sinks, tuple) else (self.sinks,) * len(self.keep)

    @property
    def changes_between_forwards(self) -> bool:
        # Tokens are quantized and evicted only after a forward: measure with chunked feeding.
        return True

    @property
    def codec(self) -> None:
        """No block codec: kept tokens are quantized per token (`bits`)."""
        return None

    @property
    def side_bits(self) -> dict[str, int | None]:
        """{"key": bits, "value": bits} (None: float16)."""
        return side_bits(self.bits)

    def make_layers(self, head_dim: int, layer_codecs: list | None, storage_dtype, capacity: int | None = None) -> list:
        """One EvictingLayer per decoder layer; `capacity`: the longest sequence the cache will hold (None: unknown,
        the stores then hold exactly their rows)."""
        if layer_codecs is not None:
            raise InvalidArgumentError("an eviction policy quantizes per token itself; it takes no block codec")
        widths = [r for ranks in self.kept_key_ranks + self.kept_value_ranks for r in ranks]
        if self.floor is not None and self.floor.bits is not None:
            widths += [r for ranks in self.floor.key_ranks + self.floor.value_ranks for r in ranks]
        rotations = None
        if any(b is not None for b in self.side_bits.values()) or (self.floor is not None and self.floor.bits):
            rotations = block_rotations(widths)
        shares = self.reconstruction_shares
        sinks = self.layer_sinks
        return [
            EvictingLayer(
                self.window,
                head_dim,
                self.kept_key_ranks[i],
                self.kept_value_ranks[i],
                self.keep[i],
                self.bits,
                self.group_size,
                self.observed_queries,
                storage_dtype,
                rotations,
                floor=None
                if self.floor is None
                else (self.floor.key_ranks[i], self.floor.value_ranks[i], self.floor.bits),
                reconstruction_share=shares[i],
                pool_repeats=self.pool_repeats,
                sinks=sinks[i],
                capacity=capacity,
            )
            for i in range(self.num_layers)
        ]


def side_bits(bits) -> dict[str, int | None]:
    """`bits` as {"key": ..., "value": ...}: one number (or None) for both sides, or a (key, value) pair."""
    key_bits, value_bits = tuple(bits) if isinstance(bits, (tuple, list)) else (bits, bits)
    return {"key": key_bits, "value": value_bits}


def eviction_policy_for_rate(
    spec,
    rate: float,
    window: int,
    keep: float | list[float],
    *,
    bits=None,
    group_size: int = DEFAULT_GROUP_SIZE,
    observed_queries: int = DEFAULT_OBSERVED_QUERIES,
    floor: dict | None = None,
    prefill_score: str = "newest",
    reconstruction_share: float | list[float] | tuple[float, ...] = 1.0,
    pool_repeats: int = 0,
    sinks: int | list[int] | tuple[int, ...] = 0,
) -> EvictionPolicy:
    """Kept tokens at the ranks of `rate` in the checkpoint's rate table (kvrewrite.spec.CompressionSpec).

    floor: {"key": dims per head, "value": dims per head (default: key's), "bits": 8 | 4 | 2 | None (default 4)},
    widths one for every layer or one per layer; evicted tokens then keep that much (tiers/floor.py)."""
    key_ranks, value_ranks = spec.ranks_for_rate(rate)
    shares = [keep] * spec.num_layers if isinstance(keep, (int, float)) else list(keep)
    kept_k = tuple(tuple(k) for k in key_ranks)
    kept_v = tuple(tuple(v) for v in value_ranks)
    floor_tier = None
    if floor is not None:
        unknown = set(floor) - {"key", "value", "bits"}
        if unknown or "key" not in floor:
            raise InvalidArgumentError(f"evict= floor takes key and optionally value and bits; got {sorted(floor)}")
        floor_tier = floor_policy(
            kept_k, kept_v, floor["key"], floor.get("value", floor["key"]), floor.get("bits", DEFAULT_FLOOR_BITS)
        )
    return EvictionPolicy(
        window=window,
        kept_key_ranks=kept_k,
        kept_value_ranks=kept_v,
        keep=tuple(float(k) for k in shares),
        bits=tuple(bits) if isinstance(bits, list) else bits,
        group_size=group_size,
        observed_queries=observed_queries,
        floor=floor_tier,
        prefill_score=prefill_score,
        reconstruction_share=reconstruction_share,  # a list becomes a tuple in EvictionPolicy
        pool_repeats=pool_repeats,
        sinks=sinks,  # a list becomes a tuple in EvictionPolicy
    )


# ---- per-token storage of the kept tier ------------------------------------------------------------------


def block_rotations(widths) -> dict[int, torch.Tensor]:
    """{r: [r, r]}: one fixed random orthogonal matrix per block width, seeded by the width (the same in every
    process). One dict is shared by all layers of a cache, so the byte walk counts each matrix once."""
    rotations = {}
    for r in sorted(set(widths)):
        if r == 0:
            continue
        generator = torch.Generator().manual_seed(1_000_003 + r)
        q, upper = torch.linalg.qr(torch.randn(r, r, generator=generator, dtype=torch.float64))
        rotations[r] = (q * torch.sign(torch.diagonal(upper))).float()  # sign fix: a unique Haar-random Q
    return rotations


def encode_tokens(
    x: torch.Tensor, bits: int | None, group_size: int, storage_dtype: torch.dtype = STORAGE_DTYPE
) -> dict[str, torch.Tensor]:
    """[B, S, C] latents -> what the kept tier stores for them, every tensor [B, S, ...] (tokens independent):
    the latents in `storage_dtype` without bits, else packed codes and a float16 scale and minimum per group."""
    if bits is None:
        return {"latents": x.to(storage_dtype)}
    batch, n, channels = x.shape
    if n == 0:  # the packer cannot shape zero tokens
        groups = -(-channels // group_size)
        return {
            "codes": x.new_empty((batch, 0, packed_length(channels, bits)), dtype=torch.uint8),
            "scale": x.new_empty((batch, 0, groups), dtype=META_DTYPE),
            "low": x.new_empty((batch, 0, groups), dtype=META_DTYPE),
        }
    coded = kivi_encode(x.float().unsqueeze(2), "value", bits, group_size)  # one "block" of one token each
    return {"codes": coded["codes"], "scale": coded["scale"].squeeze(2), "low": coded["low"].squeeze(2)}


def decode_tokens(
    stored: dict[str, torch.Tensor], channels: int, bits: int | None, group_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """Inverse of encode_tokens -> [B, 1, S, C]."""
    if bits is None:
        return stored["latents"].to(dtype).unsqueeze(1)
    scale, low = stored["scale"], stored["low"]
    groups = scale.shape[-1]
    if groups * group_size != channels:  # a last group shorter than the others
        coded = {"codes": stored["codes"], "scale": scale.unsqueeze(2), "low": low.unsqueeze(2)}
        return kivi_decode(coded, "value", bits, group_size, 1, channels).squeeze(2).unsqueeze(1).to(dtype)
    # kivi_decode's arithmetic (codes x scale + minimum, in float32) on whole groups: no per-channel copy of the
    # scales, and in place.
    batch, n = scale.shape[:2]
    # .float() of a strided slice writes a dense result directly (asking for contiguous_format is ten times slower)
    decoded = unpack_bits(stored["codes"], bits, channels).float().contiguous()
    grouped = decoded.view(batch, n, groups, group_size)
    grouped.mul_(scale.float().unsqueeze(-1)).add_(low.float().unsqueeze(-1))
    return decoded.unsqueeze(1).to(dtype)


def decode_head_blocks(
    stored: dict[str, torch.Tensor], ranks: tuple[int, ...], bits: int | None, group_size: int, dtype: torch.dtype
) -> list[torch.Tensor]:
    """decode_tokens, one contiguous [B, 1, S, r] block per head (widths `ranks`): what attention multiplies, with
    no copy of a head's columns out of the whole store, and in allocations of one head's size (on a CPU, one
    allocation of a whole 8K-token store costs more than decoding it)."""
    starts = [sum(ranks[:g]) for g in range(len(ranks))]
    aligned = bits is not None and all(
        start % group_size == 0 and r % group_size == 0 and start * bits % 8 == 0 for start, r in zip(starts, ranks)
    )
    if bits is not None and not aligned:  # heads that split a group: decode the whole store once, then cut it
        whole = decode_tokens(stored, sum(ranks), bits, group_size, dtype)
        return [whole[..., start : start + r].contiguous() for start, r in zip(starts, ranks)]
    blocks = []
    for start, r in zip(starts, ranks):
        if bits is None:
            blocks.append(stored["latents"][..., start : start + r].to(dtype).unsqueeze(1))
            continue
        first, last = start // group_size, (start + r) // group_size
        coded = {
            "codes": stored["codes"][..., start * bits // 8 : (start + r) * bits // 8],
            "scale": stored["scale"][..., first:last],
            "low": stored["low"][..., first:last],
        }
        blocks.append(decode_tokens(coded, r, bits, group_size, dtype))
    return blocks


kept_token_bytes = coded_token_bytes  # one kept token's latents of one side: the formula the stored tensors match


class EvictingLayer(RecentWindowLayer):
    """Recent window at full rank; beyond it the kept tier, re-scored and cut to its budget after every forward."""

    stored_tensor_names = ("keys", "values", "kept_positions", "floor_positions")
    stored_dict_names = ("kept_keys", "kept_values", "channel_stats", "floor_keys", "floor_values", "floor_stats")

    def __init__(
        self,
        window: int,
        head_dim: int,
        kept_key_ranks: tuple[int, ...],
        kept_value_ranks: tuple[int, ...],
        keep: float,
        bits=None,
        group_size: int = DEFAULT_GROUP_SIZE,
        observed_queries: int = DEFAULT_OBSERVED_QUERIES,
        storage_dtype: torch.dtype = STORAGE_DTYPE,
        rotations: dict[int, torch.Tensor] | None = None,
        floor: tuple[tuple[int, ...], tuple[int, ...], int | None] | None = None,
        reconstruction_share: float = 1.0,
        pool_repeats: int = 0,
        sinks: int = 0,
        capacity: int | None = None,
    ):
        super().__init__(window, head_dim, storage_dtype)
        # The longest sequence this cache will hold (None: unknown); it sizes the stores' buffers (tiers/kept_store.py).
        self.capacity = capacity
        self.kept_key_ranks, self.kept_value_ranks = tuple(kept_key_ranks), tuple(kept_value_ranks)
        self.keep, self.group_size = keep, group_size
        self.side_bits = side_bits(bits)
        quantized = any(b is not None for b in self.side_bits.values())
        self.observed_queries = self._policy_observed_queries = observed_queries
        # With bits: each head's kept block is turned by rotations[width] before quantizing (see the module docstring).
        floor_quantized = floor is not None and floor[2] is not None
        if (quantized or floor_quantized) and rotations is None:
            widths = self.kept_key_ranks + self.kept_value_ranks + (floor[0] + floor[1] if floor_quantized else ())
            rotations = block_rotations(widths)
        self.rotations = rotations if (quantized or floor_quantized) else None
        self.kept_keys: dict[str, torch.Tensor] | None = None
        self.kept_values: dict[str, torch.Tensor] | None = None
        self.kept_positions: torch.Tensor | None = None
        self.channel_stats: dict[str, torch.Tensor] | None = None  # with bits: [B, C] per side, set at the first settle
        # The floor (tiers/floor.py): (key ranks, value ranks, bits) of what an evicted token keeps; None drops it.
        self.floor_key_ranks, self.floor_value_ranks, self.floor_bits = floor if floor else (None, None, None)
        self.floor_keys: dict[str, torch.Tensor] | None = None
        self.floor_values: dict[str, torch.Tensor] | None = None
        self.floor_positions: torch.Tensor | None = None
        self.floor_stats: dict[str, torch.Tensor] | None = None  # with floor bits: [B, C] per side, first demotion
        # One forward's evidence, handed over by attention and consumed by settle(); never held between forwards.
        self._received_recent: torch.Tensor | None = None
        self._received_kept: torch.Tensor | None = None
        # Holding (tiers/reconstruction.py): settle() moves nothing while a context is scored as a whole; the max
        # attention its first `_collect_length` tokens receive is collected across forwards.
        self.holding = False
        self._collect_length = 0
        self._collected: torch.Tensor | None = None
        self.reconstruction_share = reconstruction_share
        self.pool_repeats = pool_repeats
        self.sinks = sinks
        self._held_newest: torch.Tensor | None = None  # while held, before collect(): the last forward's evidence
        # The buffers the kept tier and the floor are prefix views of, by flat name ("key.codes", "positions").
        self.kept_buffers: dict[str, torch.Tensor] = {}
        self.floor_buffers: dict[str, torch.Tensor] = {}
        # Derived from the channel statistics and k_up by the CUDA decode path (tiers/kept_decode.py), once per
        # sequence; not cache content, so not a stored tensor, and dropped wherever the statistics change.
        self.kernel_maps = None
        # The settle kernel's tables per side (tiers/kept_settle.py): fixed, like the ranks and rotations.
        self.settle_tables: dict | None = None

    wanted_evidence = ("recent", "stored")

    @property
    def beyond_window_ranks(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return self.kept_key_ranks, self.kept_value_ranks

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        batch = key_states.shape[0]
        self.kept_buffers, self.floor_buffers = {}, {}
        self.keys = key_states.new_empty((batch, 1, 0, key_states.shape[-1]), dtype=self.storage_dtype)
        self.values = value_states.new_empty((batch, 1, 0, value_states.shape[-1]), dtype=self.storage_dtype)
        for side, ranks in (("key", self.kept_key_ranks), ("value", self.kept_value_ranks)):
            setattr(
                self,
                f"kept_{side}s",
                encode_tokens(
                    key_states.new_empty((batch, 0, sum(ranks))),
                    self.side_bits[side],
                    self.group_size,
                    self.storage_dtype,
                ),
            )
        self.kept_positions = key_states.new_empty((batch, 0), dtype=POSITION_DTYPE)
        if self.floor_key_ranks is not None:
            for side, ranks in (("key", self.floor_key_ranks), ("value", self.floor_value_ranks)):
                empty = key_states.new_empty((batch, 0, sum(ranks)))
                coded = encode_tokens(empty, self._floor_side_bits(ranks), self.group_size, self.storage_dtype)
                setattr(self, f"floor_{side}s", coded)
            self.floor_positions = key_states.new_empty((batch, 0), dtype=POSITION_DTYPE)
        self.is_initialized = True

    # ---- writes --------------------------------------------------------------------------------------------
    def add_scores(
        self,
        received: torch.Tensor | None,
        received_stored: list[torch.Tensor] | None,
        denominators: torch.Tensor | None,
    ) -> None:
        """Attention the recent [B, S_recent] and kept [B, S_kept] tokens received from this forward's observed queries."""
        self._received_recent = received
        self._received_kept = received_stored[0] if received_stored else None

    def hold(self) -> None:
        """Keep every token in the recent window until release(): forwards add tokens, settle() moves none."""
        if self.is_initialized and self.kept_positions is not None and self.kept_positions.shape[-1]:
            raise InvalidArgumentError(
                "hold() needs a cache whose tokens are all in the recent window (a new sequence)"
            )
        self.holding = True

    def collect(self, length: int) -> None:
        """From now until release(), collect the max attention (over heads and every query) the first `length`
        tokens receive."""
        self._collect_length, self._collected = length, None
        self.evidence_reduce, self.observed_queries = "max", None

    def pool_repeated_evidence(self, context_ids: torch.Tensor) -> None:
        """With pool_repeats: the collected scores of the context `context_ids` [B, n] with each repeated n-gram's
        scores summed into its best copy (tiers/repeated_evidence.py); call between the scoring and release()."""
        if not self.pool_repeats or self._collected is None:
            return
        from kvrewrite.runtime.tiers.repeated_evidence import pool_repeated_ngrams

        n = min(self._collected.shape[-1], context_ids.shape[-1])
        pooled = pool_repeated_ngrams(
            self._collected[:, :n], context_ids[:, :n].to(self._collected.device), self.pool_repeats
        )
        self._collected = torch.cat([pooled, self._collected[:, n:]], dim=-1)

    def release(self) -> None:
        """Stop holding: settle once, with the collected scores deciding which tokens the kept tier keeps."""
        scores, newest = self._collected, self._held_newest
        self.evidence_reduce, self.observed_queries = "sum", self._policy_observed_queries
        self.holding, self._collect_length, self._collected, self._held_newest = False, 0, None, None
        if not self.is_initialized:
            return
        n = self.keys.shape[-2]
        if scores is not None and scores.shape[-1] >= n:
            # Sinks go first in the reconstruction's own ranking (so its share counts them, as far as it
            # reaches), and above the last queries' choice too.
            first = self.cumulative_length - n
            scores = self._with_sinks(scores[:, :n], first)
            if self.reconstruction_share < 1 and newest is not None and newest.shape[-1] >= n:
                scores = self._with_sinks(self._mixed_scores(scores, newest[:, :n]), first)
            self._received_recent = scores
            self._received_kept = scores.new_zeros((scores.shape[0], 0))
        self.settle()

    def budget(self, beyond: int) -> int:
        """Kept rows for `beyond` tokens seen past the window: the share `keep` of them, and never fewer than the
        sinks among them (so a short sequence's sinks are not evicted before the share reaches them)."""
        return max(round(self.keep * beyond), min(self.sinks, beyond))

    def _with_sinks(self, scores: torch.Tensor, first: int | torch.Tensor) -> torch.Tensor:
        """`scores` [B, n] of the tokens at positions `first` + 0..n-1 (or at the positions [B, n] given), with the
        sinks' raised above every other token's."""
        if not self.sinks:
            return scores
        if isinstance(first, int):
            if first >= self.sinks:
                return scores
            sink = torch.arange(first, first + scores.shape[-1], device=scores.device) < self.sinks
        else:
            sink = first < self.sinks
        return scores.masked_fill(sink, float("inf"))

    def _mixed_scores(self, reconstruction: torch.Tensor, newest: torch.Tensor) -> torch.Tensor:
        """[B, n] scores whose top budget is the reconstruction_share of the budget the reconstruction ranks
        highest, then the tokens the prompt's last queries read most among the rest (the settle's budget)."""
        beyond = reconstruction.shape[-1] - self.window
        if beyond <= 0:
            return reconstruction
        chosen = round(self.reconstruction_share * self.budget(beyond))
        scores = newest[:, :beyond]
        if chosen:  # the reconstruction's top above any attention: the settle's top budget takes them first
            # (the held context is in cache order: a stable sort leaves the older of equal scores first)
            first = reconstruction[:, :beyond].sort(dim=-1, descending=True, stable=True).indices[:, :chosen]
            scores = scores.scatter(1, first, float("inf"))
        return torch.cat([scores, reconstruction[:, beyond:]], dim=-1)

    def settle(self) -> None:
        """Move tokens older than the window into the kept tier, then evict down to the budget by this forward's scores."""
        if self.holding:
            received = self._received_recent
            if not self._collect_length and received is not None:
                self._held_newest = received  # the context's own newest queries, kept for a mixed prefill choice
            if self._collect_length and received is not None:
                received = received[:, : self._collect_length]
                self._collected = received if self._collected is None else torch.maximum(self._collected, received)
            self._received_recent = self._received_kept = None
            return
        beyond = self.keys.shape[-2] - self.window
        if settle_in_kernel(self, beyond):  # a decode step on CUDA: one launch, no wait for the device
            return
        kept_scores, moving, moving_scores = self._received_kept, None, None
        if beyond > 0:
            first = self.cumulative_length - self.keys.shape[-2]
            key_cols = self._columns(self.kept_key_ranks)
            value_cols = self._columns(self.kept_value_ranks)
            if self.rotations is not None and self.channel_stats is None:
                self.channel_stats = {}
                for side, store, cols in (("key", self.keys, key_cols), ("value", self.values, value_cols)):
                    if self.side_bits[side] is not None:
                        self.channel_stats.update(_channel_stats(take_columns(store[:, 0], cols), side))
            moving_k = self._to_code_space(take_columns(self.keys[:, 0, :beyond], key_cols), "key")
            moving_v = self._to_code_space(take_columns(self.values[:, 0, :beyond], value_cols), "value")
            batch = self.keys.shape[0]
            positions = torch.arange(first, first + beyond, device=self.keys.device, dtype=POSITION_DTYPE)
            moving = _flat(
                encode_tokens(moving_k, self.side_bits["key"], self.group_size, self.storage_dtype),
                encode_tokens(moving_v, self.side_bits["value"], self.group_size, self.storage_dtype),
                positions[None].expand(batch, beyond),
            )
            if kept_scores is not None and self._received_recent is not None:
                moving_scores = self._received_recent[:, :beyond]
            self._leave_window(beyond)
        self._received_recent = self._received_kept = None
        seen_beyond = self.cumulative_length - self.keys.shape[-2]
        self._admit(moving, kept_scores, moving_scores, self.budget(seen_beyond))

    def _admit(
        self,
        moving: dict[str, torch.Tensor] | None,
        kept_scores: torch.Tensor | None,
        moving_scores: torch.Tensor | None,
        budget: int,
    ) -> None:
        """The kept tier's top `budget` of its tokens and the `moving` ones (flat store of [B, n, ...]) stay: the
        moving tokens that stay take the rows evicted tokens free, then rows past the end; only those are written."""
        store = self._store("kept")
        n_old = self.kept_positions.shape[-1]
        n_new = 0 if moving is None else moving["positions"].shape[-1]
        rows = n_old + n_new
        if rows <= budget:  # nothing to evict: the moving tokens join at the end
            if n_new:
                slots = torch.arange(n_old, rows, device=moving["positions"].device)
                self._write("kept", rows, slots[None].expand(moving["positions"].shape[0], n_new), moving)
            return
        positions = self.kept_positions if not n_new else torch.cat([self.kept_positions, moving["positions"]], -1)
        scores = None
        if kept_scores is not None and kept_scores.shape[-1] == n_old and (not n_new or moving_scores is not None):
            scores = kept_scores if not n_new else torch.cat([kept_scores, moving_scores], dim=-1)
        if scores is None:
            # No evidence for every kept token (e.g. tokens settled outside attention): keep the newest.
            scores = positions.float()
        # [B, rows], kept tier first, then the moving tokens
        stays = _top_mask(self._with_sinks(scores, positions), positions, budget)
        if self.floor_key_ranks is not None:
            evicted = _in_cache_order((~stays).nonzero()[:, 1].view(stays.shape[0], -1), positions)
            self._demote(joined_rows(store, moving, evicted) if n_new else take_rows(store, evicted))
        if budget < n_old:  # the budget shrank (it never does while keep is fixed): rebuild the store, in order
            chosen = _in_cache_order(stays.nonzero()[:, 1].view(stays.shape[0], -1), positions)
            self._set_store("kept", joined_rows(store, moving, chosen) if n_new else take_rows(store, chosen))
            self.kept_buffers = {}
            return
        if not n_new:
            return
        old_evicted = ~stays[:, :n_old]
        new_stays = stays[:, n_old:]
        freed = old_evicted.sum(dim=-1, keepdim=True)  # [B, 1]: rows freed in the kept tier
        order = new_stays.long().cumsum(dim=-1) - 1  # each staying moving token's rank among them
        slots = n_old + order - freed  # past the end, once the freed rows are taken
        most_freed = min(n_new, n_old)
        if most_freed:
            index = torch.arange(n_old, device=stays.device)
            first_freed = torch.where(old_evicted, index, n_old).topk(most_freed, dim=-1, largest=False).values
            from_freed = first_freed.gather(1, order.clamp(0, most_freed - 1))
            slots = torch.where(order < freed, from_freed, slots)
        self._write("kept", budget, slots, moving, new_stays)

    def _store(self, tier: str) -> dict[str, torch.Tensor]:
        """The kept tier's (or the floor's) tensors as one flat store: "key.<name>", "value.<name>", "positions"."""
        return _flat(getattr(self, f"{tier}_keys"), getattr(self, f"{tier}_values"), getattr(self, f"{tier}_positions"))

    def _set_store(self, tier: str, store: dict[str, torch.Tensor]) -> None:
        for side in ("key", "value"):
            prefix = side + "."
            setattr(self, f"{tier}_{side}s", {n[len(prefix) :]: t for n, t in store.items() if n.startswith(prefix)})
        setattr(self, f"{tier}_positions", store["positions"])

    def _write(
        self,
        tier: str,
        rows: int,
        slots: torch.Tensor,
        new: dict[str, torch.Tensor],
        chosen: torch.Tensor | None = None,
    ) -> None:
        """Grow the tier's store to `rows` rows (in place where its buffers have room) and write the new tokens
        `chosen` (None: all) into their `slots`."""
        write_rows(self._grown_store(tier, rows), slots, new, chosen)

    def _grown_store(self, tier: str, rows: int) -> dict[str, torch.Tensor]:
        """The tier's store as `rows` rows, its own first (in place where its buffers have room); the rows past them
        are the caller's to write."""
        capacity = capacity_rows(self.capacity, self.window, self.keep, self.sinks)[0 if tier == "kept" else 1]
        store = reserve_rows(getattr(self, f"{tier}_buffers"), self._store(tier), rows, capacity)
        self._set_store(tier, store)
        return store

    def _demote(self, evicted: dict[str, torch.Tensor]) -> None:
        """Move evicted kept tokens (a flat store [B, n, ...] of them) to the floor: each head's first floor dims,
        coded per token."""
        moved = {}
        for side, kept_ranks, floor_ranks in (
            ("key", self.kept_key_ranks, self.floor_key_ranks),
            ("value", self.kept_value_ranks, self.floor_value_ranks),
        ):
            coded = {n[len(side) + 1 :]: t for n, t in evicted.items() if n.startswith(side + ".")}
            latents = decode_tokens(coded, sum(kept_ranks), self.side_bits[side], self.group_size, torch.float32)
            latents = self._from_code_space(latents[:, 0], side)
            moved[side] = take_columns(latents, floor_columns(kept_ranks, floor_ranks, latents.device))
        if self.floor_bits is not None and self.floor_stats is None:
            # The floor's per-channel centre and scale: the kept tier's (set over the window) where it has them,
            # else those of the first demoted tokens of the sequence.
            self.floor_stats = {}
            for side, kept_ranks, floor_ranks in (
                ("key", self.kept_key_ranks, self.floor_key_ranks),
                ("value", self.kept_value_ranks, self.floor_value_ranks),
            ):
                if self.channel_stats is not None and side + "_mean" in self.channel_stats:
                    columns = floor_columns(kept_ranks, floor_ranks, moved[side].device)
                    for stat in ("_mean", "_rms"):
                        self.floor_stats[side + stat] = self.channel_stats[side + stat].index_select(-1, columns)
                else:
                    self.floor_stats.update(_channel_stats(moved[side], side))
        coded = [
            encode_tokens(
                self._to_code_space(moved[side], side, floor=True),
                self._floor_side_bits(ranks),
                self.group_size,
                self.storage_dtype,
            )
            for side, ranks in (("key", self.floor_key_ranks), ("value", self.floor_value_ranks))
        ]
        positions = evicted["positions"]
        n_old, n_new = self.floor_positions.shape[-1], positions.shape[-1]
        slots = torch.arange(n_old, n_old + n_new, device=positions.device)[None].expand(positions.shape[0], n_new)
        self._write("floor", n_old + n_new, slots, _flat(*coded, positions))

    def _floor_side_bits(self, ranks: tuple[int, ...]) -> int | None:
        """A side the floor keeps no dim of holds an empty float16 run (nothing to quantize)."""
        return self.floor_bits if sum(ranks) else None

    def _to_code_space(self, x: torch.Tensor, side: str, floor: bool = False) -> torch.Tensor:
        """[B, S, C] latents of the kept tier (or the floor) -> what is quantized per token: centred and scaled per
        channel by that tier's statistics, each head's block turned."""
        stats, ranks = self._code_space(side, floor)
        if stats is None:
            return x
        return self._turn((x.float() - stats[0]) / stats[1], ranks)

    def _from_code_space(self, y: torch.Tensor, side: str, floor: bool = False) -> torch.Tensor:
        stats, ranks = self._code_space(side, floor)
        if stats is None:
            return y
        return self._turn(y, ranks, inverse=True) * stats[1] + stats[0]

    def _code_space(self, side: str, floor: bool) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, tuple[int, ...]]:
        """(mean, rms) [B, 1, C] of a tier's side and its head widths; no statistics where the side is not quantized
        or nothing has been stored yet (then there is nothing to turn)."""
        if floor:
            ranks = self.floor_key_ranks if side == "key" else self.floor_value_ranks
            stats = self.floor_stats if self.floor_bits is not None else None
        else:
            ranks = self.kept_key_ranks if side == "key" else self.kept_value_ranks
            stats = self.channel_stats if self.side_bits[side] is not None else None
        if stats is None:
            return None, ranks
        return (stats[side + "_mean"].float()[:, None], stats[side + "_rms"].float()[:, None]), ranks

    def _turn(self, x: torch.Tensor, ranks: tuple[int, ...], inverse: bool = False) -> torch.Tensor:
        """Turn every head's block (widths `ranks`) of packed latents [..., C] by its width's rotation (or back)."""
        blocks, start = [], 0
        for r in ranks:
            block = x[..., start : start + r].float()
            if r:
                rotation = self.rotations[r].to(x.device)
                block = block @ (rotation.T if inverse else rotation)
            blocks.append(block)
            start += r
        return torch.cat(blocks, dim=-1)

    # ---- reads ---------------------------------------------------------------------------------------------
    def stored_tiers(self, dtype: torch.dtype) -> list:
        """The kept tier (and the floor) as attention reads them: the codes decoded to the code space they were
        quantized in, with each head's map back to its latent (StoredTier.key_maps), which attention applies to the
        query and to the weighted value sum instead of to every stored token."""
        from kvrewrite.runtime.tiers.attention import StoredTier

        tiers = []
        for floor, prefix in ((False, "kept"), (True, "floor")):
            positions = getattr(self, f"{prefix}_positions")
            if floor and (positions is None or not positions.shape[-1]):
                continue
            read = {}
            for side in ("key", "value"):
                ranks = self._code_space(side, floor)[1]
                bits = self._floor_side_bits(ranks) if floor else self.side_bits[side]
                coded = getattr(self, f"{prefix}_{side}s")
                read[side] = decode_head_blocks(coded, ranks, bits, self.group_size, dtype)
                read[side + "_ranks"], read[side + "_maps"] = ranks, self.head_maps(side, floor, dtype)
            tiers.append(
                StoredTier(
                    read["key"],
                    read["value"],
                    read["key_ranks"],
                    read["value_ranks"],
                    positions,
                    read["key_maps"],
                    read["value_maps"],
                )
            )
        return tiers

    def head_maps(self, side: str, floor: bool, dtype: torch.dtype) -> list | None:
        """Per head, (matrix [B, r, r], offset [B, r]) such that its latent is code @ matrix + offset (the inverse of
        _to_code_space: x = (y R^T) rms + mean, so matrix = R^T diag(rms)); None where the side is stored as is."""
        stats, ranks = self._code_space(side, floor)
        if stats is None:
            return None
        mean, rms = stats[0][:, 0], stats[1][:, 0]  # [B, C]
        maps, start = [], 0
        for r in ranks:
            if not r:
                maps.append(None)
                continue
            rotation = self.rotations[r].to(mean.device)
            matrix = rotation.T[None] * rms[:, None, start : start + r]
            maps.append((matrix.to(dtype), mean[:, start : start + r].to(dtype)))
            start += r
        return maps

    def reset(self) -> None:
        super().reset()
        # The channel statistics belong to the sequence that set them: the next one sets its own at its first settle.
        self.kept_keys = self.kept_values = self.kept_positions = self.channel_stats = None
        self.floor_keys = self.floor_values = self.floor_positions = self.floor_stats = None
        self._received_recent = self._received_kept = None
        self.kept_buffers, self.floor_buffers = {}, {}
        self.kernel_maps = None

    def _map_batch(self, fn) -> None:
        # Beam search, batch selection and offloading replace the stored tensors: the next write starts new buffers,
        # and the maps derived from the statistics are made again from the new rows.
        super()._map_batch(fn)
        self.kept_buffers, self.floor_buffers = {}, {}
        self.kernel_maps = None


def _channel_stats(x: torch.Tensor, side: str) -> dict[str, torch.Tensor]:
    """[B, S, C] -> float16 per-channel mean and root mean square about it, [B, C] each (the rms floored so a
    silent channel divides safely)."""
    x = x.float()
    mean = x.mean(dim=1)
    rms = (x - mean[:, None]).pow(2).mean(dim=1).sqrt().clamp_min(1e-4)
    return {side + "_mean": mean.to(META_DTYPE), side + "_rms": rms.to(META_DTYPE)}


def _flat(keys: dict[str, torch.Tensor], values: dict[str, torch.Tensor], positions: torch.Tensor) -> dict:
    """One tier's key and value stores and cache indices as a flat store (tiers/kept_store.py)."""
    return {
        **{f"key.{name}": t for name, t in keys.items()},
        **{f"value.{name}": t for name, t in values.items()},
        "positions": positions,
    }


def _top_mask(scores: torch.Tensor, positions: torch.Tensor, budget: int) -> torch.Tensor:
    """[B, n] bool: the `budget` top-scored tokens of every row.

    Where tokens tie at the threshold, the older ones (lower cache index) stay: rows are in no order and topk's
    order among equals is unspecified, so ties are ranked explicitly (tiers/kept_settle.py's kernel ranks them the
    same way)."""
    stays = torch.zeros_like(scores, dtype=torch.bool)
    if budget <= 0:
        return stays
    top = scores.topk(budget, dim=-1)
    threshold = top.values[:, -1:]
    tied = (scores == threshold).sum(dim=-1) > (top.values == threshold).sum(dim=-1)
    index = top.indices
    if bool(tied.any()):
        order = positions.argsort(dim=-1)  # cache order; a stable sort keeps it among equal scores
        ranked = scores.gather(1, order).sort(dim=-1, descending=True, stable=True).indices[:, :budget]
        index = order.gather(1, ranked)
    return stays.scatter_(1, index, True)


def _in_cache_order(index: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Token indices [B, n] sorted by their cache indices `positions` [B, S]."""
    return index.gather(1, positions.gather(1, index).argsort(dim=-1))
