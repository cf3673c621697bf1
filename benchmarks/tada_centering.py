"""Why tada loses to int4 on SmolLM2-135M: how much TaDA's cross-head mean-centering shrinks what is quantized.

TaDA stores, per token, the mean over a layer's KV heads of their latents and quantizes each head's deviation from
it. That pays when the heads share a common component. kvrewrite's latents are per-head whitened bases (each KV head
has its own transform), so there is no reason for a shared component. This script caches the latents of a compiled
checkpoint on calibration windows and reports, per side, the energy and the per-channel range of the deviations
relative to the raw latents (a ratio near or above 1 means centering buys nothing and the mean's bits are wasted).

  flock /tmp/kvrewrite-heavy.lock python benchmarks/tada_centering.py --checkpoint DIR --rate 0.0
Writes benchmarks/results/tada_centering.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results" / "tada_centering.json"


def main() -> None:
    from transformers import AutoTokenizer, DynamicCache

    import kvrewrite
    from kvrewrite.io.calibration_data import calibration_token_sequences
    from kvrewrite.runtime.kernels.cache_layout import packed_view

    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--rate", type=float, default=0.0)
    parser.add_argument("--windows", type=int, default=4)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    tokens = calibration_token_sequences("wiki", tokenizer, 16384, 512, seed=0)[: args.windows]
    model = kvrewrite.load(args.checkpoint, rate=args.rate, kv_codec="none")
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=tokens, use_cache=True, past_key_values=cache)
    rows = {"key": [], "value": []}
    for idx, attn in enumerate(model.compressed_attentions()):
        layer = cache.layers[idx]
        for side, packed, ranks in (("key", layer.keys, attn.key_ranks), ("value", layer.values, attn.value_ranks)):
            packed = packed_view(packed)  # either memory order -> the logical [B, 1, S, sum r]
            x = packed[:, 0].reshape(-1, packed.shape[-1]).double()  # [tokens, sum r]
            width = min(ranks)
            if width == 0 or len(ranks) < 2:
                continue
            heads = torch.stack(
                [x[:, sum(ranks[:g]) : sum(ranks[:g]) + width] for g in range(len(ranks))]
            )  # [n_kv, T, w]
            deviation = heads - heads.mean(0, keepdim=True)
            rows[side].append(
                {
                    "layer": idx,
                    "energy_ratio": float(deviation.pow(2).sum() / heads.pow(2).sum()),
                    # KIVI keys are scaled per channel by their range: compare mean per-channel ranges.
                    "range_ratio": float(
                        (deviation.amax(1) - deviation.amin(1)).mean() / (heads.amax(1) - heads.amin(1)).mean()
                    ),
                }
            )
    summary = {
        side: {
            "mean_energy_ratio": sum(r["energy_ratio"] for r in v) / len(v),
            "mean_range_ratio": sum(r["range_ratio"] for r in v) / len(v),
        }
        for side, v in rows.items()
    }
    out = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "rate": args.rate,
        "tokens": int(tokens.numel()),
        "summary": summary,
        "layers": rows,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
