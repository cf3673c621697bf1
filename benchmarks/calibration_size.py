"""Issue 16, a stronger training-free default: calibration size, calibration mix and sequential statistics, compared
on held-out wiki and held-out news at 512-token windows.

Each variant is one SmolLM2-135M checkpoint compiled like the default one (`kvrewrite compress smollm2-135m -p 0.5
--calib-tokens 16384`) with one thing changed (more tokens, another calibration source, --sequential-statistics).
Every call evaluates ONE checkpoint with `evaluate_checkpoint` (what `kvrewrite eval` runs) at p = 0.3/0.5/0.7 on
both texts and merges its rows into --out, so variants can be added as their compiles finish; the default
checkpoint is evaluated in the same protocol (same tokens, same windows) as its own variant.

    OMP_NUM_THREADS=1 python benchmarks/calibration_size.py CKPT --label "32K wiki" --tokens 4096 \
        --compile-time CKPT.time --out benchmarks/results/calibration_size.json

The calibration mix (`--write-mix DIR`, then `kvrewrite compress ... --calibration DIR`): one .txt per synthetic text
(the model's own answers to the shipped seed prompts, `synthetic_texts`, the cached set the `synthetic` source makes)
and one .txt per wiki CALIBRATION article holding its lead paragraphs (about --mix-wiki-chars characters each), so
the wiki half still spans all 89 calibration articles. Nothing comes from the held-out wiki or news text.

--compile-time: the `/usr/bin/time -v` output of the compile, for its wall time and peak RSS (the checkpoint's
compress_report.json gives the pipeline's own timings and peak RSS as well).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from kvrewrite.publish.checkpoint_eval import evaluate_checkpoint

sys.path.insert(0, str(Path(__file__).parent))
from compile_cost import compress_report_cost, time_v_report  # noqa: E402
from decode import run_provenance  # noqa: E402  (the provenance header every benchmark result starts with)


def compile_facts(checkpoint: Path, time_file: Path | None) -> dict:
    facts = compress_report_cost(checkpoint)
    if facts is None:
        raise SystemExit(f"{checkpoint} has no compress_report.json (not a kvrewrite compress checkpoint)")
    mix = Path(str(facts["calibration"]["source"])) / "mix.json"
    if mix.is_file():
        facts["mix"] = json.loads(mix.read_text())
    if time_file is not None:
        facts["time_v"] = time_v_report(time_file.read_text())
    return facts


def article_lead(text: str, chars: int) -> str:
    """The article's first paragraphs, up to about `chars` characters (whole paragraphs, at least one)."""
    kept, size = [], 0
    for paragraph in text.split("\n\n"):
        if kept and size + len(paragraph) > chars:
            break
        kept.append(paragraph)
        size += len(paragraph)
    return "\n\n".join(kept)


def write_mix(directory: Path, synthetic_tokens: int, wiki_chars: int) -> dict:
    """Synthetic texts + wiki calibration-article leads, one .txt each; returns their token counts."""
    from transformers import AutoTokenizer

    from kvrewrite.io.calibration_data import synthetic_texts, wiki_split
    from kvrewrite.io.calibration_data.corpus import token_stream
    from kvrewrite.io.source_model import load_fp32_model
    from kvrewrite.io.sources import resolve_model_source

    path = resolve_model_source("smollm2-135m").path
    tokenizer = AutoTokenizer.from_pretrained(path)
    synthetic = synthetic_texts(load_fp32_model(path), tokenizer, synthetic_tokens, seed=0)
    leads = [article_lead(a.text, wiki_chars) for a in wiki_split()[0]]
    directory.mkdir(parents=True, exist_ok=False)
    for i, text in enumerate(synthetic):
        (directory / f"synthetic-{i:04d}.txt").write_text(text + "\n", encoding="utf-8")
    for i, text in enumerate(leads):
        (directory / f"wiki-{i:04d}.txt").write_text(text + "\n", encoding="utf-8")
    facts = {
        "synthetic_texts": len(synthetic),
        "synthetic_tokens": len(token_stream(tokenizer, synthetic)),
        "wiki_articles": len(leads),
        "wiki_tokens": len(token_stream(tokenizer, leads)),
        "wiki_chars": wiki_chars,
    }
    # Beside the texts (only *.txt files are calibration documents), so the results can say what the mix held.
    (directory / "mix.json").write_text(json.dumps(facts) + "\n", encoding="utf-8")
    return facts


def main() -> None:
    if "--write-mix" in sys.argv:
        mix = argparse.ArgumentParser(description="write the calibration mix directory")
        mix.add_argument("--write-mix", type=Path, required=True)
        mix.add_argument("--mix-synthetic-tokens", type=int, default=16384)
        mix.add_argument("--mix-wiki-chars", type=int, default=1200)
        args = mix.parse_args()
        print(json.dumps(write_mix(args.write_mix, args.mix_synthetic_tokens, args.mix_wiki_chars)))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--label", required=True, help="the variant's name in the results")
    parser.add_argument("--compile-command", default=None, help="the compress command that made the checkpoint")
    parser.add_argument("--compile-time", type=Path, default=None, help="/usr/bin/time -v output of that compile")
    parser.add_argument("--rates", default="0.3,0.5,0.7")
    parser.add_argument("--tokens", type=int, default=4096, help="held-out tokens per text")
    parser.add_argument("--texts", default="wiki,news")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    results = json.loads(args.out.read_text()) if args.out.is_file() else {"variants": []}
    if results.get("tokens", args.tokens) != args.tokens:
        raise SystemExit(f"{args.out} holds {results['tokens']}-token figures; these would be {args.tokens}")
    variant = {
        **run_provenance(int(os.environ.get("OMP_NUM_THREADS", "1")), "one process"),
        "label": args.label,
        "checkpoint": str(args.checkpoint),
        "compile_command": args.compile_command,
        "compile": compile_facts(args.checkpoint, args.compile_time),
        "runs": [],
    }
    results["tokens"], results["protocol"] = args.tokens, "512-token windows"
    results["variants"] = [v for v in results["variants"] if v["label"] != args.label] + [variant]
    for text in args.texts.split(","):
        started = time.time()
        rows = evaluate_checkpoint(args.checkpoint, rates=rates, tokens=args.tokens, seq_len=512, text=text)
        variant["runs"].append({"text": text, "seconds": round(time.time() - started, 1), "rows": rows})
        for row in rows[1:]:
            increase = 100 * (row["perplexity"] / row["baseline_perplexity"] - 1)
            print(
                f"{args.label:24s} {text:5s} p={row['rate']:.1f}: ppl {row['perplexity']:.2f} "
                f"(orig {row['baseline_perplexity']:.2f}, {increase:+.1f}%) KL {row['kl_mean']:.4f}",
                file=sys.stderr,
            )
        # Written after every text, so a run stopped part-way keeps what it measured.
        args.out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
