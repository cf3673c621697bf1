"""The MLA export plan: every option of `kvrewrite export-mla`, validated in one place before any work starts.

Fields are what was asked for; None means "the default for this form", resolved by the properties below (the refit
method, the distillation's epochs, learning rate and tokens), so `dataclasses.replace(plan, ...)` validates the new
plan from what was asked, not from defaults resolved for the old one. What the source model's config decides (the
widths a share gives, the latent a rate leaves) is checked by `kvrewrite.export_mla` once it has read the config,
still before any weight.

Errors name parameters in backquotes (`kv_share`, `refit=output`): the command line prints them as its flags
(cli_message).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvrewrite.compile.plan import (
    AUTO_DTYPE,
    AUTO_REFIT,
    DEFAULT_RATE_GRID,
    REFITS,
    SERVE_RATES_BY,
    Plan,
    default_distill_epochs,
    default_refit,
)
from kvrewrite.errors import InvalidArgumentError
from kvrewrite.spec import rate_key

# `layer_widths` (the command line's --layer-widths; not compress's `allocation`, a rank-allocation algorithm): the
# latent widths across layers, uniform (every engine caches the share) or sensitivity (per-layer widths placed by
# measured KL, compile/mla/allocation.py, exported zero-padded; only kvrewrite's runtime caches the share).
LAYER_WIDTHS = ("uniform", "sensitivity")
# How the position-free part scores the components whose rotation is dropped (method/mla.py): by the expected
# rotation over the distances each head attends to, attention sink left out (compile/mla/rope_response.py; the default:
# better than unrotated in the uniform form on both held-out texts at 512 tokens and at 2K-4K, docs/serving.md), or
# unrotated (source).
POSITION_FREE_QUERIES = ("expected-rotation", "source")
DEFAULT_POSITION_FREE_QUERIES = "expected-rotation"
# Weights dtype: auto (compress's rule, compile/plan.py source_dtype: the source's where it is bfloat16 or float32,
# which hold the neutralised latent, else float32) or one named dtype (float16 is refused when the export is written:
# it cannot hold the neutralised latent).
DTYPES = {AUTO_DTYPE: None, "bfloat16": "bfloat16", "float32": "float32", "float16": "float16"}
# The distillation's learning rate, compress's (the MLA form's factors are balanced to the source projections' scale
# before training, compile/mla/distill.py); its epochs and the refit default follow the rules both compilers share
# (compile/plan.py: default_distill_epochs, default_refit).
DISTILL_LR = 1e-5


@dataclass(frozen=True)
class MLAPlan:
    output: Path
    kv_share: float = 0.5  # cached values per token and layer, as a share of the source's K+V: (r + d_r) / (2 n_kv d)
    kv_lora_rank: int | None = None  # exact latent width r instead of kv_share
    qk_rope_head_dim: int | None = None  # with kv_lora_rank: the shared RoPE key's width (default head_dim)
    layer_widths: str = "uniform"  # latent widths across layers: uniform, or sensitivity (measured KL per layer)
    calibration: str = "wiki"
    calib_tokens: int = 32768  # compress's (ZACK needs at least 16K)
    dtype: str = AUTO_DTYPE
    # Where every pass that runs the model runs (cpu, cuda or cuda:N): the statistics' layers, the expected rotations,
    # the sensitivity probes, the refits, the distillation and the checks; checked as compress checks its `device`.
    device: str = "cpu"
    position_free_queries: str = DEFAULT_POSITION_FREE_QUERIES
    key_weight: float | None = None  # key side against value side in the latent's objective (None: the default)
    verify_tokens: int = 512  # compress's: the checks at the end run on about this many calibration tokens
    overwrite: bool = False
    refit: str | None = None  # none, output or output-local; None or auto: default_refit for this form (refit_method)
    refit_tokens: int | None = None  # None: the per-head Plan's default
    distill: bool = False
    distill_tokens: int | None = None  # None: every calibration token
    distill_epochs: float | None = None  # None: default_distill_epochs (8, or 2 nested), as compress
    distill_lr: float | None = None  # None: DISTILL_LR
    distill_rates: tuple[float, ...] = ()  # nested distillation: every rate of the rate table from the first to last
    refit_rates: tuple[float, ...] = ()  # one file serving these rates, o_proj refitted at each
    # The rates the file serves, exactly (the one concept compress shares, compile/plan.py SERVE_RATES_BY): the widest
    # is the export's own (kv_share = 1 - the smallest). serve_rates_by: how the narrower ones are served, the rate
    # table of an allocated export (table), a nested distillation over exactly these rates (distill) or an o_proj
    # refitted at each (refit); None: default_serve_rates_by.
    serve_rates: tuple[float, ...] = ()
    serve_rates_by: str | None = None
    progress: bool = True

    def _normalise(self, name: str, value) -> None:
        # Frozen: only __post_init__ writes, to store the normalised form of what it was given.
        object.__setattr__(self, name, value)

    def __post_init__(self) -> None:
        self._normalise("output", Path(self.output).expanduser())
        given = [
            f"`{name}`"
            for name in ("distill_tokens", "distill_epochs", "distill_lr")
            if getattr(self, name) is not None
        ]
        if not self.distill and given:
            raise InvalidArgumentError(f"{', '.join(given)} only apply with `distill`")
        if self.serve_rates:
            self._normalise("serve_rates", check_serve_rates(self.serve_rates))
        self._check_serve_rates()
        if self.distill_rates:
            self._normalise("distill_rates", tuple(sorted(float(r) for r in self.distill_rates)))
        if self.nested_rates:
            self._check_distill_rates()
        if self.refit_rates:
            self._normalise("refit_rates", check_refit_rates(self.refit_rates, "`refit_rates`"))
        if self.per_rate_refits:
            self._check_refit_rates()
        refit = self.refit_method
        if refit not in REFITS:
            raise InvalidArgumentError(f"`refit` must be one of {', '.join(REFITS)}, got {refit!r}")
        if refit == "none" and self.refit_tokens is not None:
            raise InvalidArgumentError("`refit_tokens` only applies with `refit=output` or output-local")
        if refit == "none" and self.per_rate_refits:
            raise InvalidArgumentError(
                f"{self._rates_named('refit')} refits o_proj at each rate; it needs `refit=output` or output-local"
            )
        if self.dtype not in DTYPES:
            raise InvalidArgumentError(f"`dtype` must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.key_weight is not None and not 0 < self.key_weight < float("inf"):
            raise InvalidArgumentError(
                f"`key_weight={self.key_weight}`: the key side's weight against the value side "
                "must be a positive number"
            )
        if self.verify_tokens < 1:
            raise InvalidArgumentError(
                f"`verify_tokens={self.verify_tokens}`: the checks at the end compare logits on "
                "at least 1 calibration token"
            )
        if self.verify_tokens > self.calib_tokens:
            raise InvalidArgumentError(
                f"`verify_tokens={self.verify_tokens}` is more than `calib_tokens={self.calib_tokens}`: the checks "
                "at the end run on the first calibration tokens; lower `verify_tokens` or raise `calib_tokens`"
            )
        if not 0 < self.kv_share <= 1:
            raise InvalidArgumentError(f"`kv_share` must be in (0, 1], got {self.kv_share}")
        statistics = self.statistics_plan("")  # the fields it shares with compress, checked where compress checks them
        if statistics.distill and statistics.distill_tokens > self.calib_tokens:
            raise InvalidArgumentError(
                f"`distill_tokens={statistics.distill_tokens}` is more than "
                f"`calib_tokens={self.calib_tokens}`: the distillation trains on calibration "
                "windows; raise `calib_tokens`"
            )
        if self.qk_rope_head_dim is not None and self.kv_lora_rank is None:
            raise InvalidArgumentError("`qk_rope_head_dim` needs `kv_lora_rank` (exact widths)")
        check_position_free_queries(self.position_free_queries, "`position_free_queries`")
        if self.layer_widths not in LAYER_WIDTHS:
            raise InvalidArgumentError(f"`layer_widths` must be uniform or sensitivity, got {self.layer_widths!r}")
        if self.layer_widths == "sensitivity" and self.kv_lora_rank is not None:
            raise InvalidArgumentError(
                "`kv_lora_rank` gives every layer one exact width; `layer_widths=sensitivity` "
                "places widths per layer at a `kv_share`"
            )

    def _check_distill_rates(self) -> None:
        """A nested distillation trains the rate table of a sensitivity-allocated export from its own rate on."""
        named = self._rates_named("distill")
        if not self.distill or self.layer_widths != "sensitivity" or self.kv_lora_rank is not None:
            raise InvalidArgumentError(
                f"{named} trains the rate table of an `layer_widths=sensitivity` export at "
                "a `kv_share`; add `distill` and `layer_widths=sensitivity`"
            )
        first = self.nested_rates[0]
        if round(1 - self.kv_share, 4) != round(first, 4):
            raise InvalidArgumentError(
                f"{named} starts at {first:g}: export at `kv_share={1 - first:g}`, the "
                "widest rate it trains, so every trained rate is a prefix of the exported "
                "widths"
            )

    def _check_refit_rates(self) -> None:
        """The widest refitted rate is the export's own (1 - kv_share); with a nested distillation every one lies
        within its rates, refitted after the training."""
        rates, nested, named = self.per_rate_refits, self.nested_rates, self._rates_named("refit")
        if (self.distill and not nested) or self.kv_lora_rank is not None:
            raise InvalidArgumentError(
                f"{named} refits an export at a `kv_share`, training-free or after a "
                "nested `distill_rates`; it does not combine with a single-rate `distill` or "
                "`kv_lora_rank`"
            )
        if nested and not nested[0] <= rates[-1] <= nested[-1]:
            raise InvalidArgumentError(
                f"{named} must lie within `distill_rates` {nested[0]:g}..{nested[-1]:g}, "
                "the rates the nested distillation trains"
            )
        if round(1 - self.kv_share, 4) != rates[0]:
            raise InvalidArgumentError(
                f"{named} starts at {rates[0]:g}: export at `kv_share={1 - rates[0]:g}`, "
                "the widest rate, so every refitted rate is a prefix of the exported widths"
            )
        grid = {rate_key(r) for r in self.table_rates}
        if self.layer_widths == "sensitivity" and (off := [f"{r:g}" for r in rates if rate_key(r) not in grid]):
            raise InvalidArgumentError(f"{named} {', '.join(off)} are not on the rate table's grid (steps of 0.05)")

    def _check_serve_rates(self) -> None:
        """serve_rates: one way to serve them (SERVE_RATES_BY), the old per-way fields left empty, the widest the
        export's own; `table` needs a rate table to keep (an allocated export, neither refitted once nor trained at
        one rate)."""
        if self.serve_rates_by is not None and not self.serve_rates:
            raise InvalidArgumentError("`serve_rates_by` says how `serve_rates` are served; add `serve_rates`")
        if not self.serve_rates:
            return
        by = self.serve_by
        if by not in SERVE_RATES_BY:
            raise InvalidArgumentError(f"`serve_rates_by` must be one of {', '.join(SERVE_RATES_BY)}, got {by!r}")
        given = [f"`{name}`" for name in ("distill_rates", "refit_rates") if getattr(self, name)]
        if given:
            raise InvalidArgumentError(
                f"`serve_rates` and {' and '.join(given)} both name the rates the file serves; give `serve_rates` "
                "with `serve_rates_by` alone"
            )
        if by != "table" and len(self.serve_rates) < 2:
            raise InvalidArgumentError(
                f"`serve_rates_by={by}` serves at least two rates; one rate is the export's own (`kv_share`)"
            )
        if round(1 - self.kv_share, 4) != self.serve_rates[0]:
            raise InvalidArgumentError(
                f"`serve_rates` starts at {self.serve_rates[0]:g}: export at `kv_share={1 - self.serve_rates[0]:g}`, "
                "the widest rate, so every served rate is a prefix of the exported widths"
            )
        if by == "table" and (self.layer_widths != "sensitivity" or self.kv_lora_rank is not None):
            raise InvalidArgumentError(
                "`serve_rates_by=table` keeps the rate table of an `layer_widths=sensitivity` export; a uniform export "
                "has none (`serve_rates_by=refit` serves several rates from it)"
            )
        if by == "table" and (self.distill or self.refit not in (None, AUTO_REFIT, "none")):
            raise InvalidArgumentError(
                "`serve_rates_by=table`: a `distill` or `refit` at the exported widths fits those alone, and the "
                "file would not serve the narrower rates; use `serve_rates_by=distill` or refit"
            )

    @property
    def serve_by(self) -> str | None:
        """How serve_rates are served: as asked, else default_serve_rates_by for this form; None without serve_rates."""
        if not self.serve_rates:
            return None
        return self.serve_rates_by or default_serve_rates_by(self.layer_widths, self.distill)

    @property
    def table_rates(self) -> tuple[float, ...]:
        """The rates an allocated export's rate table is computed at: serve_rates exactly, else the default grid."""
        return self.serve_rates or DEFAULT_RATE_GRID

    @property
    def nested_rates(self) -> tuple[float, ...]:
        """The rates a nested distillation names: distill_rates, or serve_rates served by distill."""
        return self.serve_rates if self.serve_by == "distill" else self.distill_rates

    @property
    def per_rate_refits(self) -> tuple[float, ...]:
        """The rates o_proj is refitted at, one each: refit_rates, or serve_rates served by refit."""
        return self.serve_rates if self.serve_by == "refit" else self.refit_rates

    def _rates_named(self, way: str) -> str:
        """How the message names the rates: `serve_rates` where they came from it, else the per-way field."""
        return "`serve_rates`" if self.serve_by == way else f"`{way}_rates`"

    @property
    def refit_method(self) -> str:
        """The o_proj refit: as asked, else default_refit (compress's rule): output-local for a uniform export without
        distillation, or with per-rate refits (each rate its own o_proj: no table to keep), else none. With per-rate
        refits it is the method of every one."""
        if self.refit not in (None, AUTO_REFIT):
            return self.refit
        if self.per_rate_refits:
            return default_refit(keeps_rate_table=False, distilled=False)
        return default_refit(keeps_rate_table=self.layer_widths == "sensitivity", distilled=self.distill)

    def statistics_plan(self, model: str) -> Plan:
        """The per-head Plan the statistics, refit and distillation passes read: calibration, the single-rate refit
        (none with refit_rates, whose refits run at each rate), the distillation with its defaults resolved."""
        options: dict = {}
        if self.distill:
            options.update(
                distill=True,
                distill_tokens=self.calib_tokens if self.distill_tokens is None else self.distill_tokens,
                distill_epochs=self.distill_epochs
                if self.distill_epochs is not None
                else default_distill_epochs(nested=bool(self.nested_rates)),
                distill_lr=DISTILL_LR if self.distill_lr is None else self.distill_lr,
            )
        if self.nested_rates:
            options.update(distill_rates=self.nested_rates, target_rate=self.nested_rates[0])
            if self.serve_rates:  # exactly these rates trained, not every grid rate between them
                options["rate_grid"] = self.serve_rates
        if not self.per_rate_refits:
            options["refit"] = self.refit_method
        if self.refit_tokens is not None:
            options["refit_tokens"] = self.refit_tokens
        return Plan(
            model=model,
            # The statistics are computed in float32 whatever the export's weights dtype (`dtype` is the written
            # checkpoint's alone, passes/write_checkpoint.py).
            dtype="float32",
            calibration=self.calibration,
            calib_tokens=self.calib_tokens,
            device=self.device,
            output=self.output,
            overwrite=self.overwrite,
            progress=self.progress,
            **options,
        )


def default_serve_rates_by(layer_widths: str, distill: bool) -> str:
    """A distilled export trains its served rates together (nested); an allocated one keeps its rate table (no
    extra cost); a uniform one has no table, so each rate gets its own refitted o_proj."""
    if distill:
        return "distill"
    return "table" if layer_widths == "sensitivity" else "refit"


def check_serve_rates(given) -> tuple[float, ...]:
    """serve_rates sorted: distinct, in [0, 1), in hundredths (the rate table's keys); one rate or more."""
    shown = ",".join(f"{float(r):g}" for r in given)
    if any(abs(float(r) - round(float(r), 2)) > 1e-9 for r in given):
        raise InvalidArgumentError(f"`serve_rates` takes rates in hundredths (the rate table's keys), got {shown!r}")
    rates = tuple(sorted({round(float(r), 2) for r in given}))
    if not all(0 <= r < 1 for r in rates):
        raise InvalidArgumentError(f"`serve_rates` takes rates in [0, 1), got {shown!r}")
    return rates


def check_position_free_queries(choice: str, option: str = "position_free_queries") -> None:
    if choice not in POSITION_FREE_QUERIES:
        raise InvalidArgumentError(f"{option} must be one of {', '.join(POSITION_FREE_QUERIES)}, got {choice!r}")


def check_refit_rates(given, option: str = "`refit_rates`", shown: str | None = None) -> tuple[float, ...]:
    """The rates of a per-rate refit, sorted: distinct, in [0, 1), in hundredths (the rate table's keys), at least
    two. shown: how the rates were written, for the message (default: the numbers, comma-separated)."""
    shown = ",".join(f"{float(r):g}" for r in given) if shown is None else shown
    if any(abs(r - round(r, 2)) > 1e-9 for r in given):
        raise InvalidArgumentError(f"{option} takes rates in hundredths (the rate table's keys), got {shown!r}")
    rates = tuple(sorted({round(r, 2) for r in given}))
    if len(rates) < 2 or not all(0 <= r < 1 for r in rates):
        raise InvalidArgumentError(f"{option} takes at least two distinct rates in [0, 1), got {shown!r}")
    return rates
