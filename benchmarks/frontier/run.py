"""Frontier benchmark driver: quality against KV bytes held per token, the original and every method on the same
tokens. Three steps, because kvpress needs transformers<5.3 and kvrewrite needs 5.23 (docs/frontier.md):

  inputs  (project env)  build the held-out wiki windows and passkey prompts, save their token ids
  eval    (either env)   run methods over the saved ids, the original first as the reference; write a partial JSON
  merge   (either env)   join partial JSONs into benchmarks/results/frontier.json, plot, print the table
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make the package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    __package__ = "benchmarks.frontier"

from .evaluate import _work, add_deltas, add_retrieval_summary, free, run_method  # noqa: E402
from .inputs import REGIMES, load_inputs, passkey_prompts, save_inputs, wiki_windows  # noqa: E402
from .registry import resolve  # noqa: E402
from .report import markdown_table, print_table, write_plot  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
INPUTS = RESULTS / "frontier_inputs.safetensors"


def _provenance() -> dict[str, Any]:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        dirty = bool(
            subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True
            ).stdout.strip()
        )
    except OSError:
        commit, dirty = "unknown", False
    import transformers

    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    for pkg in ("kvpress", "optimum-quanto", "kvrewrite"):
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            pass
    return {
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "git_commit": commit,
        "git_dirty": dirty,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
        },
        "versions": versions,
    }


def cmd_inputs(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    from kvrewrite.io.sources import resolve_model_source

    model_path = str(resolve_model_source(args.model).path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    counts = {"512-1K": args.windows_1k, "2K-4K": args.windows_4k}
    windows = {r: wiki_windows(tokenizer, n, sum(REGIMES[r])) for r, n in counts.items() if n > 0}
    prompts = passkey_prompts(
        tokenizer, args.passkey_lengths, args.passkey_depths, args.passkey_keys, args.seed, args.filler, args.variant
    )
    meta = {
        "model_path": model_path,
        "seed": args.seed,
        "filler": args.filler,
        "windows": counts,
        "passkey": {
            "lengths": args.passkey_lengths,
            "depths": args.passkey_depths,
            "keys": args.passkey_keys,
            "variant": args.variant,
        },
        **_provenance(),
    }
    save_inputs(Path(args.output), windows, prompts, meta)
    print(
        f"wrote {args.output}: "
        + ", ".join(f"{r} {tuple(w.shape)}" for r, w in windows.items())
        + f", {len(prompts)} passkey prompts"
    )


def reference_original(earlier: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    """The original's row of an earlier partial, for a run (`run`: this run's header) that reuses it: the inputs,
    chunk and selection must be the same, and the run's protocols among the partial's (the row keeps only those).
    ValueError names what differs."""
    differs = [field for field in ("inputs", "chunk") if earlier[field] != run[field]]
    if earlier.get("selection", run["selection"]) != run["selection"]:  # partials older than the field: as run
        differs.append("selection")
    missing = [p for p in run["protocols"] if p not in earlier["protocols"]]
    if missing:
        differs.append(f"protocols (it has no {', '.join(missing)})")
    if differs:
        raise ValueError(f"it was run with other {', '.join(differs)}")
    row = next(r for r in earlier["results"] if r["family"] == "original")
    return {k: v for k, v in row.items() if k not in earlier["protocols"] or k in run["protocols"]}


def cmd_eval(args: argparse.Namespace) -> None:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the weight-loading bar would drown the benchmark's own progress bar
    torch.set_num_threads(args.threads)
    windows, prompts, meta = load_inputs(Path(args.inputs))
    windows = {r: w[: args.windows] if args.windows else w for r, w in windows.items() if r in args.regimes}
    if args.passkey_lengths:  # one length's prompts alone, to add it to a row run on the shorter ones
        prompts = [p for p in prompts if p.length in args.passkey_lengths]
    prompts = prompts[: args.passkey_prompts] if args.passkey_prompts else prompts
    model_path = args.model or meta["model_path"]
    methods = resolve(args.methods, args.chunk, args.kvrewrite, args.method_module)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    shared = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    results: list[dict[str, Any]] = []
    selection = {
        "windows": args.windows,
        "passkey_prompts": args.passkey_prompts,
        "regimes": args.regimes,
        **({"passkey_lengths": args.passkey_lengths} if args.passkey_lengths else {}),
    }
    header = {
        "provenance": _provenance(),
        "inputs": meta,
        "chunk": args.chunk,
        "protocols": args.protocols,
        "selection": selection,
    }
    if args.reference:
        # The original's rows from an earlier partial of the same inputs and env, instead of running it again.
        earlier = json.loads(Path(args.reference).read_text())
        try:
            results.append(reference_original(earlier, header))
        except ValueError as exc:
            raise SystemExit(f"{args.reference}: {exc}; run the original here") from None
        results[0]["reference_from"] = args.reference
        methods = [m for m in methods if m.family != "original"]
        header["reference"] = args.reference

    def save() -> None:
        # Written after every method, so a long run that dies keeps what it finished.
        add_deltas(results)
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps({**header, "results": results}, indent=1))

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()) as bar:
        overall = bar.add_task("all methods (tokens)", total=len(methods) * _work(args.protocols, windows, prompts))
        for method in methods:
            task = bar.add_task(method.name, total=_work(args.protocols, windows, prompts))

            def advance(n: int, task: int = task) -> None:
                bar.advance(task, n)
                bar.advance(overall, n)

            try:
                model = method.load(model_path) if method.load else shared
                results.append(
                    run_method(method, model, tokenizer, args.protocols, windows, prompts, args.chunk, advance)
                )
                if model is not shared:
                    free(model)
            except Exception as exc:  # one broken method must not lose the others' results
                if method.family == "original":
                    raise
                bar.console.print(f"[red]{method.name} failed: {type(exc).__name__}: {exc}")
                results.append(
                    {
                        "name": method.name,
                        "family": method.family,
                        "settings": method.settings,
                        "error": f"{type(exc).__name__}: {exc}",
                        "seconds": 0.0,
                    }
                )
            bar.remove_task(task)
            save()
    print_table(results)
    print(f"wrote {args.output}")


def _prompt_id(item: dict[str, Any]) -> tuple:
    return item["length"], item["depth"], item["key"], item.get("variant", "single")


def _adds_passkey_lengths(earlier: dict[str, Any], later: dict[str, Any], part: dict[str, Any]) -> bool:
    """Whether `later` is the same method run on other prompt lengths only (`eval --passkey-lengths`), so its
    prompts extend the earlier row instead of replacing it."""
    if "passkey_lengths" not in part.get("selection", {}) or "continuation" in later or "passkey" not in earlier:
        return False
    if later["settings"] != earlier["settings"] or "passkey" not in later:
        return False
    seen = {_prompt_id(i) for i in earlier["passkey"]["items"]}
    return not any(_prompt_id(i) in seen for i in later["passkey"]["items"])


def _with_passkey_added(earlier: dict[str, Any], later: dict[str, Any]) -> dict[str, Any]:
    """The earlier row with the later row's passkey prompts added: accuracy over all of them, bytes weighted by
    prompts, seconds summed, and the partial each part came from."""
    a, b = earlier["passkey"], later["passkey"]
    items = a["items"] + b["items"]
    passkey = {
        "accuracy": sum(i["correct"] for i in items) / len(items),
        "n": len(items),
        "bytes_share": (a["bytes_share"] * a["n"] + b["bytes_share"] * b["n"]) / (a["n"] + b["n"]),
        "items": items,
    }
    return {
        **earlier,
        "passkey": passkey,
        "seconds": earlier.get("seconds", 0) + later.get("seconds", 0),
        "passkey_added_from": [*earlier.get("passkey_added_from", []), later["partial"]],
    }


def cmd_merge(args: argparse.Namespace) -> None:
    parts = [json.loads(Path(p).read_text()) for p in args.partials]
    results: list[dict[str, Any]] = []
    originals = []
    superseded = []
    for path, part in zip(args.partials, parts):
        for r in part["results"]:
            r["env"] = part["provenance"]["versions"]
            r["partial"] = path
            if r["family"] == "original":
                originals.append(r)
                if any(o["family"] == "original" for o in results):
                    continue  # one original row; the others are kept under references
            earlier = next((i for i, o in enumerate(results) if o["name"] == r["name"]), None)
            if earlier is not None and _adds_passkey_lengths(results[earlier], r, part):
                results[earlier] = _with_passkey_added(results[earlier], r)
                continue
            # A method run again in a later partial replaces the earlier row (kept under superseded).
            if earlier is not None:
                superseded.append(results.pop(earlier))
            results.append(r)
    family_order = {"original": 0, "kvrewrite": 1, "peer": 2}
    share = lambda r: next(iter(r.get("continuation", {}).values()), {}).get("bytes_share", 0)  # noqa: E731
    results.sort(
        key=lambda r: (
            family_order.get(r["family"], 3),
            str(r["settings"].get("press", r["name"])),
            -share(r),
            r["name"],
        )
    )
    add_retrieval_summary(results)
    merged = {
        "provenance": _provenance(),
        "inputs": parts[0]["inputs"],
        "chunk": parts[0]["chunk"],
        "partials": [{"file": p, **part["provenance"]} for p, part in zip(args.partials, parts)],
        # Each partial's Δppl is against the original of its own process; these are those references.
        "references": [
            {
                "env": o["env"],
                "continuation": {k: v["ppl"] for k, v in o.get("continuation", {}).items()},
                "passkey": o.get("passkey", {}).get("accuracy"),
            }
            for o in originals
        ],
        "results": results,
        "superseded": superseded,
    }
    Path(args.output).write_text(json.dumps(merged, indent=1))
    write_plot(results, Path(args.plot))
    print_table(results)
    if args.markdown:
        Path(args.markdown).write_text(markdown_table(results) + "\n")
    print(f"wrote {args.output} and {args.plot}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    i = sub.add_parser("inputs", help="build and save the shared token windows and passkey prompts (project env)")
    i.add_argument("--model", default="smollm2-135m")
    i.add_argument("--windows-1k", type=int, default=8, help="windows for 512-1K (context 512, score 512)")
    i.add_argument("--windows-4k", type=int, default=4, help="windows for 2K-4K (context 2048, score 2048)")
    i.add_argument("--passkey-lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    i.add_argument("--passkey-depths", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.9])
    i.add_argument("--passkey-keys", type=int, default=3, help="random keys per (length, depth)")
    i.add_argument("--filler", choices=["classic", "wiki"], default="classic")
    i.add_argument("--variant", choices=["single", "multi"], default="single", help="multi: 4 keys planted, 1 asked")
    i.add_argument("--seed", type=int, default=0)
    i.add_argument("-o", "--output", default=str(INPUTS))
    i.set_defaults(func=cmd_inputs)

    e = sub.add_parser("eval", help="run methods over the saved inputs; writes a partial JSON")
    e.add_argument("--methods", nargs="+", default=["original"], help="'original', 'peers', or peer names")
    e.add_argument("--kvrewrite", nargs="*", default=[], metavar="DIR:RATE", help="kvrewrite checkpoints")
    e.add_argument(
        "--method-module",
        nargs="*",
        default=[],
        metavar="MODULE:ATTR",
        help="extra methods: a list of Method (or a function returning one)",
    )
    e.add_argument("--protocols", nargs="+", choices=["continuation", "passkey"], default=["continuation", "passkey"])
    e.add_argument("--regimes", nargs="+", choices=list(REGIMES), default=list(REGIMES))
    e.add_argument("--windows", type=int, default=0, help="use only the first N windows per regime (0: all)")
    e.add_argument("--passkey-prompts", type=int, default=0, help="use only the first N passkey prompts (0: all)")
    e.add_argument(
        "--passkey-lengths", type=int, nargs="+", default=None, help="use only the prompts of these lengths (tokens)"
    )
    e.add_argument("--chunk", type=int, default=64, help="continuation fed C tokens at a time (KIVI-style decoding)")
    e.add_argument("--threads", type=int, default=1, help="torch threads (1: the machine is shared)")
    e.add_argument("--inputs", default=str(INPUTS))
    e.add_argument(
        "--reference",
        default=None,
        metavar="PARTIAL.json",
        help="take the original's results from this partial (same inputs, same env) instead of running it",
    )
    e.add_argument("--model", default=None, help="original model path (default: the one the inputs were built for)")
    e.add_argument("-o", "--output", required=True)
    e.set_defaults(func=cmd_eval)

    m = sub.add_parser("merge", help="join partial JSONs, plot, print the table")
    m.add_argument("partials", nargs="+", help="partial JSONs; a method in a later one replaces an earlier row")
    m.add_argument("-o", "--output", default=str(RESULTS / "frontier.json"))
    m.add_argument("--plot", default=str(RESULTS / "frontier.png"))
    m.add_argument("--markdown", default=str(RESULTS / "frontier.md"), help="the table as Markdown")
    m.set_defaults(func=cmd_merge)

    args = p.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
