"""The headline command on a random model of a named shape: time per pass, peak host RSS and peak device memory.

Writes a random-weight Llama of a public model's decoder shape (Llama-3-8B, or Llama-3-70B's layer shape) with a
chosen layer count to bf16 safetensors shards, one tensor at a time (nothing downloaded; vocab 49152 so the
bundled SmolLM2 tokenizer serves and synthetic calibration has real prompts), then runs

    kvrewrite compress DIR --target-rate 0.6 --calibration synthetic --device D --dtype bf16 -o OUT

under `/usr/bin/time -v` and records every pass's seconds (compress_report.json), the peak host RSS, the peak GPU
memory torch held (on CUDA), the command, commit, machine and date.

    python benchmarks/compile_scale.py --shape llama3-8b --layers 32 --device cuda      # the issue's headline
    python benchmarks/compile_scale.py --small                                          # CPU, a few minutes
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from compile_cost import time_v_report  # noqa: E402
from sharded_random_llama import write_random_llama  # noqa: E402
from synthetic_calibration import SHAPES, shape_config  # noqa: E402

from kvrewrite.compile.layer_streaming import empty_model  # noqa: E402
from kvrewrite.io.lazy_checkpoint import LazyCheckpoint  # noqa: E402

# --small: Llama-3-8B's layer shape, one layer, and a calibration a CPU generates in a minute.
SMALL = {"shape": "llama3-8b", "layers": 1, "calib_tokens": 2048, "seq_len": 256, "verify_tokens": 128}


def machine(device: str) -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "")
    mem_kib = next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemTotal"))
    gpu = torch.cuda.get_device_name(0) if device.startswith("cuda") and torch.cuda.is_available() else "no GPU used"
    return (
        f"{platform.node()}: {cpu}, {os.cpu_count()} CPUs, {mem_kib / 2**20:.0f} GiB, {gpu}, "
        f"torch {torch.__version__}, python {platform.python_version()}"
    )


def write_model(directory: Path, config) -> None:
    """Random bf16 shards plus the bundled SmolLM2 tokenizer (its chat template gives the synthetic prompts)."""
    from transformers import AutoTokenizer

    from kvrewrite.io.sources import bundled_smollm2_path

    write_random_llama(directory, config, dtype=torch.bfloat16, max_shard_size=2 * 10**9)
    for stale in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (directory / stale).unlink(missing_ok=True)
    AutoTokenizer.from_pretrained(bundled_smollm2_path()).save_pretrained(directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's own count)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--calibration", default="synthetic", help="synthetic (the headline) or wiki")
    parser.add_argument("--calib-tokens", type=int, default=None, help="default: compress's own (32768)")
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--verify-tokens", type=int, default=None)
    parser.add_argument("--target-rate", default="0.6")
    parser.add_argument(
        "--small", action="store_true", help="Llama-3-8B's layer shape, 1 layer, 2048 calibration tokens"
    )
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/kvrewrite-compile-scale"))
    parser.add_argument(
        "--keep", action="store_true", help="keep the random model (reused by a later run) and the output"
    )
    parser.add_argument("--note", default="", help="what else ran on the machine")
    parser.add_argument(
        "--out", type=Path, default=None, help="result file (default benchmarks/results/compile_scale_<name>.json)"
    )
    args = parser.parse_args()
    if args.small:
        args.shape, args.layers = SMALL["shape"], SMALL["layers"]
        for name in ("calib_tokens", "seq_len", "verify_tokens"):
            if getattr(args, name) is None:
                setattr(args, name, SMALL[name])

    config = shape_config(args.shape, args.layers)
    layers = config.num_hidden_layers
    parameters = sum(p.numel() for p in empty_model(config).parameters())
    model_dir = args.workdir / f"{args.shape}-{layers}l-bf16"
    out_dir = args.workdir / "compressed"
    if not (model_dir / "config.json").is_file():  # config.json is written last
        t0 = time.perf_counter()
        write_model(model_dir, config)
        print(f"wrote {model_dir} ({parameters / 1e9:.2f}B parameters) in {time.perf_counter() - t0:.0f} s")

    compress = [
        sys.executable,
        "-m",
        "kvrewrite.cli.app",
        "compress",
        str(model_dir),
        "--target-rate",
        args.target_rate,
        "--calibration",
        args.calibration,
        "--device",
        args.device,
        "--dtype",
        "bf16",
        "-o",
        str(out_dir),
        "--overwrite",
    ]
    for flag, value in (
        ("--calib-tokens", args.calib_tokens),
        ("--seq-len", args.seq_len),
        ("--verify-tokens", args.verify_tokens),
    ):
        if value is not None:
            compress += [flag, str(value)]
    print("running:", shlex.join(compress))
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(["/usr/bin/time", "-v", *compress], env=env, capture_output=True, text=True)
    if run.returncode != 0:
        print(run.stdout[-4000:], run.stderr[-6000:])
        raise SystemExit(f"compress failed with exit code {run.returncode}")
    cost = time_v_report(run.stderr)
    report = json.loads((out_dir / "compress_report.json").read_text())
    source_bytes = LazyCheckpoint(model_dir).total_bytes()
    timings = dict(report["timings_s"])
    total = timings.pop("total")
    record = {
        "command": shlex.join(["/usr/bin/time", "-v", *compress]),
        "benchmark_command": shlex.join(["python", "benchmarks/compile_scale.py", *sys.argv[1:]]),
        "commit": commit,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(args.device) + (f"; shared with other jobs ({args.note})" if args.note else ""),
        "model": {
            "shape": args.shape,
            "layers": layers,
            "of_layers": SHAPES[args.shape]["num_hidden_layers"],
            "parameters": parameters,
            "vocab_size": config.vocab_size,
            "dtype_on_disk": "bfloat16",
            "size_on_disk_gib": round(source_bytes / 2**30, 2),
            "weights": "random (nothing downloaded)",
        },
        "wall_s": cost["wall_s"],
        "peak_host_rss_mib": cost["peak_rss_mib"],
        "peak_device_memory_mib": report.get("peak_device_memory_mib"),
        "pipeline_total_s": total,
        "pass_seconds": dict(sorted(timings.items(), key=lambda item: -item[1])),
        "calibration": report.get("calibration"),
        "allocation": report.get("allocation"),
        "verification": {
            k: report.get("verification", {}).get(k) for k in ("full_rank_max_abs_logit_diff", "tolerance")
        },
    }
    out = args.out or ROOT / "benchmarks" / "results" / (
        f"compile_scale_{'small_' if args.small else ''}{args.shape}_{layers}l_{args.device.split(':')[0]}.json"
    )
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(
        json.dumps(
            {k: record[k] for k in ("wall_s", "peak_host_rss_mib", "peak_device_memory_mib", "pass_seconds")}, indent=2
        )
    )
    print(f"wrote {out}")
    if not args.keep:
        shutil.rmtree(out_dir, ignore_errors=True)
        shutil.rmtree(model_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
