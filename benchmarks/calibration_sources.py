"""Calibration sources compared on SmolLM2-135M: wiki vs self-generated synthetic text vs a user file.

Run on demand, one source per call (each is a full compile, a few minutes on 2 cores):
    python benchmarks/calibration_sources.py --source wiki
    python benchmarks/calibration_sources.py --source synthetic
    python benchmarks/calibration_sources.py --source news-file
Every call merges its rows into benchmarks/results/calibration_sources.json.

Same token count for every source (--calib-tokens), same compile configuration (optimal objective, sensitivity
allocation, latent keys, p = 0.5 checkpoint, sliced to 0.3). Held-out evaluation on two domains:
- wiki: the held-out Wikipedia articles (8,192 tokens, as in docs/results.md);
- news: the second half of gensim's Lee news corpus (lee_background.cor, Australian news stories).
The "user file" source is the FIRST half of that news corpus (one .txt per story), so calibration and
evaluation never share a story; it stands for a user who calibrates on text of their own domain.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

import kvrewrite
from kvrewrite.compile.plan import Plan
from kvrewrite.io.calibration_data import evaluation_token_sequences
from kvrewrite.io.calibration_data.corpus import token_stream
from kvrewrite.io.calibration_data.news import news_split  # noqa: F401  (distill_domains imports it from here)
from kvrewrite.publish.evaluation import evaluate_many
from kvrewrite.runtime.load import load

RATES = (0.3, 0.5)
RESULTS = Path(__file__).parent / "results" / "calibration_sources.json"


def write_news_calibration_dir(root: Path) -> Path:
    directory = root / "news-calibration"
    directory.mkdir(parents=True, exist_ok=True)
    for i, story in enumerate(news_split()[0]):
        (directory / f"{i:04d}.txt").write_text(story + "\n", encoding="utf-8")
    return directory


def evenly_spaced_windows(stream: list[int], n_tokens: int, seq_len: int) -> torch.LongTensor:
    n_seq = -(-n_tokens // seq_len)
    n_windows = len(stream) // seq_len
    if n_windows < n_seq:
        raise SystemExit(f"held-out text has {len(stream)} tokens, fewer than {n_seq * seq_len}")
    starts = [(i * n_windows // n_seq) * seq_len for i in range(n_seq)]
    return torch.tensor([stream[s : s + seq_len] for s in starts], dtype=torch.long)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--source", choices=("wiki", "synthetic", "news-file"), required=True)
    parser.add_argument("--out", type=Path, default=Path("/tmp/kvrewrite-calibration-sources"))
    parser.add_argument("--calib-tokens", type=int, default=16384)
    parser.add_argument("--eval-tokens", type=int, default=8192)
    args = parser.parse_args()

    calibration = str(write_news_calibration_dir(args.out)) if args.source == "news-file" else args.source
    plan = Plan(
        model="smollm2-135m",
        target_rate=0.5,
        calibration=calibration,
        calib_tokens=args.calib_tokens,
        rope_mode="latent",
        overwrite=True,
        progress=False,
    )
    t0 = time.perf_counter()
    shared = kvrewrite.compress_variants(plan, {args.source: {}}, args.out)
    compile_s = round(time.perf_counter() - t0, 1)

    held_out = {
        "wiki": evaluation_token_sequences(shared.tokenizer, args.eval_tokens, plan.seq_len),
        "news": evenly_spaced_windows(token_stream(shared.tokenizer, news_split()[1]), args.eval_tokens, plan.seq_len),
    }
    rows = {}
    for domain, windows in held_out.items():
        models = {f"p={r}": load(args.out / args.source, rate=r) for r in RATES}
        for name, result in evaluate_many(models, windows, baseline=shared.original_model(), progress=False).items():
            row = result.as_dict()
            rows[f"{domain} {name}"] = row
            print(
                f"{args.source:10s} {domain:5s} {name}: ppl {row['perplexity']:.2f} (orig {row['baseline_perplexity']:.2f}) "
                f"KL {row['kl_mean']:.4f} top-1 {row['top1_agreement']:.3f}"
            )
        del models

    record = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"sources": {}}
    record["setup"] = {
        "configuration": "optimal objective, sensitivity allocation, latent keys; p=0.5 checkpoint sliced to 0.3",
        "calibration_tokens": args.calib_tokens,
        "eval_tokens_per_domain": args.eval_tokens,
        "held_out": {
            "wiki": "held-out Wikipedia articles (evaluation_token_sequences)",
            "news": "second half of gensim lee_background.cor (news); the news-file source is its first half",
        },
    }
    record["sources"][args.source] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": f"{platform.node()} {platform.machine()}, {platform.processor() or 'cpu'}; torch CPU, 2 shared cores",
        "calibration_tokens": shared.statistics_report["calibration"]["tokens"],
        "compile_s": compile_s,
        "results": rows,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(record, indent=1))
    print("wrote", RESULTS)


if __name__ == "__main__":
    main()
