"""`kvrewrite export-mla SRC --kv-share 0.5 -o OUT`: the MLA form as a stock DeepSeek-V3 checkpoint."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvrewrite.errors import KVRewriteError

if TYPE_CHECKING:
    from kvrewrite.compile.mla.rate_refit import RateRefitResult, RateRefitSettings

DTYPES = {"auto": None, "bfloat16": "bfloat16", "float32": "float32", "float16": "float16"}
# --distill defaults (compress --distill's learning rate; the MLA form's factors are balanced to the source
# projections' scale before training, compile/mla/distill.py). Single-rate: 8 passes over the tokens, measured better
# than 2 on held-out wiki and news at 512 tokens and positions 2K-4K (docs/serving.md); nested (--distill-rates):
# 2, the setting its tables were measured at.
DISTILL_EPOCHS = 8.0
NESTED_DISTILL_EPOCHS = 2.0
DISTILL_LR = 1e-5
# --refit default where it was measured: a uniform export without --distill (held-out wiki and news, 512-token windows
# and positions 2K-4K, docs/serving.md). An --allocation sensitivity export keeps its rate table (a refit serves the
# exported widths only), and --distill was measured from the unrefitted form, so both default to none; with
# --refit-rates (one o_proj per named rate) it is the default for either allocation.
DEFAULT_REFIT = "output-local"


def _distill_settings(distill: bool, tokens: int | None, epochs: float | None, lr: float | None, calib_tokens: int,
                      nested: bool = False) -> dict:
    """Plan fields for the distillation; options that only --distill reads are refused without it."""
    from kvrewrite.errors import InvalidArgumentError

    given = [name for name, value in (("--distill-tokens", tokens), ("--distill-epochs", epochs), ("--distill-lr", lr)) if value is not None]
    if not distill:
        if given:
            raise InvalidArgumentError(f"{', '.join(given)} only apply with --distill")
        return {}
    return {"distill": True, "distill_tokens": calib_tokens if tokens is None else tokens,
            "distill_epochs": (NESTED_DISTILL_EPOCHS if nested else DISTILL_EPOCHS) if epochs is None else epochs,
            "distill_lr": DISTILL_LR if lr is None else lr}


def _nested_settings(rates: str | None, distill: bool, allocation: str, kv_share: float, kv_lora_rank: int | None) -> dict:
    """Plan fields for a nested MLA distillation (--distill-rates), checked before any work."""
    from kvrewrite.errors import InvalidArgumentError

    if rates is None:
        return {}
    if not distill or allocation != "sensitivity" or kv_lora_rank is not None:
        raise InvalidArgumentError("--distill-rates trains the rate table of an --allocation sensitivity export at a "
                                   "--kv-share; add --distill and --allocation sensitivity")
    try:
        parsed = tuple(sorted(float(r) for r in rates.split(",")))
    except ValueError:
        raise InvalidArgumentError(f"--distill-rates takes rates A,B (e.g. 0.3,0.7), got {rates!r}") from None
    if round(1 - kv_share, 4) != round(parsed[0], 4):
        raise InvalidArgumentError(f"--distill-rates starts at {parsed[0]:g}: export at --kv-share {1 - parsed[0]:g}, the "
                                   "widest rate it trains, so every trained rate is a prefix of the exported widths")
    return {"distill_rates": parsed, "target_rate": parsed[0]}


def _refit_settings(refit: str | None, refit_tokens: int | None, allocation: str, distill: bool,
                    rates_given: bool = False) -> dict:
    """Plan fields for the o_proj refit: DEFAULT_REFIT for a uniform export without --distill or with --refit-rates,
    else none unless asked for (an explicit refit with --distill-rates is refused by the plan: that o_proj serves
    every rate of its table)."""
    from kvrewrite.compile.plan import REFITS
    from kvrewrite.errors import InvalidArgumentError

    chosen = refit if refit is not None else (DEFAULT_REFIT if rates_given or (allocation == "uniform" and not distill)
                                              else "none")
    if chosen not in REFITS:
        raise InvalidArgumentError(f"--refit must be one of {', '.join(REFITS)}, got {chosen!r}")
    if chosen == "none" and refit_tokens is not None:
        raise InvalidArgumentError("--refit-tokens only applies with --refit output or output-local")
    if chosen == "none" and rates_given:
        raise InvalidArgumentError("--refit-rates refits o_proj at each rate; it needs --refit output or output-local")
    return {"refit": chosen, **({} if refit_tokens is None else {"refit_tokens": refit_tokens})}


def _refit_rates(rates: str | None, distill: bool, allocation: str, kv_share: float,
                 kv_lora_rank: int | None, nested: tuple[float, ...] = ()) -> tuple[float, ...]:
    """The rates of --refit-rates, checked before any work: the widest is the export's own (1 - --kv-share); with a
    nested --distill (nested: its --distill-rates A,B) every one lies within A..B, refitted after the training."""
    from kvrewrite.compile.mla.rate_refit import parse_refit_rates
    from kvrewrite.compile.plan import DEFAULT_RATE_GRID
    from kvrewrite.errors import InvalidArgumentError
    from kvrewrite.spec import rate_key

    if rates is None:
        return ()
    if (distill and not nested) or kv_lora_rank is not None:
        raise InvalidArgumentError("--refit-rates refits an export at a --kv-share, training-free or after a nested "
                                   "--distill-rates; it does not combine with a single-rate --distill or --kv-lora-rank")
    parsed = parse_refit_rates(rates)
    if nested and not nested[0] <= parsed[-1] <= nested[-1]:
        raise InvalidArgumentError(f"--refit-rates must lie within --distill-rates {nested[0]:g}..{nested[-1]:g}, the "
                                   "rates the nested distillation trains")
    if round(1 - kv_share, 4) != parsed[0]:
        raise InvalidArgumentError(f"--refit-rates starts at {parsed[0]:g}: export at --kv-share {1 - parsed[0]:g}, the "
                                   "widest rate, so every refitted rate is a prefix of the exported widths")
    grid = {rate_key(r) for r in DEFAULT_RATE_GRID}
    if allocation == "sensitivity" and (off := [f"{r:g}" for r in parsed if rate_key(r) not in grid]):
        raise InvalidArgumentError(f"--refit-rates {', '.join(off)} are not on the rate table's grid (steps of 0.05)")
    return parsed


def export_mla(
    model: str = typer.Argument(..., help="Hub id, local directory, or 'smollm2-135m' (bundled)."),
    output: Path = typer.Option(..., "--output", "-o", help="Directory for the DeepSeek-V3 checkpoint (written atomically)."),
    kv_share: float = typer.Option(0.5, "--kv-share", help="Cached values per token and layer, as a share of the source's K+V: (r + d_r) / (2 n_kv d)."),
    kv_lora_rank: int | None = typer.Option(None, "--kv-lora-rank", help="Exact latent width r instead of --kv-share (engines with fixed cached widths: vLLM's MLA kernels take r + d_r = 512 + 64)."),
    qk_rope_head_dim: int | None = typer.Option(None, "--qk-rope-head-dim", help="With --kv-lora-rank: the shared RoPE key's width d_r, head_dim (default) or head_dim / s, s dividing head_dim / 2 (every s-th frequency keeps its rotation)."),
    allocation: str = typer.Option("uniform", "--allocation", help="Latent widths across layers: uniform (every engine caches the share) or sensitivity (per-layer widths from measured KL at the same total; exported zero-padded to the widest layer, so only kvrewrite's runtime caches the share; docs/serving.md)."),
    calib_tokens: int = typer.Option(16384, "--calib-tokens", help="Calibration tokens (wiki)."),
    calibration: str = typer.Option("wiki", help="Calibration source: wiki, synthetic or a text file."),
    dtype: str = typer.Option("auto", help="Weights dtype: auto (the source's), bfloat16 or float32 (float16 cannot hold the neutralised latent)."),
    position_free_queries: str = typer.Option("expected-rotation", "--position-free-queries", help="How the latent's key part scores the RoPE components whose rotation is dropped: expected-rotation (the default: turned by each head's expected rotation over the distances its attention covers, attention sink left out, measured on calibration text and folded into q_proj) or source (the head's query unrotated). docs/serving.md has both measured."),
    key_weight: float | None = typer.Option(None, "--key-weight", help="Weight of the key side against the value side in the latent's objective (default 0.25, chosen on calibration text)."),
    verify_tokens: int = typer.Option(128, "--verify-tokens", help="Tokens of one calibration window for the checks at the end."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output directory."),
    refit: str | None = typer.Option(None, "--refit", help=f"Least-squares refit of every o_proj at the exported widths, layer by layer (closed form, no run-time cost): output-local (against the original layer on the form's own inputs), output (against the original model's attention outputs) or none. Default: {DEFAULT_REFIT} for a uniform export, none with --allocation sensitivity (it keeps its rate table; a refitted export serves its exported widths only) or --distill (docs/serving.md)."),
    refit_tokens: int | None = typer.Option(None, "--refit-tokens", help="With --refit: calibration tokens the least squares read (default 16384)."),
    distill: bool = typer.Option(False, "--distill", help="Train the MLA form's attention weights at its widths against the original model's next-token distribution (no run-time cost; docs/distill.md)."),
    distill_tokens: int | None = typer.Option(None, "--distill-tokens", help="With --distill: calibration tokens it trains on, 1/16 of them held back for validation (default: every calibration token)."),
    distill_epochs: float | None = typer.Option(None, "--distill-epochs", help=f"With --distill: passes over the distillation tokens; the best epoch on the validation windows is kept (default {DISTILL_EPOCHS:g}, with --distill-rates {NESTED_DISTILL_EPOCHS:g})."),
    distill_lr: float | None = typer.Option(None, "--distill-lr", help=f"With --distill: Adam learning rate, cosine decay (default {DISTILL_LR:g})."),
    distill_rates: str | None = typer.Option(None, "--distill-rates", help="With --distill and --allocation sensitivity: A,B trains every rate of the rate table from A to B together (nested over the latent widths; one file serves them all). A must be 1 - --kv-share."),
    refit_rates: str | None = typer.Option(None, "--refit-rates", help=f"A,B,...: one file serving these rates, o_proj refitted at each on its own (the stock weights hold A's, the others a side file kvrewrite.load(dir, rate=p) reads; no run-time cost). A must be 1 - --kv-share; widths uniform, or the rate table's with --allocation sensitivity. With --distill --distill-rates, each rate is refitted after the nested training. --refit defaults to {DEFAULT_REFIT} (docs/serving.md)."),
) -> None:
    """Compute a multi-head latent (MLA) form from calibration statistics and write it as a stock DeepSeek-V3 checkpoint."""
    console = Console() if sys.stdout.isatty() else Console(width=140)
    try:
        distilling = _distill_settings(distill, distill_tokens, distill_epochs, distill_lr, calib_tokens,
                                       nested=distill_rates is not None)
        distilling.update(_nested_settings(distill_rates, distill, allocation, kv_share, kv_lora_rank))
        refitted_rates = _refit_rates(refit_rates, distill, allocation, kv_share, kv_lora_rank,
                                      distilling.get("distill_rates", ()))
        refitting = _refit_settings(refit, refit_tokens, allocation, distill, rates_given=bool(refitted_rates))
        rate_refit = None
        if refitted_rates:  # per-rate refits, after a nested distillation where there is one (the plan's refit is
            # the single-rate one, which a nested distillation refuses)
            from kvrewrite.compile.mla.rate_refit import RateRefitSettings

            rate_refit = RateRefitSettings(refitted_rates, refitting.pop("refit"))
        distilling.update(refitting)
        _run(model, output, kv_share, calib_tokens, calibration, dtype, key_weight, verify_tokens, overwrite, console,
             kv_lora_rank, qk_rope_head_dim, distilling, allocation, position_free_queries=position_free_queries,
             rate_refit=rate_refit)
    except (KVRewriteError, ValueError) as exc:
        from kvrewrite.cli.compress_options import PLAN_FLAGS, cli_message

        # The library names parameters (`distill_tokens`); the command line says them as its flags.
        flags = {**PLAN_FLAGS, "output": "--output", "overwrite": "--overwrite", "kv_share": "--kv-share",
                 "position_free_queries": "--position-free-queries", "verify_tokens": "--verify-tokens"}
        console.print(f"[bold red]error:[/] {escape(cli_message(str(exc), flags))}")
        raise typer.Exit(code=2) from None


def _run(model, output, kv_share, calib_tokens, calibration, dtype, key_weight, verify_tokens, overwrite, console,
         kv_lora_rank=None, qk_rope_head_dim=None, distilling: dict | None = None, allocation: str = "uniform", *,
         position_free_queries: str, rate_refit: RateRefitSettings | None = None) -> None:
    import torch

    from kvrewrite.adapters import adapter_for
    from kvrewrite.compile.mla.export import (
        check_position_free_queries, check_source_exportable, export_at_share, export_matches_maths, full_width_max_logit_diff,
        mla_layers_at_widths, prepare_source,
    )
    from kvrewrite.compile.mla.form import widths_for_ranks, widths_for_share
    from kvrewrite.compile.passes.load_checkpoint import load_config
    from kvrewrite.io.sources import resolve_model_source
    from kvrewrite.compile.plan import Plan
    from kvrewrite.errors import InvalidArgumentError
    from kvrewrite.compile.passes.pipeline import prepare_output
    from kvrewrite.progress import progress_bar
    from kvrewrite.spec import rate_key

    if dtype not in DTYPES:
        raise InvalidArgumentError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if key_weight is not None and not 0 < key_weight < float("inf"):
        raise InvalidArgumentError(f"--key-weight {key_weight}: the key side's weight against the value side must be a "
                                   "positive number")
    if verify_tokens < 1:
        raise InvalidArgumentError(f"--verify-tokens {verify_tokens}: the checks at the end compare logits on at "
                                   "least 1 calibration token")
    if not 0 < kv_share <= 1:
        raise InvalidArgumentError(f"--kv-share must be in (0, 1], got {kv_share}")
    plan = Plan(model=model, calibration=calibration, calib_tokens=calib_tokens, output=output, overwrite=overwrite,
                **(distilling or {}))
    if plan.distill and plan.distill_tokens > calib_tokens:
        raise InvalidArgumentError(f"--distill-tokens {plan.distill_tokens} is more than --calib-tokens {calib_tokens}: "
                                   "the distillation trains on calibration windows; raise --calib-tokens")
    if qk_rope_head_dim is not None and kv_lora_rank is None:
        raise InvalidArgumentError("--qk-rope-head-dim needs --kv-lora-rank (exact widths)")
    check_position_free_queries(position_free_queries, "--position-free-queries")
    if allocation not in ("uniform", "sensitivity"):
        raise InvalidArgumentError(f"--allocation must be uniform or sensitivity, got {allocation!r}")
    if allocation == "sensitivity" and kv_lora_rank is not None:
        raise InvalidArgumentError("--kv-lora-rank gives every layer one exact width; --allocation sensitivity places "
                                   "widths per layer at a --kv-share")
    check_source_exportable(plan)  # the family, before any weight is read
    # The widths, from the config alone, before any weight is read.
    config = load_config(resolve_model_source(plan.model, revision=plan.revision).path)
    geometry = adapter_for(config).geometry(config)
    widths = (widths_for_share(geometry, kv_share) if kv_lora_rank is None
              else widths_for_ranks(geometry, kv_lora_rank, qk_rope_head_dim))
    # Every trained or refitted rate's widths (uniform) or mean width (allocated), from the config alone.
    from kvrewrite.compile.mla.allocation import check_rate_latents

    values = 2 * geometry.num_key_value_heads * geometry.head_dim
    if plan.distill_rates:
        check_rate_latents(plan.distill_rates, values, widths.qk_rope_head_dim, "--distill-rates")
    uniform_rates = None
    if rate_refit is not None and allocation == "uniform":
        from kvrewrite.compile.mla.rate_refit import uniform_rate_widths

        uniform_rates = uniform_rate_widths(rate_refit.rates, values, widths.qk_rope_head_dim, widths.kv_lora_rank,
                                            geometry.num_layers)
    elif rate_refit is not None:
        check_rate_latents(rate_refit.rates, values, widths.qk_rope_head_dim, "--refit-rates")
    prepare_output(Path(output), plan)  # leftovers of interrupted exports, then a safe, writable location
    prepared = prepare_source(plan, position_free_queries=position_free_queries)
    ctx = prepared.ctx
    chosen = getattr(torch, DTYPES[dtype]) if DTYPES[dtype] else _source_dtype(ctx.config)
    weighting = {} if key_weight is None else {"key_weight": key_weight}
    allocation_record, served_rates = None, None
    if allocation == "sensitivity":
        from kvrewrite.compile.mla.allocation import allocation_report
        from kvrewrite.compile.mla.export import allocated_at_share, probe_full_form

        with progress_bar("MLA form at full width, then sensitivity probes", 2 * ctx.geometry.num_layers, plan.progress) as bar:
            probed = probe_full_form(prepared, progress=bar.advance, **weighting)
        allocated = allocated_at_share(prepared, probed, kv_share)
        layers, allocation_record = allocated.layers, allocation_report(allocated.sensitivity, allocated.allocation)
        # Narrower rates are prefixes of one removal order. A single-rate --distill trains the exported widths only,
        # so its export serves those alone; a nested one (--distill-rates) keeps the rates it trained (below).
        served_rates = allocated.rate_table
    else:
        with progress_bar("MLA form per layer", ctx.geometry.num_layers, plan.progress) as bar:
            layers = mla_layers_at_widths(prepared, widths, progress=bar.advance, **weighting)
    norms, provenance, distilled, rate_o_proj = None, {}, None, None

    def refit_each_rate(layers, served_rates, norms):
        """--refit-rates: o_proj refitted at every named rate (uniform widths, or the served table's rows)."""
        from kvrewrite.compile.mla.rate_refit import refit_mla_at_rates, served_refit_table

        table = uniform_rates if allocation == "uniform" else served_refit_table(rate_refit.rates, served_rates)
        rated = refit_mla_at_rates(prepared, layers, table, rate_refit.method, plan.refit_tokens,
                                   plan.refit_ridge, plan.progress)
        _print_rate_refits(console, rated)
        bound = rated.max_square_norms if norms is None else [max(a, b) for a, b in zip(norms, rated.max_square_norms)]
        return rated, bound

    if rate_refit is not None and not plan.distill:
        rated, norms = refit_each_rate(layers, served_rates, norms)
        layers, rate_o_proj, served_rates = rated.layers, rated.rate_o_proj, rated.rate_table
        provenance = {"refit": rated.provenance()}
    elif plan.refit != "none":
        from kvrewrite.compile.mla.refit import refit_mla_output

        refitted = refit_mla_output(prepared, layers, plan.refit, plan.refit_tokens, plan.refit_ridge, plan.progress,
                                    measure_inputs=not plan.distill)  # a --distill after it measures its own form
        layers, norms, provenance = refitted.layers, refitted.max_square_norms, {"refit": refitted.provenance()}
        served_rates = None  # fitted for the exported widths: the narrower rates of a table are not served
        errors = [(r.relative_error_before, r.relative_error_after) for r in refitted.reports]
        console.print(f"refit: o_proj of {len(errors)} layers on {refitted.tokens} calibration tokens; relative error of the "
                      f"attention output, mean over layers {sum(b for b, _ in errors) / len(errors):.3f} -> "
                      f"{sum(a for _, a in errors) / len(errors):.3f}")
    if plan.distill:
        from kvrewrite.compile.mla.distill import distill_mla_layers, distill_provenance

        nested = {}
        if plan.distill_rates:  # the rates the table holds between A and B, each a prefix of the exported widths
            keys = [rate_key(r) for r in plan.nested_distill_rates() if rate_key(r) in served_rates]
            missing = [rate_key(r) for r in plan.distill_rates if rate_key(r) not in served_rates]
            if missing:
                raise InvalidArgumentError(f"--distill-rates {', '.join(missing)} are not in the export's rate table "
                                           f"({', '.join(served_rates)})")
            nested = {"rate_table": {k: served_rates[k] for k in keys},
                      "named_rates": tuple(rate_key(r) for r in plan.distill_rates)}
        distilled = distill_mla_layers(prepared, layers, progress=plan.progress, **nested)
        layers, norms = distilled.layers, distilled.max_square_norms
        provenance.update(distill_provenance(distilled, plan))
        served_rates = nested.get("rate_table")  # exactly the rates trained (none beside the export's own: single-rate)
        if rate_refit is not None:  # nested: each named rate's o_proj refitted on the trained weights
            rated, norms = refit_each_rate(layers, served_rates, norms)
            layers, rate_o_proj, served_rates = rated.layers, rated.rate_o_proj, rated.rate_table
            provenance["refit"] = {**rated.provenance(), "after": "distill"}
    provenance["position_free_queries"] = position_free_queries
    if allocation_record is not None:  # kept in the marker: how the widths were placed (the probes stay out of config.json)
        provenance["allocation"] = {k: v for k, v in allocation_record.items() if k != "probes"}
    summary = export_at_share(prepared, layers, output, dtype=chosen, overwrite=overwrite, max_square_norms=norms,
                              provenance=provenance, rate_table=served_rates, rate_o_proj=rate_o_proj)

    tokens = ctx.calibration_tokens[:1, :verify_tokens]
    full_diff = full_width_max_logit_diff(prepared, tokens)
    export_diff = export_matches_maths(prepared, layers, output, tokens)
    rate_diffs = {}
    if rate_o_proj:
        from kvrewrite.compile.mla.rate_refit import rates_match_maths

        rate_diffs = rates_match_maths(prepared, rated, output, tokens)
    source_values = 2 * ctx.geometry.num_key_value_heads * ctx.geometry.head_dim
    mean_cached = sum(layer.cached_values_per_token for layer in layers) / len(layers)
    table = Table(title=f"MLA form of {model}: {mean_cached:g} of {source_values} K+V values per token and layer"
                        + (" (mean over layers)" if allocation == "sensitivity" else ""))
    for column in ("layer", "r (kv_lora_rank)", "d_r (qk_rope_head_dim)", "share", "RoPE energy kept", "latent-norm error bound"):
        table.add_column(column, justify="right")
    for idx, (layer, norm) in enumerate(zip(layers, summary.neutralisers)):
        table.add_row(str(idx), str(layer.kv_lora_rank), str(layer.qk_rope_head_dim), f"{layer.cached_values_per_token / source_values:.3f}",
                      f"{layer.rope_energy_kept:.3f}", f"{norm.relative_error_bound:.0e}")
    console.print(table)
    if distilled is not None:
        _print_distillation(console, distilled, summary)
    console.print(f"verify: full-width MLA (every RoPE component, full latent) vs original, max |Δlogit| = {full_diff:.2e}")
    console.print(f"verify: exported checkpoint in stock transformers ({str(chosen).removeprefix('torch.')}) vs our maths, "
                  f"max |Δlogit| = {export_diff:.2e}")
    for key, diff in rate_diffs.items():
        console.print(f"verify: rate {key} loaded by kvrewrite.load (its own o_proj from the side file) vs our maths, "
                      f"max |Δlogit| = {diff:.2e}")
    if served_rates:
        console.print(f"rate table: kvrewrite.load(DIR, rate=p) serves p = {', '.join(served_rates)} from this file "
                      "(per-layer widths, prefixes of the exported ones"
                      + (", each with its own refitted o_proj)" if rate_o_proj is not None else ")"))
    console.print(f"wrote {output} (DeepseekV3ForCausalLM; load with AutoModelForCausalLM.from_pretrained)")


def _print_rate_refits(console: Console, rated: RateRefitResult) -> None:
    table = Table(title="o_proj refitted per rate (--refit-rates): relative error of the attention output, mean over layers")
    for column in ("rate", "mean latent width", "before", "after", "stored in"):
        table.add_column(column, justify="right")
    for key, refit in rated.refits.items():
        widths = rated.rate_table[key]
        before = sum(r.relative_error_before for r in refit.reports) / len(refit.reports)
        after = sum(r.relative_error_after for r in refit.reports) / len(refit.reports)
        table.add_row(key, f"{round(sum(widths) / len(widths), 1):g}", f"{before:.3f}", f"{after:.3f}",
                      "stock weights" if key == rated.widest else "side file")
    console.print(table)


def _source_dtype(config):
    """The source's dtype where it can hold the neutralised latent (bfloat16, float32); else float32."""
    import torch

    name = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(name, torch.dtype):
        return name
    return getattr(torch, str(name)) if name in ("bfloat16", "float32") else torch.float32


def _print_distillation(console, distilled, summary) -> None:
    from kvrewrite.compile.mla.deepseek_v3_export import TRANSFORMERS_LATENT_NORM_EPS
    from kvrewrite.compile.mla.distill import measured_latent_norm_errors

    report = distilled.report
    if report is None:
        console.print("distill: the form is exact at these widths (every RoPE component, full latent): nothing trained")
        return
    kept = f"epoch {report.kept_epoch} kept" if report.kept_epoch else "no epoch helped, weights unchanged"
    console.print(f"distill: validation KL {report.validation_kl_before:.4f} -> {report.validation_kl_after:.4f} nats "
                  f"({kept}; {report.train_tokens} training, {report.validation_tokens} validation tokens, {report.seconds:.0f} s)")
    errors = measured_latent_norm_errors(distilled, summary.neutralisers, TRANSFORMERS_LATENT_NORM_EPS)
    bound = max(n.relative_error_bound for n in summary.neutralisers)
    console.print(f"distill: kv_a_layernorm neutralisation re-derived from the trained weights: largest error on calibration "
                  f"tokens {max(errors):.1e} (bound {bound:.0e})")
