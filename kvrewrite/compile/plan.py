"""The compile plan: every option of `kvrewrite compress`, validated before any work starts.

Errors name parameters in backquotes (`max_ppl_increase`, `min_rank=12`): the command line prints them as its
flags (cli/compress_options.py, cli_message)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Collection

import torch

from kvrewrite.errors import InvalidArgumentError
from kvrewrite.key_modes import key_mode_names
from kvrewrite.runtime.codecs import bits_budget_codecs, parse_codec
from kvrewrite.spec import ALLOCATIONS, OBJECTIVES, validate_rate

# default: the family's best fixed mode; auto: chosen per layer by measured KL (opt-in until held-out numbers
# back it as a default); or one explicit mode.
ROPE_MODES = ("default", "auto")  # and every registered key mode (kvrewrite.key_modes)
# --prefer for --rope-mode auto: every key mode, or only those whose runtime does not grow with context.
PREFER = ("quality", "zero-overhead")
REDUCERS = ("none", "kmeans")
# auto (the default of both compress and export-mla, one rule: source_dtype): the source checkpoint's dtype where it
# is float32 or bfloat16, else float32 (float16 cannot hold an MLA export's neutralised latent, and compress computes
# in float32 or bfloat16 only).
AUTO_DTYPE = "auto"
DTYPES = (AUTO_DTYPE, "float32", "bfloat16")
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16"}
DEVICES = ("cpu", "cuda")
VALUE_METRICS = ("output", "fisher")
# Least-squares refit of o_proj at the compiled ranks (passes/refit_output.py): none; output (target: the original
# model's attention outputs, so upstream drift is absorbed too); output-local (target: the original layer on the
# compressed model's own hidden states).
REFITS = ("none", "output", "output-local")
# `refit=auto`, the default of both compress and export-mla, one rule (default_refit): output-local where the file
# serves its compiled widths alone and nothing is trained after (a uniform MLA export: docs/serving.md, measured
# better than none on held-out wiki and news at 512 tokens and 2K-4K, benchmarks/results/mla_refit_50.json), none
# where it keeps a rate table a refit would forfeit (every per-head checkpoint, docs/refit.md; an allocated MLA
# export) or is distilled (the distillations were measured from the unrefitted form).
AUTO_REFIT = "auto"
# Statistics on the compressed prefix (passes/sequential_statistics.py): off; keep-ranks (re-solve every layer's
# transforms from Grams measured after the compressed layers before it, keep the first allocation); reallocate
# (the same, then measure sensitivity and allocate again on the new transforms).
SEQUENTIAL_STATISTICS = ("off", "keep-ranks", "reallocate")
DEFAULT_RATE_GRID = tuple(round(0.05 * i, 2) for i in range(20))  # 0.00 .. 0.95
# How a file serves several rates (`serve_rates`, both compilers): from its rate table (a per-head checkpoint's, an
# allocated MLA export's; closed form, nothing fitted per rate), by a nested distillation over exactly those rates,
# or (MLA exports) with o_proj refitted at each rate.
SERVE_RATES_BY = ("table", "distill", "refit")
# --distill-epochs' default in both compilers (default_distill_epochs): a single-rate distillation 8 passes, measured
# better than 2, 4 and 6 on the MLA form (held-out wiki and news at 512 tokens and 2K-4K, docs/serving.md,
# benchmarks/results/mla_distill_nosink_8ep.json; the best epoch on the validation windows is kept, so more passes
# cost time, not validation KL); a nested one 2, the setting its rate tables were measured at (docs/results.md: 4
# helped in 16 of 18 cells, benchmarks/results/long_context_nested_4ep.json, at twice the compile time).
DISTILL_EPOCHS = 8.0
NESTED_DISTILL_EPOCHS = 2.0
# Fields that only tune a step another field turns on (the same in both compilers' plans): set without it they would
# be ignored in silence, so kvrewrite.compress refuses them (Plan.refuse_idle_tuning; MLAPlan in its validation).
TUNING_FIELDS = {
    "distill": ("distill_tokens", "distill_epochs", "distill_lr"),
    "refit": ("refit_tokens", "refit_ridge"),
}


def source_dtype(config) -> torch.dtype:
    """What `dtype=auto` means, in both compilers (AUTO_DTYPE): the source's dtype (its config's `dtype`, or the older
    `torch_dtype`) where it is float32 or bfloat16, else float32. config: a transformers config or config.json's dict
    (None: float32)."""
    if isinstance(config, dict):
        name = config.get("dtype") or config.get("torch_dtype")
    else:
        name = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(name, torch.dtype):
        name = str(name).removeprefix("torch.")
    return getattr(torch, name) if name in ("bfloat16", "float32") else torch.float32


def default_refit(keeps_rate_table: bool, distilled: bool) -> str:
    """What `refit=auto` means, in both compilers (AUTO_REFIT)."""
    return "none" if keeps_rate_table or distilled else "output-local"


def default_distill_epochs(nested: bool) -> float:
    """What an unset `distill_epochs` means, in both compilers (DISTILL_EPOCHS)."""
    return NESTED_DISTILL_EPOCHS if nested else DISTILL_EPOCHS


@dataclass(frozen=True)
class Plan:
    model: str
    target_rate: float = 0.5
    output: Path | None = None
    objective: str = "optimal"
    allocation: str = "sensitivity"
    rope_mode: str = "default"
    prefer: str = "quality"  # auto only: which key modes compete (kvrewrite.key_modes.preferred_key_modes)
    key_mode_cost: float = 0.0  # auto only: weight on a mode's runtime cost against its measured KL
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
    # Sensitivity allocation: uniform truncation rates each (layer, side) is probed at, and how many
    # 256-token calibration windows the probe KL is measured on.
    # Value objective's output metric: "output" (every hidden direction alike) or "fisher" (weighted by the
    # loss gradient's second moment at the attention output; passes/collect_fisher.py).
    value_metric: str = "output"
    fisher_tokens: int = 8192
    fisher_shrink: float = 0.5
    probe_rates: tuple[float, ...] = (0.5,)
    probe_windows: int = 2
    # Output refit (passes/refit_output.py): o_proj refitted by least squares at the compiled ranks against the
    # original attention outputs, layer by layer on refit_tokens calibration tokens; ridge is relative to the
    # mean diagonal of the latents' Gram. A refitted checkpoint serves its compiled rate only.
    refit: str = AUTO_REFIT  # auto: none here (a refit forfeits the rate table; default_refit)
    # GPTQ-style sequential statistics (see SEQUENTIAL_STATISTICS above); opt-in until held-out numbers back it.
    sequential_statistics: str = "off"
    refit_tokens: int = 16384
    refit_ridge: float = 1e-4
    # Distillation (passes/distill_attention.py): the attention weights trained at the compiled ranks against the
    # original model's next-token distribution on distill_tokens calibration tokens (1/16 held back for
    # validation). A distilled checkpoint serves its compiled rate only.
    distill: bool = False
    distill_tokens: int | None = None  # None: every calibration token (as export-mla's)
    distill_epochs: float | None = None  # None: default_distill_epochs (8, or 2 nested)
    distill_lr: float = 1e-5
    # Nested distillation: instead of the compiled rate alone, train one set of weights for every rate of the rate
    # grid between min and max of distill_rates (each window draws one; the named rates weigh as much as all the
    # others together). The checkpoint keeps exactly those rates in its table. Empty: single-rate distillation.
    distill_rates: tuple[float, ...] = ()
    # The rates the checkpoint serves, exactly (SERVE_RATES_BY; the concept export-mla shares): the rate table holds
    # these and no other (table), or a nested distillation trains exactly these (distill); serve_rates_by None:
    # distill with `distill`, else table. The target rate must be one of them.
    serve_rates: tuple[float, ...] = ()
    serve_rates_by: str | None = None
    # Quality budget (passes/quality_budget.py): instead of target_rate, the largest rate whose perplexity
    # increase (a fraction: 0.05 = 5%) and/or mean KL on held-back calibration text stays within budget.
    max_ppl_increase: float | None = None
    max_kl: float | None = None
    budget_tokens: int = 4096
    verify_tolerance: float = 1e-4
    verify_tokens: int = 512
    # Where layers run and in which dtype they compute and are written out (Grams are float64 regardless); auto: the
    # source's (source_dtype), resolved once its config is read (compute_dtype).
    device: str = "cpu"
    dtype: str = AUTO_DTYPE
    max_shard_size: str = "1GB"
    revision: str | None = None
    seed: int = 0
    overwrite: bool = False
    progress: bool = True
    # KV codec on top of the reduced cache: none or a registered codec (runtime.codecs.codec_names()), optionally with
    # parameters ("gear:bits=4,rank=4"); kv_bits_budget: tada's search budget in stored bits per cached element.
    kv_codec: str = "none"
    kv_bits_budget: float | None = None
    # Value-latent balancing (passes/balance_values.py): value dim j scaled by (its o_proj column norm)^alpha over
    # the layer's geometric mean, folded exactly into v_proj rows and o_proj columns so a value codec's shared step
    # costs the heavy dims less. 0: off; at most 2.
    balance_values: float = 0.0

    def _normalise(self, name: str, value) -> None:
        # Frozen: a changed plan is dataclasses.replace(plan, ...), which validates again. Only __post_init__
        # writes, to store the normalised form of what it was given.
        object.__setattr__(self, name, value)

    def __post_init__(self) -> None:
        self._normalise("target_rate", validate_rate(self.target_rate, "`target_rate`"))
        self._normalise("dtype", DTYPE_ALIASES.get(str(self.dtype).lower(), str(self.dtype).lower()))
        self._normalise(
            "rate_grid", tuple(sorted({round(validate_rate(r, "every `rate_grid` entry"), 4) for r in self.rate_grid}))
        )
        if self.refit == AUTO_REFIT:  # a per-head checkpoint keeps its rate table (or is distilled): none
            self._normalise("refit", default_refit(keeps_rate_table=True, distilled=self.distill))
        self._check_serve_rates()
        choices = {
            "objective": (self.objective, OBJECTIVES),
            "allocation": (self.allocation, ALLOCATIONS),
            "rope_mode": (self.rope_mode, (*ROPE_MODES, *key_mode_names())),
            "reduce": (self.reduce, REDUCERS),
            "value_metric": (self.value_metric, VALUE_METRICS),
            "refit": (self.refit, REFITS),
            "sequential_statistics": (self.sequential_statistics, SEQUENTIAL_STATISTICS),
            "prefer": (self.prefer, PREFER),
            "dtype": (self.dtype, DTYPES),
        }
        for name, (value, allowed) in choices.items():
            if value not in allowed:
                raise InvalidArgumentError(f"`{name}` must be one of {', '.join(allowed)}; got {value!r}")
        self._normalise(
            "probe_rates",
            tuple(sorted({round(validate_rate(r, "every `probe_rates` entry"), 4) for r in self.probe_rates})),
        )
        if not self.probe_rates or 0.0 in self.probe_rates:
            raise InvalidArgumentError("`probe_rates` must be one or more rates in (0, 1)")
        if self.device.split(":")[0] not in DEVICES:
            raise InvalidArgumentError(f"`device` must be cpu or cuda (optionally cuda:N); got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise InvalidArgumentError("`device=cuda` was asked for but torch sees no CUDA device here")
        parse_size(self.max_shard_size)
        for name in (
            "calib_tokens",
            "seq_len",
            "batch_size",
            "rank_multiple",
            "kmeans_clusters",
            "probe_windows",
            "fisher_tokens",
            "refit_tokens",
            "distill_tokens",
            "verify_tokens",
        ):
            if name == "distill_tokens" and self.distill_tokens is None:  # every calibration token
                continue
            if int(getattr(self, name)) < 1:
                raise InvalidArgumentError(f"`{name}` must be a positive integer, got {getattr(self, name)!r}")
        for name in ("max_ppl_increase", "max_kl"):
            value = getattr(self, name)
            if value is not None and not (float(value) > 0.0 and float(value) == float(value)):
                raise InvalidArgumentError(f"`{name}` must be a positive number, got {value!r}")
        if self.has_quality_budget() and int(self.budget_tokens) < self.seq_len:
            raise InvalidArgumentError(f"`budget_tokens` must be at least one window (`seq_len={self.seq_len}` tokens)")
        if not 0.0 <= self.fisher_shrink <= 1.0:
            raise InvalidArgumentError(f"`fisher_shrink` must be in [0, 1], got {self.fisher_shrink!r}")
        if not self.refit_ridge >= 0:
            raise InvalidArgumentError(f"`refit_ridge` must be >= 0, got {self.refit_ridge!r}")
        if self.distill_epochs is not None and not 0 < self.distill_epochs <= 100:
            raise InvalidArgumentError(f"`distill_epochs` must be in (0, 100], got {self.distill_epochs!r}")
        if not 0 < self.distill_lr < 1:
            raise InvalidArgumentError(f"`distill_lr` must be in (0, 1), got {self.distill_lr!r}")
        self._check_distill_rates()
        if self.sequential_statistics != "off" and self.reduce != "none":
            raise InvalidArgumentError(
                f"`sequential_statistics={self.sequential_statistics}` collects exact Grams; "
                f"it cannot be combined with `reduce={self.reduce}`"
            )
        try:
            alpha = float(self.balance_values)
        except (TypeError, ValueError):
            alpha = float("nan")
        if not 0.0 <= alpha <= 2.0:  # also refuses NaN
            raise InvalidArgumentError(
                f"`balance_values` must be an exponent in [0, 2] (0: off), got {self.balance_values!r}"
            )
        self._normalise("balance_values", alpha)
        if not self.key_mode_cost >= 0:
            raise InvalidArgumentError(f"`key_mode_cost` must be >= 0, got {self.key_mode_cost!r}")
        if self.min_rank < 0:
            raise InvalidArgumentError(f"`min_rank` must be >= 0, got {self.min_rank!r}")
        if not 0.0 < self.kmeans_keep_share <= 1.0:
            raise InvalidArgumentError(f"`kmeans_keep_share` must be in (0, 1], got {self.kmeans_keep_share!r}")
        if self.output is not None:
            self._normalise("output", Path(self.output).expanduser())
        codec = parse_codec(self.kv_codec, "`kv_codec`")  # raises InvalidArgumentError on unknown names / parameters
        if self.kv_bits_budget is not None:
            if codec is None or not codec.codec_class.takes_bits_budget:
                allowed = " or ".join(f"`kv_codec={name}`" for name in bits_budget_codecs())
                raise InvalidArgumentError(f"`kv_bits_budget` applies to {allowed} (a per-layer bit search)")
            if not 0 < float(self.kv_bits_budget) <= 16:
                raise InvalidArgumentError(
                    f"`kv_bits_budget` must be in (0, 16] bits per cached element, got {self.kv_bits_budget!r}"
                )
            self._normalise("kv_bits_budget", float(self.kv_bits_budget))

    def _check_serve_rates(self) -> None:
        """serve_rates become the rate grid (and, served by distill, the nested distillation's rates): exactly these
        rates are served. Runs before the grid and distill_rates are checked, on the values it sets."""
        if self.serve_rates_by is not None and not self.serve_rates:
            raise InvalidArgumentError("`serve_rates_by` says how `serve_rates` are served; add `serve_rates`")
        if not self.serve_rates:
            return
        rates = tuple(sorted({round(validate_rate(r, "every `serve_rates` entry"), 4) for r in self.serve_rates}))
        self._normalise("serve_rates", rates)
        by = self.serve_rates_by or ("distill" if self.distill else "table")
        if by not in SERVE_RATES_BY:
            raise InvalidArgumentError(f"`serve_rates_by` must be one of {', '.join(SERVE_RATES_BY)}, got {by!r}")
        if by == "refit":
            raise InvalidArgumentError(
                "`serve_rates_by=refit` refits o_proj at each rate of an MLA export (export-mla); compress's `refit` "
                "fits the compiled rate alone: use `serve_rates_by=table` or distill"
            )
        if by == "table" and (self.distill or self.refit != "none"):
            raise InvalidArgumentError(
                "`serve_rates_by=table`: a `refit` or single-rate `distill` fits the compiled ranks alone, and the "
                "checkpoint would serve its compiled rate only; use `serve_rates_by=distill`"
            )
        if self.has_quality_budget():
            raise InvalidArgumentError(
                "`serve_rates` names the rates the checkpoint serves; a quality budget chooses its rate at the end"
            )
        if round(self.target_rate, 4) not in rates:
            raise InvalidArgumentError(
                f"`target_rate={self.target_rate:g}` is not one of `serve_rates` "
                f"({', '.join(f'{r:g}' for r in rates)}): the compiled rate is always served"
            )
        grid = tuple(sorted({round(float(r), 4) for r in self.rate_grid}))
        if grid not in (DEFAULT_RATE_GRID, rates):
            raise InvalidArgumentError("`serve_rates` and `rate_grid` both name the table's rates; give one")
        self._normalise("rate_grid", rates)
        if by == "distill":
            if self.distill_rates and tuple(sorted(round(float(r), 4) for r in self.distill_rates)) != rates:
                raise InvalidArgumentError("`serve_rates` and `distill_rates` both name the nested rates; give one")
            if len(rates) < 2:
                raise InvalidArgumentError("`serve_rates_by=distill` trains at least two rates together")
            self._normalise("distill_rates", rates)
        self._normalise("serve_rates_by", by)

    @property
    def epochs(self) -> float:
        """The distillation's passes: as asked, else default_distill_epochs."""
        if self.distill_epochs is not None:
            return self.distill_epochs
        return default_distill_epochs(nested=bool(self.distill_rates))

    def _check_distill_rates(self) -> None:
        if not self.distill_rates:
            return
        self._normalise(
            "distill_rates",
            tuple(sorted({round(validate_rate(r, "every `distill_rates` entry"), 4) for r in self.distill_rates})),
        )
        if not self.distill:
            raise InvalidArgumentError("`distill_rates` chooses the rates of a nested distillation; add `distill=True`")
        if self.refit != "none":
            raise InvalidArgumentError(
                f"`refit={self.refit}` fits o_proj for the compiled ranks only; nested `distill_rates` train o_proj for "
                "every rate, so leave `refit` at none"
            )
        off_grid = [r for r in self.distill_rates if r not in self.rate_grid]
        if off_grid:
            raise InvalidArgumentError(
                f"`distill_rates` {off_grid} are not in the `rate_grid` ({', '.join(f'{r:g}' for r in self.rate_grid)})"
            )
        if not self.distill_rates[0] <= self.target_rate <= self.distill_rates[-1]:
            raise InvalidArgumentError(
                f"`target_rate={self.target_rate:g}` must lie within the nested `distill_rates` "
                f"({self.distill_rates[0]:g} to {self.distill_rates[-1]:g})"
            )

    def nested_distill_rates(self) -> tuple[float, ...]:
        """Every rate a nested distillation trains and the checkpoint keeps: the grid from min to max of distill_rates."""
        if not self.distill_rates:
            return ()
        return tuple(r for r in self.rate_grid if self.distill_rates[0] <= r <= self.distill_rates[-1])

    def optional_packages(self) -> tuple[tuple[str, str], ...]:
        """(import name, feature) of each optional package this plan needs (kvrewrite.extras): gensim for the wiki
        text, scikit-learn for k-means; synthetic text and user files need none."""
        from kvrewrite.extras import KMEANS, WIKI_TEXT

        needs = []
        if self.calibration == "wiki":
            needs.append(("gensim", WIKI_TEXT))
        if self.reduce == "kmeans":
            needs.append(("sklearn", KMEANS))
        return tuple(needs)

    def compute_dtype(self, config) -> torch.dtype:
        """The dtype layers compute in and the checkpoint is written in: as asked, or with `dtype=auto` the source's
        (source_dtype; config: the source's transformers config or config.json's dict)."""
        if self.dtype == AUTO_DTYPE:
            return source_dtype(config)
        return {"float32": torch.float32, "bfloat16": torch.bfloat16}[self.dtype]

    def distill_token_count(self, calibration_tokens: int) -> int:
        """The tokens a distillation trains on (1/16 held back): as asked, else every calibration token."""
        return calibration_tokens if self.distill_tokens is None else int(self.distill_tokens)

    def refuse_idle_tuning(self, given: Collection[str] = ()) -> None:
        """Refuse a tuning field set away from its default for a step this plan does not run (`distill_lr` without
        `distill`, `refit_tokens` with `refit=none`): it would be ignored in silence. `given`: fields the caller was
        handed explicitly, refused even at their default value (the command line's typed flags). Called by
        kvrewrite.compress and the command line, not on every Plan: the MLA export's internal statistics plan
        carries its refit tokens to the per-rate refits."""
        defaults = {f.name: f.default for f in dataclasses.fields(Plan)}
        runs = {"distill": self.distill, "refit": self.refit != "none"}
        needs = {"distill": "`distill`", "refit": "`refit=output` or output-local"}
        for step, names in TUNING_FIELDS.items():
            idle = [f"`{name}`" for name in names if name in given or getattr(self, name) != defaults[name]]
            if idle and not runs[step]:
                raise InvalidArgumentError(f"{', '.join(idle)} only apply with {needs[step]}")

    def has_quality_budget(self) -> bool:
        return self.max_ppl_increase is not None or self.max_kl is not None

    def key_mode(self) -> str:
        """A description of the key side: the fixed mode, the family's default, or how auto chooses per layer.

        The compile resolves it against the model's adapter (kvrewrite.key_modes.resolve_key_mode): `default` is
        latent for optimal / post-rope for zack on plain RoPE models, post-rope for q/k-norm families and folded
        without RoPE."""
        if self.rope_mode == "default":
            return "default (latent for optimal, post-rope for zack; the family may force post-rope or folded)"
        if self.rope_mode != "auto":
            return self.rope_mode
        return f"auto (per layer, prefer {self.prefer}, cost weight {self.key_mode_cost:g})"


_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(size: int | str) -> int:
    """Bytes in a size like 1073741824, "1GB" or "500MiB"."""
    if isinstance(size, int):
        value = size
    else:
        text = str(size).strip().upper().replace(" ", "")
        number = text.rstrip("KMGIB")
        unit = text[len(number) :]
        try:
            value = int(float(number) * _SIZE_UNITS[unit])
        except (ValueError, KeyError):
            raise InvalidArgumentError(f"`max_shard_size` must be a size like 1GB or 500MB; got {size!r}") from None
    if value < 1:
        raise InvalidArgumentError(f"`max_shard_size` must be positive; got {size!r}")
    return value
