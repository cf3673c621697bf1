"""Rich tables shared by the CLI commands."""

from __future__ import annotations

from rich.table import Table

from kvrewrite.spec import CompressionSpec


def ranks_table(spec: CompressionSpec) -> Table:
    table = Table(title=f"ranks per layer and KV head (head_dim {spec.head_dim})")
    table.add_column("layer", justify="right")
    table.add_column("key mode")
    table.add_column("key ranks")
    table.add_column("value ranks")
    table.add_column("kept", justify="right")
    per_layer = 2 * spec.num_key_value_heads * spec.head_dim
    for i, layer in enumerate(spec.layers):
        kept = sum(layer.key_ranks) + sum(layer.value_ranks)
        table.add_row(
            str(i),
            layer.key_mode,
            " ".join(f"{r:3d}" for r in layer.key_ranks),
            " ".join(f"{r:3d}" for r in layer.value_ranks),
            f"{kept / per_layer:.0%}",
        )
    return table


def summary_table(spec: CompressionSpec, report: dict | None = None) -> Table:
    table = Table(title="compression summary", show_header=False)
    table.add_column("what")
    table.add_column("value")
    table.add_row("source model", f"{spec.source_model} ({spec.source_revision or 'local'})")
    table.add_row("objective / allocation", f"{spec.objective} / {spec.allocation}")
    table.add_row("key modes", ", ".join(sorted({layer.key_mode for layer in spec.layers})))
    table.add_row("target rate", f"{spec.target_rate:.3f}")
    table.add_row("achieved rate", f"{spec.achieved_rate:.4f}")
    table.add_row("KV elements per token", f"{spec.kept_elements_per_token} of {spec.baseline_elements_per_token}")
    if spec.kv_codec:
        codec = (report or {}).get("kv_codec", {})
        coded = (
            f", {codec['coded_bytes_per_token']:.0f} coded bytes/token + fp16 window"
            if "coded_bytes_per_token" in codec
            else ""
        )
        table.add_row("KV codec", f"{spec.kv_codec['name']} {spec.kv_codec['params']}{coded}")
    if report:
        verification = report.get("verification", {})
        if "full_rank_max_abs_logit_diff" in verification:
            table.add_row("full-rank max |Δlogit|", f"{verification['full_rank_max_abs_logit_diff']:.2e}")
        compiled = verification.get("compiled_rank", {})
        if compiled:
            table.add_row(
                "calibration KL / top-1", f"{compiled['kl_mean']:.4f} nats / {compiled['top1_agreement']:.3f}"
            )
        distill = report.get("distill")
        if distill:
            kept = (
                f"epoch {distill['kept_epoch']} kept" if distill["kept_epoch"] else "no epoch helped, weights unchanged"
            )
            table.add_row(
                "distillation validation KL",
                f"{distill['validation_kl_before']:.4f} -> {distill['validation_kl_after']:.4f} nats ({kept})",
            )
        if "timings_s" in report:
            table.add_row("compile time", f"{report['timings_s'].get('total', 0):.1f} s")
        if "peak_rss_mib" in report:
            table.add_row("peak RSS", f"{report['peak_rss_mib']:.0f} MiB")
    return table


def eval_table(rows: list[dict], title: str = "evaluation on held-out wiki text") -> Table:
    table = Table(title=title)
    by_position = any("positions" in r for r in rows)  # continuation mode: one group of rows per position range
    columns = [("model", "left"), ("rate", "right")] + ([("positions", "right")] if by_position else [])
    columns += [
        ("ppl", "right"),
        ("Δppl", "right"),
        ("KL (nats)", "right"),
        ("top-1", "right"),
        ("KV bytes/token", "right"),
        ("vs baseline", "right"),
    ]
    for name, justify in columns:
        table.add_column(name, justify=justify)
    fp16 = any("fp16_kv_bytes_per_token" in r for r in rows)
    if fp16:  # codecs store float16 and packed integers: compare with the float16 cache of the original
        table.add_column("vs fp16", justify="right")
    bases = {r.get("positions"): r for r in rows if r.get("baseline")}
    for r in rows:
        base = bases.get(r.get("positions"))
        delta = f"{(r['perplexity'] / base['perplexity'] - 1):+.1%}" if base and not r.get("baseline") else ""
        ratio = f"{r['kv_bytes_per_token'] / base['kv_bytes_per_token']:.3f}" if base else ""
        kl = "" if r.get("kl_mean") is None else f"{r['kl_mean']:.4f}"
        top1 = "" if r.get("top1_agreement") is None else f"{r['top1_agreement']:.3f}"
        cells = [r["name"], f"{r.get('rate', 0.0):.2f}"] + ([r.get("positions", "")] if by_position else [])
        cells += [f"{r['perplexity']:.2f}", delta, kl, top1, f"{r['kv_bytes_per_token']:.0f}", ratio]
        if fp16:
            cells.append(
                f"{r['kv_bytes_per_token'] / r['fp16_kv_bytes_per_token']:.3f}"
                if r.get("fp16_kv_bytes_per_token")
                else ""
            )
        table.add_row(*cells)
    return table


def sweep_table(rows: list[dict], title: str = "sweep") -> Table:
    table = Table(title=title)
    for name, justify in (
        ("config", "left"),
        ("rate", "right"),
        ("ppl", "right"),
        ("Δppl", "right"),
        ("KL (nats)", "right"),
        ("top-1", "right"),
        ("KV bytes/token", "right"),
        ("Pareto", "center"),
    ):
        table.add_column(name, justify=justify)
    for r in rows:
        original = r["config"] == "original"
        table.add_row(
            r["config"],
            f"{r['rate']:.2f}",
            f"{r['perplexity']:.2f}",
            "" if original else f"{r['ppl_increase']:+.1%}",
            "" if original else f"{r['kl_mean']:.4f}",
            "" if original else f"{r['top1_agreement']:.3f}",
            f"{r['kv_bytes_per_token']:.0f}",
            "*" if r.get("pareto") else "",
        )
    return table


def budget_table(rows: list[dict], title: str = "budget splits") -> Table:
    table = Table(title=title)
    for name, justify in (
        ("split", "left"),
        ("bytes (formula)", "right"),
        ("bytes (measured)", "right"),
        ("Δppl", "right"),
        ("key NLL", "right"),
        ("keys", "right"),
        ("holds keys", "center"),
        ("chosen", "center"),
    ):
        table.add_column(name, justify=justify)
    for r in rows:
        measured = "" if r["measured_share"] is None else f"{r['measured_share']:.3f}"
        probed = r.get("key_nll") is not None  # planted keys are probed only within the perplexity slack
        table.add_row(
            r["split"],
            f"{r['bytes_share']:.3f}",
            measured,
            f"{r['delta_ppl']:+.2%}",
            f"{r['key_nll']:.3f}" if probed else "",
            f"{r['keys_answered']}/{r['key_probes']}" if probed else "",
            ("yes" if r["holds_keys"] else "no") if probed else "",
            "*" if r["chosen"] else "",
        )
    return table
