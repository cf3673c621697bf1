"""Compiled checkpoints compared on held-out text of two domains: did --distill on wiki calibration text generalise?

    python benchmarks/distill_domains.py --checkpoint "refit p=0.5=/tmp/d50/refit" --checkpoint "refit+distill p=0.5=/tmp/d50/p50"

Each --checkpoint is NAME=DIR (a kvrewrite checkpoint at its compiled rate). Held-out text:
- wiki: the held-out Wikipedia articles (evaluation_token_sequences; the calibration split never sees them);
- news: the second half of gensim's Lee news corpus (benchmarks/calibration_sources.py), a domain the wiki
  calibration text does not cover: the distillation target is the original model's distribution, so it should
  recover quality there too rather than adapt the model to Wikipedia.
Rows are merged into benchmarks/results/distill_domains.json (with the command that made them).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from calibration_sources import evenly_spaced_windows, news_split  # noqa: E402

from kvrewrite.io.calibration_data import evaluation_token_sequences  # noqa: E402
from kvrewrite.io.calibration_data.corpus import token_stream  # noqa: E402
from kvrewrite.io.source_model import load_fp32_model  # noqa: E402
from kvrewrite.io.sources import resolve_model_source  # noqa: E402
from kvrewrite.publish.evaluation import evaluate_many  # noqa: E402
from kvrewrite.runtime.load import load  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "distill_domains.json"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", action="append", required=True, help="NAME=DIR, repeatable")
    parser.add_argument("--baseline", default="smollm2-135m")
    parser.add_argument("--eval-tokens", type=int, default=8192)
    parser.add_argument("--seq-len", type=int, default=512)
    args = parser.parse_args()

    checkpoints = dict(item.rsplit("=", 1) for item in args.checkpoint)
    source = resolve_model_source(args.baseline)
    baseline = load_fp32_model(source.path)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source.path)
    held_out = {
        "wiki": evaluation_token_sequences(tokenizer, args.eval_tokens, args.seq_len),
        "news": evenly_spaced_windows(token_stream(tokenizer, news_split()[1]), args.eval_tokens, args.seq_len),
    }
    t0 = time.perf_counter()
    rows = {}
    models = {name: load(directory) for name, directory in checkpoints.items()}
    for domain, windows in held_out.items():
        for name, result in evaluate_many(models, windows, baseline=baseline, progress=False).items():
            row = result.as_dict()
            rows[f"{domain} | {name}"] = {**row, "checkpoint": checkpoints[name]}
            print(
                f"{domain:5s} {name:28s} ppl {row['perplexity']:.2f} (orig {row['baseline_perplexity']:.2f}, "
                f"{row['perplexity'] / row['baseline_perplexity'] - 1:+.1%}) KL {row['kl_mean']:.4f} top-1 {row['top1_agreement']:.3f}"
            )

    record = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"runs": []}
    record["runs"].append(
        {
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "machine": f"{platform.node()} {platform.machine()}; torch CPU, 2 shared cores",
            "eval_tokens_per_domain": args.eval_tokens,
            "seq_len": args.seq_len,
            "held_out": {
                "wiki": "held-out Wikipedia articles (evaluation_token_sequences)",
                "news": "second half of gensim lee_background.cor (news stories)",
            },
            "seconds": round(time.perf_counter() - t0, 1),
            "results": rows,
        }
    )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(record, indent=1))
    print("wrote", RESULTS)


if __name__ == "__main__":
    main()
