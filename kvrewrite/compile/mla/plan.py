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

from kvrewrite.compile.plan import DEFAULT_RATE_GRID, REFITS, Plan
from kvrewrite.errors import InvalidArgumentError
from kvrewrite.spec import rate_key

ALLOCATIONS = ("uniform", "sensitivity")
# How the position-free part scores the components whose rotation is dropped (method/mla.py): by the expected
# rotation over the distances each head attends to, attention sink left out (compile/rope_response.py; the default:
# better than unrotated in the uniform form on both held-out texts at 512 tokens and at 2K-4K, docs/serving.md), or
# unrotated (source).
POSITION_FREE_QUERIES = ("expected-rotation", "source")
DEFAULT_POSITION_FREE_QUERIES = "expected-rotation"
# Weights dtype: auto (the source's where it holds the neutralised latent, else float32) or one named dtype
# (float16 is refused when the export is written: it cannot hold the neutralised latent).
DTYPES = {"auto": None, "bfloat16": "bfloat16", "float32": "float32", "float16": "float16"}
# Distillation defaults (compress --distill's learning rate; the MLA form's factors are balanced to the source
# projections' scale before training, compile/mla/distill.py). Single-rate: 8 passes over the tokens, measured better
# than 2 on held-out wiki and news at 512 tokens and positions 2K-4K (docs/serving.md); nested (distill_rates): 2,
# the setting its tables were measured at.
DISTILL_EPOCHS = 8.0
NESTED_DISTILL_EPOCHS = 2.0
DISTILL_LR = 1e-5
# The refit default where it was measured: a uniform export without distillation (held-out wiki and news, 512-token
# windows and positions 2K-4K, docs/serving.md). A sensitivity-allocated export keeps its rate table (a refit serves
# the exported widths only), and the distillation was measured from the unrefitted form, so both default to none;
# with refit_rates (one o_proj per named rate) it is the default for either allocation.
DEFAULT_REFIT = "output-local"


@dataclass(frozen=True)
class MLAPlan:
    output: Path
    kv_share: float = 0.5  # cached values per token and layer, as a share of the source's K+V: (r + d_r) / (2 n_kv d)
    kv_lora_rank: int | None = None  # exact latent width r instead of kv_share
    qk_rope_head_dim: int | None = None  # with kv_lora_rank: the shared RoPE key's width (default head_dim)
    allocation: str = "uniform"  # latent widths across layers: uniform, or sensitivity (measured KL per layer)
    calibration: str = "wiki"
    calib_tokens: int = 16384
    dtype: str = "auto"
    position_free_queries: str = DEFAULT_POSITION_FREE_QUERIES
    key_weight: float | None = None  # key side against value side in the latent's objective (None: the default)
    verify_tokens: int = 128
    overwrite: bool = False
    refit: str | None = None  # none, output or output-local; None: DEFAULT_REFIT where measured (refit_method)
    refit_tokens: int | None = None  # None: the per-head Plan's default
    distill: bool = False
    distill_tokens: int | None = None  # None: every calibration token
    distill_epochs: float | None = None  # None: DISTILL_EPOCHS, or NESTED_DISTILL_EPOCHS with distill_rates
    distill_lr: float | None = None  # None: DISTILL_LR
    distill_rates: tuple[float, ...] = ()  # nested distillation: every rate of the rate table from the first to last
    refit_rates: tuple[float, ...] = ()  # one file serving these rates, o_proj refitted at each
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
        if self.distill_rates:
            self._normalise("distill_rates", tuple(sorted(float(r) for r in self.distill_rates)))
            self._check_distill_rates()
        if self.refit_rates:
            self._normalise("refit_rates", check_refit_rates(self.refit_rates, "`refit_rates`"))
            self._check_refit_rates()
        refit = self.refit_method
        if refit not in REFITS:
            raise InvalidArgumentError(f"`refit` must be one of {', '.join(REFITS)}, got {refit!r}")
        if refit == "none" and self.refit_tokens is not None:
            raise InvalidArgumentError("`refit_tokens` only applies with `refit=output` or output-local")
        if refit == "none" and self.refit_rates:
            raise InvalidArgumentError(
                "`refit_rates` refits o_proj at each rate; it needs `refit=output` or output-local"
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
        if self.allocation not in ALLOCATIONS:
            raise InvalidArgumentError(f"`allocation` must be uniform or sensitivity, got {self.allocation!r}")
        if self.allocation == "sensitivity" and self.kv_lora_rank is not None:
            raise InvalidArgumentError(
                "`kv_lora_rank` gives every layer one exact width; `allocation=sensitivity` "
                "places widths per layer at a `kv_share`"
            )

    def _check_distill_rates(self) -> None:
        """A nested distillation trains the rate table of a sensitivity-allocated export from its own rate on."""
        if not self.distill or self.allocation != "sensitivity" or self.kv_lora_rank is not None:
            raise InvalidArgumentError(
                "`distill_rates` trains the rate table of an `allocation=sensitivity` export at "
                "a `kv_share`; add `distill` and `allocation=sensitivity`"
            )
        first = self.distill_rates[0]
        if round(1 - self.kv_share, 4) != round(first, 4):
            raise InvalidArgumentError(
                f"`distill_rates` starts at {first:g}: export at `kv_share={1 - first:g}`, the "
                "widest rate it trains, so every trained rate is a prefix of the exported "
                "widths"
            )

    def _check_refit_rates(self) -> None:
        """The widest refitted rate is the export's own (1 - kv_share); with a nested distillation every one lies
        within its rates, refitted after the training."""
        rates, nested = self.refit_rates, self.distill_rates
        if (self.distill and not nested) or self.kv_lora_rank is not None:
            raise InvalidArgumentError(
                "`refit_rates` refits an export at a `kv_share`, training-free or after a "
                "nested `distill_rates`; it does not combine with a single-rate `distill` or "
                "`kv_lora_rank`"
            )
        if nested and not nested[0] <= rates[-1] <= nested[-1]:
            raise InvalidArgumentError(
                f"`refit_rates` must lie within `distill_rates` {nested[0]:g}..{nested[-1]:g}, "
                "the rates the nested distillation trains"
            )
        if round(1 - self.kv_share, 4) != rates[0]:
            raise InvalidArgumentError(
                f"`refit_rates` starts at {rates[0]:g}: export at `kv_share={1 - rates[0]:g}`, "
                "the widest rate, so every refitted rate is a prefix of the exported widths"
            )
        grid = {rate_key(r) for r in DEFAULT_RATE_GRID}
        if self.allocation == "sensitivity" and (off := [f"{r:g}" for r in rates if rate_key(r) not in grid]):
            raise InvalidArgumentError(
                f"`refit_rates` {', '.join(off)} are not on the rate table's grid (steps of 0.05)"
            )

    @property
    def refit_method(self) -> str:
        """The o_proj refit: as asked, else DEFAULT_REFIT for refit_rates or a uniform export without distillation,
        else none. With refit_rates it is the method of every per-rate refit."""
        if self.refit is not None:
            return self.refit
        return DEFAULT_REFIT if self.refit_rates or (self.allocation == "uniform" and not self.distill) else "none"

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
                else NESTED_DISTILL_EPOCHS
                if self.distill_rates
                else DISTILL_EPOCHS,
                distill_lr=DISTILL_LR if self.distill_lr is None else self.distill_lr,
            )
        if self.distill_rates:
            options.update(distill_rates=self.distill_rates, target_rate=self.distill_rates[0])
        if not self.refit_rates:
            options["refit"] = self.refit_method
        if self.refit_tokens is not None:
            options["refit_tokens"] = self.refit_tokens
        return Plan(
            model=model,
            calibration=self.calibration,
            calib_tokens=self.calib_tokens,
            output=self.output,
            overwrite=self.overwrite,
            progress=self.progress,
            **options,
        )


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
