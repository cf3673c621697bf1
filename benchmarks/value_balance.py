"""Value-latent balancing (kvrewrite.runtime.codecs.value_balance) under KIVI codecs: held-out wiki ppl of a p = 0.5
SmolLM2-135M checkpoint at rates 0.0 and 0.5, unbalanced (alpha 0) against s_j = ||o_proj columns of j||^alpha.

  OMP_NUM_THREADS=1 python benchmarks/value_balance.py --checkpoint CKPT --rate 0.0 --codec int2:group_size=64,residual=128
(one rate and codec per call; results merge into benchmarks/results/value_balance.json; --rate R --codec none records
the uncoded ppl and the balanced model's exactness at R).

Protocol as benchmarks/codec_table.py: 512-token held-out windows, 64-token chunked prefill through the codec cache.
No baseline model (ppl only, no agreement), to keep a row short on a shared CPU.

CKPT is the default p = 0.5 checkpoint: `kvrewrite compress smollm2-135m -p 0.5 --calib-tokens 16384 -o CKPT`.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from decode import run_provenance  # noqa: E402  (the provenance header every benchmark result starts with)

RESULTS = Path(__file__).parent / "results" / "value_balance.json"
CHUNK = 64


def _record() -> dict:
    return json.loads(RESULTS.read_text()) if RESULTS.is_file() else {"rates": {}}


def _save(record: dict) -> None:
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(record, indent=1))


def _weight_spread(model) -> list[dict]:
    """Per layer: max / median of the value dims' o_proj weight (squared column norm), as the balance sees it."""
    from kvrewrite.runtime.codecs.value_balance import value_column_norms

    out = []
    for layer in model.model.layers:
        w = torch.cat(value_column_norms(layer.self_attn)).pow(2)
        out.append(round(float(w.max() / w.median()), 1))
    return out


def raw_reference(codec: str, windows: torch.Tensor) -> None:
    """The same codec on the original SmolLM2-135M's raw post-RoPE K/V, same windows and 64-token chunks
    (kivi_faithful's `window` protocol, whose scoring equals perplexity_and_agreement_many's)."""
    from transformers import DynamicCache

    sys.path.insert(0, str(Path(__file__).parent))
    from kivi_faithful import evaluate, ours_cache

    from kvrewrite.io.source_model import load_fp32_model
    from kvrewrite.io.sources import resolve_model_source

    original = load_fp32_model(resolve_model_source("smollm2-135m").path).eval()
    plain, _ = evaluate(original, lambda: DynamicCache(config=original.config), windows, "window", None)
    coded, _ = evaluate(original, lambda: ours_cache(codec), windows, "window", None)
    rows = {"none": round(plain["ppl"], 4), codec: round(coded["ppl"], 4)}
    print("original raw K/V", rows, flush=True)
    record = _record()
    record.setdefault("original_raw_kv", {}).update(rows)
    record["original_raw_kv_increase"] = {
        name: round(ppl / record["original_raw_kv"]["none"] - 1, 4)
        for name, ppl in record["original_raw_kv"].items()
        if name != "none"
    }
    _save(record)


def summary(record: dict) -> dict:
    """Per rate and codec: each variant's ppl increase over the uncoded model (a share), and the share of the
    unbalanced increase that the best alpha removes."""
    out = {}
    for rate, entry in record["rates"].items():
        uncoded = entry.get("ppl", {}).get("none", {}).get("alpha=0")
        if uncoded is None:
            continue
        for codec, rows in entry["ppl"].items():
            if codec == "none":
                continue
            increase = {name: round(ppl / uncoded - 1, 4) for name, ppl in rows.items()}
            best = min(increase, key=increase.get)
            out.setdefault(rate, {})[codec] = {
                "increase": increase,
                "best": best,
                "share_of_increase_removed": round(1 - increase[best] / increase["alpha=0"], 3),
                "share_removed_by": {
                    name: round(1 - inc / increase["alpha=0"], 3) for name, inc in increase.items() if name != "alpha=0"
                },
            }
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", type=Path)
    parser.add_argument("--rate", type=float)
    parser.add_argument("--codec")
    parser.add_argument("--summary", action="store_true", help="only add the summary of the recorded rows")
    parser.add_argument(
        "--raw-reference",
        action="store_true",
        help="the codec on the original model's raw K/V (benchmarks/kivi_faithful.py's cache), same windows",
    )
    parser.add_argument("--alphas", default="0.5,1.0")
    parser.add_argument("--eval-tokens", type=int, default=2048)
    args = parser.parse_args()
    if args.summary:
        record = _record()
        record["summary"] = summary(record)
        _save(record)
        print(json.dumps(record["summary"], indent=1))
        return

    from transformers import AutoTokenizer

    import kvrewrite
    from kvrewrite.io.calibration_data import evaluation_token_sequences
    from kvrewrite.publish.evaluation import perplexity_and_agreement_many
    from kvrewrite.runtime.codecs.value_balance import balance_value_latents

    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    windows = evaluation_token_sequences(tokenizer, args.eval_tokens, 512)
    if args.raw_reference:
        raw_reference(args.codec, windows)
        return
    alphas = [float(a) for a in args.alphas.split(",")]
    base = kvrewrite.load(args.checkpoint, rate=args.rate, kv_codec="none")
    models = {"alpha=0": base}
    for alpha in alphas:
        balanced = copy.deepcopy(base)
        balance_value_latents(balanced, alpha)
        models[f"alpha={alpha:g}"] = balanced
    record = _record()
    # The default 2,048-token rows sit under the rate; a longer check under "RATE/TOKENStok" beside them.
    key = f"{args.rate:.2f}" if windows.numel() == 2048 else f"{args.rate:.2f}/{int(windows.numel())}tok"
    entry = record["rates"].setdefault(key, {})
    entry["eval_tokens"] = int(windows.numel())
    if args.codec == "none":
        # Exactness: without a codec every balanced model gives the unbalanced model's logits (float32 rounding).
        with torch.no_grad():
            ref = base(windows[:1]).logits
            entry["max_abs_logit_diff_no_codec"] = {
                name: float((m(windows[:1]).logits - ref).abs().max())
                for name, m in models.items()
                if name != "alpha=0"
            }
        entry["max_abs_logit"] = float(ref.abs().max())
        entry["value_weight_max_over_median_per_layer"] = _weight_spread(base)
        models = {"alpha=0": base}  # uncoded ppl once: the balanced models are the same function
    else:
        for m in models.values():
            m.set_kv_codec(args.codec)
    t0 = time.perf_counter()
    stats = perplexity_and_agreement_many(models, windows, None, chunk=CHUNK, progress=False)
    rows = {name: round(st.perplexity, 4) for name, st in stats.items()}
    print(args.rate, args.codec, rows, flush=True)
    entry.setdefault("ppl", {}).setdefault(args.codec, {}).update(rows)  # a later alpha grid adds to the row
    seconds = entry.setdefault("eval_s", {}).get(args.codec, [])
    entry["eval_s"][args.codec] = [
        *(seconds if isinstance(seconds, list) else [seconds]),
        round(time.perf_counter() - t0, 1),
    ]
    record.update(
        command_prefix=f"OMP_NUM_THREADS=1 {Path(sys.executable).name} benchmarks/value_balance.py --checkpoint {args.checkpoint}",
        **{k: v for k, v in run_provenance(torch.get_num_threads(), "one process").items() if k != "command"},
        window=512,
        chunk=CHUNK,
        checkpoint=str(args.checkpoint),
        scales="s_j = (2-norm of value dim j's o_proj input columns, all group members)^alpha / layer geometric mean",
    )
    _save(record)


if __name__ == "__main__":
    main()
