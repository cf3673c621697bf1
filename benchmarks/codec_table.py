"""KV codecs on SmolLM2-135M: held-out ppl and stored bytes/token for fp16, each codec alone, and each codec on
the p = 0.3 and p = 0.5 rank configurations (optimal objective, latent keys, sensitivity allocation).

Run on demand under the heavy-job lock, all at once (`--step all --eval-tokens 4096`) or one step at a time:
  python benchmarks/codec_table.py --checkpoint DIR --step fit
  python benchmarks/codec_table.py --checkpoint DIR --step eval --rate 0.0   (then 0.3, 0.5)
  python benchmarks/codec_table.py --step report
DIR is a p = 0.5 sensitivity checkpoint (`kvrewrite compress smollm2-135m -p 0.5 --calib-tokens 16384`); every rate
is sliced from its rate table ("codec alone" = rate 0.0, the full-rank rewrite, which equals the original model).
Trained codecs (tada's bit search, csr's dictionaries) are fitted here with the same function the compile pass
uses (kvrewrite.compile.codec_fitting.fit_codec_tables), on the same calibration windows, for each rate.

Protocol: chunked prefill, 64-token chunks, each chunk attending to the cache (coded blocks + float16 residual
window), on 512-token held-out windows; the original model runs the same protocol with a DynamicCache.
Bytes/token: tensors left in the cache after one 512-token (and one 2048-token) forward.
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
from safetensors.torch import load_file, save_file

RESULTS = Path(__file__).parent / "results" / "codec_table.json"
RATES = (0.0, 0.3, 0.5)
TADA_BUDGET = 6.0
CODECS = ("none", "int4", "int2", "tada", "gear", "gear-l", "csr")
CHUNK = 64
FIT_WINDOWS = 8


def _record() -> dict:
    return json.loads(RESULTS.read_text()) if RESULTS.is_file() else {"rates": {}}


def _save(record: dict) -> None:
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(record, indent=1))


def _sensitivity(checkpoint: Path) -> dict | None:
    report = json.loads((checkpoint / "compress_report.json").read_text())
    weights = (report.get("sensitivity") or {}).get("weights")
    return {(int(k.split(".")[0]), k.split(".")[1]): w for k, w in weights.items()} if weights else None


def fit(checkpoint: Path, work: Path) -> None:
    from transformers import AutoTokenizer

    import kvrewrite
    from kvrewrite.compile.codec_fitting import fit_codec_tables
    from kvrewrite.errors import InvalidArgumentError
    from kvrewrite.io.calibration_data import calibration_token_sequences
    from kvrewrite.runtime.codecs import parse_codec

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    tokens = calibration_token_sequences("wiki", tokenizer, 16384, 512, seed=0)[:FIT_WINDOWS]
    record = _record()
    for rate in RATES:
        model = kvrewrite.load(checkpoint, rate=rate, kv_codec="none")
        tables, reports = {}, {}
        for name, budget in (("tada", TADA_BUDGET), ("csr", None)):
            t0 = time.perf_counter()
            try:
                t, rep = fit_codec_tables(
                    parse_codec(name), model, tokens, budget_bits=budget, sensitivity=_sensitivity(checkpoint)
                )
            except InvalidArgumentError as exc:  # budget below tada's 2-bit floor at these ranks: record it, use 2 bits
                print(rate, name, exc)
                _, rep = fit_codec_tables(parse_codec("tada:bits=2"), model, tokens)
                t = {"tada.bits": torch.full((len(model.model.layers), 2), 2, dtype=torch.int32)}
                rep["budget_error"] = str(exc)
            rep["fit_s"] = round(time.perf_counter() - t0, 1)
            tables.update(t)
            reports[name] = rep
            print(rate, name, {k: v for k, v in rep.items() if k != "calibration_relative_sq_error"})
        save_file(tables, str(work / f"tables_p{rate:.2f}.safetensors"))
        record["rates"].setdefault(f"{rate:.2f}", {})["fit"] = reports
    _save(record)


def evaluate(checkpoint: Path, work: Path, rate: float, eval_tokens: int) -> None:
    from transformers import AutoTokenizer

    import kvrewrite
    from kvrewrite.io.calibration_data import evaluation_token_sequences
    from kvrewrite.io.source_model import load_fp32_model
    from kvrewrite.io.sources import resolve_model_source
    from kvrewrite.publish.evaluation import kv_cache_bytes_per_token, perplexity_and_agreement_many

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    windows = evaluation_token_sequences(tokenizer, eval_tokens, 512)
    original = load_fp32_model(resolve_model_source("smollm2-135m").path)
    base = kvrewrite.load(checkpoint, rate=rate, kv_codec="none")
    tables = load_file(str(work / f"tables_p{rate:.2f}.safetensors"))
    models = {}
    for name in CODECS:
        view = copy.copy(base)  # shares every weight; only the codec differs
        view.set_kv_codec(name, tables)
        models[name] = view
    t0 = time.perf_counter()
    stats = perplexity_and_agreement_many(models, windows, original, chunk=CHUNK, progress=False)
    eval_s = time.perf_counter() - t0
    rows = {}
    for name, st in stats.items():
        rows[name] = {
            **st.__dict__,
            "kv_bytes_per_token_512": kv_cache_bytes_per_token(models[name], 512),
            "kv_bytes_per_token_2048": kv_cache_bytes_per_token(models[name], 2048),
        }
        print(rate, name, rows[name])
    record = _record()
    entry = record["rates"].setdefault(f"{rate:.2f}", {})
    entry.update(results=rows, eval_s=round(eval_s, 1), kept_elements_per_token=base.kv_elements_per_token())
    record.update(
        command_prefix=f"{Path(sys.executable).name} benchmarks/codec_table.py --checkpoint {checkpoint}",
        machine=f"{platform.node()} {platform.machine()}; torch {torch.__version__} CPU, {torch.get_num_threads()} threads",
        eval_tokens=int(windows.numel()),
        chunk=CHUNK,
        tada_budget_bits=TADA_BUDGET,
        fp16_kv_bytes_per_token=2 * 30 * 3 * 64 * 2,
    )
    _save(record)


def report() -> None:
    """The table of docs/codecs.md, drawn by the same renderer as `make docs-tables` (tools/docs_tables.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    from docs_tables import codecs_table

    print(codecs_table(_record()).text)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", type=Path)
    parser.add_argument("--work", type=Path, default=Path("/tmp/kvrewrite-codec-table"))
    parser.add_argument("--step", choices=("fit", "eval", "all", "report"), required=True)
    parser.add_argument("--rate", type=float)
    parser.add_argument("--eval-tokens", type=int, default=8192)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    if args.step == "fit":
        fit(args.checkpoint, args.work)
    elif args.step == "eval":
        evaluate(args.checkpoint, args.work, args.rate, args.eval_tokens)
    elif args.step == "all":  # fit, then every rate; results are saved after each step
        fit(args.checkpoint, args.work)
        for rate in RATES:
            evaluate(args.checkpoint, args.work, rate, args.eval_tokens)
    else:
        report()


if __name__ == "__main__":
    main()
