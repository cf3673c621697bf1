"""What dropping RoPE costs the MLA form, at 512 tokens and at positions 2K-4K, with the position-free queries
unrotated (`--position-free-queries source`) or scored by each head's expected rotation
(`--position-free-queries expected-rotation`, export-mla's default since these rows were measured).

    OMP_NUM_THREADS=1 python benchmarks/mla_rope_position.py [--texts wiki] [--shares 0.5] [--response-lengths 512,2048] \
        --out benchmarks/results/mla_rope_position.json

Rows: our maths (compile/mla/form.mla_reference_model, float32) at a full latent (only the RoPE drop), and at
uniform widths for each --share, each way. Both use the same statistics (16K wiki calibration tokens) and the same
measured rotations, so the only difference is the position-free queries. The rotations are read from 4,096 wiki
calibration tokens in windows of each --response-lengths length, with the attention sink counted, or left out with
LENGTH-nosink (`512-nosink` is what `export-mla --position-free-queries expected-rotation` reads).

Protocols, by the evaluators `kvrewrite eval` uses: 512-token windows (publish/evaluation.py, 16 windows for 8,192
tokens), and positions 2048-4096 of 4,096-token windows (publish/continuation_eval.py, 2 windows), fed as one chunk:
the reference form keeps no cache, so the whole window goes through one causal forward, which makes the same
predictions as the chunked-cache protocol.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from decode import run_provenance  # noqa: E402  (the provenance header every benchmark result starts with)

# An ablation of one inner step, not an export: our maths with the position-free queries each way on the same
# statistics and rotations (a full-latent row no MLAPlan writes), so it calls the form's parts, not export_mla.
from kvrewrite.compile.mla.export import prepare_source  # noqa: E402
from kvrewrite.compile.mla.form import MLAWidths, compute_mla_layers, mla_reference_model, widths_for_share  # noqa: E402
from kvrewrite.compile.mla.rope_response import RESPONSE_TOKENS, measure_rope_response  # noqa: E402
from kvrewrite.compile.plan import Plan  # noqa: E402
from kvrewrite.io.calibration_data import calibration_token_sequences, evaluation_token_sequences  # noqa: E402
from kvrewrite.method.mla import full_latent_rank  # noqa: E402
from kvrewrite.publish.continuation_eval import PositionRange, continuation_quality  # noqa: E402
from kvrewrite.publish.evaluation import perplexity_and_agreement_many  # noqa: E402

LONG = PositionRange(2048, 4096)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", default="wiki,news")
    parser.add_argument("--shares", default="0.5")
    parser.add_argument("--tokens", type=int, default=8192, help="held-out tokens per text and protocol")
    parser.add_argument("--calib-tokens", type=int, default=16384)
    parser.add_argument(
        "--response-lengths",
        default="512",
        help="calibration window lengths the expected rotation is measured at (one row set each); "
        "LENGTH-nosink leaves each window's first token (the attention sink) out of the mass",
    )
    parser.add_argument("--no-source", action="store_true", help="skip the unrotated (source) rows")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    document = run_provenance(torch.get_num_threads(), "quality only, no timings")
    plan = Plan(model="smollm2-135m", calibration="wiki", calib_tokens=args.calib_tokens, progress=False)
    prepared = prepare_source(plan, position_free_queries="source")  # the statistics every row shares; rotations below
    ctx, geometry = prepared.ctx, prepared.ctx.geometry
    original = ctx.original_model().eval()
    # label -> (rotation or None for the unrotated source queries, its columns in every row)
    responses = (
        {}
        if args.no_source
        else {
            "source": (
                None,
                {"position_free_queries": "source", "response_length": None, "attention_sink_in_mass": None},
            )
        }
    )
    for choice in args.response_lengths.split(","):  # RESPONSE_TOKENS of wiki calibration text each
        length, sink_in = int(choice.removesuffix("-nosink")), not choice.endswith("-nosink")
        windows = calibration_token_sequences(plan.calibration, ctx.tokenizer, RESPONSE_TOKENS, length)
        responses[f"expected-rotation@{choice}"] = (
            measure_rope_response(original, windows, skip_first_key=not sink_in),
            {
                "position_free_queries": "expected-rotation",
                "response_length": length,
                "attention_sink_in_mass": sink_in,
            },
        )
    forms = {"full latent (RoPE drop only)": MLAWidths(1, geometry.head_dim, full_latent_rank(geometry, 1), 1.0)}
    forms.update(
        {f"{float(s):.0%} of K+V, uniform": widths_for_share(geometry, float(s)) for s in args.shares.split(",")}
    )
    rows = []
    for form, widths in forms.items():  # one form's models at a time: each is a whole float32 model
        models, forms_of = {}, {}
        for queries, (response, columns) in responses.items():
            name = f"{form}, {queries}"
            models[name] = mla_reference_model(
                original, compute_mla_layers(ctx, prepared.inputs, widths, rope_response=response)
            )
            forms_of[name] = {
                "form": form,
                **columns,
                "kv_lora_rank": widths.kv_lora_rank,
                "qk_rope_head_dim": widths.qk_rope_head_dim,
            }
        for text in args.texts.split(","):
            short = perplexity_and_agreement_many(
                models, evaluation_token_sequences(ctx.tokenizer, args.tokens, 512, text), baseline=original
            )
            long = continuation_quality(
                models,
                evaluation_token_sequences(ctx.tokenizer, args.tokens, LONG.end, text),
                (LONG,),
                baseline=original,
                chunk=LONG.end,
            )
            for protocol, stats in (
                ("512-token windows", short),
                (f"positions {LONG.label}", {n: r.by_range[LONG.label] for n, r in long.items()}),
            ):
                for name in models:
                    q = stats[name]
                    rows.append(
                        {
                            "text": text,
                            "protocol": protocol,
                            **forms_of[name],
                            "perplexity": q.perplexity,
                            "baseline_perplexity": q.baseline_perplexity,
                            "ppl_increase_pct": 100 * (q.perplexity / q.baseline_perplexity - 1),
                            "kl_mean": q.kl_mean,
                            "top1_agreement": q.top1_agreement,
                            "tokens": q.n_tokens,
                        }
                    )
                    print(json.dumps(rows[-1]), flush=True)
        del models
    document.update({"calibration_tokens": int(ctx.calibration_tokens.numel()), "tokens": args.tokens, "rows": rows})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
