"""CSR as the paper describes it (NeuralDict dictionaries, keys s = 8, values s = 4 on two halves, online atoms)
on SmolLM2-135M: reconstruction error on held-out latents, perplexity, bytes per token, and the paper's
ablations (sparsity, dictionary size, online part, NeuralDict vs its k-means start) where our model allows.

Steps (results accumulate in benchmarks/results/csr_faithful.json; each step is a separate small run):
  python benchmarks/csr_faithful.py --checkpoint CKPT --step fit --rate 0.0     (then 0.5)
  python benchmarks/csr_faithful.py --checkpoint CKPT --step eval --rate 0.0    (then 0.5)
  python benchmarks/csr_faithful.py --checkpoint CKPT --step ablation --rate 0.5
  python benchmarks/csr_faithful.py --checkpoint CKPT --step old --rate 0.0     (the csr before this
      change, its fitting function loaded from git at OLD_COMMIT, on the same latents)
  python benchmarks/csr_faithful.py --checkpoint CKPT --step diagnose --rate 0.0 (after fit: how white
      the latents are, a random dictionary's error, first-token errors)
  python benchmarks/csr_faithful.py --checkpoint CKPT --step variants --rate 0.0  (after fit: int4 and
      CSR with more online atoms per block, same protocol as eval)
Fitting uses the compile pass's function on the codec_table.py calibration windows (8 x 512 wiki tokens);
held-out latents and perplexity use the held-out evaluation windows (2,048 tokens by default), with the
codec_table.py protocol (512-token windows, 64-token chunks, each chunk attending to the coded cache).

CKPT is the default p = 0.5 checkpoint: `kvrewrite compress smollm2-135m -p 0.5 --calib-tokens 16384 -o CKPT`.
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).parent))
from decode import run_provenance  # noqa: E402  (the provenance header every benchmark result starts with)

RESULTS = Path(__file__).parent / "results" / "csr_faithful.json"
FIT_WINDOWS = 8
CHUNK = 64
OLD_COMMIT = "4c4d9ab"  # the last commit with the k-means + least-squares csr (uint8 indices, one sparsity)
ABLATION_LAYERS = (1, 5, 10, 15, 20, 25, 29)
ABLATIONS = {  # name -> codec spec (each fitted on the ablation layers only)
    "paper default (keys s=8, values s=4 x 2 halves, 256 atoms, online 1/block)": "csr",
    "no online part": "csr:online_per_block=0",
    "k-means start only (epochs=0)": "csr:epochs=0,online_per_block=0",
    "values s=8 on whole vectors (s_n=1)": "csr:value_sparsity=8,value_chunks=1,online_per_block=0",
    "values s=4 x 4 quarters": "csr:value_chunks=4,online_per_block=0",
    "s=4 (keys), s=2 x 2 (values)": "csr:key_sparsity=4,value_sparsity=2,online_per_block=0",
    "s=16 (keys), s=8 x 2 (values)": "csr:key_sparsity=16,value_sparsity=8,online_per_block=0",
    "128 atoms": "csr:atoms=128,online_per_block=0",
    "1024 atoms": "csr:atoms=1024,online_per_block=0",
}


def _record() -> dict:
    return json.loads(RESULTS.read_text()) if RESULTS.is_file() else {"rates": {}}


def _save(record: dict, step: str) -> None:
    record.setdefault("runs", []).append({"step": step, **run_provenance(torch.get_num_threads(), "one process")})
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(record, indent=1))


def _windows(checkpoint: Path, eval_tokens: int):
    from transformers import AutoTokenizer

    from kvrewrite.io.calibration_data import calibration_token_sequences, evaluation_token_sequences

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    fit_tokens = calibration_token_sequences("wiki", tokenizer, 16384, 512, seed=0)[:FIT_WINDOWS]
    return fit_tokens, evaluation_token_sequences(tokenizer, eval_tokens, 512)


def _latents(checkpoint: Path, rate: float, eval_tokens: int):
    import kvrewrite
    from kvrewrite.compile.codec_fitting import collect_latents

    model = kvrewrite.load(checkpoint, rate=rate, kv_codec="none")
    fit_tokens, held_tokens = _windows(checkpoint, eval_tokens)
    return model, collect_latents(model, fit_tokens), collect_latents(model, held_tokens)


WINDOW = 512  # held-out latents are 512-token windows, one after the other


def _held_out_error(codecs, held, layers=None) -> dict:
    """Relative squared error of decode(encode(x)) on held-out latents: per layer, and pooled per side; also
    pooled over the first token of each window only (the attention sink, whose value most queries read)."""
    from kvrewrite.runtime.codecs.base import as_blocks

    out = {}
    for side in ("key", "value"):
        per_layer, num, den, first_num, first_den = [], 0.0, 0.0, 0.0, 0.0
        for i, codec in enumerate(codecs):
            if layers is not None and i not in layers:
                continue
            x = held[i][side]
            if not codec.channels[side]:
                per_layer.append(0.0)
                continue
            blocks = as_blocks(x, codec.block_tokens)
            sq = (codec.decode(codec.encode(blocks, side), side) - blocks).pow(2).reshape(-1, x.shape[1]).sum(-1)
            energy = blocks.pow(2).reshape(-1, x.shape[1]).sum(-1)
            per_layer.append(round(sq.sum().item() / max(energy.sum().item(), 1e-30), 5))
            num, den = num + sq.sum().item(), den + energy.sum().item()
            first_num, first_den = first_num + sq[::WINDOW].sum().item(), first_den + energy[::WINDOW].sum().item()
        out[side] = {
            "pooled": round(num / max(den, 1e-30), 5),
            "per_layer": per_layer,
            "mean_of_layers": round(sum(per_layer) / max(len(per_layer), 1), 5),
            "first_token_of_window_pooled": round(first_num / max(first_den, 1e-30), 5),
        }
    return out


def diagnose(checkpoint: Path, work: Path, rate: float, eval_tokens: int, spec: str) -> dict:
    """Why sparse coding is hard on these latents: how isotropic they are (participation ratio of each head's
    covariance spectrum, (sum l)^2 / sum l^2, which is the width for white latents and 1 for a single direction), what
    a random unit dictionary of the same size achieves, and the first-token errors of the fitted codec."""
    import kvrewrite
    from kvrewrite.compile.codec_fitting import collect_latents
    from kvrewrite.runtime.codecs import build_layer_codecs, parse_codec

    model = kvrewrite.load(checkpoint, rate=rate, kv_codec="none")
    held = collect_latents(model, _windows(checkpoint, eval_tokens)[1])
    key_ranks, value_ranks = model._layer_ranks()
    config = parse_codec(spec)
    tables = load_file(str(work / f"csr_tables_p{rate:.2f}.safetensors"))
    generator = torch.Generator().manual_seed(0)
    random_tables = {}
    for name, atoms in tables.items():
        t = torch.randn(atoms.shape, generator=generator)
        random_tables[name] = t / t.norm(dim=1, keepdim=True)
    no_online = parse_codec(spec + (",", ":")[":" not in spec] + "online_per_block=0")
    ratio = {}
    for side, ranks in (("key", key_ranks), ("value", value_ranks)):
        values = []
        for i, layer in enumerate(held):
            start = 0
            for r in ranks[i]:
                if r > 1:
                    x = layer[side][:, start : start + r]
                    spectrum = torch.linalg.eigvalsh(x.T @ x / x.shape[0]).clamp_min(0)
                    values.append((float(spectrum.sum() ** 2 / spectrum.pow(2).sum()), r))
                start += r
        ratio[side] = {
            "mean_participation_ratio": round(sum(v for v, _ in values) / len(values), 2),
            "mean_width": round(sum(r for _, r in values) / len(values), 2),
        }
    return {
        "participation_ratio": ratio,
        "random_dictionary_no_online": _held_out_error(
            build_layer_codecs(no_online, key_ranks, value_ranks, random_tables), held
        ),
        "csr": _held_out_error(build_layer_codecs(config, key_ranks, value_ranks, tables), held),
        "csr, no online part": _held_out_error(build_layer_codecs(no_online, key_ranks, value_ranks, tables), held),
    }


def fit(checkpoint: Path, work: Path, rate: float, eval_tokens: int, spec: str) -> dict:
    from kvrewrite.compile.codec_fitting import fit_codec_tables_on_latents
    from kvrewrite.runtime.codecs import build_layer_codecs, parse_codec

    model, fit_lat, held = _latents(checkpoint, rate, eval_tokens)
    key_ranks, value_ranks = model._layer_ranks()
    config = parse_codec(spec)
    t0 = time.perf_counter()
    tables, report = fit_codec_tables_on_latents(config, fit_lat, key_ranks, value_ranks)
    fit_s = time.perf_counter() - t0
    save_file(tables, str(work / f"csr_tables_p{rate:.2f}.safetensors"))
    entry = {
        "spec": config.describe(),
        "fit_s": round(fit_s, 1),
        "fit_tokens": report["fit_tokens"],
        "coded_bytes_per_token": report["coded_bytes_per_token"],
        "calibration_relative_sq_error": report["calibration_relative_sq_error"],
        "neuraldict_relative_mse_first_last": report["neuraldict_relative_mse_first_last"],
    }
    for name, variant in (
        ("csr", config),
        ("csr, no online part", parse_codec(spec + (",", ":")[":" not in spec] + "online_per_block=0")),
    ):
        entry.setdefault("held_out_relative_sq_error", {})[name] = _held_out_error(
            build_layer_codecs(variant, key_ranks, value_ranks, tables), held
        )
    return entry


def evaluate(checkpoint: Path, work: Path, rate: float, eval_tokens: int, spec: str) -> dict:
    import kvrewrite
    from kvrewrite.io.source_model import load_fp32_model
    from kvrewrite.io.sources import resolve_model_source
    from kvrewrite.runtime.codecs import parse_codec

    _, windows = _windows(checkpoint, eval_tokens)
    original = load_fp32_model(resolve_model_source("smollm2-135m").path)
    base = kvrewrite.load(checkpoint, rate=rate, kv_codec="none")
    tables = load_file(str(work / f"csr_tables_p{rate:.2f}.safetensors"))
    no_online = spec + (",", ":")[":" not in spec] + "online_per_block=0"
    variants = [("none", None, {}), ("csr", spec, tables), ("csr, no online part", no_online, tables)]
    old_tables = work / f"csr_before_tables_p{rate:.2f}.safetensors"
    if old_tables.is_file():  # the old step ran: the csr before this change, same protocol
        _old_codec_class()
        variants.append((f"csr before this change ({OLD_COMMIT})", OLD_NAME, load_file(str(old_tables))))
    models = {}
    for name, codec, codec_tables in variants:
        view = copy.copy(base)  # shares every weight; only the codec differs
        view.set_kv_codec(parse_codec(codec) if codec else None, codec_tables)
        models[name] = view
    return {**_scored(models, windows, original), "fp16_kv_bytes_per_token": 2 * 30 * 3 * 64 * 2}


def _scored(models: dict, windows, original) -> dict:
    """Perplexity, agreement and bytes/token (at 512 and 2,048 tokens) of each model, eval protocol (chunked)."""
    from kvrewrite.publish.evaluation import kv_cache_bytes_per_token, perplexity_and_agreement_many

    t0 = time.perf_counter()
    stats = perplexity_and_agreement_many(models, windows, original, chunk=CHUNK, progress=False)
    rows = {
        name: {
            **st.__dict__,
            "kv_bytes_per_token_512": kv_cache_bytes_per_token(models[name], 512),
            "kv_bytes_per_token_2048": kv_cache_bytes_per_token(models[name], 2048),
        }
        for name, st in stats.items()
    }
    return {
        "results": rows,
        "eval_s": round(time.perf_counter() - t0, 1),
        "eval_tokens": int(windows.numel()),
        "chunk": CHUNK,
    }


VARIANTS = ("int4", "csr:online_per_block=2", "csr:online_per_block=4")  # the variants step's default


def variants(checkpoint: Path, work: Path, rate: float, eval_tokens: int, specs: list[str]) -> dict:
    """Perplexity and bytes of more codecs under the eval step's protocol: references (int4) and run-time-only
    CSR settings (online atoms per block) that reuse the fitted CSR dictionaries."""
    import kvrewrite
    from kvrewrite.io.source_model import load_fp32_model
    from kvrewrite.io.sources import resolve_model_source
    from kvrewrite.runtime.codecs import parse_codec

    _, windows = _windows(checkpoint, eval_tokens)
    original = load_fp32_model(resolve_model_source("smollm2-135m").path)
    base = kvrewrite.load(checkpoint, rate=rate, kv_codec="none")
    tables = load_file(str(work / f"csr_tables_p{rate:.2f}.safetensors"))
    models = {}
    for spec in specs:
        view = copy.copy(base)
        view.set_kv_codec(parse_codec(spec), tables if spec.startswith("csr") else {})
        models[spec] = view
    return _scored(models, windows, original)


def ablation(checkpoint: Path, rate: float, eval_tokens: int) -> dict:
    from kvrewrite.compile.codec_fitting import fit_codec_tables_on_latents
    from kvrewrite.runtime.codecs import build_layer_codecs, parse_codec

    model, fit_lat, held = _latents(checkpoint, rate, eval_tokens)
    key_ranks, value_ranks = model._layer_ranks()
    keep = set(ABLATION_LAYERS)
    # Layers outside the ablation set get rank 0 (nothing fitted, nothing coded), so each variant costs 7 layers.
    ks = [r if i in keep else [0] * len(r) for i, r in enumerate(key_ranks)]
    vs = [r if i in keep else [0] * len(r) for i, r in enumerate(value_ranks)]
    rows = {}
    for name, spec in ABLATIONS.items():
        config = parse_codec(spec)
        t0 = time.perf_counter()
        tables, report = fit_codec_tables_on_latents(config, fit_lat, ks, vs)
        codecs = build_layer_codecs(config, ks, vs, tables)
        err = _held_out_error(codecs, held, keep)
        rows[name] = {
            "spec": config.describe(),
            "fit_s": round(time.perf_counter() - t0, 1),
            "coded_bytes_per_token_these_layers": report["coded_bytes_per_token"],
            "held_out": {side: err[side]["pooled"] for side in err},
            "held_out_per_layer": {side: err[side]["per_layer"] for side in err},
        }
        print(name, rows[name]["held_out"], rows[name]["fit_s"], flush=True)
    return {"layers": list(ABLATION_LAYERS), "variants": rows}


OLD_NAME = "csr-before"  # the old class is registered under this name while a step uses it


def _old_codec_class():
    """The csr class at OLD_COMMIT (module text from git), renamed OLD_NAME and registered."""
    from kvrewrite.runtime.codecs import register_codec

    source = subprocess.run(
        ["git", "show", f"{OLD_COMMIT}:kvrewrite/runtime/codecs/csr.py"],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).parent,
    ).stdout
    namespace: dict = {}
    exec(compile(source.replace("@register_codec\n", ""), f"csr@{OLD_COMMIT}", "exec"), namespace)
    old = namespace["CsrCodec"]
    old.name = OLD_NAME
    return register_codec(old)


def old_codec_error(checkpoint: Path, work: Path, rate: float, eval_tokens: int) -> dict:
    """The csr before this change (k-means + matching pursuit / least-squares refits, sparsity 8 on keys and
    values, uint8 indices), its module text taken from git, fitted and measured on the same latents; its
    dictionaries are saved for the eval step."""
    old = _old_codec_class()
    model, fit_lat, held = _latents(checkpoint, rate, eval_tokens)
    key_ranks, value_ranks = model._layer_ranks()
    from kvrewrite.runtime.codecs.config import CodecConfig

    config = CodecConfig(OLD_NAME, dict(old.defaults))
    t0 = time.perf_counter()
    tables, _ = old.fit_tables(config, fit_lat, key_ranks, value_ranks)
    save_file(tables, str(work / f"csr_before_tables_p{rate:.2f}.safetensors"))
    codecs = [old.for_layer(config, i, k, v, tables) for i, (k, v) in enumerate(zip(key_ranks, value_ranks))]
    train = _held_out_error(codecs, fit_lat)
    return {
        "commit": OLD_COMMIT,
        "params": config.params,
        "fit_s": round(time.perf_counter() - t0, 1),
        "held_out_relative_sq_error": _held_out_error(codecs, held),
        "calibration_relative_sq_error_pooled": {side: train[side]["pooled"] for side in train},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/kvrewrite-csr-faithful"))
    parser.add_argument("--step", choices=("fit", "eval", "ablation", "old", "diagnose", "variants"), required=True)
    parser.add_argument("--variants", default=";".join(VARIANTS), help="variants step: codec specs, ';'-separated")
    parser.add_argument("--rate", type=float, required=True)
    parser.add_argument("--eval-tokens", type=int, default=2048)
    parser.add_argument("--codec", default="csr", help="codec spec to fit / evaluate (default: the paper's CSR-8)")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    if args.step == "fit":
        out = fit(args.checkpoint, args.work, args.rate, args.eval_tokens, args.codec)
    elif args.step == "eval":
        out = evaluate(args.checkpoint, args.work, args.rate, args.eval_tokens, args.codec)
    elif args.step == "ablation":
        out = ablation(args.checkpoint, args.rate, args.eval_tokens)
    elif args.step == "variants":
        out = variants(args.checkpoint, args.work, args.rate, args.eval_tokens, args.variants.split(";"))
    elif args.step == "diagnose":
        out = diagnose(args.checkpoint, args.work, args.rate, args.eval_tokens, args.codec)
    else:
        out = old_codec_error(args.checkpoint, args.work, args.rate, args.eval_tokens)
    print(json.dumps({k: v for k, v in out.items() if "per_layer" not in str(k)}, indent=1)[:4000])
    record = _record()
    record.update(checkpoint=str(args.checkpoint), model="SmolLM2-135M (p = 0.5 sensitivity checkpoint)")
    record["rates"].setdefault(f"{args.rate:.2f}", {})[args.step] = out
    _save(record, args.step)


if __name__ == "__main__":
    main()
