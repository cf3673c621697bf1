"""Commit a `kvrewrite demo` run as a result file: its demo_results.json plus provenance and derived columns.

    python tools/record_demo.py DEMO_DIR benchmarks/results/demo_smollm2.json --command "kvrewrite demo -o DEMO_DIR"

Adds the command, commit, machine and date, and per row the KV share (bytes / baseline bytes) that
docs/results.md prints, and the share of the original's cache held in float16 (the demo runs in float32, 4 bytes an
element; docs/frontier.md measures against float16). Its Δppl column needs nothing added: tools/doc_numbers.py derives a row's increase from
its perplexity and baseline_perplexity.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("demo_dir", type=Path)
    parser.add_argument("output", type=Path)
    parser.add_argument("--command", required=True, help="the command that produced demo_dir")
    parser.add_argument("--commit", help="the commit the demo ran on (default: HEAD)")
    parser.add_argument(
        "--time-log", type=Path, help="the run's `/usr/bin/time -v` output: record wall time and peak RSS"
    )
    parser.add_argument("--before", type=Path, help="an earlier run's demo_results.json: record the largest difference")
    parser.add_argument("--note", default="", help="what else ran on the machine meanwhile")
    args = parser.parse_args()
    data = json.loads((args.demo_dir / "demo_results.json").read_text(encoding="utf-8"))
    for row in data["rows"]:
        # the original's own row holds the reference bytes
        baseline_bytes = row["kv_bytes_per_token"] if row.get("baseline") else row["baseline_kv_bytes_per_token"]
        row["kv_share"] = 1.0 if row.get("baseline") else row["kv_bytes_per_token"] / baseline_bytes
        row["kv_share_of_fp16"] = round(row["kv_bytes_per_token"] / (baseline_bytes / 2), 4)
    commit = (
        args.commit
        or subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).resolve().parent
        ).stdout.strip()
    )
    if args.time_log is not None:
        log = args.time_log.read_text(encoding="utf-8", errors="replace")
        wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", log).group(1)
        seconds = sum(float(part) * 60**i for i, part in enumerate(reversed(wall.split(":"))))
        cpu = sum(float(re.search(rf"{kind} time \(seconds\): ([\d.]+)", log).group(1)) for kind in ("User", "System"))
        # On a shared machine the wall time includes waiting for a core; the CPU time (user + system) does not.
        data["time_v"] = {
            "wall_s": round(seconds, 1),
            "cpu_s": round(cpu, 1),
            "peak_rss_gib": round(
                int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", log).group(1)) / 2**20, 2
            ),
        }
    if args.before is not None:  # e.g. the same demo on the commit before a refactor
        before = json.loads(args.before.read_text(encoding="utf-8"))["rows"]
        fields = ("perplexity", "kl_mean", "top1_agreement", "kv_bytes_per_token")
        data["max_abs_difference_to_before"] = max(
            abs(a[f] - b[f]) for a, b in zip(before, data["rows"]) for f in fields if a.get(f) is not None
        )
    record = {
        "command": args.command,
        "commit": commit,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()} (no GPU)"
        + (f"; shared with other jobs: {args.note}" if args.note else ""),
        "date": datetime.date.today().isoformat(),
        **data,
    }
    args.output.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
