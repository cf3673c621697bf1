"""The recent window's effect at equal bytes: continuation perplexity of one checkpoint with and without token tiers.

    python benchmarks/recent_window.py --checkpoint DIR [--windows 8] [--length 1024] [--context 512] \
        [--point "rate=0.6;window=64"] [--point "rate=0.7;window=64;imp=0.3;share=0.25;score=denominator"] ...

Protocol: held-out wiki windows of --length tokens; the first --context tokens are context, the rest are scored
(continuation ppl, Δ against the original in the same run). Because a tiered query reads key j at full rank
exactly when t - j <= W, one forward over the window gives the same logits as a chunked prefill followed by
decoding (tests/test_tiers.py checks this), so each method is one forward per window; points with a coded or
token-adaptive tier change between forwards and are fed 64 tokens at a time, as decoding would. Bytes are measured on
the real cache tensors after the whole window, as a share of the original's float16 K/V bytes.
Rows are written to benchmarks/results/recent_window.json with the command, commit and machine.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from transformers import AutoTokenizer

import kvrewrite
from kvrewrite.io.calibration_data import evaluation_token_sequences
from kvrewrite.io.source_model import load_fp32_model
from kvrewrite.io.sources import resolve_model_source
from kvrewrite.publish.evaluation import continuation_nll, kv_cache_bytes_per_token_formula

RESULTS = Path(__file__).parent / "results" / "recent_window.json"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--baseline", default="smollm2-135m")
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument(
        "--out", type=Path, default=RESULTS, help="results JSON (default: benchmarks/results/recent_window.json)"
    )
    parser.add_argument(
        "--point",
        action="append",
        default=None,
        help="';'-separated settings: rate=0.5;window=64[;codec=int4][;imp=0.3;share=0.25|ramp;score=attention|denominator]; repeatable",
    )
    args = parser.parse_args()
    points = args.point or [
        "rate=0.5",
        "rate=0.5;window=16",
        "rate=0.5;window=64",
        "rate=0.5;window=128",
        "rate=0.5;window=256",
        "rate=0.6;window=128",
        "rate=0.65;window=64",
    ]

    source = resolve_model_source(args.baseline)
    tokenizer = AutoTokenizer.from_pretrained(source.path)
    windows = evaluation_token_sequences(tokenizer, args.windows * args.length, args.length)
    original = load_fp32_model(source.path).eval()
    config = original.config
    fp16_bytes = kv_cache_bytes_per_token_formula(config, torch.float16)
    from transformers import DynamicCache

    rows = {}
    t0 = time.perf_counter()
    nll, n, held = continuation_nll(original, windows, args.context, lambda: DynamicCache(config=config))
    base_ppl = math.exp(nll / n)
    rows["original"] = {"ppl": base_ppl, "delta_ppl": 0.0, "bytes_per_token": held, "fp16_share": held / fp16_bytes / 2}
    print(f"original: ppl {base_ppl:.3f}  (fp32 cache {held:.0f} B/token)", flush=True)
    for point in points:
        settings = dict(item.split("=", 1) for item in point.split(";"))
        rate, window, codec = float(settings["rate"]), settings.get("window"), settings.get("codec")
        important = None
        if "imp" in settings:
            share = settings["share"]
            if share == "ramp":  # g_l growing linearly with depth, mean 0.25 (ZDC: deeper layers keep more)
                n_layers = config.num_hidden_layers
                share = [0.05 + 0.4 * i / (n_layers - 1) for i in range(n_layers)]
            else:
                share = float(share)
            important = {"rate": float(settings["imp"]), "share": share, "score": settings.get("score", "attention")}
        model = kvrewrite.load(
            args.checkpoint,
            rate=rate,
            kv_codec=codec,
            recent_window=int(window) if window is not None else None,
            important=important,
        ).eval()
        # A coded or token-adaptive tier changes between forwards: feed 64-token chunks, as decoding would.
        chunk = 64 if model.tier_policy is not None and model.tier_policy.changes_between_forwards or codec else None
        nll, n, held = continuation_nll(model, windows, args.context, model.make_kv_cache, chunk)
        ppl = math.exp(nll / n)
        # Plain caches store the model's float32; the tiered and codec caches store float16 or codes.
        plain_fp32 = window is None and not codec
        share = held / fp16_bytes / (2 if plain_fp32 else 1)
        rows[point] = {
            "settings": settings,
            "chunk": chunk,
            "ppl": ppl,
            "delta_ppl": ppl / base_ppl - 1,
            "bytes_per_token": held,
            "fp16_share": share,
        }
        print(f"{point:>16}: ppl {ppl:.3f}  Δ {100 * (ppl / base_ppl - 1):+.1f}%  fp16 share {share:.3f}", flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "command": "python " + " ".join(sys.argv),
                "commit": commit,
                "machine": f"{platform.machine()} {platform.processor() or ''} cpus={torch.get_num_threads()}",
                "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "seconds": round(time.perf_counter() - t0, 1),
                "protocol": {
                    "windows": args.windows,
                    "length": args.length,
                    "context": args.context,
                    "text": "held-out wiki",
                },
                "rows": rows,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
