"""`kvrewrite export-mla SRC --kv-share 0.5 -o OUT`: the MLA form as a stock DeepSeek-V3 checkpoint.

The command's flags become an MLAPlan (kvrewrite/compile/mla/plan.py, where every option is validated) and the export
is `kvrewrite.export_mla` (compile/mla/api.py); this file parses text and prints."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvrewrite.cli.shared_options import AUTO_DTYPE_MEANING, DISTILL_TOKENS_MEANING, VERIFY_TOKENS_MEANING
from kvrewrite.compile.mla.plan import DISTILL_LR, MLAPlan
from kvrewrite.compile.plan import DISTILL_EPOCHS, NESTED_DISTILL_EPOCHS, SERVE_RATES_BY
from kvrewrite.errors import InvalidArgumentError, KVRewriteError

# export-mla's defaults are MLAPlan's, never restated here (both commands' shared flags: tests/test_cli_and_errors.py).
MLA_DEFAULTS = {field.name: field.default for field in dataclasses.fields(MLAPlan)}


def _rates(text: str | None, option: str) -> tuple[float, ...]:
    """'0.3,0.7' -> (0.3, 0.7); None -> ()."""
    if text is None:
        return ()
    try:
        return tuple(float(r) for r in text.split(","))
    except ValueError:
        raise InvalidArgumentError(f"{option} takes rates A,B (e.g. 0.3,0.7), got {text!r}") from None


def _flags() -> dict[str, str]:
    """Parameter name -> the command's flag, for cli_message (MLAPlan's messages name its fields, the same names).

    Read off the command's signature: typer runs its own copy of click, whose current context click cannot see."""
    import inspect

    from typer.models import OptionInfo

    flags = {}
    for name, parameter in inspect.signature(export_mla_command).parameters.items():
        if isinstance(parameter.default, OptionInfo):
            long = [d for d in parameter.default.param_decls or () if d.startswith("--")]
            flags[name] = max(long, key=len) if long else "--" + name.replace("_", "-")
    flags.pop("old_allocation", None)
    return flags


def export_mla_command(
    model: str = typer.Argument(..., help="Hub id, local directory, or 'smollm2-135m' (bundled)."),
    kv_share: float | None = typer.Option(
        None,
        "--kv-share",
        help="Cached values per token and layer, as a share of the source's K+V: (r + d_r) / (2 n_kv d). Default 0.5, or with --serve-rates 1 - the smallest.",
        rich_help_panel="Form",
    ),
    kv_lora_rank: int | None = typer.Option(
        None,
        "--kv-lora-rank",
        help="Exact latent width r instead of --kv-share (engines with fixed cached widths: vLLM's MLA kernels take r + d_r = 512 + 64).",
        rich_help_panel="Form",
    ),
    qk_rope_head_dim: int | None = typer.Option(
        None,
        "--qk-rope-head-dim",
        help="With --kv-lora-rank: the shared RoPE key's width d_r, head_dim (default) or head_dim / s, s dividing head_dim / 2 (every s-th frequency keeps its rotation).",
        rich_help_panel="Form",
    ),
    layer_widths: str = typer.Option(
        MLA_DEFAULTS["layer_widths"],
        "--layer-widths",
        help="Latent widths across layers: uniform (every engine caches the share) or sensitivity (per-layer widths from measured KL at the same total; exported zero-padded to the widest layer, so only kvrewrite's runtime caches the share; docs/serving.md). Not compress's --allocation (a rank-allocation algorithm).",
        rich_help_panel="Form",
    ),
    position_free_queries: str = typer.Option(
        "expected-rotation",
        "--position-free-queries",
        help="How the latent's key part scores the RoPE components whose rotation is dropped: expected-rotation (the default: turned by each head's expected rotation over the distances its attention covers, attention sink left out, measured on calibration text and folded into q_proj) or source (the head's query unrotated). docs/serving.md has both measured.",
        rich_help_panel="Form",
    ),
    key_weight: float | None = typer.Option(
        None,
        "--key-weight",
        help="Weight of the key side against the value side in the latent's objective (default 0.25, chosen on calibration text).",
        rich_help_panel="Form",
    ),
    calib_tokens: int = typer.Option(
        MLA_DEFAULTS["calib_tokens"],
        "--calib-tokens",
        help="Calibration tokens the statistics are collected on.",
        rich_help_panel="Calibration",
    ),
    calibration: str = typer.Option(
        "wiki", help="Calibration source: wiki, synthetic or a text file.", rich_help_panel="Calibration"
    ),
    refit_rates: str | None = typer.Option(
        None,
        "--refit-rates",
        help="A,B,...: one file serving these rates, o_proj refitted at each on its own (the stock weights hold A's, the others a side file kvrewrite.load(dir, rate=p) reads; no run-time cost). A must be 1 - --kv-share; widths uniform, or the rate table's with --layer-widths sensitivity. With --distill --distill-rates, each rate is refitted after the nested training. --refit auto is output-local (docs/serving.md). Same as --serve-rates A,B,... --serve-rates-by refit.",
        rich_help_panel="Rates served",
    ),
    serve_rates: str | None = typer.Option(
        None,
        "--serve-rates",
        help="The rates the file serves, exactly, e.g. 0.3,0.5,0.7 (the same option as compress's); the smallest is the export's own, so --kv-share defaults to 1 - it. Served as --serve-rates-by says.",
        rich_help_panel="Rates served",
    ),
    serve_rates_by: str | None = typer.Option(
        None,
        "--serve-rates-by",
        help=f"How --serve-rates are served: {', '.join(SERVE_RATES_BY)}. table: the rate table of a --layer-widths sensitivity export (closed form; its default); distill: a nested --distill trains exactly them (the default with --distill); refit: o_proj refitted at each (the default for a uniform export).",
        rich_help_panel="Rates served",
    ),
    refit: str = typer.Option(
        "auto",
        "--refit",
        help="Least-squares refit of every o_proj at the exported widths, layer by layer (closed form, no run-time cost): output-local (against the original layer on the form's own inputs), output (against the original model's attention outputs) or none. auto (the default, as compress's): output-local for a uniform export or per-rate refits, none with --layer-widths sensitivity (it keeps its rate table; a refitted export serves its exported widths only) or --distill (docs/serving.md).",
        rich_help_panel="Refit and distillation",
    ),
    refit_tokens: int | None = typer.Option(
        None,
        "--refit-tokens",
        help="With --refit: calibration tokens the least squares read (default 16384).",
        rich_help_panel="Refit and distillation",
    ),
    distill: bool = typer.Option(
        False,
        "--distill",
        help="Train the MLA form's attention weights at its widths against the original model's next-token distribution (no run-time cost; docs/distill.md).",
        rich_help_panel="Refit and distillation",
    ),
    distill_tokens: int | None = typer.Option(
        None,
        "--distill-tokens",
        help=f"With --distill: {DISTILL_TOKENS_MEANING}.",
        rich_help_panel="Refit and distillation",
    ),
    distill_epochs: float | None = typer.Option(
        None,
        "--distill-epochs",
        help=f"With --distill: passes over the distillation tokens; the best epoch on the validation windows is kept (default {DISTILL_EPOCHS:g}, with --distill-rates {NESTED_DISTILL_EPOCHS:g}).",
        rich_help_panel="Refit and distillation",
    ),
    distill_lr: float | None = typer.Option(
        None,
        "--distill-lr",
        help=f"With --distill: Adam learning rate, cosine decay (default {DISTILL_LR:g}).",
        rich_help_panel="Refit and distillation",
    ),
    distill_rates: str | None = typer.Option(
        None,
        "--distill-rates",
        help="With --distill and --layer-widths sensitivity: A,B trains every rate of the rate table from A to B together (nested over the latent widths; one file serves them all). A must be 1 - --kv-share.",
        rich_help_panel="Refit and distillation",
    ),
    output: Path = typer.Option(
        ...,
        "--output",
        "-o",
        help="Directory for the DeepSeek-V3 checkpoint (written atomically).",
        rich_help_panel="Output",
    ),
    verify_tokens: int = typer.Option(
        MLA_DEFAULTS["verify_tokens"],
        "--verify-tokens",
        help=f"{VERIFY_TOKENS_MEANING}: max |Δlogit| of the full-width MLA form against the original, and of the written checkpoint (stock transformers) and each refitted rate against our maths; the first calibration windows, up to 256 tokens each, as compress's checks.",
        rich_help_panel="Output",
    ),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Replace an existing output directory.", rich_help_panel="Output"
    ),
    dtype: str = typer.Option(
        MLA_DEFAULTS["dtype"],
        help=f"Weights dtype: auto ({AUTO_DTYPE_MEANING}), bfloat16 or float32 (float16 cannot hold the neutralised latent).",
        rich_help_panel="Source and hardware",
    ),
    device: str = typer.Option(
        MLA_DEFAULTS["device"],
        help="Where every step that runs the model runs: cpu or cuda (optionally cuda:N). The statistics' layers, the expected rotations, the sensitivity probes, the refits, the distillation and the checks; Grams and the form's decompositions stay float64 on the CPU.",
        rich_help_panel="Source and hardware",
    ),
    old_allocation: str | None = typer.Option(None, "--allocation", hidden=True),
) -> None:
    """Compute a multi-head latent (MLA) form from calibration statistics and write it as a stock DeepSeek-V3 checkpoint."""
    from kvrewrite.cli.compress_options import cli_message

    console = Console() if sys.stdout.isatty() else Console(width=140)
    try:
        from kvrewrite.compile.mla.api import export_mla
        from kvrewrite.compile.mla.rate_refit import parse_refit_rates

        if old_allocation is not None:
            raise InvalidArgumentError(
                f"export-mla's --allocation is now --layer-widths (--layer-widths {old_allocation}): the latent widths "
                "across layers, uniform or sensitivity; compress's --allocation is a rank-allocation algorithm"
            )
        served = _rates(serve_rates, "--serve-rates")
        if kv_share is None:  # the widest served rate is the export's own
            kv_share = round(1 - min(served), 4) if served else 0.5
        plan = MLAPlan(
            output=output,
            kv_share=kv_share,
            kv_lora_rank=kv_lora_rank,
            qk_rope_head_dim=qk_rope_head_dim,
            layer_widths=layer_widths,
            calibration=calibration,
            calib_tokens=calib_tokens,
            dtype=dtype,
            device=device,
            position_free_queries=position_free_queries,
            key_weight=key_weight,
            verify_tokens=verify_tokens,
            overwrite=overwrite,
            refit=refit,
            refit_tokens=refit_tokens,
            distill=distill,
            distill_tokens=distill_tokens,
            distill_epochs=distill_epochs,
            distill_lr=distill_lr,
            distill_rates=_rates(distill_rates, "--distill-rates"),
            refit_rates=parse_refit_rates(refit_rates) if refit_rates is not None else (),
            serve_rates=served,
            serve_rates_by=serve_rates_by,
        )
        result = export_mla(model, plan)
    except (KVRewriteError, ValueError) as exc:
        console.print(f"[bold red]error:[/] {escape(cli_message(str(exc), _flags()))}")
        raise typer.Exit(code=2) from None
    _print_export(console, model, plan, result)


def _print_export(console: Console, model: str, plan, result) -> None:
    if result.rate_refit is not None:
        _print_rate_refits(console, result.rate_refit)
    if result.refit is not None:
        errors = [(r.relative_error_before, r.relative_error_after) for r in result.refit.reports]
        console.print(
            f"refit: o_proj of {len(errors)} layers on {result.refit.tokens} calibration tokens; relative error "
            f"of the attention output, mean over layers {sum(b for b, _ in errors) / len(errors):.3f} -> "
            f"{sum(a for _, a in errors) / len(errors):.3f}"
        )
    layers, source_values = result.layers, result.source_values
    mean_cached = sum(layer.cached_values_per_token for layer in layers) / len(layers)
    table = Table(
        title=f"MLA form of {model}: {mean_cached:g} of {source_values} K+V values per token and layer"
        + (" (mean over layers)" if plan.layer_widths == "sensitivity" else "")
    )
    for column in (
        "layer",
        "r (kv_lora_rank)",
        "d_r (qk_rope_head_dim)",
        "share",
        "RoPE energy kept",
        "latent-norm error bound",
    ):
        table.add_column(column, justify="right")
    for idx, (layer, norm) in enumerate(zip(layers, result.summary.neutralisers)):
        table.add_row(
            str(idx),
            str(layer.kv_lora_rank),
            str(layer.qk_rope_head_dim),
            f"{layer.cached_values_per_token / source_values:.3f}",
            f"{layer.rope_energy_kept:.3f}",
            f"{norm.relative_error_bound:.0e}",
        )
    console.print(table)
    if result.distilled is not None:
        _print_distillation(console, result)
    console.print(
        f"verify: full-width MLA (every RoPE component, full latent) vs original, max |Δlogit| = {result.full_width_diff:.2e}"
    )
    console.print(
        f"verify: exported checkpoint in stock transformers ({str(result.summary.dtype).removeprefix('torch.')}) vs our maths, "
        f"max |Δlogit| = {result.export_diff:.2e}"
    )
    for key, diff in result.rate_diffs.items():
        console.print(
            f"verify: rate {key} loaded by kvrewrite.load (its own o_proj from the side file) vs our maths, "
            f"max |Δlogit| = {diff:.2e}"
        )
    if result.served_rates:
        console.print(
            f"rate table: kvrewrite.load(DIR, rate=p) serves p = {', '.join(result.served_rates)} from this file "
            "(per-layer widths, prefixes of the exported ones"
            + (", each with its own refitted o_proj)" if result.rate_refit is not None else ")")
        )
    console.print(f"wrote {result.output} (DeepseekV3ForCausalLM; load with AutoModelForCausalLM.from_pretrained)")


def _print_rate_refits(console: Console, rated) -> None:
    table = Table(
        title="o_proj refitted per rate (--serve-rates-by refit): relative error of the attention output, mean over layers"
    )
    for column in ("rate", "mean latent width", "before", "after", "stored in"):
        table.add_column(column, justify="right")
    for key, refit in rated.refits.items():
        widths = rated.rate_table[key]
        before = sum(r.relative_error_before for r in refit.reports) / len(refit.reports)
        after = sum(r.relative_error_after for r in refit.reports) / len(refit.reports)
        table.add_row(
            key,
            f"{round(sum(widths) / len(widths), 1):g}",
            f"{before:.3f}",
            f"{after:.3f}",
            "stock weights" if key == rated.widest else "side file",
        )
    console.print(table)


def _print_distillation(console: Console, result) -> None:
    report = result.distilled.report
    if report is None:
        console.print("distill: the form is exact at these widths (every RoPE component, full latent): nothing trained")
        return
    kept = f"epoch {report.kept_epoch} kept" if report.kept_epoch else "no epoch helped, weights unchanged"
    console.print(
        f"distill: validation KL {report.validation_kl_before:.4f} -> {report.validation_kl_after:.4f} nats "
        f"({kept}; {report.train_tokens} training, {report.validation_tokens} validation tokens, {report.seconds:.0f} s)"
    )
    bound = max(n.relative_error_bound for n in result.summary.neutralisers)
    console.print(
        f"distill: kv_a_layernorm neutralisation re-derived from the trained weights: largest error on calibration "
        f"tokens {max(result.latent_norm_errors):.1e} (bound {bound:.0e})"
    )
