"""The compression spec: what a rewritten checkpoint is, stored in config.json and the shard metadata.

The checkpoint keeps every per-head transform at full rank, with dimensions ordered by importance,
so the runtime takes the first r of them. One compiled checkpoint therefore serves every rate in
its rate table (`kvrewrite.load(dir, rate=...)`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Protocol

from kvrewrite.errors import CorruptCheckpointError, InvalidArgumentError

SPEC_FORMAT_VERSION = 1


class KeyModeRules(Protocol):
    """What the spec asks of a key mode (kvrewrite.key_modes.KeyMode implements it)."""

    def full_key_ranks(self, num_kv_heads: int, head_dim: int) -> list[int]: ...
    def per_head_key_ranks(self, key_ranks: list[int]) -> list[int]: ...
    def key_rank_problems(self, index: int, layer: "LayerSpec", num_kv_heads: int, head_dim: int) -> list[str]: ...
    def layer_problems(self, index: int, layer: "LayerSpec", num_kv_heads: int, head_dim: int) -> list[str]: ...


# Every key mode by name (docs/key-modes.md), filled by kvrewrite.key_modes.register_key_mode, which owns it. It
# lives here because the spec sits below the modes (they import it) yet checks each layer by its own mode's rules;
# `import kvrewrite` registers the built-in modes.
KEY_MODE_REGISTRY: dict[str, KeyModeRules] = {}


def full_key_ranks(mode: str, num_kv_heads: int, head_dim: int) -> list[int]:
    """The key ranks of a layer at full rank: d per KV head, or one shared block of n_kv * d (crosshead)."""
    return KEY_MODE_REGISTRY[mode].full_key_ranks(num_kv_heads, head_dim)


OBJECTIVES = ("zack", "optimal")
ALLOCATIONS = ("eps", "greedy", "sensitivity", "uniform")


def validate_rate(rate: float, name: str = "target rate") -> float:
    """A rate is the share of K+V cache elements removed: 0 keeps everything, 1 would keep nothing."""
    try:
        value = float(rate)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"{name} must be a number in [0, 1), got {rate!r}") from exc
    if not (0.0 <= value < 1.0) or value != value:
        raise InvalidArgumentError(f"{name} must be in [0, 1) (the share of KV-cache elements removed), got {rate!r}")
    return value


@dataclass
class LayerSpec:
    """Per-layer compression: the key mode and the kept rank of each KV head on each side."""

    key_mode: str
    key_ranks: list[int]
    value_ranks: list[int]
    # freq mode: per KV head, rotary frequency indices in the order their pairs are stored (most
    # important first). The runtime rotates stored pair i with frequency freq_order[g][i].
    # crosshead mode: one list (the shared key block) of n_kv * d/2 entries, each frequency n_kv times.
    freq_order: list[list[int]] | None = None


@dataclass
class CompressionSpec:
    """Everything the runtime needs to rebuild the attention of a rewritten checkpoint."""

    source_model: str
    source_revision: str | None
    base_model_type: str
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    objective: str
    allocation: str
    target_rate: float
    layers: list[LayerSpec]
    # rate (as a "0.50"-style string) -> {"key": [[r per KV head] per layer], "value": [...]}
    rate_table: dict[str, dict[str, list[list[int]]]] = field(default_factory=dict)
    rank_multiple: int = 1
    # KV codec applied on top of the reduced latents ({"name", "params"}, see kvrewrite.runtime.codecs); None = plain cache.
    kv_codec: dict | None = None
    format_version: int = SPEC_FORMAT_VERSION

    # ---- derived quantities -------------------------------------------------------------
    @property
    def baseline_elements_per_token(self) -> int:
        return 2 * self.num_layers * self.num_key_value_heads * self.head_dim

    @property
    def kept_elements_per_token(self) -> int:
        return sum(sum(layer.key_ranks) + sum(layer.value_ranks) for layer in self.layers)

    @property
    def achieved_rate(self) -> float:
        return 1.0 - self.kept_elements_per_token / self.baseline_elements_per_token

    def with_ranks(self, key_ranks: list[list[int]], value_ranks: list[list[int]], rate: float) -> "CompressionSpec":
        """A copy of this spec with other ranks (same transforms, another point of the rate table)."""
        layers = [
            LayerSpec(layer.key_mode, list(k), list(v), layer.freq_order)
            for layer, k, v in zip(self.layers, key_ranks, value_ranks)
        ]
        spec = CompressionSpec(**{**asdict(self), "layers": []})
        spec.layers = layers
        spec.target_rate = rate
        spec.validate()
        return spec

    def ranks_for_rate(self, rate: float) -> tuple[list[list[int]], list[list[int]]]:
        """Look a rate up in the table; the table's keys are formatted with rate_key()."""
        rate = validate_rate(rate)
        entry = self.rate_table.get(rate_key(rate))
        if entry is None:
            available = ", ".join(sorted(self.rate_table, key=float))
            raise InvalidArgumentError(f"rate {rate} is not in this checkpoint's rate table; available: {available}")
        self._check_rate_entry(rate_key(rate), entry)
        return entry["key"], entry["value"]

    def _check_rate_entry(self, key: str, entry) -> None:
        """A recorded rate-table entry holds, per layer and KV head, whole-number ranks the layer can serve: checked on
        every path that reads one (the token tiers too), so an edited entry fails here, not in the first forward."""
        where = f"the rate table's entry for rate {key}"
        if not isinstance(entry, dict) or not all(isinstance(entry.get(side), list) for side in ("key", "value")):
            raise CorruptCheckpointError(f"{where} must hold 'key' and 'value' rank lists, got {entry!r}")
        for side in ("key", "value"):
            per_layer = entry[side]
            if len(per_layer) != self.num_layers:
                raise CorruptCheckpointError(
                    f"{where} lists {side} ranks for {len(per_layer)} layers; the model has {self.num_layers}"
                )
            for i, ranks in enumerate(per_layer):
                if not isinstance(ranks, list) or not all(
                    isinstance(r, int) and not isinstance(r, bool) for r in ranks
                ):
                    raise CorruptCheckpointError(f"{where}: layer {i} {side} ranks {ranks!r} are not whole numbers")
        try:
            self.with_ranks(entry["key"], entry["value"], float(key))
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(
                f"{where} is invalid: {str(exc).removeprefix('invalid kvrewrite compression spec: ')}"
            ) from None

    # ---- checks and serialisation -------------------------------------------------------
    def validate(self) -> None:
        """Raise CorruptCheckpointError if the spec is internally inconsistent."""
        problems: list[str] = []
        if self.format_version != SPEC_FORMAT_VERSION:
            problems.append(f"format_version {self.format_version} (this kvrewrite reads {SPEC_FORMAT_VERSION})")
        if len(self.layers) != self.num_layers:
            problems.append(f"{len(self.layers)} layer entries for {self.num_layers} layers")
        if self.num_attention_heads % max(self.num_key_value_heads, 1):
            problems.append("num_attention_heads is not a multiple of num_key_value_heads")
        for i, layer in enumerate(self.layers):
            mode = KEY_MODE_REGISTRY.get(layer.key_mode)
            if mode is None:
                problems.append(f"layer {i}: unknown key mode {layer.key_mode!r}")
            for side, ranks in (("key", layer.key_ranks), ("value", layer.value_ranks)):
                if len(ranks) != self.num_key_value_heads:
                    problems.append(f"layer {i}: {len(ranks)} {side} ranks for {self.num_key_value_heads} KV heads")
                elif side == "key" and mode is not None:
                    problems += mode.key_rank_problems(i, layer, self.num_key_value_heads, self.head_dim)
                elif any(not (0 <= r <= self.head_dim) for r in ranks):
                    problems.append(f"layer {i}: {side} ranks {ranks} outside [0, {self.head_dim}]")
            if mode is not None:
                problems += mode.layer_problems(i, layer, self.num_key_value_heads, self.head_dim)
        if problems:
            raise CorruptCheckpointError("invalid kvrewrite compression spec: " + "; ".join(problems))

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict) -> "CompressionSpec":
        try:
            layers = [LayerSpec(**layer) for layer in data["layers"]]
            spec = cls(**{**data, "layers": layers})
        except (KeyError, TypeError) as exc:
            raise CorruptCheckpointError(f"malformed kvrewrite compression spec: {exc}") from exc
        spec.validate()
        return spec

    @classmethod
    def from_json(cls, text: str) -> "CompressionSpec":
        return cls.from_dict(json.loads(text))


def per_head_key_ranks(layer: LayerSpec) -> list[int]:
    """Key dims per KV head for display: a crosshead layer's shared block is split evenly over its heads."""
    return KEY_MODE_REGISTRY[layer.key_mode].per_head_key_ranks(layer.key_ranks)


def rate_key(rate: float) -> str:
    return f"{rate:.2f}"
