"""`kvrewrite sweep`: compile a grid of configurations x rates, evaluate each on held-out text, pick from a Pareto plot.

A configuration is a named set of Plan-field overrides (`NAMED_CONFIGS`, or a custom `name:field=value,...`),
so any new Plan option (a KV codec, a key mode) is sweepable without touching this module. Statistics are
collected once and shared by every configuration (passes.pipeline.compile_variants). Each configuration is
compiled once, at the largest rate, with every swept rate in its rate table; the other rates are sliced
from that checkpoint. That equals a direct compile at each rate because every transform is stored at full
rank in importance order and every allocation is a function of the rate alone
(tests/test_sweep.py checks it).
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import os
import platform
import sys
import time
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvrewrite.compile.plan import Plan
from kvrewrite.errors import InvalidArgumentError
from kvrewrite.io.atomic_files import atomic_write, atomic_write_text

NAMED_CONFIGS: dict[str, dict] = {
    # ZACK as published: [Q;K] SVD on post-RoPE q/k, [V; W_O^T] SVD values, shared removal rate (Eq. 6).
    "zack-faithful": {"objective": "zack", "allocation": "eps", "rope_mode": "post-rope"},
    "zack-uniform": {"objective": "zack", "allocation": "uniform", "rope_mode": "post-rope"},
    # Whitened objectives: KQ-SVD keys post-RoPE, output-aware values.
    "whitened-post-rope": {"objective": "optimal", "allocation": "uniform", "rope_mode": "post-rope"},
    # Query-aware pre-RoPE latent keys + output-aware values.
    "latent-uniform": {"objective": "optimal", "allocation": "uniform", "rope_mode": "latent"},
    "latent-greedy": {"objective": "optimal", "allocation": "greedy", "rope_mode": "latent"},
    "latent-sensitivity": {"objective": "optimal", "allocation": "sensitivity", "rope_mode": "latent"},
    # Sensitivity measured as a KL curve (three probe rates) instead of one point.
    "latent-sensitivity-curve": {
        "objective": "optimal",
        "allocation": "sensitivity",
        "rope_mode": "latent",
        "probe_rates": (0.25, 0.5, 0.75),
    },
    # The default plus the output refit at each rate (rank-specific, so compiled at every swept rate).
    "latent-sensitivity-refit": {
        "objective": "optimal",
        "allocation": "sensitivity",
        "rope_mode": "latent",
        "refit": "output",
    },
    # ... and the distillation on top of the refit (docs/distill.md): the best quality per byte, the slowest compile.
    "latent-sensitivity-distill": {
        "objective": "optimal",
        "allocation": "sensitivity",
        "rope_mode": "latent",
        "refit": "output",
        "distill": True,
    },
    "freq-sensitivity": {"objective": "optimal", "allocation": "sensitivity", "rope_mode": "freq"},
}

# Plan fields a sweep configuration may not override: the sweep owns the rates, and a quality budget picks
# its own rate (use `kvrewrite compress --max-ppl-increase`).
RESERVED_FIELDS = ("model", "target_rate", "output", "rate_grid", "overwrite", "progress", "max_ppl_increase", "max_kl")


@dataclass
class SweepConfig:
    name: str
    overrides: dict = field(default_factory=dict)


def _convert(name: str, text: str):
    """Parse one override value by the Plan field's type (tuples of floats are written a/b/c, fractions may be 5%)."""
    hints = typing.get_type_hints(Plan)
    if name not in hints or name in RESERVED_FIELDS:
        allowed = sorted(set(hints) - set(RESERVED_FIELDS) - {"extra"})
        raise InvalidArgumentError(f"unknown or reserved config field {name!r}; fields: {', '.join(allowed)}")
    hint = hints[name]
    if isinstance(hint, types.UnionType):  # X | None
        if text.lower() == "none":
            return None
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    try:
        if hint is int:
            return int(text)
        if hint is float:
            return float(text[:-1]) / 100 if text.endswith("%") else float(text)
        if hint is bool:
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError(text)
            return text.lower() in ("true", "1")
        if typing.get_origin(hint) is tuple:
            return tuple(float(x) for x in text.split("/") if x)
    except ValueError as exc:
        raise InvalidArgumentError(f"config field {name}: cannot read {text!r} as {hint}") from exc
    return text


def parse_config(text: str) -> SweepConfig:
    """`NAME` (from NAMED_CONFIGS) or `NAME:field=value,field=value` (optionally `NAME:base=KNOWN,...`)."""
    text = text.strip()
    if ":" not in text:
        if text not in NAMED_CONFIGS:
            raise InvalidArgumentError(
                f"unknown sweep config {text!r}; named configs: {', '.join(NAMED_CONFIGS)} "
                "(or a custom one: NAME:field=value,field=value)"
            )
        return SweepConfig(text, dict(NAMED_CONFIGS[text]))
    name, _, body = text.partition(":")
    if not name or "/" in name:
        raise InvalidArgumentError(f"bad sweep config name in {text!r}")
    overrides: dict = {}
    for part in filter(None, (p.strip() for p in body.split(","))):
        key, eq, value = part.partition("=")
        if not eq:
            raise InvalidArgumentError(f"sweep config {name}: expected field=value, got {part!r}")
        key = key.strip().replace("-", "_")
        if key == "base":
            if value not in NAMED_CONFIGS:
                raise InvalidArgumentError(f"sweep config {name}: unknown base {value!r}")
            overrides = {**NAMED_CONFIGS[value], **overrides}
            continue
        overrides[key] = _convert(key, value.strip())
    return SweepConfig(name, overrides)


def rate_sliceable(overrides: dict) -> bool:
    """Whether one compile at the largest rate, sliced through its rate table, equals a compile at each rate."""
    return (
        overrides.get("kv_codec", "none") in ("none", None)
        and overrides.get("refit", "none") == "none"
        and not overrides.get("distill", False)
    )


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both axes (fewer bytes and lower perplexity)."""
    front = []
    for i, (b, p) in enumerate(points):
        dominated = any((b2 <= b and p2 <= p) and (b2 < b or p2 < p) for j, (b2, p2) in enumerate(points) if j != i)
        if not dominated:
            front.append(i)
    return front


def sweep_rows_csv(rows: list[dict]) -> str:
    columns = [
        "config",
        "rate",
        "perplexity",
        "ppl_increase",
        "kl_mean",
        "top1_agreement",
        "kv_bytes_per_token",
        "kv_share",
        "pareto",
        "compile_s",
    ]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore")
    writer.writeheader()
    for row in rows:
        writer.writerow(row)
    return buf.getvalue()


def sweep_rows_markdown(rows: list[dict]) -> str:
    """The table as Markdown, one row per (config, rate); Pareto points marked."""
    lines = [
        "| config | rate | ppl | Δppl | KL (nats) | top-1 | KV bytes/token | Pareto |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["config"] == "original":
            lines.append(
                f"| original | 0 | {r['perplexity']:.2f} | | | | {r['kv_bytes_per_token']:,.0f} | {'*' if r.get('pareto') else ''} |"
            )
            continue
        lines.append(
            f"| {r['config']} | {r['rate']:.2f} | {r['perplexity']:.2f} | {r['ppl_increase']:+.1%} | {r['kl_mean']:.3f} | "
            f"{r['top1_agreement']:.3f} | {r['kv_bytes_per_token']:,.0f} | {'*' if r.get('pareto') else ''} |"
        )
    return "\n".join(lines) + "\n"


def plot_pareto(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = next(r for r in rows if r["config"] == "original")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r["config"] for r in rows if r["config"] != "original"):
        pts = sorted((r["kv_bytes_per_token"], r["perplexity"]) for r in rows if r["config"] == name)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", alpha=0.75, label=name)
    front = sorted((r["kv_bytes_per_token"], r["perplexity"]) for r in rows if r["pareto"])
    ax.plot([p[0] for p in front], [p[1] for p in front], "k--", linewidth=2.5, alpha=0.5, label="Pareto frontier")
    ax.scatter(
        [base["kv_bytes_per_token"]], [base["perplexity"]], marker="*", s=160, color="black", label="original", zorder=5
    )
    ax.set_xlabel("KV bytes per token (measured on the cache)")
    ax.set_ylabel("held-out perplexity")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=120))
    plt.close(fig)


def run_sweep(
    model: str,
    rates: list[float],
    configs: list[SweepConfig],
    output: Path,
    *,
    base_overrides: dict | None = None,
    eval_tokens: int = 8192,
    eval_windows=None,
    on_pass=None,
    on_result=None,
) -> dict:
    """Compile every config (statistics shared), evaluate every (config, rate) on held-out text, write the results."""
    from kvrewrite.compile.passes.pipeline import compile_variants
    from kvrewrite.io.calibration_data import evaluation_token_sequences
    from kvrewrite.publish.evaluation import evaluate_many
    from kvrewrite.runtime.load import load

    if not rates:
        raise InvalidArgumentError("`rates` needs at least one rate")
    if not configs:
        raise InvalidArgumentError("`configs` needs at least one configuration")
    names = [c.name for c in configs]
    if len(set(names)) != len(names):
        raise InvalidArgumentError(f"duplicate sweep config names: {names}")
    started = time.perf_counter()
    output = Path(output)
    plan = Plan(
        model=model,
        target_rate=max(rates),
        overwrite=True,
        progress=False,
        rate_grid=tuple(sorted({*Plan.__dataclass_fields__["rate_grid"].default, *rates})),
        **(base_overrides or {}),
    )
    for cfg in configs:  # fail on a bad override before any work
        dataclasses.replace(plan, **cfg.overrides)
    # A KV codec's tables are fitted at the compiled ranks, so a codec config is compiled at every rate
    # rather than sliced from one checkpoint.
    variants = {}
    for c in configs:
        if rate_sliceable(c.overrides):
            variants[c.name] = c.overrides
        else:
            variants.update({f"{c.name}@{r:.2f}": {**c.overrides, "target_rate": r} for r in rates})
    shared, compiled = compile_variants(plan, variants, output / "checkpoints", on_pass=on_pass)
    # The held-out wiki articles by default; tests pass their own windows.
    windows = (
        eval_windows
        if eval_windows is not None
        else evaluation_token_sequences(shared.tokenizer, eval_tokens, plan.seq_len)
    )

    rows: list[dict] = []
    for cfg in configs:
        if cfg.name in compiled:
            models = {rate: load(compiled[cfg.name].output_dir, rate=rate) for rate in rates}
        else:
            models = {rate: load(compiled[f"{cfg.name}@{rate:.2f}"].output_dir) for rate in rates}
        results = evaluate_many(
            {f"{r:.2f}": m for r, m in models.items()}, windows, baseline=shared.original_model(), progress=False
        )
        del models
        for rate in rates:
            res = results[f"{rate:.2f}"]
            if not rows:
                rows.append(
                    {
                        "config": "original",
                        "rate": 0.0,
                        "perplexity": res.baseline_perplexity,
                        "ppl_increase": 0.0,
                        "kl_mean": 0.0,
                        "top1_agreement": 1.0,
                        "kv_bytes_per_token": res.baseline_kv_bytes_per_token,
                        "kv_share": 1.0,
                        "overrides": {},
                        "compile_s": None,
                    }
                )
            row = {
                "config": cfg.name,
                "rate": rate,
                "perplexity": res.perplexity,
                "ppl_increase": res.perplexity / res.baseline_perplexity - 1,
                "kl_mean": res.kl_mean,
                "top1_agreement": res.top1_agreement,
                "kv_bytes_per_token": res.kv_bytes_per_token,
                "kv_share": res.kv_bytes_per_token / res.baseline_kv_bytes_per_token,
                "overrides": {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.overrides.items()},
                "compile_s": compiled.get(cfg.name, compiled.get(f"{cfg.name}@{rate:.2f}")).report.get(
                    "variant_compile_s"
                ),
            }
            rows.append(row)
            if on_result is not None:
                on_result(row)
    front = set(pareto_front([(r["kv_bytes_per_token"], r["perplexity"]) for r in rows]))
    for i, row in enumerate(rows):
        row["pareto"] = i in front
    summary = {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs; torch {torch.__version__}",
        "model": model,
        "rates": rates,
        "configs": {c.name: rows[1 + i * len(rates)]["overrides"] for i, c in enumerate(configs)},
        "calibration": plan.calibration,
        "calibration_tokens": int(shared.calibration_tokens.numel()),
        "eval_tokens": int(windows.numel()),
        "statistics_s": shared.report.get("timings_s", {}),
        "total_s": round(time.perf_counter() - started, 1),
        "rows": rows,
    }
    output.mkdir(parents=True, exist_ok=True)
    atomic_write_text(output / "sweep_results.json", json.dumps(summary, indent=1))
    atomic_write_text(output / "sweep_results.csv", sweep_rows_csv(rows))
    atomic_write_text(output / "sweep_results.md", sweep_rows_markdown(rows))
    plot_pareto(
        rows, output / "sweep_pareto.png", f"{Path(model).name}: held-out ppl vs KV bytes ({windows.numel()} tokens)"
    )
    return summary
