"""`kvrewrite` command line: compress, eval, inspect, card, push, sweep, demo."""

from __future__ import annotations

import inspect
import json
import sys
import threading
import warnings
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvrewrite.cli.compress_options import (
    PANEL_OF,
    PLAN_FLAGS,
    cli_message,
    number,
    numbers,
    plan_arguments,
    plan_parameters,
    with_signature,
)
from kvrewrite.cli.export import export_mla_command
from kvrewrite.compile.budget_search import DEFAULT_PERPLEXITY_SLACK, DEFAULT_PROBES
from kvrewrite.compile.plan import TUNING_FIELDS
from kvrewrite.compile.sweep import NAMED_CONFIGS
from kvrewrite.compile.token_budget import parse_group_sizes
from kvrewrite.errors import InvalidArgumentError, KVRewriteError, KVRewriteWarning
from kvrewrite.extras import PLOTS, WIKI_TEXT, require_compile_extra, require_package
from kvrewrite.interrupts import EXIT_INTERRUPTED, INTERRUPTED_MESSAGE, Interrupted, unwind_while_running
from kvrewrite.spec import per_head_key_ranks

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="Rewrite a Hugging Face causal LM so its KV cache is smaller."
)
# Off a terminal (logs, CI) rich would wrap tables at 80 columns; give them room instead.
console = Console() if sys.stdout.isatty() else Console(width=140)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    if issubclass(category, KVRewriteWarning):
        console.print(
            f"[yellow]warning:[/] {escape(cli_message(str(message), _flags()))}"
        )  # escaped: [compile] is text, not markup
    else:
        _default_showwarning(message, category, filename, lineno, file, line)


_default_showwarning = warnings.showwarning


@app.callback()
def _setup() -> None:
    warnings.showwarning = _show_warning
    if threading.current_thread() is threading.main_thread():
        # SIGINT and SIGTERM unwind (the atomic writers delete their temporary files), then main() says so in one line.
        unwind_while_running()


def _flags() -> dict[str, str]:
    """Parameter name -> flag: the Plan's options, then the running command's own (push's `revision`, eval's `rates`)."""
    flags = dict(PLAN_FLAGS)
    context = _current_context()
    for param in context.command.params if context is not None else ():
        longest = max(param.opts, key=len)
        if param.name and longest.startswith("--"):
            flags[param.name] = longest
    return flags


def _current_context():
    """The running command's context. typer 0.29 runs commands on its own copy of click, whose context stack is not
    click's: click.get_current_context() there is always None."""
    try:
        from typer._click.globals import get_current_context
    except ImportError:  # a typer that runs on click itself
        from click import get_current_context
    return get_current_context(silent=True)


def _fail(exc: Exception) -> None:
    # The library names parameters (`min_rank=12`); the command line says them as its flags (--min-rank 12).
    message = cli_message(str(exc), _flags())
    console.print(f"[bold red]error:[/] {escape(message)}")  # escaped: brackets in messages are text, not markup
    raise typer.Exit(code=2)


def _dtype_shown(plan) -> str:
    """The dtype a compile of `plan` runs in: `dtype=auto` resolved where the source is already on disk."""
    from kvrewrite.compile.passes.pipeline import local_config
    from kvrewrite.compile.plan import AUTO_DTYPE
    from kvrewrite.io.sources import local_source_dir

    if plan.dtype != AUTO_DTYPE:
        return plan.dtype
    source = local_source_dir(plan.model)
    config = local_config(source)
    if config is None:
        return "auto (the source's when float32 or bfloat16, else float32; known once the source is loaded)"
    return f"{str(plan.compute_dtype(config)).removeprefix('torch.')} (auto: the source's)"


def _typed_tuning_flags(ctx: typer.Context) -> set[str]:
    """The tuning options (TUNING_FIELDS) typed on the command line: the plan refuses them without their step even
    at their default values."""
    return {
        name
        for names in TUNING_FIELDS.values()
        for name in names
        if getattr(ctx.get_parameter_source(name), "name", None) == "COMMANDLINE"
    }


def compress(
    ctx: typer.Context,
    model: str,
    dry_run: bool,
    push_to_hub: str | None,
    hub_private: bool,
    kv_budget: str | None,
    **plan_options,
) -> None:
    """Compile MODEL into a checkpoint whose KV cache keeps (1 - target_rate) of its elements."""
    from kvrewrite.cli.tables import ranks_table, summary_table
    from kvrewrite.compile.api import compress as compile_plan
    from kvrewrite.compile.passes.pipeline import default_pipeline, describe
    from kvrewrite.compile.plan import Plan

    try:
        plan = Plan(model=model, **plan_arguments(plan_options))
        plan.refuse_idle_tuning(given=_typed_tuning_flags(ctx))
        passes = default_pipeline()
        budget_share = _budget_share(kv_budget) if kv_budget is not None else None  # refused now, not after the compile
        if dry_run:
            table = Table(title=f"kvrewrite compress {model} --target-rate {plan.target_rate} (dry run)")
            table.add_column("#", justify="right")
            table.add_column("pass")
            table.add_column("what it does")
            for i, (name, text) in enumerate(describe(passes), 1):
                table.add_row(str(i), name, text)
            console.print(table)
            console.print(
                f"key mode: {plan.key_mode()} (for a plain RoPE model; the family may force another, docs/adapters.md), objective: {plan.objective}, allocation: {plan.allocation}, "
                f"calibration: {plan.calibration} ({plan.calib_tokens} tokens), device: {plan.device}, dtype: {_dtype_shown(plan)}"
            )
            if plan.has_quality_budget():
                console.print(
                    f"quality budget: ppl increase <= {plan.max_ppl_increase}, KL <= {plan.max_kl} "
                    f"on {plan.budget_tokens} held-back calibration tokens (replaces --target-rate)"
                )
            return
        for module, feature in plan.optional_packages():  # before any work, not mid-run at the first missing import
            require_package(module, feature)
        counter = iter(range(1, len(passes) + 1))
        result = compile_plan(  # kvrewrite.compress, running default_pipeline()
            plan,
            on_pass=lambda p: console.print(f"[cyan][{next(counter)}/{len(passes)}][/] {p.name}: {p.description}"),
        )
    except (KVRewriteError, ValueError) as exc:
        _fail(exc)
    report = result.report
    if "quality_budget" in report:
        chosen = report["quality_budget"]["chosen"]
        console.print(
            f"quality budget: rate {chosen['rate']:.2f} is the largest within budget on held-back calibration text "
            f"(ppl {chosen['ppl_increase']:+.1%}, KL {chosen['kl_mean']:.4f})"
        )
    console.print(summary_table(result.spec, report))
    console.print(ranks_table(result.spec))
    console.print(f"[bold green]wrote[/] {result.output_dir}")
    if budget_share is not None:
        _split_and_report(
            result.output_dir, budget_share, context=4096, windows=2, length=1024, calibration="wiki", write=True
        )
    if push_to_hub:
        _push(result.output_dir, push_to_hub, private=hub_private)


# The command's options: the Plan's (generated from the Plan and cli/compress_options.py), then its own.
app.command()(
    with_signature(
        compress,
        [
            inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context),
            inspect.Parameter(
                "model",
                inspect.Parameter.POSITIONAL_OR_KEYWORD,
                annotation=str,
                default=typer.Argument(
                    ..., help="Hub id (e.g. meta-llama/Llama-3.1-8B), local directory, or 'smollm2-135m' (bundled)."
                ),
            ),
            *plan_parameters(),
            inspect.Parameter(
                "dry_run",
                inspect.Parameter.KEYWORD_ONLY,
                annotation=bool,
                default=typer.Option(
                    False,
                    "--dry-run",
                    help="Print the plan and the pipeline, do nothing.",
                    rich_help_panel=PANEL_OF["dry_run"],
                ),
            ),
            inspect.Parameter(
                "push_to_hub",
                inspect.Parameter.KEYWORD_ONLY,
                annotation=Optional[str],
                default=typer.Option(
                    None,
                    "--push-to-hub",
                    help="Then upload the checkpoint (with a generated model card) to this Hub repo id.",
                    rich_help_panel=PANEL_OF["push_to_hub"],
                ),
            ),
            inspect.Parameter(
                "hub_private",
                inspect.Parameter.KEYWORD_ONLY,
                annotation=bool,
                default=typer.Option(
                    False,
                    "--hub-private",
                    help="With --push-to-hub: create the repo private.",
                    rich_help_panel=PANEL_OF["hub_private"],
                ),
            ),
            inspect.Parameter(
                "kv_budget",
                inspect.Parameter.KEYWORD_ONLY,
                annotation=Optional[str],
                default=typer.Option(
                    None,
                    "--kv-budget",
                    help="Then split this share of the fp16 cache (at 4,096 tokens) across full-rank window, kept ranks, bits and re-scored eviction by calibration quality, and record it so kvrewrite.load(DIR) uses it (as `kvrewrite budget`; docs/tiers.md).",
                    rich_help_panel=PANEL_OF["kv_budget"],
                ),
            ),
        ],
    )
)


def _parse_windows(text: str) -> list[int]:
    try:
        windows = [int(w) for w in text.split(",") if w.strip()]
    except ValueError:
        raise InvalidArgumentError(
            f"--recent-window {text!r}: expected comma-separated whole numbers of tokens, e.g. 64,128"
        ) from None
    if not windows or any(w < 0 for w in windows):
        raise InvalidArgumentError(f"--recent-window {text!r}: windows must be >= 0 tokens")
    return windows


@app.command("eval")
def evaluate_command(
    directory: Path = typer.Argument(..., help="A kvrewrite checkpoint directory."),
    baseline: Optional[str] = typer.Option(
        None, help="Original model to compare with (default: the spec's source model)."
    ),
    rates: Optional[str] = typer.Option(
        None, help="Comma-separated rates from the checkpoint's rate table (default: compiled rate)."
    ),
    tokens: int = typer.Option(8192, help="Held-out evaluation tokens."),
    seq_len: int = typer.Option(512, "--seq-len", help="Evaluation window length."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Also write the results as JSON here."),
    kv_codec: Optional[str] = typer.Option(
        None,
        "--kv-codec",
        help="Evaluate with these codecs instead of the compiled one (';'-separated, e.g. 'none;int4;gear:bits=4').",
    ),
    chunk: Optional[int] = typer.Option(
        None,
        "--chunk",
        help="Chunked prefill through the cache, this many tokens per chunk (default: 64 when a codec is in use, else one forward).",
    ),
    recent_window: Optional[str] = typer.Option(
        None,
        "--recent-window",
        help="Token tiers: comma-separated windows W; each query reads its last W tokens at full rank, older ones at the rate's ranks (docs/tiers.md).",
    ),
    positions: Optional[str] = typer.Option(
        None,
        "--positions",
        help="Continuation mode: score only these token positions, each with the cache of everything before it, e.g. 512-1K,2K-4K,4K-8K (windows as long as the last range; --tokens counts all their tokens).",
    ),
    text: str = typer.Option(
        "wiki", "--text", help="Held-out evaluation text: wiki (Wikipedia articles) or news (Lee news stories)."
    ),
    save: bool = typer.Option(
        True,
        "--save/--no-save",
        help="Save the results as DIR/eval_results.json (the model card's evaluation table), or DIR/eval_results_continuation.json with --positions.",
    ),
) -> None:
    """Held-out perplexity, KL and top-1 agreement against the original, and KV bytes per token measured on the cache."""
    from kvrewrite.cli.tables import eval_table
    from kvrewrite.io.calibration_data.corpus import EVALUATION_TEXTS
    from kvrewrite.io.output_safety import check_writable_file
    from kvrewrite.publish.checkpoint_eval import evaluate_checkpoint
    from kvrewrite.publish.continuation_eval import parse_positions

    try:
        for flag, value, least in (("--tokens", tokens, 1), ("--seq-len", seq_len, 2), ("--chunk", chunk, 1)):
            if value is not None and value < least:  # named as flags, before any model is loaded
                raise InvalidArgumentError(f"{flag} {value}: give at least {least}")
        rate_list = list(numbers(rates, "--rates")) if rates else None
        codec_list = kv_codec.split(";") if kv_codec else None
        window_list = _parse_windows(recent_window) if recent_window else None
        position_ranges = parse_positions(positions) if positions else None
        if text not in EVALUATION_TEXTS:
            raise InvalidArgumentError(f"--text {text!r}: choose one of {', '.join(EVALUATION_TEXTS)}")
        require_package("gensim", f"kvrewrite eval ({WIKI_TEXT})")
        if json_out:  # found now, not after minutes of evaluation
            check_writable_file(json_out, "--json")
        rows = evaluate_checkpoint(
            directory,
            baseline=baseline,
            rates=rate_list,
            tokens=tokens,
            seq_len=seq_len,
            kv_codecs=codec_list,
            chunk=chunk,
            recent_windows=window_list,
            positions=position_ranges,
            text=text,
        )
    except (KVRewriteError, ValueError) as exc:
        _fail(exc)
    from kvrewrite.io.atomic_files import atomic_write_text
    from kvrewrite.publish.eval_results import (
        CONTINUATION_RESULTS_FILE,
        EVAL_RESULTS_FILE,
        eval_results_document,
        write_eval_results,
    )

    where = (
        f"positions {positions} of {position_ranges[-1].end}-token windows"
        if position_ranges
        else f"{seq_len}-token windows"
    )
    console.print(eval_table(rows, title=f"evaluation on held-out {text} text, {where}"))
    if json_out:
        atomic_write_text(json_out, json.dumps(rows, indent=2))
    if save:
        command = " ".join(
            [
                "kvrewrite eval",
                str(directory),
                *([f"--baseline {baseline}"] if baseline else []),
                *([f"--rates {rates}"] if rates else []),
                *([f"--kv-codec '{kv_codec}'"] if kv_codec else []),
                *([f"--chunk {chunk}"] if chunk else []),
                *([f"--recent-window {recent_window}"] if recent_window else []),
                *([f"--positions {positions}"] if positions else []),
                *([f"--text {text}"] if text != "wiki" else []),
                f"--tokens {tokens}",
                *([] if position_ranges else [f"--seq-len {seq_len}"]),
            ]
        )
        document = eval_results_document(
            rows,
            tokens=tokens,
            seq_len=position_ranges[-1].end if position_ranges else seq_len,
            command=command,
            text=EVALUATION_TEXTS[text],
            positions=[r.label for r in position_ranges] if position_ranges else None,
        )
        try:
            path = write_eval_results(
                directory, document, CONTINUATION_RESULTS_FILE if position_ranges else EVAL_RESULTS_FILE
            )
            console.print(f"saved {path}")
        except OSError as exc:  # a read-only checkpoint (e.g. in the Hub cache) still gets its table printed
            console.print(f"[yellow]warning:[/] could not save the results in {directory}: {exc}")


@app.command()
def inspect(
    directory: Path = typer.Argument(..., help="A kvrewrite checkpoint directory."),
    rate: Optional[float] = typer.Option(None, help="Show the ranks of another rate of the rate table."),
    plot: Optional[Path] = typer.Option(None, help="Heat map PNG path (default: DIR/rank_heatmap.png)."),
) -> None:
    """Ranks per layer and KV head as a table and a PNG heat map."""
    from kvrewrite.cli.tables import ranks_table, summary_table
    from kvrewrite.extras import missing_compile_packages
    from kvrewrite.io.output_safety import check_writable_file
    from kvrewrite.spec import CompressionSpec

    try:
        config_path = directory / "config.json"
        if not config_path.is_file():
            raise KVRewriteError(f"{directory} has no config.json; is it a kvrewrite checkpoint?")
        config = json.loads(config_path.read_text())
        if "kvrewrite" not in config:
            from kvrewrite.runtime.mla.checkpoint import missing_spec_message

            raise KVRewriteError(missing_spec_message(config_path, config, "inspect"))
        spec = CompressionSpec.from_dict(config["kvrewrite"])
        if rate is not None:
            spec = spec.with_ranks(*spec.ranks_for_rate(rate), rate)
        report_path = directory / "compress_report.json"
        report = json.loads(report_path.read_text()) if report_path.is_file() and rate is None else None
        target = plot or directory / "rank_heatmap.png"
        if plot is not None:
            require_package("matplotlib", f"kvrewrite inspect --plot ({PLOTS})")
            check_writable_file(plot, "--plot")
        else:
            try:
                check_writable_file(target, "the heat map")
            except InvalidArgumentError as exc:  # a read-only checkpoint (Hub cache, shared disk) still gets its tables
                target = None
                warnings.warn(
                    f"{exc}; no heat map written (pass --plot PATH to write it elsewhere)",
                    KVRewriteWarning,
                    stacklevel=2,
                )
            if target is not None and missing_compile_packages(["matplotlib"]):  # the tables need no plotting library
                target = None
                warnings.warn(
                    "no heat map written: it needs matplotlib (pip install 'kvrewrite[compile]')",
                    KVRewriteWarning,
                    stacklevel=2,
                )
    except (KVRewriteError, ValueError) as exc:
        _fail(exc)
    console.print(summary_table(spec, report))
    console.print(ranks_table(spec))
    if target is None:
        return
    from kvrewrite.publish.rank_plot import plot_rank_heatmap

    plot_rank_heatmap(
        [per_head_key_ranks(l) for l in spec.layers],
        [l.value_ranks for l in spec.layers],
        spec.head_dim,
        target,
        title=f"{spec.source_model}: p = {spec.target_rate:.2f} ({spec.objective}/{spec.allocation})",
    )
    console.print(f"heat map: {target}")


@app.command()
def card(
    directory: Path = typer.Argument(..., help="A kvrewrite checkpoint directory."),
    repo_id: Optional[str] = typer.Option(None, "--repo-id", help="Hub repo id the card's usage snippet loads from."),
    base_model: Optional[str] = typer.Option(
        None, "--base-model", help="Hub id of the source model (default: from the spec)."
    ),
    license: Optional[str] = typer.Option(
        None, help="Licence of the weights (default: the bundled model's, else none)."
    ),
    output: Optional[Path] = typer.Option(
        None, "--output", "-o", help="Where to write the card (default: DIR/README.md)."
    ),
) -> None:
    """Write the Hub model card (README.md): metadata, compression spec, saved eval table, rank heat map."""
    from kvrewrite.publish.hub import ensure_heatmap
    from kvrewrite.publish.model_card import CARD_FILE, is_generated_card, render_model_card, write_model_card

    try:
        target = output or directory / CARD_FILE
        if target.is_file() and not is_generated_card(target):
            raise InvalidArgumentError(
                f"{target} was not written by kvrewrite; delete it or write the card elsewhere with -o"
            )
        ensure_heatmap(directory)
        path = write_model_card(
            directory, render_model_card(directory, repo_id=repo_id, base_model=base_model, license=license), output
        )
    except (KVRewriteError, ValueError) as exc:
        _fail(exc)
    console.print(f"[bold green]wrote[/] {path}")


def _push(directory: Path, repo_id: str, **options) -> None:
    from kvrewrite.publish.hub import push_checkpoint

    try:
        result = push_checkpoint(directory, repo_id, **options)
    except KVRewriteError as exc:
        _fail(exc)
    for note in result.notes:
        console.print(f"note: {note}")
    console.print(f"{'would upload' if result.dry_run else 'uploaded'} to {repo_id}:")
    table = Table()
    table.add_column("file")
    table.add_column("size", justify="right")
    for name in result.files:
        table.add_row(name, f"{(Path(directory) / name).stat().st_size:,}")
    console.print(table)
    if result.dry_run:
        console.print(
            f"dry run: card {'written to' if result.card_written else 'kept at'} {Path(directory) / 'README.md'}; nothing was uploaded"
        )
        return
    console.print(f"[bold green]pushed[/] {result.pr_url or result.commit_url or result.repo_url}")


@app.command()
def push(
    directory: Path = typer.Argument(..., help="A kvrewrite checkpoint directory."),
    repo_id: str = typer.Argument(..., help="Hub repo id, e.g. your-name/SmolLM2-135M-kvrewrite-p50."),
    private: bool = typer.Option(
        False, "--private", help="Create the repo private (an existing repo keeps its visibility)."
    ),
    revision: Optional[str] = typer.Option(None, help="Branch to push to (created if missing)."),
    create_pr: bool = typer.Option(
        False, "--create-pr", help="Open a pull request instead of committing to the branch."
    ),
    commit_message: Optional[str] = typer.Option(None, "--commit-message", "-m", help="Commit message."),
    base_model: Optional[str] = typer.Option(
        None, "--base-model", help="Hub id of the source model for the card (default: from the spec)."
    ),
    license: Optional[str] = typer.Option(None, help="Licence of the weights for the card."),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Check the checkpoint, write the card and list the files; upload nothing."
    ),
) -> None:
    """Upload a checkpoint to the Hugging Face Hub with a generated model card (needs `hf auth login` or HF_TOKEN)."""
    _push(
        directory,
        repo_id,
        private=private,
        revision=revision,
        create_pr=create_pr,
        commit_message=commit_message,
        base_model=base_model,
        license=license,
        dry_run=dry_run,
    )


@app.command()
def demo(
    output: Path = typer.Option(
        Path("kvrewrite-demo"), "--output", "-o", help="Where the demo writes its checkpoints and results."
    ),
    rates: str = typer.Option(
        "0.5", help="Rates of the default checkpoint to evaluate (one checkpoint serves them all)."
    ),
    calib_tokens: int = typer.Option(16384, "--calib-tokens", help="Calibration tokens (wiki calibration articles)."),
    eval_tokens: int = typer.Option(4096, "--eval-tokens", help="Held-out wiki tokens for perplexity."),
    mla: bool = typer.Option(
        False, "--mla", help="Also export and evaluate the allocated MLA form (several minutes more)."
    ),
) -> None:
    """Compress the bundled SmolLM2-135M with the defaults, evaluate it and the best recipe at a quarter of the fp16 cache against the original, print the table."""
    from kvrewrite.cli.demo import run_demo

    try:
        require_compile_extra("kvrewrite demo (wiki text and plots)", ["gensim", "matplotlib"])
        run_demo(output, [float(r) for r in rates.split(",")], calib_tokens, eval_tokens, console, mla=mla)
    except (KVRewriteError, ValueError) as exc:
        _fail(exc)


@app.command()
def sweep(
    model: str = typer.Argument(..., help="Hub id, local directory, or 'smollm2-135m' (bundled)."),
    rates: str = typer.Option(
        "0.3,0.5,0.7", help="Comma-separated rates to evaluate (sliced from one checkpoint per config)."
    ),
    configs: str = typer.Option(
        "zack-faithful,latent-uniform,latent-sensitivity",
        help="Comma-separated named configs: " + ", ".join(NAMED_CONFIGS) + ".",
    ),
    config: Optional[list[str]] = typer.Option(
        None,
        "--config",
        help="A custom config, repeatable: NAME:field=value,field=value (Plan fields; base=NAMED to start from a named one; tuples as a/b/c).",
    ),
    output: Path = typer.Option(
        Path("kvrewrite-sweep"),
        "--output",
        "-o",
        help="Directory for checkpoints/, sweep_results.json/.csv and sweep_pareto.png.",
    ),
    calibration: str = typer.Option("wiki", help="Calibration source for every config."),
    calib_tokens: int = typer.Option(
        32768, "--calib-tokens", help="Calibration tokens (statistics are collected once)."
    ),
    eval_tokens: int = typer.Option(8192, "--eval-tokens", help="Held-out wiki tokens for perplexity."),
) -> None:
    """Compile a grid of configurations x rates, evaluate each on held-out text, write a table and a Pareto plot."""
    from kvrewrite.compile.sweep import parse_config, run_sweep

    try:
        require_compile_extra("kvrewrite sweep (held-out wiki text and a plot)", ["gensim", "matplotlib"])
        rate_list = [float(r) for r in rates.split(",") if r.strip()]
        chosen = [parse_config(c) for c in configs.split(",") if c.strip()] + [parse_config(c) for c in (config or [])]
        summary = run_sweep(
            model,
            rate_list,
            chosen,
            output,
            base_overrides={"calibration": calibration, "calib_tokens": calib_tokens},
            eval_tokens=eval_tokens,
            on_pass=lambda variant, step: console.print(f"[cyan]{variant}[/] {step.name}"),
            on_result=lambda row: console.print(
                f"  {row['config']} p={row['rate']:.2f}: ppl {row['perplexity']:.2f} ({row['ppl_increase']:+.1%})"
            ),
        )
    except (KVRewriteError, ValueError) as exc:
        _fail(exc)
    from kvrewrite.cli.tables import sweep_table

    console.print(sweep_table(summary["rows"], title=f"sweep: {model} on {summary['eval_tokens']} held-out tokens"))
    console.print(
        f"results: {output / 'sweep_results.json'}, {output / 'sweep_results.csv'}; plot: {output / 'sweep_pareto.png'}"
    )


@app.command()
def budget(
    directory: Path = typer.Argument(..., help="A kvrewrite checkpoint directory."),
    kv_budget: str = typer.Option(
        ..., "--kv-budget", help="Bytes the cache may hold, as a share of the original's fp16 cache (0.25, not 25%)."
    ),
    context: int = typer.Option(
        4096,
        "--context",
        help="Context length (tokens) the recorded split holds the budget at (the full-rank window weighs more in short contexts).",
    ),
    windows: int = typer.Option(2, "--windows", help="Calibration windows each split is measured on."),
    length: int = typer.Option(
        1024,
        "--length",
        help="Calibration window length: the first half is context, the second half is scored; every split is measured at the budget for this length.",
    ),
    calibration: str = typer.Option(
        "wiki", help="wiki (the calibration split, never the held-out text), or a path to text."
    ),
    perplexity_slack: float = typer.Option(
        DEFAULT_PERPLEXITY_SLACK,
        "--perplexity-slack",
        help="Splits within this share of the best split's perplexity are probed with planted keys; the lowest perplexity among those that hold them wins (0: perplexity alone, no probes).",
    ),
    key_probes: int = typer.Option(
        DEFAULT_PROBES,
        "--key-probes",
        help="Planted-key probes (calibration windows of --length tokens, four labelled keys, one asked) per split.",
    ),
    group_sizes: str = typer.Option(
        "64,token",
        "--group-sizes",
        help="Channels per (scale, minimum) pair of quantized kept tokens, comma-separated; 'token': one pair per token and side. Every split is measured at the first; the best quantized splits again at each other.",
    ),
    write: bool = typer.Option(
        True, "--write/--dry-run", help="Record the winner in DIR/token_policy.json (kvrewrite.load(DIR) then uses it)."
    ),
    json_out: Optional[Path] = typer.Option(
        None, "--json", help="Also write every measured split and the chosen one as JSON here."
    ),
) -> None:
    """Split a KV byte budget across full-rank window, kept ranks, bits and re-scored eviction by measured calibration
    NLL, preferring the splits within --perplexity-slack of the best that still answer planted keys."""
    from kvrewrite.io.output_safety import check_writable_file

    try:
        share = _budget_share(kv_budget, context)
        groups = parse_group_sizes(group_sizes)
        _check_budget_checkpoint(directory)
        if calibration == "wiki":
            require_package("gensim", f"kvrewrite budget --calibration wiki ({WIKI_TEXT})")
        if json_out:  # found now, not after minutes of measurement
            check_writable_file(json_out, "--json")
        if write:  # likewise the checkpoint the split is recorded in
            check_writable_file(directory / "token_policy.json", "recording the split (--write) in")
    except (KVRewriteError, ValueError) as exc:
        _fail(exc)
    command = " ".join(
        [
            "kvrewrite budget",
            str(directory),
            f"--kv-budget {kv_budget}",
            f"--context {context}",
            f"--windows {windows}",
            f"--length {length}",
            f"--calibration {calibration}",
            f"--perplexity-slack {perplexity_slack:g}",
            f"--key-probes {key_probes}",
            f"--group-sizes {','.join(map(str, groups))}",
            "--write" if write else "--dry-run",
        ]
    )
    _split_and_report(
        directory,
        share,
        context=context,
        windows=windows,
        length=length,
        calibration=calibration,
        perplexity_slack=perplexity_slack,
        probes=key_probes,
        group_sizes=groups,
        write=write,
        json_out=json_out,
        command=command,
    )


def _budget_share(text: str, context: int = 4096) -> float:
    """--kv-budget as a share, refused before any work where no split can hold it at `context` tokens (--context)."""
    from kvrewrite.compile.token_budget import DEFAULT_WINDOWS

    share = number(text, "--kv-budget")
    if not 0 < share <= 1:
        raise InvalidArgumentError(f"--kv-budget must be a share of the fp16 cache in (0, 1], got {text}")
    longest, shortest = max(DEFAULT_WINDOWS), min(DEFAULT_WINDOWS)
    if context <= longest:
        raise InvalidArgumentError(
            f"--context {context}: every split keeps a full-rank window of up to {longest} tokens; "
            f"the budget is held at a longer context (> {longest} tokens)"
        )
    if share < shortest / context:  # the shortest full-rank window alone, in float16, holds this share
        raise InvalidArgumentError(
            f"--kv-budget {text}: no split can fit: the shortest full-rank window ({shortest} "
            f"tokens) alone holds {shortest / context:.4f} of the fp16 cache at {context} tokens"
        )
    return share


def _check_budget_checkpoint(directory: Path) -> None:
    """budget splits a per-head checkpoint's cache: anything else is named now, not in a traceback after loading."""
    config_path = directory / "config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise KVRewriteError(f"{config_path}: unreadable ({exc}); is {directory} a kvrewrite checkpoint?") from None
    if not isinstance(config, dict) or "kvrewrite" not in config:
        from kvrewrite.runtime.mla.checkpoint import missing_spec_message

        raise KVRewriteError(missing_spec_message(config_path, config if isinstance(config, dict) else {}, "budget"))


def _split_and_report(
    directory: Path, share: float, json_out: Path | None = None, command: str = "", **options
) -> None:
    import time

    from kvrewrite.cli.tables import budget_table
    from kvrewrite.compile.budget_search import budget_rows, split_budget

    started = time.perf_counter()
    try:
        result = split_budget(directory, share, **options)
    except (KVRewriteError, ValueError) as exc:
        _fail(exc)
    seconds = round(time.perf_counter() - started, 1)
    if json_out:
        import platform
        from dataclasses import asdict
        from datetime import datetime, timezone

        from kvrewrite.io.atomic_files import atomic_write_text

        atomic_write_text(
            json_out,
            json.dumps(
                {
                    "command": command,
                    "kv_budget": share,
                    **options,
                    "machine": platform.platform(),
                    "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    "seconds": seconds,
                    "reference_nll": result["reference"],
                    "reference_keys": None if result["reference_keys"] is None else asdict(result["reference_keys"]),
                    "splits": budget_rows(result),
                    "chosen": asdict(result["chosen"]),
                },
                indent=2,
            )
            + "\n",
        )
    context, windows, length = options["context"], options["windows"], options["length"]
    console.print(
        budget_table(
            budget_rows(result),
            title=f"splits of {share:.1%} of the fp16 cache, measured at {length} "
            f"tokens (Δppl vs the full-rank cache, {windows} calibration window(s))",
        )
    )
    keys = result["reference_keys"]
    if keys is not None:
        from kvrewrite.compile.token_budget import KEY_NLL_MARGIN, holds_keys

        probed = [c for c in result["candidates"] if c.key_nll is not None]
        holding = [c for c in probed if holds_keys(c, keys.answer_nll)]
        console.print(
            f"planted keys: the full-rank cache answers {keys.answered} of {keys.probes} (answer NLL "
            f"{keys.answer_nll:.3f}); {len(holding)} of the {len(probed)} splits within "
            f"{result['perplexity_slack']:.0%} of the best perplexity hold them (answer NLL <= "
            f"{keys.answer_nll + KEY_NLL_MARGIN:.3f})"
            + ("; the lowest perplexity of those is chosen" if holding else "; the lowest perplexity is chosen")
        )
    chosen = result["chosen"]
    console.print(
        f"chosen at {context} tokens: {chosen.label()} ({chosen.bytes_share:.3f} of fp16)"
        + (f"; recorded in {result['path']}" if result["path"] else " (dry run)")
    )


app.command("export-mla")(export_mla_command)


@app.command("prefill-parallel")
def prefill_parallel(
    directory: Path = typer.Argument(..., help="A kvrewrite checkpoint directory."),
    prompt_file: Path = typer.Option(..., "--prompt-file", help="Text file holding the prompt."),
    nproc: int = typer.Option(2, "--nproc", help="Processes to split the prompt over (at most the query heads)."),
    rate: Optional[float] = typer.Option(None, help="Another rate of the checkpoint's rate table (0 = full rank)."),
    new_tokens: int = typer.Option(16, "--new-tokens", help="Tokens to decode greedily on rank 0 after the prefill."),
    threads: int = typer.Option(1, "--threads", help="Torch threads per process."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Also write the per-process results as JSON here."),
) -> None:
    """Sequence-parallel prefill across N local processes (gloo), shipping the packed latents; then decode on rank 0."""
    from kvrewrite.cli.prefill_parallel import read_prompt, run

    try:
        prompt = read_prompt(prompt_file)
        if json_out is not None:
            from kvrewrite.io.output_safety import check_writable_file

            check_writable_file(json_out, "--json")
        outcome = run(directory, prompt, nproc, rate, new_tokens, threads, console)
    except (KVRewriteError, ValueError) as exc:
        _fail(exc)
    if json_out is not None:
        import datetime
        import platform

        from kvrewrite.io.atomic_files import atomic_write_text

        date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        atomic_write_text(
            json_out,
            json.dumps(
                {
                    "command": " ".join(["kvrewrite", *sys.argv[1:]]),
                    "date": date,
                    "machine": platform.platform(),
                    "threads_per_process": threads,
                    **outcome,
                },
                indent=1,
            )
            + "\n",
        )
        console.print(f"wrote {json_out}")


def main() -> None:
    unwind_while_running()
    try:
        app()
    except Interrupted:
        print(INTERRUPTED_MESSAGE, file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)


if __name__ == "__main__":
    main()
