"""Summary table (rich) and the frontier plot: quality against bytes held per token, one panel per protocol."""

from __future__ import annotations

from pathlib import Path
from typing import Any

REGIME_LABELS = {"512-1K": "Δppl 512–1K", "2K-4K": "Δppl 2K–4K"}


def _share(r: dict[str, Any], key: str) -> float | None:
    """Bytes share of one protocol point: a regime name or 'passkey'."""
    point = r.get("passkey") if key == "passkey" else r.get("continuation", {}).get(key)
    return None if point is None else point["bytes_share"]


def print_table(results: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="frontier: quality vs KV bytes held per token (share of the original's fp16 cache)")
    for col in (
        "method",
        "family",
        "bytes 512–1K",
        "Δppl 512–1K",
        "bytes 2K–4K",
        "Δppl 2K–4K",
        "bytes passkey",
        "passkey acc",
        "s",
    ):
        table.add_column(col, justify="left" if col in ("method", "family") else "right")
    fmt_share = lambda v: "—" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    for r in results:
        cont = r.get("continuation", {})
        cells = [r["name"] + (" (failed)" if "error" in r else ""), r["family"]]
        for regime in REGIME_LABELS:
            c = cont.get(regime)
            cells += [fmt_share(_share(r, regime)), "—" if c is None else f"{c.get('delta_ppl_pct', 0):+.1f}%"]
        pk = r.get("passkey")
        cells += [fmt_share(_share(r, "passkey")), "—" if pk is None else f"{pk['accuracy']:.0%} ({pk['n']})"]
        cells.append(f"{r['seconds']:.0f}")
        table.add_row(*cells)
    Console(width=max(Console().width, 150)).print(table)


def write_plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter

    panels = [(k, v) for k, v in REGIME_LABELS.items() if any(k in r.get("continuation", {}) for r in results)]
    if any("passkey" in r for r in results):
        panels.append(("passkey", "passkey accuracy"))
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 5.5), squeeze=False)
    # Series: a press kind across ratios is one line; every other method is one point.
    series: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        # A press on codes is its own line (tova+fp8), not a point of the press alone.
        press = r["settings"].get("press")
        line = (
            r["name"] if press is None else press + (f"+{r['settings']['codec']}" if "codec" in r["settings"] else "")
        )
        series.setdefault(line if r["family"] == "peer" else r["name"], []).append(r)
    colors = plt.get_cmap("tab20").colors
    color_of = {name: colors[i % len(colors)] for i, name in enumerate(series)}

    def marker(name: str, family: str) -> str:
        if family != "peer":
            return {"original": "*", "kvrewrite": "s"}.get(family, "o")
        return (
            "x"
            if "prefill only" in name
            else "s"
            if name.startswith("quanto")
            else "D"
            if name.startswith("fp8")
            else "P"
            if name == "think"
            else "o"
        )

    for ax, (key, label) in zip(axes[0], panels):
        for name, rows in series.items():
            pts = []
            for r in rows:
                x = _share(r, key)
                if x is None:
                    continue
                y = r["passkey"]["accuracy"] * 100 if key == "passkey" else r["continuation"][key]["delta_ppl_pct"]
                pts.append((100 * x, y))
            if not pts:
                continue
            pts.sort()
            fam = rows[0]["family"]
            ax.plot(
                *zip(*pts),
                marker=marker(name, fam),
                linestyle="-" if len(pts) > 1 else "none",
                markersize=12 if fam == "original" else 7,
                label=name,
                color=color_of[name],
            )
        ax.set_xlabel("KV bytes held per token (% of original fp16)")
        ax.set_ylabel("accuracy (%)" if key == "passkey" else "Δppl vs original (%)")
        if key != "passkey":
            # Δppl spans +0.1% (int4) to hundreds of % (int2, strong eviction): linear to 10%, log above.
            ax.set_yscale("symlog", linthresh=10)
            ax.yaxis.set_major_locator(FixedLocator([-5, 0, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000]))
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:+g}%" if v else "0"))
        ax.set_xlim(0, 105)
        ax.set_title(label)
        ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 8), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _name_and_continuation_cells(r: dict[str, Any]) -> list[str]:
    """A Markdown row's first cells: the method, its family, then bytes and Δppl per continuation regime."""
    pct = lambda v: "—" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    cells = [f"`{r['name']}`" + (" (failed)" if "error" in r else ""), r["family"]]
    for regime in REGIME_LABELS:
        c = r.get("continuation", {}).get(regime)
        cells += [pct(_share(r, regime)), "—" if c is None else f"{c['delta_ppl_pct']:+.1f}%"]
    return cells


def markdown_table(results: list[dict[str, Any]]) -> str:
    """The summary table as Markdown (pasted into docs/frontier.md from the committed JSON)."""
    pct = lambda v: "—" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    lines = [
        "| method | family | bytes 512–1K | Δppl 512–1K | bytes 2K–4K | Δppl 2K–4K | bytes passkey | passkey |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        cells = _name_and_continuation_cells(r)
        pk = r.get("passkey")
        cells += [
            pct(_share(r, "passkey")),
            "—" if pk is None else f"{sum(i['correct'] for i in pk['items'])}/{pk['n']}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def retrieval_table(results: list[dict[str, Any]]) -> str:
    """Perplexity and retrieval side by side: passkey accuracy per prompt length and overall, and as a share of the
    original's (the fields `run.py merge` adds: evaluate.add_retrieval_summary)."""
    pct = lambda v: "—" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    acc = lambda v: "—" if v is None else f"{100 * v:.0f}%"  # noqa: E731
    groups = sorted(
        {g for r in results for g in r.get("passkey", {}).get("by_length", {})}, key=lambda g: int(g.split("/")[0])
    )
    header = ["method", "family", "bytes 512–1K", "Δppl 512–1K", "bytes 2K–4K", "Δppl 2K–4K", "bytes passkey"]
    header += [f"passkey {int(g.split('/')[0]) // 1024}K" + (f" {g.split('/')[1]}" if "/" in g else "") for g in groups]
    header += ["passkey (prompts)", "of the original's"]
    lines = ["| " + " | ".join(header) + " |", "|---|---|" + "---:|" * (len(header) - 2)]
    for r in results:
        cells = _name_and_continuation_cells(r)
        pk = r.get("passkey")
        cells.append(pct(_share(r, "passkey")))
        for g in groups:
            cells.append(acc((pk or {}).get("by_length", {}).get(g)))
        cells.append("—" if pk is None else f"{acc(pk['accuracy'])} ({pk['n']})")
        cells.append(acc((pk or {}).get("of_original")))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
