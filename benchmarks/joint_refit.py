"""Can one o_proj refit serve several rates? The least-squares refit of `--refit output` fitted for one rate, or for
every rate from 0.3 to 0.7 at once, against no refit, all evaluated at p = 0.3 / 0.5 / 0.7 from one checkpoint.

    kvrewrite compress smollm2-135m -p 0.5 --calib-tokens 16384 -o CKPT
    OMP_NUM_THREADS=1 python benchmarks/joint_refit.py CKPT --out benchmarks/results/joint_refit.json

Issue 16 asks for the o_proj refit (single-rate today) to become either nested or rate-conditional at no run-time
cost. The cheapest nested form is one closed-form refit whose rows are every fitted rate's: the calibration windows
run once per rate in one batch, each copy truncated to its rate's ranks in every layer (the latent dims beyond a
rank zeroed: exactly the sliced model, compile/probes.py), GPTQ-style layer by layer as `refit_output_projections`
(method/output_refit.py), and each o_proj solves

    min_W  sum over fitted rates r  || z_r W^T - t ||^2 + lam ||W||^2

with t the original model's attention output (`--refit output`'s target). Columns no fitted rate reads keep their
folded values. Rows: the checkpoint as compiled (no refit), the single-rate refit at 0.5 (what `compress -p 0.5
--refit output` folds, here read at every rate of the table), and the joint refit over 0.3, 0.4, 0.5, 0.6, 0.7.
Every row scores held-out wiki and news (8,192 tokens each, 512-token windows) against the original.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import kvrewrite
from kvrewrite.adapters import adapter_for
from kvrewrite.compile.probes import truncated_model
from kvrewrite.io.calibration_data.corpus import calibration_token_sequences, evaluation_token_sequences
from kvrewrite.io.sources import resolve_model_source
from kvrewrite.method.output_refit import least_squares_output, original_attention_outputs
from kvrewrite.publish.evaluation import perplexity_and_agreement_many
from kvrewrite.spec import CompressionSpec

sys.path.insert(0, str(Path(__file__).parent))
from decode import run_provenance  # noqa: E402

EVALUATED_RATES = (0.3, 0.5, 0.7)
CONFIGS = {"no refit": (), "refit for p = 0.5 only": (0.5,), "one refit for p = 0.3 to 0.7": (0.3, 0.4, 0.5, 0.6, 0.7)}


def keep_mask(widths: list[int], keep: list[int]) -> torch.Tensor:
    """1 on each packed block's first `keep` dims."""
    return torch.cat([(torch.arange(w) < r).float() for w, r in zip(widths, keep)])


@contextlib.contextmanager
def rows_at_rates(model, adapter, ranks: dict, rates: tuple[float, ...], rows_per_rate: int):
    """Batch rows [i * rows_per_rate, (i + 1) * rows_per_rate) run at rates[i]'s ranks in every layer."""
    wrapped = []
    for idx, layer in enumerate(adapter.decoder_layers(model)):
        attention = adapter.attention(layer)
        key_mask = torch.stack([keep_mask(attention.key_ranks, ranks[r][0][idx]) for r in rates])
        value_mask = torch.stack([keep_mask(attention.value_ranks, ranks[r][1][idx]) for r in rates])
        key_mask = key_mask.repeat_interleave(rows_per_rate, 0)[:, None]
        value_mask = value_mask.repeat_interleave(rows_per_rate, 0)[:, None]

        def project(hidden, position_embeddings=None, inner=attention.project, km=key_mask, vm=value_mask):
            query, key, value = inner(hidden, position_embeddings)
            return query, key * km.to(key.dtype), value * vm.to(value.dtype)

        attention.project = project
        wrapped.append(attention)
    try:
        yield
    finally:
        for attention in wrapped:
            del attention.project


def joint_refit(model, original, adapter, ranks: dict, rates: tuple[float, ...], windows: torch.Tensor,
                ridge: float = 1e-4) -> None:
    """Refit every o_proj in place on the rows of every rate at once (module docstring)."""
    targets = original_attention_outputs(original, adapter, windows)

    def hook_for(idx: int):
        def hook(module, inputs):
            z = inputs[0].reshape(-1, inputs[0].shape[-1]).double()
            t = targets[idx].reshape(-1, targets[idx].shape[-1]).double().repeat(len(rates), 1)
            targets[idx] = None
            read = z.abs().amax(0) > 0  # columns some fitted rate reads; the others keep their folded values
            weight = module.weight.detach().double().clone()
            weight[:, read] = least_squares_output(z[:, read], t, ridge)
            module.weight.copy_(weight.to(module.weight.dtype))
        return hook

    handles = [adapter.output_projection(adapter.attention(layer)).register_forward_pre_hook(hook_for(i))
               for i, layer in enumerate(adapter.decoder_layers(model))]
    try:
        with torch.no_grad(), rows_at_rates(model, adapter, ranks, rates, windows.shape[0]):
            model.get_decoder()(input_ids=windows.repeat(len(rates), 1), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path, help="a per-head checkpoint whose table holds rate 0.0 (full rank)")
    parser.add_argument("--refit-tokens", type=int, default=16384)
    parser.add_argument("--eval-tokens", type=int, default=8192)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    record = {**run_provenance(torch.get_num_threads(), "quality only, no timings"), "checkpoint": args.checkpoint.name,
              "refit_tokens": args.refit_tokens, "eval_tokens": args.eval_tokens, "rows": []}
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    source = json.loads((args.checkpoint / "config.json").read_text())["kvrewrite"]
    spec = CompressionSpec.from_dict(source)
    original = AutoModelForCausalLM.from_pretrained(resolve_model_source(spec.source_model).path, dtype=torch.float32).eval()
    adapter = adapter_for(original.config)
    ranks = {r: spec.ranks_for_rate(r) for r in {*EVALUATED_RATES, *(r for rates in CONFIGS.values() for r in rates)}}
    texts = {text: evaluation_token_sequences(tokenizer, args.eval_tokens, 512, text=text) for text in ("wiki", "news")}
    windows = calibration_token_sequences("wiki", tokenizer, args.refit_tokens, 512)
    for config, rates in CONFIGS.items():
        model = kvrewrite.load(args.checkpoint, rate=0.0).eval()  # full rank; every rate is a truncation of it
        started = time.perf_counter()
        if rates:
            joint_refit(model, original, adapter, ranks, rates, windows)
        fit_s = round(time.perf_counter() - started, 1)
        for text, held_out in texts.items():
            for rate in EVALUATED_RATES:
                with truncated_model(model, adapter, *ranks[rate]):
                    res = perplexity_and_agreement_many({"m": model}, held_out, baseline=original, progress=False)["m"]
                row = {"config": config, "fitted_rates": list(rates), "text": text, "rate": rate,
                       "perplexity": res.perplexity, "baseline_perplexity": res.baseline_perplexity,
                       "ppl_increase_pct": 100 * (res.perplexity / res.baseline_perplexity - 1),
                       "kl_mean": res.kl_mean, "top1_agreement": res.top1_agreement, "refit_s": fit_s}
                record["rows"].append(row)
                print(json.dumps(row), flush=True)
                args.out.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        del model
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
