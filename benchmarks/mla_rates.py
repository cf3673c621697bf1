"""MLA exports with a rate table (`export-mla --layer-widths sensitivity`, optionally `--distill --distill-rates`), each
loaded at several rates of its table by kvrewrite's runtime, against the original: held-out wiki and news, 512-token
windows and (optionally) continuation positions, one file per export serving every rate.

    OMP_NUM_THREADS=1 python benchmarks/mla_rates.py --export free=DIR1 --export nested=DIR2 --rates 0.3,0.5,0.7 \
        [--texts wiki,news] [--positions 2K-4K] [--compile-log free=TIME_V_FILE ...] --out benchmarks/results/mla_rates.json

The 512-token protocol is benchmarks/mla_quality.py's and `kvrewrite eval`'s (evaluation_token_sequences, 16 windows
of 512 for 8,192 tokens); the continuation protocol is `kvrewrite eval --positions`' (publish/continuation_eval.py:
every scored token predicted from the cache of everything before it, fed in chunks).

An export without a rate table (a single-rate `--distill`) is evaluated once, at its exported widths.
`--compile-log NAME=FILE` records what building that export cost: FILE is the `/usr/bin/time -v` output of the
`kvrewrite export-mla` run that wrote it (its command, wall time and peak RSS go under `compiles`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from compile_cost import time_v_report  # noqa: E402
from decode import run_provenance  # noqa: E402  (the provenance header every benchmark result starts with)

SOURCE = "smollm2-135m"


def export_file_bytes(directory: Path) -> dict[str, int]:
    """Bytes of every weight file of an export (the stock shards, and --refit-rates' side file), by relative path."""
    return {
        path.relative_to(directory).as_posix(): path.stat().st_size for path in sorted(directory.rglob("*.safetensors"))
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--export", action="append", required=True, help="NAME=DIR, repeatable")
    parser.add_argument("--rates", default="0.3,0.5,0.7")
    parser.add_argument("--texts", default="wiki,news")
    parser.add_argument(
        "--positions", default=None, help="continuation ranges as `kvrewrite eval --positions` takes them"
    )
    parser.add_argument("--tokens", type=int, default=8192, help="held-out tokens per text and protocol")
    parser.add_argument(
        "--compile-log",
        action="append",
        default=[],
        help="NAME=FILE: the `/usr/bin/time -v` report of the export-mla run that wrote export NAME",
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    import torch
    from transformers import AutoTokenizer

    from kvrewrite.io.calibration_data import evaluation_token_sequences
    from kvrewrite.io.source_model import load_fp32_model
    from kvrewrite.io.sources import resolve_model_source
    from kvrewrite.publish.checkpoint_eval import continuation_rows, mla_models_at_rates, result_rows
    from kvrewrite.publish.continuation_eval import continuation_quality, parse_positions
    from kvrewrite.publish.evaluation import evaluate_many

    exports = dict(item.split("=", 1) for item in args.export)
    rates = [float(r) for r in args.rates.split(",")]
    compile_logs = dict(item.split("=", 1) for item in args.compile_log)
    if unknown := set(compile_logs) - set(exports):
        raise SystemExit(f"--compile-log names no --export: {', '.join(sorted(unknown))}")
    record = {
        **run_provenance(int(os.environ.get("OMP_NUM_THREADS", "1")), "one process"),
        "exports": {
            name: json.loads((Path(d) / "config.json").read_text())["kvrewrite_mla"] for name, d in exports.items()
        },
        "compiles": {name: time_v_report(Path(log).read_text()) for name, log in compile_logs.items()},
        "export_files": {name: export_file_bytes(Path(d)) for name, d in exports.items()},
        "tokens": args.tokens,
        "runs": [],
    }
    original = load_fp32_model(resolve_model_source(SOURCE).path)
    tokenizer = AutoTokenizer.from_pretrained(next(iter(exports.values())))
    models, model_rates = {}, {}
    for name, directory in exports.items():
        # A single-rate export (e.g. --distill without --distill-rates) has no table: it serves its own widths only.
        served = rates if "rate_table" in record["exports"][name] else None
        loaded, loaded_rates = mla_models_at_rates(Path(directory), served, original.config, name)
        models.update({label: model.eval() for label, model in loaded.items()})
        model_rates.update(loaded_rates)
    protocols = [None] + ([parse_positions(args.positions)] if args.positions else [])
    for text in args.texts.split(","):
        for positions in protocols:
            started = time.time()
            length = positions[-1].end if positions else 512
            windows = evaluation_token_sequences(tokenizer, args.tokens, length, text)
            with torch.inference_mode():
                if positions is None:
                    rows = result_rows(
                        SOURCE, evaluate_many(models, windows, baseline=original, progress=False), model_rates
                    )
                else:
                    measured = continuation_quality(
                        models, windows, positions, baseline=original, chunk=512, progress=False
                    )
                    rows = continuation_rows(SOURCE, measured, model_rates)
            protocol = "512-token windows" if positions is None else f"continuation, {length}-token windows"
            record["runs"].append(
                {"text": text, "protocol": protocol, "seconds": round(time.time() - started, 1), "rows": rows}
            )
            print(f"{text}, {protocol}: {record['runs'][-1]['seconds']} s", file=sys.stderr)
            for row in rows:
                print(
                    json.dumps(
                        {
                            k: row.get(k)
                            for k in ("name", "perplexity", "baseline_perplexity", "kl_mean", "kv_bytes_per_token")
                        }
                    )
                )
            args.out.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")  # kept if stopped part-way
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
