"""Output refit (--refit output / output-local) on SmolLM2-135M: held-out ppl with and without it, per rate.

The refit depends on the ranks, so each rate is refitted separately on a model sliced from one compiled checkpoint
(the sensitivity allocation is a function of the rate alone, so that is the model a compile at that rate folds);
the refit is the compile pass's own function (kvrewrite.method.output_refit.refit_output_projections), on the first
`--refit-tokens` wiki calibration tokens (the compile's calibration windows). Evaluation: the held-out wiki
articles, 512-token windows, as in results.md.

  flock /tmp/kvrewrite-heavy.lock python benchmarks/refit_compare.py --checkpoint DIR --rates 0.3,0.5 --target model
Appends to benchmarks/results/refit_compare.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results" / "refit_compare.json"


def main() -> None:
    from transformers import AutoTokenizer

    import kvrewrite
    from kvrewrite.adapters import adapter_for
    from kvrewrite.io.calibration_data import calibration_token_sequences, evaluation_token_sequences
    from kvrewrite.io.source_model import load_fp32_model
    from kvrewrite.io.sources import resolve_model_source
    from kvrewrite.method.output_refit import refit_output_projections
    from kvrewrite.publish.evaluation import evaluate_many

    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--tag", default="default", help="names the checkpoint's configuration")
    parser.add_argument("--rates", default="0.3,0.5")
    parser.add_argument("--target", choices=("model", "layer"), default="model")
    parser.add_argument("--refit-tokens", type=int, default=8192)
    parser.add_argument("--ridge", type=float, default=1e-4)
    parser.add_argument("--eval-tokens", type=int, default=8192)
    parser.add_argument("--no-plain", action="store_true", help="skip the un-refitted models")
    args = parser.parse_args()

    source = resolve_model_source("smollm2-135m").path
    original = load_fp32_model(source)
    tokenizer = AutoTokenizer.from_pretrained(source)
    windows = calibration_token_sequences("wiki", tokenizer, 16384, 512, seed=0)[: -(-args.refit_tokens // 512)]
    adapter = adapter_for(original.config)
    models, refit_s = {}, {}
    for rate in (float(r) for r in args.rates.split(",")):
        if not args.no_plain:
            models[f"plain@{rate:.2f}"] = kvrewrite.load(args.checkpoint, rate=rate)
        model = kvrewrite.load(args.checkpoint, rate=rate)
        t0 = time.perf_counter()
        refit_output_projections(model, original, adapter, windows, ridge=args.ridge, target=args.target)
        refit_s[f"{rate:.2f}"] = round(time.perf_counter() - t0, 1)
        models[f"refit-{args.target}@{rate:.2f}"] = model
    results = evaluate_many(
        models, evaluation_token_sequences(tokenizer, args.eval_tokens, 512), baseline=original, progress=False
    )
    record = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {"runs": []}
    for name, res in results.items():
        row = {
            "tag": args.tag,
            "model": name,
            "rate": float(name.split("@")[1]),
            "refit_tokens": args.refit_tokens,
            "ridge": args.ridge,
            "perplexity": res.perplexity,
            "baseline_perplexity": res.baseline_perplexity,
            "ppl_increase": res.perplexity / res.baseline_perplexity - 1,
            "kl_mean": res.kl_mean,
            "top1_agreement": res.top1_agreement,
            "kv_bytes_per_token": res.kv_bytes_per_token,
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "machine": f"{platform.node()} {platform.machine()}; torch {torch.__version__} CPU",
            "refit_s": refit_s.get(name.split("@")[1]),
        }
        print(json.dumps(row), flush=True)
        record["runs"].append(row)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
