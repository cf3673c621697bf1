"""Key modes compared on SmolLM2-135M (held-out wiki, 8,192 tokens, 16K wiki calibration tokens).

Run on demand (each part collects the statistics once and shares them between its variants):
    python benchmarks/key_modes.py --part key-only      # freq / post-rope / latent / crosshead, keys only, equal rate
    python benchmarks/key_modes.py --part full          # whole pipeline (optimal, sensitivity) per key mode, p = 0.3/0.5
    python benchmarks/key_modes.py --part full --variants auto,auto-zero-overhead
Every call merges its rows into benchmarks/results/key_modes.json.

key-only: the value side stays at full rank and every layer keeps the same number of key dims, half of
its n_kv x d_h (32 per KV head; 96 in the one shared crosshead block): the issue's "one side only at
p = 0.5" comparison, where only the key mode differs.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import kvrewrite
from kvrewrite.adapters.base import AttentionFeatures
from kvrewrite.compile.plan import Plan
from kvrewrite.io.calibration_data import evaluation_token_sequences
from kvrewrite.key_modes import key_mode, key_mode_names
from kvrewrite.publish.evaluation import evaluate_many
from kvrewrite.runtime.load import load

RESULTS = Path(__file__).parent / "results" / "key_modes.json"
FULL_VARIANTS = {
    "freq": {"rope_mode": "freq"},
    "post-rope": {"rope_mode": "post-rope"},
    "latent": {"rope_mode": "latent"},
    "crosshead": {"rope_mode": "crosshead"},
    "auto": {"rope_mode": "auto", "prefer": "quality"},
    "auto-zero-overhead": {"rope_mode": "auto", "prefer": "zero-overhead"},
}
RATES = (0.3, 0.5)


def key_only_model(directory: Path, key_share_kept: float = 0.5):
    """The checkpoint at full rank, then every layer's keys cut to `key_share_kept` of their dims."""
    model = load(directory, rate=0.0)
    spec = model.compression_spec
    keys, values = [], []
    for layer in spec.layers:
        total = sum(layer.key_ranks)
        kept = int(round(key_share_kept * total / 2)) * 2
        if key_mode(layer.key_mode).shared_key_block:
            keys.append([kept] + [0] * (len(layer.key_ranks) - 1))
        else:
            per_head = kept // len(layer.key_ranks)
            keys.append([per_head] * len(layer.key_ranks))
        values.append(list(layer.value_ranks))
    model.set_ranks(keys, values)
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--part", choices=("key-only", "full"), required=True)
    parser.add_argument(
        "--variants", default=None, help="comma-separated (full part); default: crosshead,auto,auto-zero-overhead"
    )
    parser.add_argument("--out", type=Path, default=Path("/tmp/kvrewrite-key-modes"))
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--calib-tokens", type=int, default=16384)
    parser.add_argument("--eval-tokens", type=int, default=8192)
    args = parser.parse_args()

    plan = Plan(
        model=args.model,
        target_rate=0.5,
        calibration="wiki",
        calib_tokens=args.calib_tokens,
        overwrite=True,
        progress=False,
    )
    if args.part == "key-only":
        # Greedy allocation: no sensitivity probe needed, the ranks are set by hand below anyway.
        rope_modes = [m for m in key_mode_names() if key_mode(m).allowed_for(AttentionFeatures())]  # a plain RoPE model
        variants = {m: {"rope_mode": m, "allocation": "greedy"} for m in rope_modes}
    else:
        names = (args.variants or "crosshead,auto,auto-zero-overhead").split(",")
        variants = {n: FULL_VARIANTS[n] for n in names}
    shared = kvrewrite.compress_variants(plan, variants, args.out / args.part)
    compiled = shared.results
    windows = evaluation_token_sequences(shared.tokenizer, args.eval_tokens, plan.seq_len)

    if args.part == "key-only":
        models = {f"{name} keys p=0.5 (values full)": key_only_model(args.out / args.part / name) for name in variants}
    else:
        models = {f"{name} p={r}": load(args.out / args.part / name, rate=r) for name in variants for r in RATES}
    results = {
        name: r.as_dict()
        for name, r in evaluate_many(models, windows, baseline=shared.original_model(), progress=False).items()
    }
    for name, r in results.items():
        print(
            f"{name:36s} ppl {r['perplexity']:.2f} (orig {r['baseline_perplexity']:.2f}) KL {r['kl_mean']:.4f} "
            f"top-1 {r['top1_agreement']:.3f} KV bytes/token {r['kv_bytes_per_token']:.0f}"
        )

    record = json.loads(args.results.read_text()) if args.results.exists() else {}
    part = record.setdefault(args.part, {"runs": {}, "results": {}})
    part["results"].update(results)
    part["runs"][",".join(variants)] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": f"{platform.node()} {platform.machine()}, {platform.processor() or 'cpu'}; torch CPU, 2 shared cores",
        "calibration_tokens": args.calib_tokens,
        "eval_tokens": int(windows.numel()),
        "compile_s": {n: ctx.report["variant_compile_s"] for n, ctx in compiled.items()},
        "key_modes": {n: [layer.key_mode for layer in ctx.spec.layers] for n, ctx in compiled.items()},
        "key_mode_choice": {
            n: ctx.report.get("key_mode_choice") for n, ctx in compiled.items() if "key_mode_choice" in ctx.report
        },
        "calibration_kl_at_0.5": {
            n: ctx.report["verification"]["compiled_rank"]["kl_mean"] for n, ctx in compiled.items()
        },
    }
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(record, indent=1))
    print("wrote", args.results)


if __name__ == "__main__":
    main()
