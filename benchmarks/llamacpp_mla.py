"""llama.cpp runs kvrewrite's MLA export: SmolLM2-135M at 50% of its K+V values, converted with llama.cpp's own
convert_hf_to_gguf.py and measured against the original converted the same way, in the same run.

    make bench-llamacpp-env                                  # .venv-llamacpp: llama-cpp-python built from its sdist
    OMP_NUM_THREADS=1 .venv/bin/kvrewrite export-mla smollm2-135m --kv-share 0.5 --dtype float32 --calib-tokens 16384 --verify-tokens 128 --refit none -o /tmp/smollm2-mla-50
    OMP_NUM_THREADS=1 .venv-llamacpp/bin/python benchmarks/llamacpp_mla.py --export /tmp/smollm2-mla-50

What it does (writes benchmarks/results/llamacpp_mla.json):
- converts the original SmolLM2 and the export with the vendored convert_hf_to_gguf.py, float32; the export also in
  bfloat16 and float16 (the float16 GGUF shows what the neutralised kv_a_layernorm needs, docs/serving.md);
- perplexity on the same held-out wiki windows (512 tokens, every window evaluated from an empty cache), token ids
  fed through llama-cpp-python's API with logits for every position: the MLA GGUF against our runtime
  (kvrewrite.load on the export, absorbed attention), the original GGUF against the original in transformers;
- the KV cache size as llama.cpp states it (its `llama_kv_cache: size = ...` log line, parsed);
- decode tokens/s with the cache holding about 512, 4K and 8K tokens: one 8K-token held-out sequence per model is
  prefilled up to each length and `--steps` single-token decode calls are timed there, the two models' calls
  alternating so that load from other processes falls on both; tokens/s = 1 / median step time.

Why the export's config is staged for conversion: llama.cpp's deepseek2 loader (src/models/deepseek2.cpp) reads the
`q_lora_rank` key as required unless the model has 26 or 27 layers (its guess for "lite" models without a query
LoRA), and convert_hf_to_gguf.py writes that key only when config.json's q_lora_rank is not null. transformers and
vLLM need `q_lora_rank: null` for a plain q_proj, so the export keeps null and this benchmark converts from a staging
directory (links to the same files) whose config says `q_lora_rank: 0`, which llama.cpp reads as "no query LoRA".
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "llamacpp_mla.json"
VENV = ROOT / ".venv-llamacpp"
SEQ_LEN = 512
CONTEXTS = (512, 4096, 8192)
KV_LINE = re.compile(
    r"llama_kv_cache: size = +([\d.]+) MiB \( *(\d+) cells, +(\d+) layers.*?K \((\w+)\): +([\d.]+) MiB, V \((\w+)\): +([\d.]+) MiB"
)


def vendored_llama_cpp() -> tuple[Path, str, str]:
    """(vendored llama.cpp directory, llama-cpp-python version, llama.cpp commit from the sdist's changelog)."""
    import llama_cpp

    sources = sorted((VENV / "src").glob(f"llama_cpp_python-{llama_cpp.__version__}"))
    if not sources:
        sys.exit(
            f"no unpacked llama-cpp-python {llama_cpp.__version__} sdist under {VENV / 'src'}: run make bench-llamacpp-env"
        )
    changelog = (sources[0] / "CHANGELOG.md").read_text()
    section = changelog.split(f"## [{llama_cpp.__version__}]", 1)[1].split("\n## [", 1)[0]
    commit = re.search(r"ggml-org/llama\.cpp@([0-9a-f]+)", section)
    return sources[0] / "vendor" / "llama.cpp", llama_cpp.__version__, commit.group(1) if commit else "unknown"


def staged_for_conversion(export: Path, stage: Path) -> Path:
    """A directory with the export's files linked and config.json's q_lora_rank null -> 0 (see the module doc)."""
    config = json.loads((export / "config.json").read_text())
    if config.get("q_lora_rank") is not None:
        return export
    stage.mkdir(parents=True, exist_ok=True)
    for item in export.iterdir():
        target = stage / item.name
        if item.name != "config.json" and not target.exists():
            target.symlink_to(item.resolve())
    (stage / "config.json").write_text(json.dumps({**config, "q_lora_rank": 0}, indent=2) + "\n")
    return stage


def convert(converter: Path, source: Path, out: Path, outtype: str) -> float:
    if out.exists():
        return 0.0
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, str(converter), str(source), "--outtype", outtype, "--outfile", str(out)],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    return round(time.perf_counter() - started, 1)


def target_nll(logits: torch.Tensor, window: torch.Tensor) -> tuple[float, int]:
    """Summed next-token NLL over a window's positions 1..T-1 (logits [T, V] float32) and the count."""
    logp = torch.log_softmax(logits[:-1].double(), dim=-1)
    return float(-logp.gather(1, window[1:, None]).sum()), int(window.numel() - 1)


def llama(path: Path, n_ctx: int, threads: int, threads_batch: int, logits_all: bool, flash_attn: bool):
    """A llama-cpp-python context; returns (Llama, its log text) with the log captured (verbose)."""
    from llama_cpp import Llama

    log = io.StringIO()
    with contextlib.redirect_stderr(log):
        model = Llama(
            str(path),
            n_ctx=n_ctx,
            n_batch=SEQ_LEN,
            n_ubatch=SEQ_LEN,
            n_threads=threads,
            n_threads_batch=threads_batch,
            logits_all=logits_all,
            flash_attn=flash_attn,
            verbose=True,
            seed=0,
        )
    return model, log.getvalue()


def kv_cache_statement(log: str) -> dict:
    match = KV_LINE.search(log)
    if not match:
        raise RuntimeError("llama.cpp printed no 'llama_kv_cache: size = ...' line")
    total, cells, layers, k_type, k_mib, v_type, v_mib = match.groups()
    return {
        "line": match.group(0),
        "total_mib": float(total),
        "cells": int(cells),
        "layers": int(layers),
        "k_type": k_type,
        "k_mib": float(k_mib),
        "v_type": v_type,
        "v_mib": float(v_mib),
        "bytes_per_token": float(total) * 2**20 / int(cells),
    }


def llama_window_nll(model, windows: torch.Tensor) -> tuple[float, int, list[np.ndarray]]:
    total, count, first = 0.0, 0, []
    for window in windows:
        model.reset()
        model.eval(window.tolist())
        logits = torch.from_numpy(np.array(model.scores[: window.numel()], dtype=np.float32))
        nll, n = target_nll(logits, window)
        total, count = total + nll, count + n
        if not first:
            first.append(logits)
    return total, count, first


def torch_window_nll(model, windows: torch.Tensor) -> tuple[float, int, list[torch.Tensor]]:
    total, count, first = 0.0, 0, []
    with torch.no_grad():
        for window in windows:
            logits = model(window[None]).logits[0].float()
            nll, n = target_nll(logits, window)
            total, count = total + nll, count + n
            if not first:
                first.append(logits)
    return total, count, first


def decode_speed(models: dict, stream: list[int], steps: dict[int, int]) -> dict:
    """Prefill each model up to every context length, then time single-token decode calls, alternating models."""
    results = {name: {} for name in models}
    filled = {name: 0 for name in models}
    for context in CONTEXTS:
        n = steps[context]
        start = context - n
        for name, model in models.items():
            t0 = time.perf_counter()
            model.eval(stream[filled[name] : start])
            results[name][str(context)] = {
                "prefill_tokens": start - filled[name],
                "prefill_s": round(time.perf_counter() - t0, 2),
            }
            filled[name] = start
        times = {name: [] for name in models}
        for i in range(n):
            for name, model in models.items():
                t0 = time.perf_counter()
                model.eval([stream[start + i]])
                times[name].append(time.perf_counter() - t0)
        for name in models:
            filled[name] = context
            median = statistics.median(times[name])
            results[name][str(context)].update(
                {
                    "decode_steps": n,
                    "cache_tokens_at_end": context,
                    "median_step_ms": round(1000 * median, 3),
                    "tokens_per_s": round(1 / median, 3),
                    "step_ms": [round(1000 * t, 3) for t in times[name]],
                }
            )
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--export", type=Path, required=True, help="kvrewrite export-mla output (float32)")
    parser.add_argument("--source", default="smollm2-135m", help="the export's source model")
    parser.add_argument("--work", type=Path, default=Path("/tmp/kvrewrite-llamacpp"), help="GGUF files go here")
    parser.add_argument("--eval-tokens", type=int, default=8192)
    parser.add_argument("--dtype-check-windows", type=int, default=2, help="windows for the bf16/f16 GGUF rows")
    parser.add_argument("--threads", type=int, default=1, help="llama.cpp threads for decode")
    parser.add_argument("--threads-batch", type=int, default=1, help="llama.cpp threads for prefill / perplexity")
    parser.add_argument("--steps", default="512:32,4096:24,8192:16", help="decode steps timed per context")
    parser.add_argument("--no-flash-attn", action="store_true", help="llama.cpp's non-flash attention path")
    args = parser.parse_args()
    started = time.perf_counter()
    torch.set_num_threads(1)
    flash_attn = not args.no_flash_attn
    steps = {int(c): int(n) for c, n in (item.split(":") for item in args.steps.split(","))}

    import llama_cpp
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import kvrewrite
    from kvrewrite.io.calibration_data import evaluation_token_sequences
    from kvrewrite.io.sources import resolve_model_source

    llama_dir, version, llama_commit = vendored_llama_cpp()
    converter = llama_dir / "convert_hf_to_gguf.py"
    source = resolve_model_source(args.source).path
    export = args.export.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    staged = staged_for_conversion(export, args.work / "export-staged")
    ggufs = {
        "original-f32": (source, "f32"),
        "mla-f32": (staged, "f32"),
        "mla-bf16": (staged, "bf16"),
        "mla-f16": (staged, "f16"),
    }
    paths, convert_s = {}, {}
    for name, (directory, outtype) in ggufs.items():
        paths[name] = args.work / f"{name}.gguf"
        convert_s[name] = convert(converter, directory, paths[name], outtype)
        print(f"converted {name}: {paths[name]} ({convert_s[name]} s)", flush=True)

    tokenizer = AutoTokenizer.from_pretrained(source)
    windows = evaluation_token_sequences(tokenizer, args.eval_tokens, SEQ_LEN)
    export_config = json.loads((export / "config.json").read_text())

    # ---- perplexity ------------------------------------------------------------------------------------------
    nll = {}
    original_hf = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    nll["original, transformers"] = torch_window_nll(original_hf, windows)
    del original_hf
    ours = kvrewrite.load(export, dtype=torch.float32).eval()
    nll["MLA export, kvrewrite runtime"] = torch_window_nll(ours, windows)
    nll["MLA export, kvrewrite runtime (dtype-check windows)"] = torch_window_nll(
        ours, windows[: args.dtype_check_windows]
    )
    del ours
    logs = {}
    for name, rows in (
        ("original-f32", windows),
        ("mla-f32", windows),
        ("mla-bf16", windows[: args.dtype_check_windows]),
        ("mla-f16", windows[: args.dtype_check_windows]),
    ):
        model, logs[f"ppl {name}"] = llama(
            paths[name], SEQ_LEN, args.threads_batch, args.threads_batch, True, flash_attn
        )
        nll[f"llama.cpp {name}"] = llama_window_nll(model, rows)
        del model
        print(f"perplexity {name} done", flush=True)

    def ppl(key: str) -> float:
        total, count, _ = nll[key]
        return math.exp(total / count)

    def first_window_diff(a: str, b: str) -> dict:
        la, lb = nll[a][2][0], nll[b][2][0]
        return {
            "max_abs_logit_diff": float((la - lb).abs().max()),
            "top1_agreement": float((la.argmax(-1) == lb.argmax(-1)).double().mean()),
        }

    rows = []
    for name, reference, key in (
        ("original SmolLM2, llama.cpp f32 GGUF", "original, transformers", "llama.cpp original-f32"),
        ("MLA export 50%, llama.cpp f32 GGUF", "MLA export, kvrewrite runtime", "llama.cpp mla-f32"),
        (
            "MLA export 50%, llama.cpp bf16 GGUF",
            "MLA export, kvrewrite runtime (dtype-check windows)",
            "llama.cpp mla-bf16",
        ),
        (
            "MLA export 50%, llama.cpp f16 GGUF",
            "MLA export, kvrewrite runtime (dtype-check windows)",
            "llama.cpp mla-f16",
        ),
    ):
        value, ref = ppl(key), ppl(reference)
        rows.append(
            {
                "name": name,
                "windows": nll[key][1] // (SEQ_LEN - 1),
                "perplexity": value,
                "reference": reference,
                "reference_perplexity": ref,
                "delta_vs_reference_pct": 100 * (value / ref - 1),
                "first_window_vs_reference": first_window_diff(key, reference),
            }
        )
        print(json.dumps(rows[-1]), flush=True)

    # ---- KV cache size and decode speed -------------------------------------------------------------------------
    stream = evaluation_token_sequences(tokenizer, max(CONTEXTS), max(CONTEXTS))[0].tolist()
    decoders, kv = {}, {}
    for name in ("original-f32", "mla-f32"):
        decoders[name], logs[f"decode {name}"] = llama(
            paths[name], max(CONTEXTS), args.threads, args.threads_batch, False, flash_attn
        )
        kv[name] = kv_cache_statement(logs[f"decode {name}"])
        print(f"{name}: {kv[name]['line']}", flush=True)
    speed = decode_speed(decoders, stream, steps)
    for context in CONTEXTS:
        o, m = speed["original-f32"][str(context)], speed["mla-f32"][str(context)]
        print(f"{context}: original {o['tokens_per_s']} tok/s, MLA {m['tokens_per_s']} tok/s", flush=True)

    (args.work / "llama_cpp_logs.txt").write_text("\n".join(f"===== {k}\n{v}" for k, v in logs.items()))
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    document = {
        "command": (
            "OMP_NUM_THREADS=1 .venv/bin/kvrewrite export-mla smollm2-135m --kv-share 0.5 --dtype float32 --calib-tokens 16384 --verify-tokens 128 --refit none -o "
            f"{args.export} && OMP_NUM_THREADS=1 .venv-llamacpp/bin/python benchmarks/llamacpp_mla.py "
            + " ".join(sys.argv[1:])
        ),
        "commit": commit,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared with other processes), {platform.system()} (no GPU)",
        "date": datetime.date.today().isoformat(),
        "llama_cpp_python": version,
        "llama_cpp_commit": llama_commit,
        "llama_cpp_system_info": llama_cpp.llama_print_system_info().decode(),
        "threads": {"decode": args.threads, "prefill_and_perplexity": args.threads_batch},
        "flash_attn": flash_attn,
        "kv_cache_type": "f16 (llama.cpp's default)",
        "export": {
            "kv_lora_rank": export_config["kv_lora_rank"],
            "qk_rope_head_dim": export_config["qk_rope_head_dim"],
            "rms_norm_eps": export_config["rms_norm_eps"],
            "q_lora_rank_in_export": export_config["q_lora_rank"],
            "q_lora_rank_given_to_converter": 0 if staged != export else export_config["q_lora_rank"],
        },
        "eval_tokens": int(windows.numel()),
        "seq_len": SEQ_LEN,
        "convert_s": convert_s,
        "perplexity_rows": rows,
        "goal": "MLA GGUF perplexity within 1% of our runtime's (issue 13)",
        "kv_cache": kv,
        "kv_cache_ratio_mla_over_original": kv["mla-f32"]["bytes_per_token"] / kv["original-f32"]["bytes_per_token"],
        "decode": speed,
        "decode_speedup_mla_over_original": {
            str(c): speed["mla-f32"][str(c)]["tokens_per_s"] / speed["original-f32"][str(c)]["tokens_per_s"]
            for c in CONTEXTS
        },
        # One record per model for the docs table (docs/serving.md): everything above, side by side.
        "summary": [
            {
                "name": name,
                "reference": row["reference"],
                "reference_perplexity": row["reference_perplexity"],
                "llama_cpp_perplexity": row["perplexity"],
                "delta_vs_reference_pct": row["delta_vs_reference_pct"],
                "kv_cache_mib": kv[gguf]["total_mib"],
                "kv_cache_cells": kv[gguf]["cells"],
                "kv_bytes_per_token": kv[gguf]["bytes_per_token"],
                **{f"tokens_per_s_{c}": speed[gguf][str(c)]["tokens_per_s"] for c in CONTEXTS},
            }
            for name, gguf, row in (
                ("original SmolLM2-135M", "original-f32", rows[0]),
                ("MLA export, 50% of K+V", "mla-f32", rows[1]),
            )
        ],
        "total_time_s": round(time.perf_counter() - started, 1),
    }
    RESULTS.write_text(json.dumps(document, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
