"""Sequence-parallel prefill on CPU (gloo): equality with the single-process model, bytes per collective, wall time.

Run on demand (OMP_NUM_THREADS=1; each process also uses one thread):
    .venv/bin/python benchmarks/sequence_parallel.py --checkpoint DIR [--parts equality,bytes,timing]
DIR: a SmolLM2-135M checkpoint compiled at p = 0.5 (its rate table serves 0.3 and 0.7; rate 0.0 is the full-rank
rewrite, whose q/k/v widths are the original model's). Writes benchmarks/results/sequence_parallel_cpu.json,
merging the parts it runs into what the file already holds and re-writing it after every measurement.

The prompt is the repository's own docs, tokenized and repeated to length. SmolLM2-135M was trained to 8,192
positions; longer prompts are used for timing only (RoPE extends, quality past 8K is not measured).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import kvrewrite
from kvrewrite.runtime.kernels.cache_layout import packed_view
from kvrewrite.runtime.sequence_parallel import greedy_continue, prefill, run_processes

ROOT = Path(__file__).resolve().parent.parent
RESULT = ROOT / "benchmarks" / "results" / "sequence_parallel_cpu.json"
ORIGINAL = 0.0  # the full-rank rewrite: the original model's attention through the same code


def prompt_tokens(directory: str, length: int) -> torch.Tensor:
    from transformers import AutoTokenizer

    text = "\n\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    ids = AutoTokenizer.from_pretrained(directory)(text, return_tensors="pt").input_ids[0]
    return ids.repeat(length // ids.numel() + 1)[:length][None]


# ---- what each process runs ------------------------------------------------------------------------------
def equality_worker(rank: int, world: int, directory: str, tokens: torch.Tensor, new_tokens: int) -> dict:
    from transformers import DynamicCache

    model = kvrewrite.load(directory).eval()
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        reference = model(tokens, past_key_values=cache, use_cache=True).logits
        generated = model.generate(tokens, max_new_tokens=new_tokens, do_sample=False)[:, tokens.shape[1] :]
    result = prefill(model, tokens, cache_on="all", all_logits=True)
    start, stop = result.tokens
    cache_diff = max(
        max(
            (packed_view(a.keys) - packed_view(b.keys)).abs().max().item(),
            (packed_view(a.values) - packed_view(b.values)).abs().max().item(),
        )
        for a, b in zip(result.cache.layers, cache.layers)
    )
    continuation = greedy_continue(model, result, new_tokens)
    return {
        "max_abs_logit_diff": (result.logits - reference[:, start:stop]).abs().max().item(),
        "max_abs_cache_diff": cache_diff,
        "same_greedy_tokens": bool(torch.equal(continuation, generated)),
        "tokens": continuation[0].tolist(),
    }


def bytes_worker(rank: int, world: int, directory: str, tokens: torch.Tensor, rates: list) -> dict:
    out = {}
    for rate in rates:
        model = kvrewrite.load(directory, rate=rate).eval()
        result = prefill(model, tokens, cache_on="first")
        out[rate] = [vars(call) for call in result.collectives.calls]
    return out


def timing_worker(rank: int, world: int, directory: str, tokens: torch.Tensor, rate: float) -> dict:
    model = kvrewrite.load(directory, rate=rate).eval()
    if world > 1:
        dist.barrier()
    start = time.perf_counter()
    result = prefill(model, tokens, cache_on="first")
    if world > 1:
        dist.barrier()
    return {"seconds": time.perf_counter() - start, "next_token": int(result.next_token_logits.argmax(-1)[0])}


# ---- the parts -----------------------------------------------------------------------------------------------
def equality(args, record: dict) -> None:
    tokens = prompt_tokens(args.checkpoint, args.equality_length)
    rows = []
    for world in (2, 4):
        ranks = run_processes(equality_worker, world, args.checkpoint, tokens, args.new_tokens)
        rows.append(
            {
                "name": f"N={world}",
                "processes": world,
                "prompt_tokens": tokens.shape[1],
                "max_abs_logit_diff": max(r["max_abs_logit_diff"] for r in ranks),
                "max_abs_cache_diff": max(r["max_abs_cache_diff"] for r in ranks),
                "same_greedy_tokens": all(r["same_greedy_tokens"] for r in ranks),
                "greedy_tokens": ranks[0]["tokens"],
            }
        )
        print(rows[-1], flush=True)
    record["equality"] = {"rate": "compiled (0.5)", "dtype": "float32", "new_tokens": args.new_tokens, "rows": rows}


def byte_rows(world: int, length: int, calls_by_rate: dict) -> list[dict]:
    """Per rate: bytes every collective moved between ranks, summed over ranks and layers (from the wrapper)."""
    totals = {rate: {} for rate in calls_by_rate}
    for rate, per_rank in calls_by_rate.items():
        for calls in per_rank:
            for call in calls:
                totals[rate][call["name"]] = totals[rate].get(call["name"], 0) + call["sent"]
    rows = []
    for rate, sent in totals.items():
        name = "original" if rate == ORIGINAL else f"p={rate}"
        base = totals[ORIGINAL]
        rows.append(
            {
                "name": f"{name} N={world}",
                "rate": rate,
                "processes": world,
                "prompt_tokens": length,
                **{f"{k}_bytes": v for k, v in sent.items()},
                "qkv_MiB": round(sent["qkv"] / 2**20, 2),
                "output_MiB": round(sent["output"] / 2**20, 2),
                "cache_MiB": round(sent["cache"] / 2**20, 2),
                "qkv_vs_original": round(sent["qkv"] / base["qkv"], 3),
                "output_vs_original": round(sent["output"] / base["output"], 3),
                "attention_vs_original": round((sent["qkv"] + sent["output"]) / (base["qkv"] + base["output"]), 3),
            }
        )
    return rows


def measure_bytes(args, record: dict) -> None:
    """Bytes per collective of args.checkpoint (or --bytes-checkpoint, recorded as bytes_<label>)."""
    checkpoint = args.bytes_checkpoint or args.checkpoint
    tokens = prompt_tokens(checkpoint, args.bytes_length)
    rates = [ORIGINAL, 0.3, 0.5, 0.7]
    rows = []
    for world in (2, 4):
        ranks = run_processes(bytes_worker, world, checkpoint, tokens, rates)
        rows += byte_rows(world, tokens.shape[1], {rate: [r[rate] for r in ranks] for rate in rates})
        for row in rows[-len(rates) :]:
            if args.bytes_label:
                row["name"] = f"{args.bytes_label} {row['name']}"
            print(row, flush=True)
    key = f"bytes_{args.bytes_label.replace('-', '_')}" if args.bytes_label else "bytes"
    modes = sorted(
        {
            layer["key_mode"]
            for layer in json.loads((Path(checkpoint) / "config.json").read_text())["kvrewrite"]["layers"]
        }
    )
    record[key] = {
        "rows": rows,
        "key_modes": modes,
        "what": "bytes each collective sent between ranks, summed over ranks and layers, "
        "counted by kvrewrite.runtime.sequence_parallel.CountingCollectives",
    }


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def timing(args, record: dict) -> None:
    """Prefill times, appended to those of earlier invocations. Ratios (vs 1 process, vs the original) compare rows
    of one invocation only: the machine's load differs between invocations. A later invocation's rows say which run
    they come from in their name, so every name stays unique."""
    rows = record.setdefault("timing", {}).setdefault("rows", [])
    earlier = record["timing"].get("run")
    invocation = 0 if earlier is None else len(earlier) if isinstance(earlier, list) else 1
    suffix = f" ({_ordinal(invocation + 1)} run)" if invocation else ""
    started = time.perf_counter()
    for length in args.lengths:
        tokens = prompt_tokens(args.checkpoint, length)
        for world in args.procs:
            for rate in (ORIGINAL, 0.5):
                label = f"{length} tokens N={world} {'original' if rate == ORIGINAL else 'p=0.5'}"
                if time.perf_counter() - started > args.budget_s:
                    record["timing"]["skipped_over_budget"] = record["timing"].get("skipped_over_budget", []) + [label]
                    continue
                ranks = run_processes(timing_worker, world, args.checkpoint, tokens, rate)
                skipped = record["timing"].get("skipped_over_budget", [])
                if label in skipped:  # skipped by an earlier invocation, measured now
                    skipped.remove(label)
                rows.append(
                    {
                        "name": f"{length // 1024}K N={world} {'original' if rate == ORIGINAL else 'p=0.5'}{suffix}",
                        "prompt_tokens": length,
                        "processes": world,
                        "rate": rate,
                        "invocation": invocation,
                        "prefill_s": round(max(r["seconds"] for r in ranks), 1),
                    }
                )
                print(rows[-1], flush=True)
                write(record)
    by = {(r.get("invocation", 0), r["prompt_tokens"], r["processes"], r["rate"]): r["prefill_s"] for r in rows}
    for row in rows:
        run = row.get("invocation", 0)
        one = by.get((run, row["prompt_tokens"], 1, row["rate"]))
        original = by.get((run, row["prompt_tokens"], row["processes"], ORIGINAL))
        row["speedup_vs_1_process"] = round(one / row["prefill_s"], 2) if one else None
        row["vs_original"] = round(row["prefill_s"] / original, 2) if original else None


def write(record: dict) -> None:
    RESULT.write_text(json.dumps(record, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--parts", default="equality,bytes,timing")
    parser.add_argument("--equality-length", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--bytes-length", type=int, default=1024)
    parser.add_argument(
        "--bytes-checkpoint", default=None, help="count bytes on this checkpoint instead (e.g. other key modes)"
    )
    parser.add_argument(
        "--bytes-label", default="", help="with --bytes-checkpoint: stored as bytes_<label> (- becomes _)"
    )
    parser.add_argument("--lengths", default="8192,16384,32768")
    parser.add_argument("--procs", default="1,2,4")
    parser.add_argument(
        "--budget-s", type=float, default=1200.0, help="skip the timings left once this much time is spent"
    )
    args = parser.parse_args()
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.procs = [int(x) for x in args.procs.split(",")]
    if os.environ.get("OMP_NUM_THREADS") != "1":
        sys.exit("run with OMP_NUM_THREADS=1 (the processes share the machine's cores)")

    record = json.loads(RESULT.read_text()) if RESULT.exists() else {}
    provenance = ("command", "commit", "date")
    for part in [k for k, v in record.items() if isinstance(v, dict) and ("rows" in v) and "run" not in v]:
        record[part]["run"] = {k: record[k] for k in provenance if k in record}  # written by an earlier invocation
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    record.update(
        {
            "command": " ".join(["OMP_NUM_THREADS=1", Path(sys.executable).name, *sys.argv]),
            "commit": commit,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPU cores shared with other jobs; torch "
            f"{torch.__version__}, gloo; 1 thread per process",
            "model": "SmolLM2-135M (9 query heads, 3 KV heads, head_dim 64, 30 layers, latent keys)",
            "gpu": "not run: no GPU in this session",
        }
    )
    for part in args.parts.split(","):
        print(f"== {part}", flush=True)
        {"equality": equality, "bytes": measure_bytes, "timing": timing}[part](args, record)
        key = f"bytes_{args.bytes_label.replace('-', '_')}" if part == "bytes" and args.bytes_label else part
        current = {k: record[k] for k in provenance}  # each part keeps the invocation(s) that measured it
        earlier = record[key].get("run") if part == "timing" else None  # timing rows accumulate over invocations
        record[key]["run"] = (
            current if earlier is None else [*(earlier if isinstance(earlier, list) else [earlier]), current]
        )
        write(record)
    print("wrote", RESULT)


if __name__ == "__main__":
    main()
