"""Rank allocations compared on SmolLM2-135M: uniform vs greedy vs sensitivity (optimal objective, latent keys).

Run on demand:  .venv/bin/python benchmarks/allocation_compare.py [--out DIR]
Writes benchmarks/results/allocation_compare.json (held-out ppl, KL, top-1, KV bytes per rate and allocation).
Statistics are collected once and shared; every rate is sliced from one p = 0.5 checkpoint per allocation.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

from kvrewrite.calibration_data import evaluation_token_sequences
from kvrewrite.evaluation import evaluate_many
from kvrewrite.passes.allocate_ranks import AllocateRanks
from kvrewrite.passes.build_calibration import BuildCalibration
from kvrewrite.passes.collect_statistics import CollectStatistics
from kvrewrite.passes.compute_transforms import ComputeTransforms
from kvrewrite.passes.context import CompileContext
from kvrewrite.passes.emit import Emit
from kvrewrite.passes.fold_weights import FoldWeights
from kvrewrite.passes.load_checkpoint import LoadCheckpoint
from kvrewrite.passes.measure_sensitivity import MeasureSensitivity
from kvrewrite.passes.verify import Verify
from kvrewrite.plan import Plan
from kvrewrite.runtime import load

ALLOCATIONS = ("uniform", "greedy", "sensitivity")
RATES = (0.3, 0.5)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("/tmp/kvrewrite-allocation-compare"))
    parser.add_argument("--calib-tokens", type=int, default=16384)
    parser.add_argument("--eval-tokens", type=int, default=8192)
    args = parser.parse_args()

    plan = Plan(model="smollm2-135m", target_rate=0.5, calibration="wiki", calib_tokens=args.calib_tokens,
                overwrite=True, progress=False)
    shared = CompileContext(plan=plan)
    for step in (LoadCheckpoint(), BuildCalibration(), CollectStatistics()):
        step.run(shared)
    compile_s, calib_kl = {}, {}
    for allocation in ALLOCATIONS:
        t0 = time.perf_counter()
        ctx = dataclasses.replace(shared, plan=dataclasses.replace(plan, output=args.out / allocation, allocation=allocation),
                                  report=copy.deepcopy(shared.report), verification={}, sensitivity=None)
        for step in (ComputeTransforms(), MeasureSensitivity(), AllocateRanks(), FoldWeights(), Verify(), Emit()):
            step.run(ctx)
        compile_s[allocation] = round(time.perf_counter() - t0, 1)
        calib_kl[allocation] = ctx.verification["compiled_rank"]["kl_mean"]
        print(allocation, "compiled in", compile_s[allocation], "s; calibration KL", calib_kl[allocation], flush=True)

    windows = evaluation_token_sequences(shared.tokenizer, args.eval_tokens, plan.seq_len)
    models = {f"{a} p={r}": load(args.out / a, rate=r) for a in ALLOCATIONS for r in RATES}
    results = {name: r.as_dict() for name, r in evaluate_many(models, windows, baseline=shared.model, progress=False).items()}
    for name, r in results.items():
        print(f"{name:20s} ppl {r['perplexity']:.2f} (orig {r['baseline_perplexity']:.2f}) KL {r['kl_mean']:.4f} top-1 {r['top1_agreement']:.3f}")
    record = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": f"{platform.node()} {platform.machine()}, {platform.processor() or 'cpu'}; torch CPU",
        "calibration_tokens": args.calib_tokens, "eval_tokens": int(windows.numel()),
        "compile_s": compile_s, "calibration_kl_at_0.5": calib_kl, "results": results,
    }
    target = Path(__file__).parent / "results" / "allocation_compare.json"
    target.write_text(json.dumps(record, indent=1))
    print("wrote", target)


if __name__ == "__main__":
    main()
