"""Peak memory of compressing a >= 3B-parameter Llama on a small machine (layer streaming).

Writes a randomly initialised Llama (default: hidden 3072, 28 layers, intermediate 8192, 24 query /
8 KV heads, vocab 32000, untied: 3.0B parameters) to safetensors shards one tensor at a time, then
runs `kvrewrite compress` on it under `/usr/bin/time -v` and records the peak RSS against the model's
size, with the command, the machine and the wall time, in benchmarks/results/big_model_memory.json.

Run it alone on the machine (it reads the ~6 GB checkpoint several times):

    flock /tmp/kvrewrite-heavy.lock python benchmarks/big_model_memory.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from sharded_random_llama import random_words, write_random_llama  # noqa: E402

from kvrewrite.compile.layer_streaming import DTYPES, empty_model  # noqa: E402
from kvrewrite.io.lazy_checkpoint import LazyCheckpoint  # noqa: E402


def machine() -> dict:
    mem_kib = next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemTotal"))
    cpu = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
        platform.processor(),
    )
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(mem_kib / 2**20, 1),
        "gpu": None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }


def time_v_field(stderr: str, label: str) -> str:
    match = re.search(rf"{re.escape(label)}: (.+)", stderr)
    if match is None:
        raise RuntimeError(f"/usr/bin/time -v printed no {label!r}:\n{stderr[-2000:]}")
    return match.group(1).strip()


def load_check(source: Path, compressed: Path, tokens: int, vocab: int) -> dict:
    """Load the compressed output with stock transformers (after `import kvrewrite`) and the source, one after the
    other, and compare next-token predictions on `tokens` random tokens: at full rank (rate 0 of the rate table,
    which must equal the source up to bf16 rounding) and at the compiled rate."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    import kvrewrite

    ids = torch.randint(3, vocab, (1, tokens), generator=torch.Generator().manual_seed(7))
    out: dict = {"tokens": tokens}

    def logits_of(load) -> torch.Tensor:
        t0 = time.perf_counter()
        model = load()
        loaded = time.perf_counter() - t0
        with torch.inference_mode():
            logits = model(input_ids=ids, use_cache=False).logits.float()
        del model
        return logits, round(loaded, 1)

    original, out["source_load_s"] = logits_of(
        lambda: AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16).eval()
    )
    full, out["compressed_full_rank_load_s"] = logits_of(
        lambda: kvrewrite.load(compressed, rate=0.0, dtype=torch.bfloat16).eval()
    )
    compiled, out["compressed_load_s"] = logits_of(
        lambda: AutoModelForCausalLM.from_pretrained(compressed, dtype=torch.bfloat16).eval()
    )
    ref = F.log_softmax(original, -1)
    for name, logits in (("full_rank", full), ("compiled_rate", compiled)):
        logp = F.log_softmax(logits, -1)
        out[name] = {
            "max_abs_logit_diff_vs_source": (logits - original).abs().max().item(),
            "top1_agreement": (logits.argmax(-1) == original.argmax(-1)).float().mean().item(),
            "kl_mean": float((ref.exp() * (ref - logp)).sum(-1).mean()),
        }
    return out


def run_load_check(args, model_dir: Path, out_dir: Path, env: dict) -> dict:
    """load_check in its own process, under /usr/bin/time -v for its peak RSS (whole-model loads, one at a time)."""
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--load-check",
        str(model_dir),
        str(out_dir),
        "--load-check-tokens",
        str(args.load_check_tokens),
        "--vocab",
        str(args.vocab),
    ]
    print("running:", shlex.join(command))
    run = subprocess.run(["/usr/bin/time", "-v", *command], env=env, capture_output=True, text=True)
    if run.returncode != 0:
        print(run.stdout[-3000:], run.stderr[-6000:])
        raise SystemExit(f"load check failed with exit code {run.returncode}")
    result = json.loads(run.stdout.strip().splitlines()[-1])
    result["command"] = shlex.join(command)
    result["peak_rss_mib"] = round(int(time_v_field(run.stderr, "Maximum resident set size (kbytes)")) / 1024, 1)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/kvrewrite-big-model"))
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--hidden", type=int, default=3072)
    parser.add_argument("--intermediate", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--source-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--dtype", default="bfloat16", help="kvrewrite compress --dtype")
    parser.add_argument("--calib-tokens", type=int, default=1024)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--verify-tokens", type=int, default=256)
    parser.add_argument(
        "--verify-tolerance",
        type=float,
        default=1e-4,
        help="compress --verify-tolerance (28 random layers with sharpened q/k amplify float64 rounding)",
    )
    parser.add_argument("--allocation", default="greedy")
    parser.add_argument("--target-rate", type=float, default=0.5)
    parser.add_argument("--keep", action="store_true", help="keep the random model and the output")
    parser.add_argument("--skip-load-check", action="store_true", help="do not load the output whole afterwards")
    parser.add_argument("--load-check-tokens", type=int, default=64)
    parser.add_argument("--load-check", nargs=2, type=Path, metavar=("SOURCE", "COMPRESSED"), help=argparse.SUPPRESS)
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results" / "big_model_memory.json")
    args = parser.parse_args()
    if args.load_check:
        print(json.dumps(load_check(*args.load_check, args.load_check_tokens, args.vocab)))
        return

    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    n_params = sum(p.numel() for p in empty_model(config).parameters())
    model_dir = args.workdir / f"llama-random-{n_params / 1e9:.1f}b-{args.source_dtype}"
    out_dir = args.workdir / "compressed"
    args.workdir.mkdir(parents=True, exist_ok=True)

    if not (model_dir / "config.json").is_file():  # config.json is written last
        t0 = time.perf_counter()
        write_random_llama(model_dir, config, dtype=DTYPES[args.source_dtype], max_shard_size=2 * 10**9)
        print(f"wrote {model_dir} in {time.perf_counter() - t0:.0f} s")
    source_bytes = LazyCheckpoint(model_dir).total_bytes()
    calib = args.workdir / "calibration.txt"
    calib.write_text(random_words(args.calib_tokens * 2, args.vocab))

    command = [
        sys.executable,
        "-m",
        "kvrewrite.cli.app",
        "compress",
        str(model_dir),
        "-o",
        str(out_dir),
        "--overwrite",
        "--target-rate",
        str(args.target_rate),
        "--allocation",
        args.allocation,
        "--calibration",
        str(calib),
        "--calib-tokens",
        str(args.calib_tokens),
        "--seq-len",
        str(args.seq_len),
        "--verify-tokens",
        str(args.verify_tokens),
        "--verify-tolerance",
        str(args.verify_tolerance),
        "--dtype",
        args.dtype,
    ]
    print("running:", shlex.join(command))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    run = subprocess.run(["/usr/bin/time", "-v", *command], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    print(run.stdout[-6000:])
    if run.returncode != 0:
        print(run.stderr[-6000:])
        raise SystemExit(f"compress failed with exit code {run.returncode}")
    peak_kib = int(time_v_field(run.stderr, "Maximum resident set size (kbytes)"))
    report = json.loads((out_dir / "compress_report.json").read_text())
    output_bytes = LazyCheckpoint(out_dir).total_bytes()

    results = {
        "command": shlex.join(["/usr/bin/time", "-v", *command]),
        "benchmark_command": shlex.join([sys.executable, *sys.argv]),
        "machine": machine(),
        "model": {
            "parameters": n_params,
            "config": {
                k: getattr(config, k)
                for k in (
                    "hidden_size",
                    "intermediate_size",
                    "num_hidden_layers",
                    "num_attention_heads",
                    "num_key_value_heads",
                    "vocab_size",
                )
            },
            "dtype_on_disk": args.source_dtype,
            "size_on_disk_bytes": source_bytes,
            "size_on_disk_gib": round(source_bytes / 2**30, 2),
            "size_fp32_gib": round(n_params * 4 / 2**30, 2),
            "one_decoder_layer_fp32_mib": round(report_layer_params(config) * 4 / 2**20, 1),
        },
        "peak_rss_mib": round(peak_kib / 1024, 1),
        "peak_rss_over_size_on_disk": round(peak_kib * 1024 / source_bytes, 3),
        "wall_time_s": round(wall, 1),
        "time_v_elapsed": time_v_field(run.stderr, "Elapsed (wall clock) time (h:mm:ss or m:ss)"),
        "pass_timings_s": report.get("timings_s"),
        "output_size_on_disk_gib": round(output_bytes / 2**30, 2),
        "output_shards": len(set(LazyCheckpoint(out_dir).weight_map.values())),
        "calibration": report.get("calibration"),
        "allocation": report.get("allocation"),
        "verification": report.get("verification", {}),
        "load_check": None if args.skip_load_check else run_load_check(args, model_dir, out_dir, env),
    }
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({k: results[k] for k in ("peak_rss_mib", "wall_time_s", "model")}, indent=2))
    if not args.keep:
        shutil.rmtree(out_dir, ignore_errors=True)
        shutil.rmtree(model_dir, ignore_errors=True)


def report_layer_params(config: LlamaConfig) -> int:
    h, i = config.hidden_size, config.intermediate_size
    d = h // config.num_attention_heads
    attention = h * d * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
    return attention + 3 * h * i + 2 * h


if __name__ == "__main__":
    main()
