"""The compile plan: every option of `kvrewrite compress`, validated before any work starts."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvrewrite.codecs.config import parse_codec
from kvrewrite.errors import InvalidArgumentError
from kvrewrite.spec import ALLOCATIONS, KEY_MODES, OBJECTIVES, validate_rate

ROPE_MODES = ("auto", *KEY_MODES)
REDUCERS = ("none", "kmeans")
DEFAULT_RATE_GRID = tuple(round(0.05 * i, 2) for i in range(20))  # 0.00 .. 0.95


@dataclass
class Plan:
    model: str
    target_rate: float = 0.5
    output: Path | None = None
    objective: str = "optimal"
    allocation: str = "sensitivity"
    rope_mode: str = "auto"
    calibration: str = "wiki"
    calib_tokens: int = 32768
    seq_len: int = 512
    batch_size: int = 4
    reduce: str = "none"
    kmeans_clusters: int = 256
    kmeans_keep_share: float = 0.5
    rank_multiple: int = 1
    min_rank: int = 0
    rate_grid: tuple[float, ...] = DEFAULT_RATE_GRID
    verify_tolerance: float = 1e-4
    revision: str | None = None
    seed: int = 0
    overwrite: bool = False
    progress: bool = True
    # KV codec on top of the reduced cache: none, int4, int2, tada, gear, gear-l, csr, optionally with
    # parameters ("gear:bits=4,rank=4"); kv_bits_budget: tada's search budget in stored bits per cached element.
    kv_codec: str = "none"
    kv_bits_budget: float | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.target_rate = validate_rate(self.target_rate)
        self.rate_grid = tuple(sorted({round(validate_rate(r, "rate grid entry"), 4) for r in self.rate_grid}))
        choices = {
            "objective": (self.objective, OBJECTIVES),
            "allocation": (self.allocation, ALLOCATIONS),
            "rope_mode": (self.rope_mode, ROPE_MODES),
            "reduce": (self.reduce, REDUCERS),
        }
        for name, (value, allowed) in choices.items():
            if value not in allowed:
                raise InvalidArgumentError(f"--{name.replace('_', '-')} must be one of {', '.join(allowed)}; got {value!r}")
        for name in ("calib_tokens", "seq_len", "batch_size", "rank_multiple", "kmeans_clusters"):
            if int(getattr(self, name)) < 1:
                raise InvalidArgumentError(f"--{name.replace('_', '-')} must be a positive integer")
        if self.min_rank < 0:
            raise InvalidArgumentError("--min-rank must be >= 0")
        if not 0.0 < self.kmeans_keep_share <= 1.0:
            raise InvalidArgumentError("kmeans keep share must be in (0, 1]")
        if self.output is not None:
            self.output = Path(self.output).expanduser()
        codec = parse_codec(self.kv_codec)  # raises InvalidArgumentError on unknown names / parameters
        if self.kv_bits_budget is not None:
            if codec is None or codec.name != "tada":
                raise InvalidArgumentError("--kv-bits-budget applies to --kv-codec tada (its per-layer bit search)")
            if not 0 < float(self.kv_bits_budget) <= 16:
                raise InvalidArgumentError("--kv-bits-budget must be in (0, 16] bits per cached element")
            self.kv_bits_budget = float(self.kv_bits_budget)

    def key_mode(self) -> str:
        """The key-side mode of a plain RoPE model (Llama-like). `auto` is a fixed rule for now: latent for optimal,
        post-rope for zack. The compile resolves the mode against the model's adapter instead
        (ArchitectureAdapter.resolve_key_mode: post-rope for q/k-norm families, folded without RoPE)."""
        if self.rope_mode != "auto":
            return self.rope_mode
        return "latent" if self.objective == "optimal" else "post-rope"
