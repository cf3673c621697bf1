"""The options of `kvrewrite compress`, generated from the Plan: one table of flags and help text, defaults from Plan.

Every Plan field is either an option here (its default is the Plan's, never restated) or listed in LIBRARY_ONLY
with the reason (tests/test_cli_and_errors.py holds that). The same table maps the library's parameter names to
flags when the CLI prints an error (`cli_message`): the library says `max_ppl_increase`, the user reads
--max-ppl-increase.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Optional

import typer

from kvrewrite.cli.shared_options import AUTO_DTYPE_MEANING, DISTILL_TOKENS_MEANING, VERIFY_TOKENS_MEANING
from kvrewrite.compile.plan import Plan
from kvrewrite.errors import InvalidArgumentError
from kvrewrite.runtime.codecs import codec_names


def fraction_or_percent(text: str, option: str) -> float:
    """'5%' -> 0.05; '0.05' -> 0.05."""
    text = text.strip()
    try:
        return float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise InvalidArgumentError(f"{option} must be a percentage (5%) or a fraction (0.05), got {text!r}") from None


def number(text: str, option: str) -> float:
    """A fraction given on the command line; '50%' is refused with the fraction it probably meant."""
    text = text.strip()
    if text.endswith("%"):
        try:
            hint = f"; for {text} pass {float(text[:-1]) / 100:g}"
        except ValueError:
            hint = ""
        raise InvalidArgumentError(f"{option} takes a fraction in [0, 1), not a percentage: got {text!r}{hint}")
    try:
        return float(text)
    except ValueError:
        raise InvalidArgumentError(f"{option} must be a number such as 0.5, got {text!r}") from None


def numbers(text: str, option: str) -> tuple[float, ...]:
    """A comma-separated list of fractions, e.g. --probe-rates 0.3,0.5."""
    values = tuple(number(part, option) for part in text.split(",") if part.strip())
    if not values:
        raise InvalidArgumentError(f"{option} needs at least one number, got {text!r}")
    return values


def numbers_or_none(text: str, option: str) -> tuple[float, ...]:
    """numbers(), or () for an empty text (an option whose default is 'not used')."""
    return numbers(text, option) if text.strip() else ()


def _comma_list(values: tuple[float, ...]) -> str:
    return ",".join(f"{v:g}" for v in values)


@dataclass(frozen=True)
class PlanOption:
    """One Plan field on the command line. Flag: --field-name; default: the Plan's."""

    field: str
    help: str
    short: tuple[str, ...] = ()  # extra names, e.g. -p
    # Fields the command line takes as text (fractions that refuse '50%', percentages, comma lists):
    # parse(text, flag) -> Plan value, and show(Plan default) -> the text shown as the default.
    parse: Callable[[str, str], Any] | None = None
    show: Callable[[Any], str] = str

    @property
    def flag(self) -> str:
        return "--" + self.field.replace("_", "-")


# In the order `kvrewrite compress --help` lists them within each of its panels (PANELS).
PLAN_OPTIONS: tuple[PlanOption, ...] = (
    PlanOption(
        "target_rate", "Share of KV-cache elements removed, in [0, 1) (0.5, not 50%).", short=("-p",), parse=number
    ),
    PlanOption(
        "output",
        "Output directory (default: <model>-kvrewrite-pNN; with a quality budget, whose rate is only known at the end, <model>-kvrewrite-ppl5 / -kl0.05).",
        short=("-o",),
    ),
    PlanOption("objective", "zack (paper-faithful SVD) or optimal (whitened, output-aware)."),
    PlanOption(
        "allocation",
        "eps (ZACK Eq. 6 shared removal rate), greedy (objective error), sensitivity (greedy weighted by measured KL per layer and side) or uniform.",
    ),
    PlanOption(
        "rope_mode",
        "default (latent for optimal, post-rope for zack, or what the family allows), auto (chosen per layer by measured KL), freq, post-rope, latent, crosshead (RoPE models) or folded (models without RoPE); checked against the model's family (docs/adapters.md).",
    ),
    PlanOption(
        "prefer",
        "auto only: quality (every key mode) or zero-overhead (freq/post-rope/crosshead: no work that grows with context).",
    ),
    PlanOption(
        "key_mode_cost",
        "auto only: a mode of runtime cost c (latent 1, post-rope 0.1, freq/crosshead 0) must have (1 + W c) times less measured KL to be chosen.",
    ),
    PlanOption("calibration", "wiki, synthetic, or a path to a text file / directory of .txt files."),
    PlanOption("calib_tokens", "Calibration tokens (ZACK needs at least 16K)."),
    PlanOption("seq_len", "Calibration window length."),
    PlanOption("batch_size", "Calibration windows per forward pass (and per --distill optimiser step)."),
    PlanOption("reduce", "none or kmeans (ZDC §5.1 pruning + k-means reducer)."),
    PlanOption(
        "kmeans_clusters", "--reduce kmeans: clusters per layer, side and head that stand in for the kept vectors."
    ),
    PlanOption(
        "kmeans_keep_share",
        "--reduce kmeans: share of calibration batches whose vectors are kept for clustering (sequence pruning), in (0, 1].",
    ),
    PlanOption("min_rank", "Floor on every head's rank."),
    PlanOption("rank_multiple", "Round ranks to multiples of this (8 or 16 for kernels)."),
    PlanOption(
        "rate_grid",
        "Comma-separated rates of the checkpoint's rate table (the ranks any of them loads with; the target rate is always added).",
        parse=numbers,
        show=_comma_list,
    ),
    PlanOption(
        "serve_rates",
        "The rates the checkpoint serves, exactly, e.g. 0.3,0.5,0.7 (the same option as export-mla's; the target rate must be one of them): from its rate table, or trained together (--serve-rates-by).",
        parse=numbers_or_none,
        show=_comma_list,
    ),
    PlanOption(
        "serve_rates_by",
        "How --serve-rates are served: table (the rate table holds exactly them; the default) or distill (with --distill, its default: a nested distillation trains exactly them). export-mla also takes refit.",
    ),
    PlanOption(
        "max_ppl_increase",
        "Quality budget instead of a rate: the largest rate whose perplexity rises at most this much on held-back calibration text (e.g. 5% or 0.05).",
        parse=fraction_or_percent,
    ),
    PlanOption(
        "max_kl",
        "Quality budget: the largest rate whose mean next-token KL (nats) on held-back calibration text stays within this.",
    ),
    PlanOption("budget_tokens", "Calibration tokens held back from the statistics for the quality budget search."),
    PlanOption(
        "value_metric",
        "output (attention-output error) or fisher (weighted by the loss gradient at the attention output).",
    ),
    PlanOption("fisher_tokens", "--value-metric fisher: calibration tokens the loss gradients are collected on."),
    PlanOption(
        "fisher_shrink",
        "--value-metric fisher: shrinkage of the measured Fisher towards the identity, in [0, 1] (0: as measured, 1: the plain output metric).",
    ),
    PlanOption(
        "sequential_statistics",
        "off; keep-ranks: re-collect each layer's Grams on hidden states that went through the already-compressed layers before it (at the compiled ranks) and re-solve its transforms, GPTQ-style; reallocate: the same, then measure sensitivity and allocate ranks again (docs/compress.md).",
    ),
    PlanOption(
        "refit",
        "auto (the default, as export-mla's: output-local where the file serves its compiled widths alone, none where it keeps a rate table or is distilled, so none here), none; output: refit every o_proj by least squares at the compiled ranks against the original model's attention outputs; output-local: against the original layer on the compressed hidden states (the checkpoint serves its compiled rate only; docs/refit.md).",
    ),
    PlanOption("refit_tokens", "Calibration tokens the output refit is fitted on."),
    PlanOption("refit_ridge", "Ridge of the output refit, relative to the mean diagonal of the latents' Gram (>= 0)."),
    PlanOption(
        "distill",
        "Train the attention weights at the compiled ranks against the original model's next-token distribution (zero runtime cost; the checkpoint serves its compiled rate only; docs/distill.md).",
    ),
    PlanOption("distill_tokens", f"With --distill: {DISTILL_TOKENS_MEANING}."),
    PlanOption(
        "distill_epochs",
        "Passes over the distillation tokens; the best epoch on the validation windows is kept (default 8, with --distill-rates 2; as export-mla's).",
    ),
    PlanOption("distill_lr", "Adam learning rate of the distillation (cosine decay)."),
    PlanOption(
        "distill_rates",
        "Nested --distill: comma-separated rates, e.g. 0.3,0.5,0.7; one checkpoint trained for every grid rate from the first to the last, and serving them all (docs/distill.md).",
        parse=numbers_or_none,
        show=_comma_list,
    ),
    PlanOption(
        "probe_rates",
        "Sensitivity allocation: comma-separated truncation rates each layer side is probed at (one point, or a KL curve).",
        parse=numbers,
        show=_comma_list,
    ),
    PlanOption(
        "probe_windows", "Sensitivity allocation: calibration windows (256 tokens each) the probe KL is measured on."
    ),
    PlanOption("revision", "Hub revision of the source model."),
    PlanOption("device", "Where decoder layers run: cpu or cuda (statistics are float64 on the CPU either way)."),
    PlanOption(
        "dtype",
        f"Compute and output dtype: auto ({AUTO_DTYPE_MEANING}; the compress report records the one used), float32 (fp32) or bfloat16 (bf16).",
    ),
    PlanOption("max_shard_size", "Largest output shard; shards are written as they fill."),
    PlanOption(
        "verify_tokens",
        f"{VERIFY_TOKENS_MEANING}: max |Δlogit| of the full-rank rewrite against the original (float64, layer by layer), and the compiled ranks' KL and top-1 against the original; in windows of up to 256 tokens, whole windows, at least one.",
    ),
    PlanOption(
        "verify_tolerance",
        "Largest full-rank float64 logit difference the compile accepts (deep models with sharp attention amplify float64 rounding).",
    ),
    PlanOption("seed", "Seed for calibration sampling."),
    PlanOption("overwrite", "Replace an existing output directory."),
    PlanOption(
        "kv_codec",
        f"KV codec on the reduced cache: {', '.join(codec_names())}; parameters as int4:group_size=64 (docs/codecs.md).",
    ),
    PlanOption("kv_bits_budget", "tada: stored bits per cached element for the per-layer bit search."),
    PlanOption(
        "balance_values",
        "Exponent ALPHA in [0, 2] (0: off): scale each value latent dim by its o_proj column norm^ALPHA, folded exactly into v_proj/o_proj, so a value codec (int2) costs less; every rate keeps it (docs/codecs.md).",
    ),
)

# The panels `kvrewrite compress --help` groups its options in, in this order; within a panel, PLAN_OPTIONS' order.
PANELS: dict[str, tuple[str, ...]] = {
    "Rate and key modes": ("target_rate", "objective", "rope_mode", "prefer", "key_mode_cost"),
    "Calibration": (
        "calibration",
        "calib_tokens",
        "seq_len",
        "batch_size",
        "reduce",
        "kmeans_clusters",
        "kmeans_keep_share",
        "seed",
    ),
    "Allocation": (
        "allocation",
        "min_rank",
        "rank_multiple",
        "rate_grid",
        "serve_rates",
        "serve_rates_by",
        "max_ppl_increase",
        "max_kl",
        "budget_tokens",
        "value_metric",
        "fisher_tokens",
        "fisher_shrink",
        "probe_rates",
        "probe_windows",
    ),
    "Refit and distillation": (
        "sequential_statistics",
        "refit",
        "refit_tokens",
        "refit_ridge",
        "distill",
        "distill_tokens",
        "distill_epochs",
        "distill_lr",
        "distill_rates",
    ),
    "Codecs and cache budget": ("kv_codec", "kv_bits_budget", "balance_values", "kv_budget"),
    "Output": (
        "output",
        "overwrite",
        "max_shard_size",
        "verify_tokens",
        "verify_tolerance",
        "dry_run",
        "push_to_hub",
        "hub_private",
    ),
    "Source and hardware": ("revision", "device", "dtype"),
}
# Option (Plan field, or the command's own parameter) -> its panel.
PANEL_OF = {name: panel for panel, names in PANELS.items() for name in names}

# Plan fields `kvrewrite compress` does not offer as options, and why.
LIBRARY_ONLY: dict[str, str] = {
    "model": "the command's MODEL argument, not an option",
    "progress": "the command always shows progress bars; library callers (sweeps, tests, notebooks) may turn them off",
}

OPTIONS_BY_FIELD = {option.field: option for option in PLAN_OPTIONS}
# Parameter name -> flag, for the error messages of every command (one mapping; cli_message).
PLAN_FLAGS = {option.field: option.flag for option in PLAN_OPTIONS}


def _base_type(hint) -> type:
    """int for `int`, Path for `Path | None`: what typer converts the text to."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def plan_parameters() -> list[inspect.Parameter]:
    """One keyword parameter per option, its default the Plan's, for the compress command's signature."""
    hints = typing.get_type_hints(Plan)
    defaults = {f.name: f.default for f in dataclasses.fields(Plan)}
    parameters = []
    panels = list(PANELS)
    # typer draws the panels in the order their first option comes: grouped by panel, PLAN_OPTIONS' order within.
    for option in sorted(PLAN_OPTIONS, key=lambda option: panels.index(PANEL_OF[option.field])):
        default = defaults[option.field]
        if option.parse is not None:
            annotation, shown = (
                Optional[str] if default is None else str,
                None if default is None else option.show(default),
            )
        else:
            base = _base_type(hints[option.field])
            annotation, shown = Optional[base] if default is None else base, default
        flags = (option.flag, *option.short)
        parameters.append(
            inspect.Parameter(
                option.field,
                inspect.Parameter.KEYWORD_ONLY,
                annotation=annotation,
                default=typer.Option(shown, *flags, help=option.help, rich_help_panel=PANEL_OF[option.field]),
            )
        )
    return parameters


def plan_arguments(values: dict[str, Any]) -> dict[str, Any]:
    """The command line's values of the Plan options as Plan keyword arguments (text fields parsed)."""
    arguments = {}
    for option in PLAN_OPTIONS:
        value = values[option.field]
        if option.parse is not None and value is not None:
            value = option.parse(value, option.flag)
        arguments[option.field] = value
    return arguments


def with_signature(function: Callable, parameters: list[inspect.Parameter]) -> Callable:
    """Give `function(**options)` the signature (and annotations) typer builds its options from."""
    function.__signature__ = inspect.Signature(parameters)
    function.__annotations__ = {p.name: p.annotation for p in parameters}
    return function


_NAMED = re.compile(r"`([a-z_][a-z0-9_]*)(?:=([^`]*))?`")


def cli_message(text: str, flags: dict[str, str]) -> str:
    """A library message as the command line says it: `name` -> --flag, `name=value` -> --flag value.

    Names the mapping does not hold keep their backquotes (a Python parameter the command has no flag for)."""

    def flag(match: re.Match) -> str:
        name, value = match.group(1), match.group(2)
        if name not in flags:
            return match.group(0)
        if value is None:
            return flags[name]
        return f"{flags[name]} {value.strip().strip(chr(39)).strip(chr(34))}"

    return _NAMED.sub(flag, text)
