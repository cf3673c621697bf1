"""What dropping RoPE costs the MLA form, at 512 tokens and at positions 2K-4K, with the position-free queries
unrotated (`--position-free-queries source`, the default) or scored by each head's expected rotation
(`--position-free-queries expected-rotation`).

    OMP_NUM_THREADS=1 python benchmarks/mla_rope_position.py [--texts wiki] [--shares 0.5] \
        --out benchmarks/results/mla_rope_position.json

Rows: our maths (compile/mla_form.mla_reference_model, float32) at a full latent (only the RoPE drop), and at
uniform widths for each --share, each way. Both use the same statistics (16K wiki calibration tokens) and the same
measured rotations, so the only difference is the position-free queries.

Protocols: 512-token windows (16 for 8,192 tokens, as `kvrewrite eval`), and tokens 2048-4095 of 4,096-token
windows (2 for 8,192 tokens, `kvrewrite eval --positions 2K-4K`'s windows) scored from one causal forward of the
whole window: the same predictions the chunked-cache protocol makes, since the reference form has no cache.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from decode import run_provenance  # noqa: E402  (the provenance header every benchmark result starts with)

from kvrewrite.compile.mla_export import prepare_source  # noqa: E402
from kvrewrite.compile.mla_form import MLAWidths, compute_mla_layers, mla_reference_model, widths_for_share  # noqa: E402
from kvrewrite.compile.plan import Plan  # noqa: E402
from kvrewrite.io.calibration_data import evaluation_token_sequences  # noqa: E402
from kvrewrite.method.mla import full_latent_rank  # noqa: E402
from kvrewrite.progress import progress_bar  # noqa: E402

LONG_WINDOW, LONG_START = 4096, 2048


def _score(model, original, windows: torch.Tensor, start: int) -> dict:
    """Mean NLL and KL to the original over the targets at positions >= start of every window."""
    nll = kl = 0.0
    count = 0
    with torch.no_grad():
        for window in windows.split(1):
            log_probs = F.log_softmax(model(input_ids=window, use_cache=False).logits[0, start - 1 : -1].double(), -1)
            reference = F.log_softmax(original(input_ids=window, use_cache=False).logits[0, start - 1 : -1].double(), -1)
            targets = window[0, start:]
            nll -= float(log_probs.gather(-1, targets[:, None]).sum())
            kl += float((reference.exp() * (reference - log_probs)).sum())
            count += targets.numel()
    return {"nll": nll / count, "kl_mean": kl / count, "tokens": count}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", default="wiki,news")
    parser.add_argument("--shares", default="0.5")
    parser.add_argument("--tokens", type=int, default=8192, help="held-out tokens per text and protocol")
    parser.add_argument("--calib-tokens", type=int, default=16384)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    document = run_provenance(torch.get_num_threads(), "quality only, no timings")
    plan = Plan(model="smollm2-135m", calibration="wiki", calib_tokens=args.calib_tokens, progress=False)
    prepared = prepare_source(plan, position_free_queries="expected-rotation")  # statistics and the measured rotations
    ctx, geometry = prepared.ctx, prepared.ctx.geometry
    original = ctx.original_model().eval()
    forms = {"full latent (RoPE drop only)": MLAWidths(1, geometry.head_dim, full_latent_rank(geometry, 1), 1.0)}
    forms.update({f"{float(s):.0%} of K+V, uniform": widths_for_share(geometry, float(s)) for s in args.shares.split(",")})
    models = {}
    for form, widths in forms.items():
        for queries, response in (("source", None), ("expected-rotation", prepared.rope_response)):
            layers = compute_mla_layers(ctx, prepared.inputs, widths, rope_response=response)
            models[(form, queries, widths.kv_lora_rank, widths.qk_rope_head_dim)] = mla_reference_model(original, layers)
    texts = args.texts.split(",")
    rows = []
    with progress_bar("scoring", len(texts) * (len(models) + 1) * 2, True) as bar:
        for text in texts:
            protocols = {"512-token windows": (evaluation_token_sequences(ctx.tokenizer, args.tokens, 512, text), 1),
                         f"positions {LONG_START}-{LONG_WINDOW}": (
                             evaluation_token_sequences(ctx.tokenizer, args.tokens, LONG_WINDOW, text), LONG_START)}
            for protocol, (windows, start) in protocols.items():
                base = _score(original, original, windows, start)
                bar.advance()
                for (form, queries, rank, d_r), model in models.items():
                    scored = _score(model, original, windows, start)
                    rows.append({"text": text, "protocol": protocol, "form": form, "position_free_queries": queries,
                                 "kv_lora_rank": rank, "qk_rope_head_dim": d_r,
                                 "perplexity": math.exp(scored["nll"]), "baseline_perplexity": math.exp(base["nll"]),
                                 "ppl_increase_pct": 100 * (math.exp(scored["nll"] - base["nll"]) - 1),
                                 "kl_mean": scored["kl_mean"], "tokens": scored["tokens"]})
                    print(json.dumps(rows[-1]), flush=True)
                    bar.advance()
    document.update({"calibration_tokens": int(ctx.calibration_tokens.numel()), "tokens": args.tokens, "rows": rows})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
