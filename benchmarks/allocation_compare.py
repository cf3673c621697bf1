"""Rank allocations compared on SmolLM2-135M: uniform vs greedy vs sensitivity (optimal objective, latent keys).

Run on demand:  .venv/bin/python benchmarks/allocation_compare.py [--out DIR]
Writes benchmarks/results/allocation_compare.json (held-out ppl, KL, top-1, KV bytes per rate and allocation).
Statistics are collected once and shared; every rate is sliced from one p = 0.5 checkpoint per allocation.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import kvrewrite
from kvrewrite.compile.plan import Plan
from kvrewrite.io.calibration_data import evaluation_token_sequences
from kvrewrite.publish.evaluation import evaluate_many
from kvrewrite.runtime.load import load

ALLOCATIONS = ("uniform", "greedy", "sensitivity")
RATES = (0.3, 0.5)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("/tmp/kvrewrite-allocation-compare"))
    parser.add_argument("--calib-tokens", type=int, default=16384)
    parser.add_argument("--eval-tokens", type=int, default=8192)
    args = parser.parse_args()

    plan = Plan(
        model="smollm2-135m",
        target_rate=0.5,
        calibration="wiki",
        calib_tokens=args.calib_tokens,
        overwrite=True,
        progress=False,
    )
    shared = kvrewrite.compress_variants(plan, {a: {"allocation": a} for a in ALLOCATIONS}, args.out)
    compiled = shared.results
    compile_s = {a: ctx.report["variant_compile_s"] for a, ctx in compiled.items()}
    calib_kl = {a: ctx.report["verification"]["compiled_rank"]["kl_mean"] for a, ctx in compiled.items()}

    windows = evaluation_token_sequences(shared.tokenizer, args.eval_tokens, plan.seq_len)
    models = {f"{a} p={r}": load(args.out / a, rate=r) for a in ALLOCATIONS for r in RATES}
    results = {
        name: r.as_dict()
        for name, r in evaluate_many(models, windows, baseline=shared.original_model(), progress=False).items()
    }
    for name, r in results.items():
        print(
            f"{name:20s} ppl {r['perplexity']:.2f} (orig {r['baseline_perplexity']:.2f}) KL {r['kl_mean']:.4f} top-1 {r['top1_agreement']:.3f}"
        )
    record = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": f"{platform.node()} {platform.machine()}, {platform.processor() or 'cpu'}; torch CPU",
        "calibration_tokens": args.calib_tokens,
        "eval_tokens": int(windows.numel()),
        "compile_s": compile_s,
        "calibration_kl_at_0.5": calib_kl,
        "results": results,
    }
    target = Path(__file__).parent / "results" / "allocation_compare.json"
    target.write_text(json.dumps(record, indent=1))
    print("wrote", target)


if __name__ == "__main__":
    main()
