"""Which KV codec a model uses, and its parameters: parsed from `--kv-codec NAME[:key=value,...]`."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvrewrite.errors import InvalidArgumentError

# Every codec's parameters and defaults. `group_size` is KIVI's G: keys are quantized per channel over
# blocks of G tokens, values per token over groups of G channels; `residual` is the number of most recent
# tokens kept in float16 (KIVI/TaDA "residual tokens", GEAR's streaming buffer). Coded blocks are G tokens.
CODEC_DEFAULTS: dict[str, dict[str, float]] = {
    "int4": {"bits": 4, "group_size": 32, "residual": 32},
    "int2": {"bits": 2, "group_size": 32, "residual": 32},
    # bits: the uniform deviation width when no budget search runs; mean_bits: the per-token shared mean.
    "tada": {"bits": 4, "mean_bits": 4, "group_size": 32, "residual": 32},
    # rank: low-rank residual per block (power iteration); outlier_percent: top + bottom s% kept exactly.
    "gear": {"bits": 2, "rank": 2, "outlier_percent": 2.0, "power_iterations": 3, "group_size": 32, "residual": 32},
    "gear-l": {"bits": 2, "rank": 2, "outlier_percent": 0.0, "power_iterations": 3, "group_size": 32, "residual": 32},
    # atoms: dictionary size per layer, side and KV head; sparsity: matching-pursuit atoms per vector.
    "csr": {"atoms": 256, "sparsity": 8, "kmeans_iterations": 10, "fit_iterations": 5, "group_size": 32, "residual": 32},
}
CODEC_NAMES = ("none", *CODEC_DEFAULTS)
INTEGER_PARAMS = {"bits", "mean_bits", "group_size", "residual", "rank", "power_iterations", "atoms", "sparsity",
                  "kmeans_iterations", "fit_iterations"}


@dataclass(frozen=True)
class CodecConfig:
    name: str
    params: dict = field(default_factory=dict)

    @property
    def block_tokens(self) -> int:
        return int(self.params["group_size"])

    @property
    def residual(self) -> int:
        return int(self.params["residual"])

    def to_dict(self) -> dict:
        return {"name": self.name, "params": dict(self.params)}

    def describe(self) -> str:
        defaults = CODEC_DEFAULTS[self.name]
        changed = [f"{k}={v}" for k, v in self.params.items() if defaults.get(k) != v]
        return self.name + (":" + ",".join(changed) if changed else "")

    @classmethod
    def from_dict(cls, data: dict) -> "CodecConfig":
        return make_codec_config(data["name"], data.get("params", {}))


def make_codec_config(name: str, overrides: dict | None = None) -> CodecConfig:
    if name not in CODEC_DEFAULTS:
        raise InvalidArgumentError(f"--kv-codec must be one of {', '.join(CODEC_NAMES)}; got {name!r}")
    params = dict(CODEC_DEFAULTS[name])
    for key, value in (overrides or {}).items():
        if key not in params:
            raise InvalidArgumentError(f"codec {name} has no parameter {key!r}; it has {', '.join(params)}")
        try:
            params[key] = int(value) if key in INTEGER_PARAMS else float(value)
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"codec parameter {key} must be a number, got {value!r}") from exc
    _validate(name, params)
    return CodecConfig(name, params)


def _validate(name: str, params: dict) -> None:
    for key in ("bits", "mean_bits"):
        if key in params and params[key] not in (1, 2, 4, 8):
            raise InvalidArgumentError(f"codec {name}: {key} must be 1, 2, 4 or 8, got {params[key]}")
    if params["group_size"] < 1 or params["residual"] < 0:
        raise InvalidArgumentError(f"codec {name}: group_size must be >= 1 and residual >= 0")
    if name.startswith("gear") and (params["rank"] < 0 or not 0 <= params["outlier_percent"] < 50):
        raise InvalidArgumentError(f"codec {name}: rank must be >= 0 and outlier_percent in [0, 50)")
    if name == "csr" and not (1 <= params["sparsity"] and 2 <= params["atoms"] <= 32768):
        raise InvalidArgumentError("codec csr: sparsity must be >= 1 and atoms in [2, 32768]")


def parse_codec(text: str | None) -> CodecConfig | None:
    """`int4`, `gear:bits=4,rank=4`, `none` (-> None)."""
    if text is None or text == "none" or text == "":
        return None
    name, _, rest = str(text).partition(":")
    overrides = {}
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise InvalidArgumentError(f"codec parameter {item!r} must be key=value (e.g. int4:group_size=64)")
        overrides[key.strip()] = value.strip()
    return make_codec_config(name.strip(), overrides)
