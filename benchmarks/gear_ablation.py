"""Issue 20: GEAR against its own 2-bit backbone on SmolLM2-135M, and the GEAR paper's ablations.

Rates are sliced from one p = 0.5 checkpoint (rate 0.0 = the full-rank rewrite, i.e. the codec alone). For every
codec spec (`--codecs`, `;`-separated, e.g. `int2:group_size=64,residual=0;gear;gear:rank=4`):

- error: relative squared reconstruction error ||decode(encode(x)) - x||^2 / ||x||^2 on the latents the model
  itself caches for the first evaluation window (whole blocks of G tokens), mean over layers, keys and values
  apart: cheap, so the whole ablation grid gets it;
- ppl (only for the specs in `--ppl`): held-out wiki perplexity by chunked prefill (64-token chunks attending to
  the coded cache), KL and top-1 agreement against the original model under the same protocol;
- spectrum (`--spectrum`, gear specs): the share of the backbone residual's energy in its top-r singular values
  per KV head and block (what an exact rank-r correction removes), against Gaussian noise of the same shapes;
- raw K/V (`--raw`): error and spectrum of the same specs on the original model's own K/V (post-RoPE keys),
  for the first evaluation window;
- value output (`--value-output`, rate 0): value errors seen through each layer's output projection, per token
  and after averaging over tokens (value_output_errors);
- bytes/token: read off the cache tensors after filling a fresh cache with 512 and with 2048 tokens of latents
  (what the cache holds depends on the shapes only, not on the values).

One job, small: `OMP_NUM_THREADS=1 python benchmarks/gear_ablation.py --checkpoint CKPT --rates 0,0.5`
Results are merged into benchmarks/results/gear_ablation.json by (tag, rate, codec).

CKPT is the default p = 0.5 checkpoint: `kvrewrite compress smollm2-135m -p 0.5 --calib-tokens 16384 -o CKPT`.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results" / "gear_ablation.json"
CHUNK = 64
SEQ_LEN = 512
FP16_BYTES = 2 * 30 * 3 * 64 * 2  # SmolLM2-135M: K and V, 30 layers, 3 KV heads, 64 dims, 2 bytes
BYTE_LENGTHS = (512, 2048)


def _commit() -> str:
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+uncommitted" if dirty else "")


def filled_cache_bytes(model, length: int) -> float:
    """Bytes per token a fresh cache of `model` holds after `length` tokens of random latents in every layer."""
    from kvrewrite.runtime.cache_bytes import cache_tensor_bytes

    cache = model.make_kv_cache()
    gen = torch.Generator().manual_seed(0)
    for i, attn in enumerate(model.compressed_attentions()):
        keys = torch.randn(1, 1, length, sum(attn.key_ranks), generator=gen)
        values = torch.randn(1, 1, length, sum(attn.value_ranks), generator=gen)
        cache.update(keys, values, i)
    return cache_tensor_bytes(cache) / length


def residual_spectrum(spec: str, latents, key_ranks, value_ranks) -> dict[str, float]:
    """What an exact rank-r correction could remove: the share of the backbone residual's energy (no outliers) in
    its top-r singular values, per KV head and block, mean over layers, heads and blocks; and the same share for
    Gaussian noise of the same shapes (a residual with no coherent part)."""
    from kvrewrite.runtime.codecs import build_layer_codecs, parse_codec
    from kvrewrite.runtime.codecs.base import as_blocks
    from kvrewrite.runtime.codecs.kivi import kivi_decode, kivi_encode

    gen = torch.Generator().manual_seed(0)
    shares: dict[str, list[float]] = {}
    for codec, layer in zip(build_layer_codecs(parse_codec(spec), key_ranks, value_ranks), latents):
        for side in ("key", "value"):
            x = as_blocks(layer[side], codec.block_tokens)
            _, _, g, c = x.shape
            residual = x - kivi_decode(
                kivi_encode(x, side, codec.bits, codec.group_size), side, codec.bits, codec.group_size, g, c
            )
            for start, end, rank in codec.head_ranks(side):
                for name, matrix in (
                    (side, residual[..., start:end]),
                    (f"{side}_noise", torch.randn(residual[..., start:end].shape, generator=gen)),
                ):
                    energy = torch.linalg.svdvals(matrix.double()).pow(2)
                    shares.setdefault(name, []).extend((energy[..., :rank].sum(-1) / energy.sum(-1)).flatten().tolist())
    return {f"top_r_share_{name}": sum(v) / len(v) for name, v in shares.items()}


def raw_kv_rows(original, windows: torch.Tensor, specs: list[str], tag: str) -> list[dict]:
    """Reconstruction error and residual spectrum of each spec on the original model's own K/V (post-RoPE keys,
    heads side by side as [tokens, heads * head_dim]): the data GEAR was designed on, against our whitened latents."""
    from transformers import DynamicCache

    from kvrewrite.compile.codec_fitting import codec_calibration_errors
    from kvrewrite.runtime.codecs import build_layer_codecs, parse_codec

    cache = DynamicCache(config=original.config)
    with torch.inference_mode():
        original(input_ids=windows[:1], past_key_values=cache, use_cache=True)
    latents = [
        {
            side: t[0].permute(1, 0, 2).reshape(t.shape[2], -1).float()
            for side, t in (("key", layer.keys), ("value", layer.values))
        }
        for layer in cache.layers
    ]
    heads = [[layer.keys.shape[-1]] * layer.keys.shape[1] for layer in cache.layers]
    rows = []
    for spec in specs:
        errors = codec_calibration_errors(build_layer_codecs(parse_codec(spec), heads, heads), latents)
        row = {
            "tag": tag,
            "latents": "original model's raw K/V",
            "codec": spec,
            **{f"rel_sq_error_{side}": sum(v) / len(v) for side, v in errors.items()},
        }
        if spec.startswith("gear"):
            row.update(residual_spectrum(spec, latents, heads, heads))
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def value_output_errors(base, latents, specs: list[str], tag: str) -> list[dict]:
    """Value errors seen through the layer's output projection (full-rank rewrite only: every KV head the same width).

    A value latent error e_t reaches the layer output as W_o e_t (each query head reading its KV head's latents).
    Per layer and spec: rel_token_error = mean_t ||W_o e_t||^2 / mean_t ||W_o x_t||^2, and rel_mean_error =
    ||W_o mean_t e_t||^2 / ||W_o mean_t x_t||^2 (uniform attention over the window's blocks: the part of the
    error that averaging over tokens does not remove); importance = max / median of the column energies of W_o
    per latent channel (how unevenly the output weighs the latent channels the codec treats alike).
    """
    from kvrewrite.runtime.codecs import build_layer_codecs, parse_codec
    from kvrewrite.runtime.codecs.base import as_blocks

    rows = []
    key_ranks, value_ranks = base._layer_ranks()
    for layer_idx, attn in enumerate(base.compressed_attentions()):
        widths = value_ranks[layer_idx]
        weight = attn.o_proj.weight.detach().float()
        if len(set(widths)) != 1 or weight.shape[1] % widths[0]:
            continue
        width, kv_heads = widths[0], len(widths)
        group = weight.shape[1] // width // kv_heads

        def to_output(e: torch.Tensor) -> torch.Tensor:  # [T, kv_heads * width] -> [T, hidden]
            return e.reshape(-1, kv_heads, width).repeat_interleave(group, 1).reshape(len(e), -1) @ weight.T

        importance = weight.pow(2).sum(0).reshape(kv_heads, group, width).sum(1).flatten()
        for spec in specs:
            codec = build_layer_codecs(parse_codec(spec), key_ranks, value_ranks)[layer_idx]
            x = as_blocks(latents[layer_idx]["value"], codec.block_tokens)
            e = (codec.decode(codec.encode(x, "value"), "value") - x).reshape(-1, x.shape[-1])
            x = x.reshape(-1, x.shape[-1])
            rows.append(
                {
                    "tag": tag,
                    "layer": layer_idx,
                    "codec": spec,
                    "rel_token_error": to_output(e).pow(2).sum(-1).mean().item()
                    / to_output(x).pow(2).sum(-1).mean().item(),
                    "rel_mean_error": to_output(e.mean(0, keepdim=True)).pow(2).sum().item()
                    / to_output(x.mean(0, keepdim=True)).pow(2).sum().item(),
                    "importance_max_over_median": (importance.max() / importance.median()).item(),
                }
            )
    return rows


def run(
    checkpoint: Path,
    rates: list[float],
    specs: list[str],
    ppl_specs: list[str],
    eval_tokens: int,
    tag: str,
    commit: str,
    spectrum: bool = False,
    raw: bool = False,
    value_output: bool = False,
) -> None:
    from transformers import AutoTokenizer

    import kvrewrite
    from kvrewrite.compile.codec_fitting import codec_calibration_errors, collect_latents
    from kvrewrite.io.calibration_data import evaluation_token_sequences
    from kvrewrite.io.source_model import load_fp32_model
    from kvrewrite.io.sources import resolve_model_source
    from kvrewrite.publish.evaluation import perplexity_and_agreement_many
    from kvrewrite.runtime.codecs import build_layer_codecs, parse_codec

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    windows = evaluation_token_sequences(tokenizer, eval_tokens, SEQ_LEN)
    original = load_fp32_model(resolve_model_source("smollm2-135m").path) if ppl_specs else None
    record = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {"runs": []}
    if raw:
        original = original or load_fp32_model(resolve_model_source("smollm2-135m").path)
        rows = raw_kv_rows(original, windows, [s for s in specs if s != "none"], tag)
        keys = {(r["tag"], r["codec"]) for r in rows}
        record["raw_kv"] = [r for r in record.get("raw_kv", []) if (r["tag"], r["codec"]) not in keys] + rows
    for rate in rates:
        base = kvrewrite.load(checkpoint, rate=rate, kv_codec="none")
        latents = collect_latents(base, windows[:1])
        ranks = base._layer_ranks()
        if value_output and rate == 0.0:
            diag = value_output_errors(base, latents, [s for s in specs if s != "none"], tag)
            keys = {(r["tag"], r["codec"]) for r in diag}
            record["value_output_space"] = [
                r for r in record.get("value_output_space", []) if (r["tag"], r["codec"]) not in keys
            ] + diag
            for spec in [s for s in specs if s != "none"]:
                mine = [r for r in diag if r["codec"] == spec]
                print(
                    spec,
                    "layer 0:",
                    {k: round(v, 3) for k, v in mine[0].items() if k.startswith("rel")},
                    "layers 1+ mean rel_token_error:",
                    round(sum(r["rel_token_error"] for r in mine[1:]) / max(len(mine) - 1, 1), 4),
                    flush=True,
                )
        rows = {}
        for spec in specs:
            row = {"tag": tag, "rate": rate, "codec": spec}
            if spec != "none":
                errors = codec_calibration_errors(build_layer_codecs(parse_codec(spec), *ranks), latents)
                row.update({f"rel_sq_error_{side}": sum(v) / len(v) for side, v in errors.items()})
                if spec.startswith("gear") and spectrum:
                    row.update(residual_spectrum(spec, latents, *ranks))
            view = copy.copy(base)  # shares every weight; only the codec differs
            view.set_kv_codec(spec, {})
            for length in BYTE_LENGTHS:
                # The uncoded reduced cache is the model's float32; a deployment stores it in float16.
                measured = filled_cache_bytes(view, length)
                row[f"bytes_{length}"] = measured / 2 if spec == "none" else measured
                row[f"bytes_{length}_vs_fp16"] = round(row[f"bytes_{length}"] / FP16_BYTES, 4)
            rows[spec] = (row, view)
            print(json.dumps(row), flush=True)
        models = {spec: rows[spec][1] for spec in ppl_specs}
        if models:
            t0 = time.perf_counter()
            stats = perplexity_and_agreement_many(models, windows, original, chunk=CHUNK, progress=False)
            eval_s = round(time.perf_counter() - t0, 1)
            for spec, st in stats.items():
                rows[spec][0].update(
                    perplexity=st.perplexity,
                    baseline_perplexity=st.baseline_perplexity,
                    ppl_change=st.perplexity / st.baseline_perplexity - 1,
                    kl_mean=st.kl_mean,
                    top1_agreement=st.top1_agreement,
                    eval_tokens=int(windows.numel()),
                    eval_s=eval_s,
                )
                print(json.dumps(rows[spec][0]), flush=True)
        for row, _ in rows.values():
            key = (row["tag"], row["rate"], row["codec"])
            record["runs"] = [r for r in record["runs"] if (r["tag"], r["rate"], r["codec"]) != key]
            record["runs"].append(row)
        record.setdefault("invocations", []).append(
            {
                "tag": tag,
                "rate": rate,
                "command": " ".join(["OMP_NUM_THREADS=1", Path(sys.executable).name, *sys.argv]),
                "commit": commit,
                "machine": f"{platform.node()} {platform.machine()}; torch {torch.__version__} CPU, {torch.get_num_threads()} threads",
                "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            }
        )
        record.update(checkpoint=str(checkpoint), chunk=CHUNK, seq_len=SEQ_LEN, fp16_kv_bytes_per_token=FP16_BYTES)
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(record, indent=1))


def report() -> None:
    record = json.loads(RESULTS.read_text())
    print("| tag | rate p | codec | rel. sq. error K / V | ppl | Δppl | KL | bytes/token @512 | @2048 vs fp16 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in record["runs"]:
        err = f"{r['rel_sq_error_key']:.4f} / {r['rel_sq_error_value']:.4f}" if "rel_sq_error_key" in r else "–"
        ppl = (
            f"{r['perplexity']:.2f} | {r['ppl_change']:+.1%} | {r['kl_mean']:.4f}" if "perplexity" in r else "– | – | –"
        )
        print(
            f"| {r['tag']} | {r['rate']:.2f} | `{r['codec']}` | {err} | {ppl} | {r['bytes_512']:.0f} | "
            f"{r['bytes_2048_vs_fp16']:.3f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", type=Path)
    parser.add_argument("--rates", default="0,0.5")
    parser.add_argument(
        "--codecs",
        default="none;int2;int2:group_size=64,residual=0;gear;gear-l",
        help="`;`-separated codec specs: reconstruction error and bytes for each",
    )
    parser.add_argument(
        "--ppl", default=None, help="`;`-separated subset of --codecs that also gets perplexity (default: all of them)"
    )
    parser.add_argument("--eval-tokens", type=int, default=2048)
    parser.add_argument("--tag", default="paper recipe")
    parser.add_argument("--commit", default=None, help="the commit measured, when not run from a git checkout")
    parser.add_argument(
        "--spectrum",
        action="store_true",
        help="also the top-r energy share of each gear spec's backbone residual, against Gaussian noise",
    )
    parser.add_argument("--raw", action="store_true", help="also error and spectrum on the original model's raw K/V")
    parser.add_argument(
        "--value-output",
        action="store_true",
        help="at rate 0: value errors seen through each layer's output projection",
    )
    parser.add_argument("--report", action="store_true")
    args = parser.parse_args()
    if args.report:
        report()
        return
    specs = args.codecs.split(";")
    ppl_specs = specs if args.ppl is None else [s for s in args.ppl.split(";") if s]
    missing = set(ppl_specs) - set(specs)
    if missing:
        parser.error(f"--ppl names specs not in --codecs: {sorted(missing)}")
    run(
        args.checkpoint,
        [float(r) for r in args.rates.split(",")],
        specs,
        ppl_specs,
        args.eval_tokens,
        args.tag,
        args.commit or _commit(),
        args.spectrum,
        args.raw,
        args.value_output,
    )


if __name__ == "__main__":
    main()
