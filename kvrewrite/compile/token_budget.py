"""A KV byte budget split across window, ranks, bits and eviction, by measured quality on calibration text.

`candidates` enumerates re-scored eviction policies (kvrewrite.runtime.tiers.eviction) over one checkpoint: a
full-rank window W, the kept tokens' rate (a point of the checkpoint's rate table) and bits, how a prompt's kept
tokens are chosen (re-scored as they come, or by the prompt's reconstruction: runtime.tiers.reconstruction) and
whether evicted tokens keep a floor of dims (runtime.tiers.floor), and, for quantized kept tokens, how many channels
share one (scale, minimum) pair (64, or the whole token side: fewer bytes per token, so more tokens). For each, `solve_keep`
solves the share of tokens kept beyond the window that fills the budget at the stated context length (from the bytes
formula `held_bytes`, the one the cache's tensors are tested against); `measure` measures continuation NLL on
calibration windows fed in chunks, as decoding reads the cache, and `choose` takes the candidate with the lowest
NLL, or, given a perplexity slack, the lowest-NLL one among those within it of the best that still answer planted-key
probes about as well as the full-rank cache (kvrewrite.compile.key_probes: calibration perplexity cannot see a policy
that drops what a later question asks).
`write_token_policy` records its CachePolicy in the checkpoint (token_policy.json, added to the checksums), and
kvrewrite.load uses it when no cache policy is asked for. The search over a checkpoint that strings these together
is `split_budget` (kvrewrite.compile.budget_search, behind `kvrewrite budget`).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from kvrewrite.errors import InvalidArgumentError
from kvrewrite.runtime.cache_policy import CachePolicy, Eviction, Floor
from kvrewrite.runtime.tiers.eviction import (
    DEFAULT_GROUP_SIZE,
    EvictionPolicy,
    eviction_policy_for_rate,
    kept_token_bytes,
    side_bits,
)
from kvrewrite.runtime.tiers.floor import floor_token_bytes
from kvrewrite.runtime.tiers.token_policy_file import TOKEN_POLICY_FILE, policy_record
from kvrewrite.spec import rate_key

DEFAULT_WINDOWS = (16, 64)
DEFAULT_RATES = (0.0, 0.3, 0.5)
DEFAULT_BITS = (None, 8, (8, 4), 4)  # (8, 4): keys at 8 bits, values at 4
DEFAULT_PREFILL_SCORES = ("newest", "reconstruction")
# With "reconstruction": the shares of a prompt's kept budget its reconstruction chooses (EvictionPolicy).
# A half found the most keys at a sixteenth, and of several competing keys at an eighth (docs/results/frontier.md).
DEFAULT_RECONSTRUCTION_SHARES = (1.0, 0.5, 0.25)
DEFAULT_FLOORS = (0,)  # floor dims per head (keys and values, 4 bits); 0: evicted tokens leave
# Channels per (scale, minimum) pair of a quantized kept token: 64, or TOKEN_GROUP, one pair per token and side. At a
# quarter of the bytes the whole-token group kept 45.5% of the tokens instead of 44% and cost less perplexity
# (docs/results/frontier.md). The group is a second-order knob: the search measures every split at the first group
# size, then the REGROUPED best quantized ones again at each other (regrouped), not the whole cross product.
TOKEN_GROUP = "token"
DEFAULT_GROUP_SIZES = (DEFAULT_GROUP_SIZE, TOKEN_GROUP)
REGROUPED = 8
FLOOR_BITS = 4
MEASURE_CHUNK = 64  # tokens per forward while scoring: the cache quantizes and evicts between forwards
# A split holds the planted keys when its answers' mean NLL is at most this far (nats per answer token) above the
# full-rank cache's: the geometric mean of its answer tokens' probabilities is at least exp(-0.15) = 86% of that
# cache's.
KEY_NLL_MARGIN = 0.15


@dataclass(frozen=True)
class Candidate:
    """One split of the budget: what load() is given, and what it was measured at."""

    window: int
    rate: float
    bits: int | tuple[int | None, int | None] | None  # both sides, or (key bits, value bits); None: float16
    keep: float
    bytes_share: float  # of the fp16 cache at the budget's context length, from the formula
    nll: float | None = None  # mean NLL per scored calibration token
    measured_share: float | None = None  # held bytes per token on the calibration windows, of fp16
    prefill_score: str = "newest"  # how a prompt's kept tokens are chosen (EvictionPolicy.prefill_score)
    floor: int = 0  # key and value dims per head an evicted token keeps at FLOOR_BITS; 0: it leaves
    reconstruction_share: float = 1.0  # with prefill_score "reconstruction" (EvictionPolicy.reconstruction_share)
    key_nll: float | None = None  # mean NLL of the planted keys' answers (key_probes); None: not probed
    keys_answered: int | None = None  # probes whose key greedy decoding writes exactly
    group_size: int = DEFAULT_GROUP_SIZE  # channels per (scale, minimum) pair of a quantized kept token

    def policy(self) -> CachePolicy:
        """The cache policy load() builds this split with."""
        evict = Eviction(
            keep=self.keep,
            bits=self.bits,
            group_size=self.group_size,
            prefill_score=self.prefill_score,
            reconstruction_share=self.reconstruction_share if self.prefill_score == "reconstruction" else 1.0,
            floor=Floor(key=self.floor, value=self.floor, bits=FLOOR_BITS) if self.floor else None,
        )
        return CachePolicy(rate=self.rate, recent_window=self.window, kv_codec="none", evict=evict)

    def label(self) -> str:
        sides = side_bits(self.bits)
        bits = "fp16" if self.bits is None else f"k{sides['key'] or 16}v{sides['value'] or 16}"
        rec = " rec" + (f"{self.reconstruction_share:g}" if self.reconstruction_share < 1 else "")
        extra = (rec if self.prefill_score == "reconstruction" else "") + (f" floor{self.floor}" if self.floor else "")
        group = f"-g{self.group_size}" if self.group_size != DEFAULT_GROUP_SIZE else ""
        return f"W={self.window} p={self.rate:g} {bits}{group} keep={self.keep:.3f}{extra}"


def held_bytes(policy: EvictionPolicy, spec, context: int) -> int:
    """Bytes one batch row of the policy's cache holds after `context` tokens (window float16 at full rank, kept
    tokens' codes, scales and int32 cache indices, per-channel statistics, the shared rotations)."""
    full = 2 * 2 * spec.head_dim * spec.num_key_value_heads
    total = 0
    sides = policy.side_bits
    floor = policy.floor
    for i, (key_ranks, value_ranks, keep) in enumerate(
        zip(policy.kept_key_ranks, policy.kept_value_ranks, policy.keep)
    ):
        n_recent = min(policy.window, context)
        n_kept = round(keep * (context - n_recent))
        if floor is not None:  # every token beyond the window and not kept is demoted, with its statistics once
            n_floor = context - n_recent - n_kept
            fk, fv = floor.key_ranks[i], floor.value_ranks[i]
            total += n_floor * floor_token_bytes(fk, fv, floor.bits, policy.group_size)
            if n_floor and floor.bits is not None:
                total += 2 * 2 * (sum(fk) + sum(fv))
        per_kept = (
            sum(
                kept_token_bytes(sum(r), sides[side], policy.group_size)
                for side, r in (("key", key_ranks), ("value", value_ranks))
            )
            + 4
        )
        total += n_recent * full + n_kept * per_kept
        if context > n_recent:  # float16 mean and rms per channel of each quantized side, from the first settle
            total += sum(
                2 * 2 * sum(r) for side, r in (("key", key_ranks), ("value", value_ranks)) if sides[side] is not None
            )
    floor_coded = floor is not None and floor.bits is not None
    if any(b is not None for b in sides.values()) or floor_coded:  # built with the cache, shared by its layers
        widths = {r for ranks in policy.kept_key_ranks + policy.kept_value_ranks for r in ranks if r}
        if floor_coded:
            widths |= {r for ranks in floor.key_ranks + floor.value_ranks for r in ranks if r}
        total += sum(4 * r * r for r in widths)
    return total


def fp16_bytes(spec, context: int) -> int:
    """The original model's float16 K/V cache for `context` tokens (one batch row)."""
    return 2 * spec.baseline_elements_per_token * context


def solve_keep(
    spec,
    budget: float,
    context: int,
    window: int,
    rate: float,
    bits,
    prefill_score: str = "newest",
    floor: int = 0,
    reconstruction_share: float = 1.0,
    group_size: int = DEFAULT_GROUP_SIZE,
) -> Candidate | None:
    """The largest keep share (to 1/1000) whose bytes at `context` stay within `budget` x fp16; None if even keep = 0
    exceeds it (the window, or the window and the floor, alone are over budget)."""
    total = fp16_bytes(spec, context)
    floor_options = {"key": floor, "value": floor, "bits": FLOOR_BITS} if floor else None

    def held(keep: float) -> int:
        policy = eviction_policy_for_rate(
            spec, rate, window, keep, bits=bits, floor=floor_options, group_size=group_size
        )
        return held_bytes(policy, spec, context)

    if held(0.0) > budget * total:
        return None
    low, high = 0, 1000  # bytes grow with keep: bisect on thousandths
    while low < high:
        mid = (low + high + 1) // 2
        if held(mid / 1000) <= budget * total:
            low = mid
        else:
            high = mid - 1
    return Candidate(
        window,
        rate,
        bits,
        low / 1000,
        held(low / 1000) / total,
        prefill_score=prefill_score,
        floor=floor,
        reconstruction_share=reconstruction_share,
        group_size=group_size,
    )


def group_size_channels(spec, option: int | str) -> int:
    """A group-size option as channels: TOKEN_GROUP is every channel of a full-rank token side (one pair per token
    and side at any rate, since a rate's ranks are at most the head's width)."""
    if option == TOKEN_GROUP:
        return spec.head_dim * spec.num_key_value_heads
    if isinstance(option, bool) or not isinstance(option, int) or option < 1:
        raise InvalidArgumentError(
            f"a group size is a whole number of channels >= 1 or {TOKEN_GROUP!r}, got {option!r}"
        )
    return option


def parse_group_sizes(text: str) -> tuple[int | str, ...]:
    """--group-sizes "64,token" -> (64, "token"); each a whole number of channels >= 1 or TOKEN_GROUP."""
    options: list[int | str] = []
    for part in (p.strip() for p in text.split(",")):
        if part == TOKEN_GROUP:
            options.append(part)
        elif part.isascii() and part.isdigit() and int(part) >= 1:
            options.append(int(part))
        else:
            raise InvalidArgumentError(
                f"--group-sizes takes whole numbers of channels >= 1 or {TOKEN_GROUP!r}, comma-separated; got {part!r}"
            )
    return tuple(dict.fromkeys(options))


def _quantized(bits) -> bool:
    return any(b is not None for b in side_bits(bits).values())


def candidates(
    spec,
    budget: float,
    context: int,
    windows=DEFAULT_WINDOWS,
    rates=DEFAULT_RATES,
    bits_options=DEFAULT_BITS,
    prefill_scores=DEFAULT_PREFILL_SCORES,
    floors=DEFAULT_FLOORS,
    reconstruction_shares=DEFAULT_RECONSTRUCTION_SHARES,
    group_sizes=(DEFAULT_GROUP_SIZE,),
) -> list[Candidate]:
    """Every split that fits `budget` at `context` tokens, its keep share solved (solve_keep). Group sizes apply to
    quantized kept tokens only: a float16 split is listed once, at the default group size."""
    if not 0 < budget <= 1:
        raise InvalidArgumentError(f"kv budget must be a share of the fp16 cache in (0, 1], got {budget}")
    if context < 1:
        raise InvalidArgumentError(f"budget context must be >= 1 token, got {context}")
    if not group_sizes:
        raise InvalidArgumentError("the budget search needs at least one group size")
    widths = list(dict.fromkeys(group_size_channels(spec, g) for g in group_sizes))
    out = []
    for window in windows:
        for rate in rates:
            if rate_key(rate) not in spec.rate_table:  # only rates the checkpoint serves
                continue
            for bits in bits_options:
                for prefill_score in prefill_scores:
                    shares = reconstruction_shares if prefill_score == "reconstruction" else (1.0,)
                    for floor in floors:
                        for share in shares:
                            # A floor is quantized too (FLOOR_BITS), in the same groups.
                            coded = _quantized(bits) or bool(floor)
                            for group in widths if coded else [DEFAULT_GROUP_SIZE]:
                                found = solve_keep(
                                    spec, budget, context, window, rate, bits, prefill_score, floor, share, group
                                )
                                if found is not None:
                                    out.append(found)
    if not out:
        raise InvalidArgumentError(
            f"no split fits {budget:.1%} of the fp16 cache at {context} tokens: even the smallest window "
            f"({min(windows)} tokens at full rank) holds more; raise the budget or the context length"
        )
    return out


def regrouped(
    spec, budget: float, context: int, measured: list[Candidate], group_sizes, count: int = REGROUPED
) -> list[Candidate]:
    """The `count` best measured splits whose kept tokens (or floor) are quantized, each at every group size in
    `group_sizes` it was not measured at, its keep share solved again (a wider group frees bytes for tokens); splits
    already in `measured` are not repeated."""
    widths = list(dict.fromkeys(group_size_channels(spec, g) for g in group_sizes))
    coded = [c for c in sorted(measured, key=ranking) if _quantized(c.bits) or c.floor][:count]
    out = []
    for c in coded:
        sides = _stored_widths(spec, c)
        tried = [c.group_size]
        for group in widths:
            # A group at least as wide as every stored side holds each side whole, whatever its size: the same
            # codes and bytes as a group already tried, so it is not measured again.
            if any(group == g or all(w <= min(group, g) for w in sides) for g in tried):
                continue
            tried.append(group)
            found = solve_keep(
                spec, budget, context, c.window, c.rate, c.bits, c.prefill_score, c.floor, c.reconstruction_share, group
            )
            if found is not None:
                out.append(found)
    return out


def _stored_widths(spec, c: Candidate) -> set[int]:
    """The channel counts one token's sides hold in the candidate's kept tier (and floor), per layer."""
    floor_options = {"key": c.floor, "value": c.floor, "bits": FLOOR_BITS} if c.floor else None
    policy = eviction_policy_for_rate(spec, c.rate, c.window, c.keep, bits=c.bits, floor=floor_options)
    widths = {sum(r) for r in policy.kept_key_ranks + policy.kept_value_ranks}
    if policy.floor is not None:
        widths |= {sum(r) for r in policy.floor.key_ranks + policy.floor.value_ranks}
    return widths


def _prefill(candidate: Candidate):
    """How a prompt goes into the candidate's cache: scored by its reconstruction, or fed like the rest (None)."""
    if candidate.prefill_score != "reconstruction":
        return None
    from kvrewrite.runtime.tiers.reconstruction import prefill_scored_by_reconstruction

    def prefill(model, cache, ids):
        return prefill_scored_by_reconstruction(model, cache, ids, model.repeat_instruction_ids)

    return prefill


def measure(
    with_policy: Callable[[Candidate], torch.nn.Module],
    found: list[Candidate],
    windows: torch.Tensor,
    context: int,
    fp16_per_token: float,
    progress: Callable[[Candidate], None] | None = None,
) -> list[Candidate]:
    """Each candidate's mean continuation NLL on `windows` (tokens after `context`), fed MEASURE_CHUNK at a time;
    with_policy(candidate) returns the model caching through that candidate's policy."""
    from kvrewrite.publish.evaluation import continuation_nll

    measured = []
    for candidate in found:
        model = with_policy(candidate)
        nll, count, held = continuation_nll(
            model, windows, context, model.make_kv_cache, chunk=MEASURE_CHUNK, prefill=_prefill(candidate)
        )
        measured.append(Candidate(**{**asdict(candidate), "nll": nll / count, "measured_share": held / fp16_per_token}))
        if progress is not None:
            progress(measured[-1])
    return measured


def within_slack(measured: list[Candidate], perplexity_slack: float) -> list[Candidate]:
    """The candidates whose perplexity is at most (1 + perplexity_slack) x the best one's."""
    if perplexity_slack < 0:
        raise InvalidArgumentError(f"perplexity slack must be >= 0, got {perplexity_slack}")
    floor = min(c.nll for c in measured)
    return [c for c in measured if c.nll - floor <= math.log1p(perplexity_slack) + 1e-12]


def probe_keys(
    with_policy: Callable[[Candidate], torch.nn.Module],
    shortlist: list[Candidate],
    probes: list,
    progress: Callable[[Candidate], None] | None = None,
) -> list[Candidate]:
    """Each candidate's recall of planted keys (kvrewrite.compile.key_probes), read through its policy."""
    from kvrewrite.compile.key_probes import key_recall

    probed = []
    for candidate in shortlist:
        model = with_policy(candidate)
        recall = key_recall(model, probes, model.make_kv_cache, MEASURE_CHUNK, _prefill(candidate))
        probed.append(
            Candidate(**{**asdict(candidate), "key_nll": recall.answer_nll, "keys_answered": recall.answered})
        )
        if progress is not None:
            progress(probed[-1])
    return probed


def ranking(candidate: Candidate) -> tuple[float, float]:
    """Lower is better: NLL, then bytes among equals."""
    return candidate.nll, candidate.bytes_share


def holds_keys(candidate: Candidate, reference_key_nll: float) -> bool:
    """Whether the candidate answers the planted keys about as well as the full-rank cache: its answer NLL within
    KEY_NLL_MARGIN of the full-rank cache's."""
    return candidate.key_nll is not None and candidate.key_nll <= reference_key_nll + KEY_NLL_MARGIN


def choose(
    measured: list[Candidate], perplexity_slack: float = 0.0, reference_key_nll: float | None = None
) -> Candidate:
    """The lowest-NLL candidate; with a slack and probes, the lowest-NLL one among the candidates within the slack
    that hold the planted keys (holds_keys), where any does."""
    best = min(measured, key=ranking)
    if perplexity_slack == 0 or reference_key_nll is None:
        return best
    holding = [c for c in within_slack(measured, perplexity_slack) if holds_keys(c, reference_key_nll)]
    return min(holding, key=ranking) if holding else best


def write_token_policy(
    directory: Path, chosen: Candidate, measured: list[Candidate], budget: float, context: int, calibration: dict
) -> Path:
    """token_policy.json in the checkpoint, written atomically and added to its checksums."""
    from kvrewrite.io.atomic_files import atomic_write_text
    from kvrewrite.io.checkpoint_io import CHECKSUM_FILE, write_checksums

    directory = Path(directory)
    record = {
        "kv_budget": budget,
        "context": context,
        **policy_record(chosen.policy()),
        "chosen": asdict(chosen),
        "candidates": [asdict(c) for c in measured],
        "calibration": calibration,
    }
    path = atomic_write_text(directory / TOKEN_POLICY_FILE, json.dumps(record, indent=2) + "\n")
    # The other entries were verified when the checkpoint was loaded for the measurement: only the new file is read.
    listed = json.loads((directory / CHECKSUM_FILE).read_text(encoding="utf-8"))
    listed.pop(TOKEN_POLICY_FILE, None)
    write_checksums(directory, sorted(set(listed) | {TOKEN_POLICY_FILE}), known=listed)
    return path
