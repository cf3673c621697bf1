"""Can one o_proj refit serve several rates? The least-squares refit of `--refit output` fitted for one rate, or for
every rate from 0.3 to 0.7 at once, against no refit, all evaluated at p = 0.3 / 0.5 / 0.7 from one checkpoint.

    kvrewrite compress smollm2-135m -p 0.5 --calib-tokens 16384 -o CKPT
    OMP_NUM_THREADS=2 python benchmarks/joint_refit.py CKPT --out benchmarks/results/joint_refit.json

Issue 16 asks for the o_proj refit (single-rate today) to become either nested or rate-conditional at no run-time
cost. The cheapest nested form is one closed-form refit whose rows are every fitted rate's: the calibration windows
run once per rate in one batch, each copy truncated to its rate's ranks in every layer (the latent dims beyond a
rank zeroed: exactly the sliced model, compile/probes.py), GPTQ-style layer by layer (`refit_output_projections(...,
copies=len(rates))` under `probes.truncated_by_rows`), and each o_proj solves

    min_W  sum over fitted rates r  || z_r W^T - t ||^2 + lam ||W||^2

with t the original model's attention output (`--refit output`'s target). Columns no fitted rate reads keep their
folded values. Rows: the checkpoint as compiled (no refit), the single-rate refit at 0.5 (what `compress -p 0.5
--refit output` folds, here read at every rate of the table), and the joint refit over 0.3, 0.4, 0.5, 0.6, 0.7.
Every row scores held-out wiki and news (8,192 tokens each, 512-token windows) against the original.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import kvrewrite
from kvrewrite.adapters import adapter_for
from kvrewrite.compile.probes import truncated_by_rows, truncated_model
from kvrewrite.io.calibration_data.corpus import calibration_token_sequences, evaluation_token_sequences
from kvrewrite.io.sources import resolve_model_source
from kvrewrite.method.output_refit import refit_output_projections
from kvrewrite.publish.evaluation import perplexity_and_agreement_many
from kvrewrite.spec import CompressionSpec

sys.path.insert(0, str(Path(__file__).parent))
from decode import run_provenance  # noqa: E402

EVALUATED_RATES = (0.3, 0.5, 0.7)
CONFIGS = {"no refit": (), "refit for p = 0.5 only": (0.5,), "one refit for p = 0.3 to 0.7": (0.3, 0.4, 0.5, 0.6, 0.7)}


def joint_refit(model, original, adapter, ranks: dict, rates: tuple[float, ...], windows: torch.Tensor) -> None:
    """Refit every o_proj in place on the rows of every rate at once: one batch copy of the windows per rate, each
    truncated to its rate's ranks (module docstring)."""
    with truncated_by_rows(model, adapter, [ranks[r] for r in rates], windows.shape[0]):
        refit_output_projections(model, original, adapter, windows, copies=len(rates))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path, help="a per-head checkpoint whose table holds rate 0.0 (full rank)")
    parser.add_argument("--refit-tokens", type=int, default=16384)
    parser.add_argument("--eval-tokens", type=int, default=8192)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    record = {
        **run_provenance(torch.get_num_threads(), "quality only, no timings"),
        "checkpoint": args.checkpoint.name,
        "refit_tokens": args.refit_tokens,
        "eval_tokens": args.eval_tokens,
        "rows": [],
    }
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    source = json.loads((args.checkpoint / "config.json").read_text())["kvrewrite"]
    spec = CompressionSpec.from_dict(source)
    original = AutoModelForCausalLM.from_pretrained(
        resolve_model_source(spec.source_model).path, dtype=torch.float32
    ).eval()
    adapter = adapter_for(original.config)
    ranks = {r: spec.ranks_for_rate(r) for r in {*EVALUATED_RATES, *(r for rates in CONFIGS.values() for r in rates)}}
    texts = {text: evaluation_token_sequences(tokenizer, args.eval_tokens, 512, text=text) for text in ("wiki", "news")}
    windows = calibration_token_sequences("wiki", tokenizer, args.refit_tokens, 512)
    for config, rates in CONFIGS.items():
        model = kvrewrite.load(args.checkpoint, rate=0.0).eval()  # full rank; every rate is a truncation of it
        started = time.perf_counter()
        if rates:
            joint_refit(model, original, adapter, ranks, rates, windows)
        fit_s = round(time.perf_counter() - started, 1)
        for text, held_out in texts.items():
            for rate in EVALUATED_RATES:
                with truncated_model(model, adapter, *ranks[rate]):
                    res = perplexity_and_agreement_many({"m": model}, held_out, baseline=original, progress=False)["m"]
                row = {
                    "config": config,
                    "fitted_rates": list(rates),
                    "text": text,
                    "rate": rate,
                    "perplexity": res.perplexity,
                    "baseline_perplexity": res.baseline_perplexity,
                    "ppl_increase_pct": 100 * (res.perplexity / res.baseline_perplexity - 1),
                    "kl_mean": res.kl_mean,
                    "top1_agreement": res.top1_agreement,
                    "refit_s": fit_s,
                }
                record["rows"].append(row)
                print(json.dumps(row), flush=True)
                args.out.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        del model
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
