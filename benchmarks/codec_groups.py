"""Issue 6 on SmolLM2-135M: int4 with larger quantization groups, and bytes/token of a long cache.

codec_table.py measured bytes after a 512-token forward, where the float16 residual window (32-63 tokens) and the
per-block scales cost a lot. A serving cache is long: this script reads the bytes off the cache tensors after one
512-, 2048- and 4096-token forward, for int4 at group sizes G = 32, 64, 128 (keys: one fp16 scale + minimum per
channel per G tokens; values: per token per G channels), on rates sliced from one checkpoint.

Quality: held-out wiki, chunked prefill in 64-token chunks against the coded cache, the original model under the
same protocol. `--seq-len` sets the evaluation window: at 512 a G = 128 codec keeps up to 32 + 127 tokens of each
window in float16, which flatters it; 2048-token windows show the long-cache quality.

`--refit-tokens N` applies the output refit (`--refit output`, kvrewrite/method/output_refit.py) to each sliced rate first,
on the first N wiki calibration tokens, as a compile with --refit output at that rate does.

Run under the heavy-job lock, one rate per call:
  flock /tmp/kvrewrite-heavy.lock python benchmarks/codec_groups.py --checkpoint DIR --rates 0.3 --seq-len 512
  python benchmarks/codec_groups.py --report
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results" / "codec_groups.json"
CHUNK = 64
FP16_BYTES = 2 * 30 * 3 * 64 * 2  # SmolLM2-135M: K and V, 30 layers, 3 KV heads, 64 dims, 2 bytes
BYTE_LENGTHS = (512, 2048, 4096)


def _record() -> dict:
    return json.loads(RESULTS.read_text()) if RESULTS.is_file() else {"runs": []}


def run(
    checkpoint: Path,
    rates: list[float],
    codecs: list[str],
    seq_len: int,
    eval_tokens: int,
    tag: str,
    refit_tokens: int = 0,
) -> None:
    from transformers import AutoTokenizer

    import kvrewrite
    from kvrewrite.adapters import adapter_for
    from kvrewrite.io.calibration_data import calibration_token_sequences, evaluation_token_sequences
    from kvrewrite.io.source_model import load_fp32_model
    from kvrewrite.io.sources import resolve_model_source
    from kvrewrite.method.output_refit import refit_output_projections
    from kvrewrite.publish.evaluation import kv_cache_bytes_per_token, perplexity_and_agreement_many

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    windows = evaluation_token_sequences(tokenizer, eval_tokens, seq_len)
    original = load_fp32_model(resolve_model_source("smollm2-135m").path)
    record = _record()
    for rate in rates:
        base = kvrewrite.load(checkpoint, rate=rate, kv_codec="none")
        if refit_tokens:  # what `--refit output` compiles at this rate, applied to the sliced model
            calib = calibration_token_sequences("wiki", tokenizer, 16384, 512, seed=0)[: -(-refit_tokens // 512)]
            refit_output_projections(base, original, adapter_for(original.config), calib)
        models = {}
        for name in codecs:
            view = copy.copy(base)  # shares every weight; only the codec differs
            view.set_kv_codec(name, {})
            models[name] = view
        t0 = time.perf_counter()
        stats = perplexity_and_agreement_many(models, windows, original, chunk=CHUNK, progress=False)
        eval_s = round(time.perf_counter() - t0, 1)
        for name, st in stats.items():
            row = {
                "checkpoint": str(checkpoint),
                "tag": tag,
                "refit_tokens": refit_tokens,
                "rate": rate,
                "codec": name,
                "seq_len": seq_len,
                "eval_tokens": int(windows.numel()),
                "perplexity": st.perplexity,
                "baseline_perplexity": st.baseline_perplexity,
                "kl_mean": st.kl_mean,
                "top1_agreement": st.top1_agreement,
                "eval_s": eval_s,
            }
            for length in BYTE_LENGTHS:
                measured = kv_cache_bytes_per_token(models[name], length)
                # The uncoded reduced cache is the model's float32; a deployment stores it in float16.
                row[f"bytes_{length}"] = measured / 2 if name == "none" else measured
            print(json.dumps(row), flush=True)
            record["runs"] = [
                r
                for r in record["runs"]
                if not all(r.get(k) == row[k] for k in ("tag", "rate", "codec", "seq_len", "eval_tokens"))
            ]
            record["runs"].append(row)
    record.update(
        command=" ".join([Path(sys.executable).name, *sys.argv]),
        machine=f"{platform.node()} {platform.machine()}; torch {torch.__version__} CPU, {torch.get_num_threads()} threads",
        chunk=CHUNK,
        fp16_kv_bytes_per_token=FP16_BYTES,
    )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(record, indent=1))


def report() -> None:
    record = _record()
    print("| tag | window | rate p | codec | ppl | Δppl | KL | bytes/token @512 | @2048 | @4096 | @4096 vs fp16 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in sorted(record["runs"], key=lambda r: (r["tag"], r["seq_len"], r["rate"], r["codec"])):
        print(
            f"| {r['tag']} | {r['seq_len']} | {r['rate']:.2f} | {r['codec']} | {r['perplexity']:.2f} | "
            f"{r['perplexity'] / r['baseline_perplexity'] - 1:+.1%} | {r['kl_mean']:.4f} | {r['bytes_512']:.0f} | "
            f"{r['bytes_2048']:.0f} | {r['bytes_4096']:.0f} | {r['bytes_4096'] / FP16_BYTES:.3f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", type=Path)
    parser.add_argument("--rates", default="0.3")
    parser.add_argument("--codecs", default="none;int4;int4:group_size=64;int4:group_size=128")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--eval-tokens", type=int, default=4096)
    parser.add_argument("--tag", default="default", help="names the checkpoint's configuration in the table")
    parser.add_argument(
        "--refit-tokens", type=int, default=0, help="apply the output refit (--refit output) at each rate"
    )
    parser.add_argument("--report", action="store_true")
    args = parser.parse_args()
    if args.report:
        report()
        return
    run(
        args.checkpoint,
        [float(r) for r in args.rates.split(",")],
        args.codecs.split(";"),
        args.seq_len,
        args.eval_tokens,
        args.tag,
        args.refit_tokens,
    )


if __name__ == "__main__":
    main()
