"""Screening for the MLA latent's key/value weighting (DEFAULT_KEY_WEIGHT in kvrewrite/method/mla.py), SmolLM2-135M.

    OMP_NUM_THREADS=1 python benchmarks/mla_key_weight_screen.py [--windows 8] [--share 0.5] [--weights 0.125,0.25,0.5,1,2,4]

Statistics once (16K wiki calibration tokens, as benchmarks/mla_quality.py), then per weight our MLA maths (the
reference model, not an export) scored against the original on two sets of 512-token windows: held-back calibration
windows (the calibration split's windows on the same grid that the statistics did not use; the weight is chosen on
these) and held-out wiki windows (reported only). Prints one JSON line per weight (~2.5 min each on one thread).
"""

from __future__ import annotations

import argparse
import json
import math
import random

import torch

# An ablation of one inner step, not an export: it scores our maths at each key weight from one statistics pass, so
# it calls the form's parts; kvrewrite.export_mla(source, MLAPlan(key_weight=...)) would recollect them per weight.
from kvrewrite.compile.mla.export import mla_layers_at_share, prepare_source
from kvrewrite.compile.mla.form import mla_reference_model
from kvrewrite.compile.plan import Plan
from kvrewrite.io.calibration_data import evaluation_token_sequences
from kvrewrite.io.calibration_data.corpus import token_stream
from kvrewrite.io.calibration_data.wiki import wiki_split
from kvrewrite.publish.evaluation import perplexity_and_agreement_many

CALIB_TOKENS = 16384


def held_back_windows(tokenizer, seq_len: int, n_windows: int) -> torch.Tensor:
    """Calibration-split windows the statistics did not read: corpus._random_windows' grid for seed 0, unpicked ones."""
    stream = token_stream(tokenizer, [a.text for a in wiki_split()[0]])
    n_seq = math.ceil(CALIB_TOKENS / seq_len)
    rng = random.Random(0)
    offset = rng.randrange(min(len(stream) - n_seq * seq_len, seq_len - 1) + 1)
    total = (len(stream) - offset) // seq_len
    picked = set(rng.sample(range(total), n_seq))
    unused = [i for i in range(total) if i not in picked]
    chosen = unused[:: max(1, len(unused) // n_windows)][:n_windows]
    return torch.tensor([stream[offset + i * seq_len : offset + (i + 1) * seq_len] for i in chosen])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--share", type=float, default=0.5)
    parser.add_argument("--weights", default="0.125,0.25,0.5,1,2,4")
    args = parser.parse_args()
    plan = Plan(model="smollm2-135m", calibration="wiki", calib_tokens=CALIB_TOKENS, progress=False)
    prepared = prepare_source(
        plan, position_free_queries="source"
    )  # the screen that chose the key weight ran unrotated
    ctx = prepared.ctx
    original = ctx.original_model()
    sets = {
        "calibration_held_back": held_back_windows(ctx.tokenizer, plan.seq_len, args.windows),
        "held_out": evaluation_token_sequences(ctx.tokenizer, args.windows * plan.seq_len, plan.seq_len),
    }
    for weight in (float(w) for w in args.weights.split(",")):
        _, layers = mla_layers_at_share(prepared, args.share, key_weight=weight)
        model = mla_reference_model(original, layers)
        row = {"key_weight": weight, "share": args.share}
        for name, windows in sets.items():
            res = perplexity_and_agreement_many({"mla": model}, windows, baseline=original, progress=False)["mla"]
            row[f"{name}_ppl_increase_pct"] = round(100 * (res.perplexity / res.baseline_perplexity - 1), 3)
            row[f"{name}_kl_mean"] = round(res.kl_mean, 4)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
