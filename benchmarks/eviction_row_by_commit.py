"""The demo's quarter-of-the-bytes row (re-scored eviction, keep 0.57, 8-bit keys and 4-bit values, a 16-token
window) scored by the runtime of each named commit, on one checkpoint, in float32 and float64: where the row moved
between two demo runs, and whether a change was arithmetic or maths.

    python benchmarks/eviction_row_by_commit.py CHECKPOINT COMMIT [COMMIT ...] [--out FILE]

Each commit is checked out in a temporary git worktree and evaluated in a subprocess with that worktree first on
PYTHONPATH, exactly as `kvrewrite demo` scores the row (its QUARTER_OPTIONS, the 4,096 held-out wiki tokens,
CODEC_EVAL_CHUNK-token prefill chunks). The codec's codes, scales and the attention's score accumulators stay float32
in a float64 model, so float64 removes most but not all of the rounding a re-ordered sum changes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "benchmarks" / "results" / "demo_eviction_row_by_commit.json"

EVALUATE = """
import json, sys, torch
from transformers import AutoTokenizer
from kvrewrite.cli.demo import QUARTER_OPTIONS
from kvrewrite.io.calibration_data import evaluation_token_sequences
from kvrewrite.publish.evaluation import CODEC_EVAL_CHUNK, evaluate_many
from kvrewrite.runtime.load import load
checkpoint, dtype = sys.argv[1], getattr(torch, sys.argv[2])
windows = evaluation_token_sequences(AutoTokenizer.from_pretrained(checkpoint), 4096, 512)
model = load(checkpoint, **QUARTER_OPTIONS).to(dtype)
row = evaluate_many({"q": model}, windows, baseline=None, batch_size=1, chunk=CODEC_EVAL_CHUNK)["q"]
print(json.dumps({"perplexity": row.perplexity, "kv_bytes_per_token": row.kv_bytes_per_token}))
"""


def score(worktree: Path, checkpoint: Path, dtype: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(worktree), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    done = subprocess.run(
        [sys.executable, "-c", EVALUATE, str(checkpoint), dtype],
        cwd=worktree,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path, help="a per-head checkpoint (the demo's: compress -p 0.5, 16K wiki)")
    parser.add_argument("commits", nargs="+")
    parser.add_argument("--dtypes", default="float32,float64")
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args()
    git = ["git", "-C", str(ROOT)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for commit in args.commits:
            full = subprocess.run([*git, "rev-parse", commit], capture_output=True, text=True, check=True).stdout
            subject = subprocess.run(
                [*git, "log", "-1", "--format=%s", commit], capture_output=True, text=True, check=True
            ).stdout.strip()
            worktree = Path(tmp) / commit.replace("^", "_parent")
            subprocess.run([*git, "worktree", "add", "-q", "--detach", str(worktree), commit], check=True)
            try:
                row = {"commit": full.strip(), "subject": subject}
                for dtype in args.dtypes.split(","):
                    row[dtype] = score(worktree, args.checkpoint.resolve(), dtype)["perplexity"]
                    print(f"{commit:>10} {dtype}: ppl {row[dtype]!r}  ({subject})", flush=True)
                rows.append(row)
            finally:
                subprocess.run([*git, "worktree", "remove", "--force", str(worktree)], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    record = {
        "command": " ".join(["python", *[a if not a.startswith(str(ROOT)) else "." for a in sys.argv]]),
        "commit": head,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()} (no GPU); OMP_NUM_THREADS=1",
        "date": datetime.date.today().isoformat(),
        "checkpoint": "kvrewrite compress smollm2-135m -p 0.5 --calib-tokens 16384 (the demo's default variant)",
        "rows": rows,
    }
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
