"""The compression spec: what a rewritten checkpoint is, stored in config.json and the shard metadata.

The checkpoint keeps every per-head transform at full rank, with dimensions ordered by importance,
so the runtime takes the first r of them. One compiled checkpoint therefore serves every rate in
its rate table (`kvrewrite.load(dir, rate=...)`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from kvrewrite.errors import CorruptCheckpointError, InvalidArgumentError

SPEC_FORMAT_VERSION = 1

# Key-side modes (docs/method.md, "Key side"); the first three are for RoPE models.
KEY_MODE_FREQ = "freq"  # keep whole rotary frequency pairs; folded into q_proj/k_proj, zero runtime cost
KEY_MODE_POST_ROPE = "post-rope"  # project rotated q/k online by a [d_h, r] basis (ZACK §5.1)
KEY_MODE_LATENT = "latent"  # cache a pre-RoPE latent; rebuild k and rotate it inside attention
# Mix each rotary frequency's 2-D components across the layer's KV heads with a complex-linear map: it
# commutes with RoPE, so it folds into q_proj/k_proj (zero extra ops). The layer then caches ONE shared
# key block; its rank is stored in key_ranks[0] (the other KV heads' entries are 0).
KEY_MODE_CROSSHEAD = "crosshead"
# Models without RoPE (OPT, GPT-2): the key-side transform folds exactly into W_Q/W_K (ZACK Fig. 8).
KEY_MODE_FOLDED = "folded"
KEY_MODES = (KEY_MODE_FREQ, KEY_MODE_POST_ROPE, KEY_MODE_LATENT, KEY_MODE_CROSSHEAD, KEY_MODE_FOLDED)
# Modes that compete in --rope-mode auto (RoPE models; folded is the only mode of models without RoPE).
ROPE_KEY_MODES = (KEY_MODE_FREQ, KEY_MODE_POST_ROPE, KEY_MODE_LATENT, KEY_MODE_CROSSHEAD)
# Modes whose runtime work does not grow with the context (latent rebuilds every cached key each step):
# freq and crosshead fold entirely into the projections, post-rope adds one small per-token projection.
ZERO_OVERHEAD_KEY_MODES = (KEY_MODE_FREQ, KEY_MODE_POST_ROPE, KEY_MODE_CROSSHEAD)


def full_key_ranks(mode: str, num_kv_heads: int, head_dim: int) -> list[int]:
    """The key ranks of a layer at full rank: d per KV head, or one shared block of n_kv * d (crosshead)."""
    if mode == KEY_MODE_CROSSHEAD:
        return [num_kv_heads * head_dim] + [0] * (num_kv_heads - 1)
    return [head_dim] * num_kv_heads

OBJECTIVES = ("zack", "optimal")
ALLOCATIONS = ("eps", "greedy", "sensitivity", "uniform")


def validate_rate(rate: float, name: str = "target rate") -> float:
    """A rate is the share of K+V cache elements removed: 0 keeps everything, 1 would keep nothing."""
    try:
        value = float(rate)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"{name} must be a number in [0, 1), got {rate!r}") from exc
    if not (0.0 <= value < 1.0) or value != value:
        raise InvalidArgumentError(
            f"{name} must be in [0, 1) (the share of KV-cache elements removed), got {rate!r}"
        )
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
            raise InvalidArgumentError(
                f"rate {rate} is not in this checkpoint's rate table; available: {available}"
            )
        return entry["key"], entry["value"]

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
            if layer.key_mode not in KEY_MODES:
                problems.append(f"layer {i}: unknown key mode {layer.key_mode!r}")
            for side, ranks in (("key", layer.key_ranks), ("value", layer.value_ranks)):
                if len(ranks) != self.num_key_value_heads:
                    problems.append(f"layer {i}: {len(ranks)} {side} ranks for {self.num_key_value_heads} KV heads")
                elif side == "key" and layer.key_mode == KEY_MODE_CROSSHEAD:
                    problems += _crosshead_problems(i, layer, self.num_key_value_heads, self.head_dim)
                elif any(not (0 <= r <= self.head_dim) for r in ranks):
                    problems.append(f"layer {i}: {side} ranks {ranks} outside [0, {self.head_dim}]")
            if layer.key_mode == KEY_MODE_FREQ:
                if any(r % 2 for r in layer.key_ranks):
                    problems.append(f"layer {i}: freq-mode key ranks must be even, got {layer.key_ranks}")
                half = self.head_dim // 2
                order = layer.freq_order or []
                if len(order) != self.num_key_value_heads or any(sorted(o) != list(range(half)) for o in order):
                    problems.append(f"layer {i}: freq_order must be a permutation of range({half}) per KV head")
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
    if layer.key_mode != KEY_MODE_CROSSHEAD:
        return list(layer.key_ranks)
    n, total = len(layer.key_ranks), layer.key_ranks[0]
    return [total // n + (1 if g < total % n else 0) for g in range(n)]


def _crosshead_problems(i: int, layer: LayerSpec, n_kv: int, d: int) -> list[str]:
    problems = []
    shared, rest = layer.key_ranks[0], layer.key_ranks[1:]
    if any(rest) or not (0 <= shared <= n_kv * d) or shared % 2:
        problems.append(f"layer {i}: crosshead key ranks must be [R, 0, ...] with even R <= {n_kv * d}, got {layer.key_ranks}")
    order = layer.freq_order or []
    if len(order) != 1 or sorted(order[0]) != sorted(j for j in range(d // 2) for _ in range(n_kv)):
        problems.append(f"layer {i}: crosshead freq_order must be one list holding each of range({d // 2}) {n_kv} times")
    return problems


def rate_key(rate: float) -> str:
    return f"{rate:.2f}"
