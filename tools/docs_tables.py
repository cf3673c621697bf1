"""The docs' tables, rendered from the committed result files they cite (`make docs-tables`).

A doc holds a rendered table as a block naming its result file(s) and the renderer that draws it:

    <!-- table: benchmarks/results/demo_smollm2_full.json template=demo -->
    | ... rendered, not edited by hand ... |
    <!-- /table -->

`python tools/docs_tables.py` rewrites every block's body from its files; `--check` only reports the blocks whose
body differs (tests/test_docs_tables.py runs the same check, so a hand edit fails). A renderer is one function
registered under its template name below: it gets the cited documents in order and returns the Markdown table and
the values it computed from them (ratios, halved sizes), which tools/doc_numbers.py accepts besides the files'
own values when it checks the table's numbers. The frontier table is benchmarks/frontier/report.py's, the same
function that `run.py merge` prints, so the two cannot drift.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # benchmarks.frontier.report, from this checkout
sys.path.insert(0, str(ROOT / "tools"))
from doc_numbers import TABLE_BLOCK, documents  # noqa: E402


@dataclass(frozen=True)
class Table:
    text: str  # the Markdown table, without a trailing newline
    derived: tuple[float, ...] = field(default=())  # values computed from the files, printed in the table


Renderer = Callable[..., Table]
RENDERERS: dict[str, Renderer] = {}


def renderer(name: str) -> Callable[[Renderer], Renderer]:
    def register(function: Renderer) -> Renderer:
        RENDERERS[name] = function
        return function

    return register


def markdown(header: list[str], rows: list[list[str]], align: str | None = None) -> str:
    lines = ["| " + " | ".join(header) + " |", align or "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return re.sub(r"\|  (?=\|)", "| ", "\n".join(lines))  # an empty cell is "| |"


def increase(record: dict) -> float:
    return record["perplexity"] / record["baseline_perplexity"] - 1


def ppl_with_increase(record: dict, bold: bool = False) -> str:
    cell = f"{record['perplexity']:.2f} ({increase(record):+.1%})"
    return f"**{cell}**" if bold else cell


# ---- README -------------------------------------------------------------------------------------------------


@renderer("readme-headline")
def readme_headline(demo: dict, distill: dict) -> Table:
    """README's recipes: the 32K refit and refit + distill checkpoints, and the default compile, all latent."""
    runs = {name: r for run in distill["runs"] for name, r in run["results"].items()}
    default = next(r for r in demo["rows"] if r["name"] == "kvrewrite-optimal p=0.50")
    rows = [
        ("`compress -p 0.3 --refit output --refit-tokens 32768` ([refit](docs/refit.md))", runs["wiki | refit p=0.3"]),
        (
            "`compress -p 0.5 --refit output --refit-tokens 32768 --distill --distill-epochs 2` ([distill](docs/distill.md); checkpoint "
            "from an earlier version of the distill pass)",
            runs["wiki | refit+distill p=0.5"],
        ),
        ("`compress -p 0.5 --calib-tokens 16384` (default method; one checkpoint serves every rate)", default),
    ]
    shares = [r["kv_bytes_per_token"] / r["baseline_kv_bytes_per_token"] for _, r in rows]
    return Table(
        markdown(
            ["recipe", "KV cache vs original", "held-out ppl"],
            [[label, f"{share:.1f}", f"{increase(r):+.1%}"] for (label, r), share in zip(rows, shares)],
        ),
        tuple(shares),
    )


# ---- docs/results.md ----------------------------------------------------------------------------------------

DEMO_CONFIGURATIONS = {
    "zack-faithful": "ZACK-faithful (`--objective zack --allocation eps --rope-mode post-rope`)",
    "kvrewrite-optimal": "kvrewrite default (`--objective optimal --allocation sensitivity --rope-mode latent`)",
    "mla-allocated": "MLA form (`export-mla --kv-share 0.7 --layer-widths sensitivity`, its rate table; kvrewrite's runtime)",
}


@renderer("demo")
def demo_table(demo: dict) -> Table:
    """`kvrewrite demo`'s table: the original and both configurations at every evaluated rate."""
    rows, previous = [], None
    for r in demo["rows"]:
        if r.get("baseline"):
            rows.append(
                [
                    "original",
                    "0",
                    f"{r['perplexity']:.2f}",
                    "",
                    "",
                    "",
                    f"{r['kv_bytes_per_token']:,.0f}",
                    f"{r['kv_share']:.3f}",
                ]
            )
            continue
        configuration = r["name"].rsplit(" p=", 1)[0]
        label = DEMO_CONFIGURATIONS[configuration] if configuration != previous else ""
        previous = configuration
        rows.append(
            [
                label,
                f"{r['rate']:.2f}",
                f"{r['perplexity']:.2f}",
                f"{increase(r):+.1%}",
                f"{r['kl_mean']:.3f}",
                f"{r['top1_agreement']:.3f}",
                f"{r['kv_bytes_per_token']:,.0f}",
                f"{r['kv_share']:.3f}",
            ]
        )
    header = ["configuration", "p", "ppl", "Δppl", "KL (nats)", "top-1", "KV bytes/token", "vs original"]
    return Table(markdown(header, rows))


ALLOCATIONS = {
    "greedy": "greedy (relative error, unweighted)",
    "uniform": "uniform (same rank everywhere)",
    "sensitivity": "sensitivity (greedy weighted by measured KL per layer and side)",
}


@renderer("allocation")
def allocation_table(compare: dict) -> Table:
    """benchmarks/allocation_compare.py: each allocation at p = 0.3 and 0.5, and its calibration KL at 0.5."""
    rows = []
    for name, label in ALLOCATIONS.items():
        best = name == "sensitivity"
        kl = f"{compare['calibration_kl_at_0.5'][name]:.2f}"
        rows.append(
            [
                label,
                ppl_with_increase(compare["results"][f"{name} p=0.3"], best),
                ppl_with_increase(compare["results"][f"{name} p=0.5"], best),
                f"**{kl}**" if best else kl,
            ]
        )
    return Table(markdown(["allocation", "`p = 0.3` ppl", "`p = 0.5` ppl", "calibration KL at `p = 0.5`"], rows))


SWEEP_CONFIGURATIONS = {
    "zack-uniform": "ZACK-faithful, uniform (`zack-uniform`)",
    "zack-faithful": "ZACK-faithful, shared removal rate (`zack-faithful`)",
    "whitened-post-rope": "whitened: KQ-SVD keys post-RoPE + output-aware values, uniform (`whitened-post-rope`)",
    "latent-uniform": "pre-RoPE latent keys (query-aware) + output-aware values, uniform (`latent-uniform`)",
}


@renderer("issue3")
def issue3_table(sweep: dict, demo: dict) -> Table:
    """Issue 3's configurations from one `kvrewrite sweep`, and the demo's default at the rates it measured."""
    rates = sweep["rates"]
    by_key = {(r["config"], r["rate"]): r for r in sweep["rows"]}
    cell = lambda r: f"{r['perplexity']:.2f} ({r['ppl_increase']:+.1%})"  # noqa: E731
    rows = [
        [label, *(cell(by_key[(config, rate)]) for rate in rates)] for config, label in SWEEP_CONFIGURATIONS.items()
    ]
    default = {r["rate"]: r for r in demo["rows"] if r["name"].startswith("kvrewrite-optimal")}
    rows.append(
        [
            "kvrewrite default: latent keys + output-aware values, `sensitivity` allocation (demo run above)",
            *(ppl_with_increase(default[rate]) if rate in default else "not measured" for rate in rates),
        ]
    )
    return Table(markdown(["configuration", *(f"`p = {rate}`" for rate in rates)], rows))


KEY_MODES = {
    "freq": "none",
    "post-rope": "one small projection per token",
    "crosshead": "none",
    "latent": "rebuilds every cached key each step",
}


@renderer("key-modes")
def key_modes_table(key_modes: dict) -> Table:
    """benchmarks/key_modes.py --part key-only: half of the key dims in every layer, values at full rank."""
    results = key_modes["key-only"]["results"]
    rows = []
    for mode, cost in KEY_MODES.items():
        r = results[f"{mode} keys p=0.5 (values full)"]
        rows.append(
            [
                mode,
                cost,
                f"{r['perplexity']:.2f}",
                f"{increase(r):+.1%}",
                f"{r['kl_mean']:.3f}",
                f"{r['top1_agreement']:.3f}",
                f"{r['kv_bytes_per_token']:.0f}",
            ]
        )
    return Table(markdown(["key mode", "runtime cost", "ppl", "Δppl", "KL", "top-1", "KV bytes/token"], rows))


# ---- docs/codecs.md ------------------------------------------------------------------------------------------


@renderer("codecs")
def codecs_table(table: dict) -> Table:
    """benchmarks/codec_table.py: every codec at rates 0 / 0.3 / 0.5, bytes against a float16 cache."""
    fp16 = table["fp16_kv_bytes_per_token"]
    rows, derived = [], [512.0, 2048.0]  # the context lengths, named in the files' keys (kv_bytes_per_token_512)
    for rate, entry in sorted(table["rates"].items()):
        for name, r in entry.get("results", {}).items():
            if not rows:
                rows.append(
                    [
                        "–",
                        "original (fp16 cache)",
                        f"{r['baseline_perplexity']:.2f}",
                        "–",
                        "–",
                        str(fp16),
                        "1.000",
                        str(fp16),
                        "1.000",
                    ]
                )
            # The uncoded reduced cache is measured in the model's float32; its float16 size is half of that.
            b512, b2048 = r["kv_bytes_per_token_512"], r["kv_bytes_per_token_2048"]
            if name == "none":
                b512, b2048 = b512 / 2, b2048 / 2
            derived += [float(rate), b512, b2048, b512 / fp16, b2048 / fp16]  # the rate is a key of the file
            rows.append(
                [
                    rate,
                    "none (fp16 latents)" if name == "none" else name,
                    f"{r['perplexity']:.2f}",
                    f"{increase(r):+.1%}",
                    f"{r['kl_mean']:.4f}",
                    f"{b512:.0f}",
                    f"{b512 / fp16:.3f}",
                    f"{b2048:.0f}",
                    f"{b2048 / fp16:.3f}",
                ]
            )
    header = [
        "rate p",
        "codec",
        "ppl",
        "Δppl vs original",
        "KL",
        "bytes/token @512",
        "vs fp16",
        "bytes/token @2048",
        "vs fp16",
    ]
    return Table(markdown(header, rows), tuple(derived))


def _protocol_model(spec: str) -> str:
    if spec.startswith("p") and "/" in spec:
        rate = float(spec[1 : spec.index("/")])
        return "rewrite, p = 0 (codec alone on the whitened latents)" if rate == 0 else f"rewrite, p = {rate:g}"
    return "original (raw post-RoPE K/V)"


def _protocol_cache(spec: str) -> str:
    cache = spec.split("/", 1)[-1]
    kind, _, rest = cache.partition(":")
    if kind == "quanto":
        bits, ak, av, group, residual = rest.split(",")
        axes = "KIVI axes" if (ak, av) == ("-1", "0") else f"axes {ak}/{av}"
        return f"QuantizedCache int{bits}, {axes}, G = {group}, residual {residual}"
    if rest == "none":
        return "none (fp16 latents)"
    if kind == "balanced":
        return f"ours `{rest}`, value latents balanced (α = 0.5)"
    return f"ours `{rest}`"


CODEC_ORDER = ("none", "quanto:4", "int4", "quanto:2", "int2", "tada", "gear", "gear-l", "csr")


def _protocol_order(spec: str) -> tuple:
    """Rows by model (original first, then by rate), then by codec family, 4-bit before 2-bit, quanto first."""
    rate = float(spec[1 : spec.index("/")]) if spec.startswith("p") and "/" in spec else -1.0
    cache = spec.split("/", 1)[-1].replace("codec:", "").replace("ours:", "").replace("balanced:", "")
    family = cache.split(":")[0] if not cache.startswith("quanto") else cache[:8]
    return rate, CODEC_ORDER.index(family) if family in CODEC_ORDER else len(CODEC_ORDER), cache


@renderer("codec-protocol")
def codec_protocol_table(faithful: dict, tag: str = "table") -> Table:
    """benchmarks/kivi_faithful.py: QuantizedCache and our codecs per model, 512-token windows and 2K-4K positions,
    each with the bytes held at the end of the sequence (512 / 4,096 tokens) against the float16 cache."""
    fp16 = faithful["fp16_bytes_per_token"]
    by_spec: dict[str, dict[str, dict]] = {}
    for run in faithful["runs"]:
        if run.get("tag") == tag:
            by_spec.setdefault(run["spec"], {})[run["protocol"]] = run
    rows = []
    for spec, runs in sorted(by_spec.items(), key=lambda item: _protocol_order(item[0])):
        cells = [_protocol_model(spec), _protocol_cache(spec)]
        for protocol in ("window", "long"):
            r = runs.get(protocol)
            cells += (
                [f"{r['bytes_fp16']:.0f} ({r['fp16_share']:.3f})", f"{r['dppl']:+.1%}", f"{r['kl']:.3f}"]
                if r
                else ["", "", ""]
            )
        rows.append(cells)
    header = [
        "model",
        "cache",
        "bytes/token @512 (of fp16)",
        "Δppl, 512-token windows",
        "KL",
        "bytes/token @4096 (of fp16)",
        "Δppl, positions 2K–4K",
        "KL",
    ]
    rates = {float(spec[1 : spec.index("/")]) for spec in by_spec if spec.startswith("p") and "/" in spec}
    return Table(markdown(header, rows), (float(fp16), *sorted(rates)))  # the rates are read off the row specs


CODEC_GROUP_TAGS = {
    "default+refit": "default + refit",
    "refit30": "`compress -p 0.3 --refit output` (16K refit tokens)",
    "refit32": "`compress -p 0.32 --refit output` (16K refit tokens)",
}
CODEC_LABELS = {"none": "none (fp16 latents)", "int4": "int4 (G = 32)"}


@renderer("codec-groups")
def codec_groups_table(groups: dict) -> Table:
    """benchmarks/codec_groups.py: int4 group sizes, bytes at 512 / 2,048 / 4,096 tokens. The real compiles'
    int4:group_size=128 rows are the candidates for issue 6, so their figures are bold."""
    fp16 = groups["fp16_kv_bytes_per_token"]
    codec_order = ["none", "int4", "int4:group_size=64", "int4:group_size=128"]
    runs = sorted(
        groups["runs"], key=lambda r: (list(CODEC_GROUP_TAGS).index(r["tag"]), r["rate"], codec_order.index(r["codec"]))
    )
    base = runs[0]["baseline_perplexity"]
    rows = [["original (fp16 cache)", "–", "–", f"{base:.2f}", "–", "–", str(fp16), str(fp16), str(fp16), "1.000"]]
    derived = [float(fp16) / fp16]
    for r in runs:
        bold = (lambda cell: f"**{cell}**") if r["tag"] != "default+refit" and r["codec"] != "none" else str
        share = r["bytes_4096"] / fp16
        derived.append(share)
        rows.append(
            [
                CODEC_GROUP_TAGS[r["tag"]],
                f"{r['rate']:.2f}",
                CODEC_LABELS.get(r["codec"], r["codec"]),
                bold(f"{r['perplexity']:.2f}"),
                bold(f"{increase(r):+.1%}"),
                f"{r['kl_mean']:.4f}",
                f"{r['bytes_512']:.0f}",
                f"{r['bytes_2048']:.0f}",
                bold(f"{r['bytes_4096']:.0f}"),
                bold(f"{share:.3f}"),
            ]
        )
    header = [
        "configuration",
        "rate p",
        "codec",
        "ppl",
        "Δppl",
        "KL",
        "bytes/token @512",
        "@2048",
        "@4096",
        "@4096 vs fp16",
    ]
    return Table(markdown(header, rows), tuple(derived))


# ---- docs/runtime.md -----------------------------------------------------------------------------------------


def _raw_table(header: list[str], rows: list[list[str]]) -> str:
    """A table whose empty cells keep two spaces, as benchmarks/decode.py's tables were first written."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


@renderer("decode-cpu")
def decode_cpu_table(decode: dict) -> Table:
    """benchmarks/decode.py: every model's decode step at every context x batch, with its ratios to stock."""
    rows, derived = [], []
    for model, result in decode["results"].items():
        for r in result["decode"]:
            vs = r.get("vs_stock", {})
            ratio = lambda key, fmt: "" if key not in vs else format(vs[key], fmt)  # noqa: E731
            mib = r["cache_bytes"] / 2**20
            derived.append(mib)
            rows.append(
                [
                    model,
                    f"{r['context']} x {r['batch']}",
                    str(r["tokens_per_s"]),
                    ratio("tokens_per_s", ".3f"),
                    f"{r['attention_s']:.4f}",
                    ratio("attention_s", ".3f"),
                    ratio("attention_layer_s", ".3f"),
                    f"{mib:.0f}",
                    ratio("cache_bytes", ".2f"),
                    f"{r['peak_rss_mib']:.1f}",
                ]
            )
    header = [
        "model",
        "context x batch",
        "tokens/s",
        "vs stock",
        "attention s/step",
        "vs stock",
        "attn layer vs stock",
        "cache MiB",
        "vs stock",
        "peak RSS MiB",
    ]
    return Table(_raw_table(header, rows), tuple(derived))


@renderer("gpu-decode")
def gpu_decode_table(record: dict) -> Table:
    """benchmarks/gpu_decode.py: every cache form's decode tokens/s against stock StaticCache (eager and compiled)."""
    rows, derived = [], []
    for form, results in record["results"].items():
        for r in results:
            if "tokens_per_s" not in r:
                rows.append(
                    [form, f"{r.get('batch', '')} x {r.get('context', '')}", r.get("error", "failed"), "", "", "", ""]
                )
                continue
            ratio = lambda key: format(r[key], ".2f") + "x" if key in r else ""  # noqa: E731
            rows.append(
                [
                    form,
                    f"{r['batch']} x {r['context']}",
                    f"{r['tokens_per_s']:.1f}",
                    ratio("vs_stock_static"),
                    ratio("vs_stock_compiled"),
                    format(r["cache_share"], ".2f") if "cache_share" in r else "",
                    format(r["attention_bandwidth_GBps"], ".1f") if "attention_bandwidth_GBps" in r else "",
                ]
            )
    header = [
        "form",
        "batch x context",
        "tokens/s",
        "vs stock static",
        "vs stock compiled",
        "cache bytes",
        "attention GB/s",
    ]
    kept = [i for i in range(len(header)) if i < 3 or any(row[i] for row in rows)]  # no column left empty
    return Table(markdown([header[i] for i in kept], [[row[i] for i in kept] for row in rows]), tuple(derived))


@renderer("prefill-cpu")
def prefill_cpu_table(decode: dict) -> Table:
    """benchmarks/decode.py --prefill: each model's prefill time and its ratio to stock."""
    rows = [
        [
            model,
            f"{r['length']} x {r['batch']}",
            f"{r['prefill_s']:.4f}",
            "" if "vs_stock" not in r else f"{r['vs_stock']:.3f}",
        ]
        for model, result in decode["results"].items()
        for r in result.get("prefill", [])
    ]
    return Table(_raw_table(["model", "prefill length x batch", "seconds", "vs stock"], rows))


# ---- docs/results.md: one checkpoint, every rate, short and long context (benchmarks/long_context.py) -------------


def _rate_quality(text: str, *results: dict) -> Table:
    """Per checkpoint and protocol, the perplexity increase at every evaluated rate. A long_context.py file holds one
    checkpoint (named by its label up to the first colon); an mla_rates.py file holds several exports, each row
    named "EXPORT p=RATE"."""
    rates = sorted(
        {
            row["rate"]
            for result in results
            for run in result["runs"]
            if run["text"] == text
            for row in run["rows"]
            if not row.get("baseline")
        }
    )
    rows = []
    for result in results:
        # checkpoint -> scored positions -> rate -> row, so each checkpoint's rows stay together, in file order.
        groups: dict[str, dict[str, dict[float, dict]]] = {}
        for run in (r for r in result["runs"] if r["text"] == text):
            for row in run["rows"]:
                if not row.get("baseline"):
                    name = (
                        result["checkpoint"].split(":")[0]
                        if "checkpoint" in result
                        else row["name"].rsplit(" p=", 1)[0]
                    )
                    groups.setdefault(name, {}).setdefault(row.get("positions", "all"), {})[row["rate"]] = row
        for name, by_positions in groups.items():
            for positions, by_rate in by_positions.items():
                where = "512-token windows" if positions == "all" else f"positions {positions}"
                rows.append([name, where] + [f"{increase(by_rate[r]):+.1%}" if r in by_rate else "" for r in rates])
    return Table(markdown(["checkpoint", "scored tokens"] + [f"p = {r:g}" for r in rates], rows))


@renderer("rates-wiki")
def rates_wiki_table(*results: dict) -> Table:
    return _rate_quality("wiki", *results)


@renderer("rates-news")
def rates_news_table(*results: dict) -> Table:
    return _rate_quality("news", *results)


# ---- docs/frontier.md ----------------------------------------------------------------------------------------


@renderer("frontier")
def frontier_table(frontier: dict) -> Table:
    """The frontier summary, by the function `benchmarks/frontier/run.py merge` prints."""
    from benchmarks.frontier.report import markdown_table

    return Table(markdown_table(frontier["results"]))


@renderer("retrieval")
def retrieval_frontier_table(frontier: dict) -> Table:
    """Perplexity and passkey retrieval per prompt length, every method beside the original."""
    from benchmarks.frontier.report import retrieval_table

    return Table(retrieval_table(frontier["results"]))


# ---- docs/reliability.md -------------------------------------------------------------------------------------


def _code(text: str) -> str:
    """Inline code that may itself hold backquotes, with table pipes escaped."""
    fence = "``" if "`" in text else "`"
    pad = " " if fence == "``" else ""
    return f"{fence}{pad}{text}{pad}{fence}".replace("|", "\\|")


@renderer("fault-table")
def fault_table(result: dict) -> Table:
    """benchmarks/fault_table.py: every case of the fault suite through the CLI, what the user saw, the exit code."""
    rows = [
        [r["case"].replace("|", "\\|"), _code(r["command"]), _code(r["message"]), str(r["exit"])]
        for r in result["cases"]
    ]
    return Table(markdown(["case", "command", "what the user sees", "exit"], rows))


# ---- rendering -----------------------------------------------------------------------------------------------


def render_block(files: str, template: str, root: Path = ROOT) -> Table:
    if template not in RENDERERS:
        raise KeyError(f"no table renderer {template!r}; known: {', '.join(sorted(RENDERERS))}")
    loaded = [json.loads((root / f.strip()).read_text(encoding="utf-8")) for f in files.split(",")]
    return RENDERERS[template](*loaded)


def render_text(text: str, root: Path = ROOT) -> str:
    """The doc with every table block's body rendered from its files."""

    def body(m) -> str:
        rendered = render_block(m.group("files"), m.group("template"), root).text
        return (
            m.group().replace(m.group("body"), rendered + "\n", 1)
            if m.group("body")
            else m.group().replace("<!-- /table -->", rendered + "\n<!-- /table -->")
        )

    return TABLE_BLOCK.sub(body, text)


def stale(root: Path = ROOT) -> list[Path]:
    """The docs whose table blocks differ from their rendering."""
    return [doc for doc in documents(root) if render_text(text := doc.read_text(encoding="utf-8"), root) != text]


def main(argv: list[str] | None = None) -> int:
    check = "--check" in (sys.argv[1:] if argv is None else argv)
    changed = stale()
    for doc in changed:
        print(f"{doc.relative_to(ROOT)}: tables differ from their result files" + ("" if check else "; rewritten"))
        if not check:
            doc.write_text(render_text(doc.read_text(encoding="utf-8")), encoding="utf-8")
    if not changed:
        print("every rendered table matches its result files")
    return 1 if check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
