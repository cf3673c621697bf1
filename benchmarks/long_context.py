"""Quality at 512-token windows and at long-context positions, held-out wiki and news, one checkpoint, several rates.

Issue 16's two tables: every figure at independent 512-token windows AND at continuation positions (each token
scored with the cache of everything before it, `kvrewrite eval --positions`). Runs `evaluate_checkpoint` (what
`kvrewrite eval` runs) once per text and protocol and writes every row with its provenance.

    OMP_NUM_THREADS=1 python benchmarks/long_context.py CKPT --rates 0.3,0.5,0.7 \
        --positions 512-1K,2K-4K --tokens 16384 --out benchmarks/results/long_context_default.json

CKPT is the default p = 0.5 checkpoint: `kvrewrite compress smollm2-135m -p 0.5 --calib-tokens 16384 -o CKPT`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from kvrewrite.publish.checkpoint_eval import evaluate_checkpoint
from kvrewrite.publish.continuation_eval import parse_positions

sys.path.insert(0, str(Path(__file__).parent))
from compile_cost import compress_report_cost  # noqa: E402
from decode import run_provenance  # noqa: E402  (the provenance header every benchmark result starts with)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--rates", default="0.3,0.5,0.7")
    parser.add_argument("--positions", default="512-1K,2K-4K")
    parser.add_argument("--tokens", type=int, default=16384, help="held-out tokens per text and protocol")
    parser.add_argument("--texts", default="wiki,news")
    parser.add_argument("--label", default=None, help="what the checkpoint is (default: its directory name)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    record = {
        **run_provenance(int(os.environ.get("OMP_NUM_THREADS", "1")), "one process"),
        "checkpoint": args.label or args.checkpoint.name,
        "compile": compress_report_cost(args.checkpoint),
        "tokens": args.tokens,
        "runs": [],
    }
    for text in args.texts.split(","):
        for positions in (None, parse_positions(args.positions)):
            started = time.time()
            rows = evaluate_checkpoint(
                args.checkpoint, rates=rates, tokens=args.tokens, seq_len=512, positions=positions, text=text
            )
            protocol = "512-token windows" if positions is None else f"continuation, {positions[-1].end}-token windows"
            record["runs"].append(
                {"text": text, "protocol": protocol, "seconds": round(time.time() - started, 1), "rows": rows}
            )
            print(f"{text}, {protocol}: {record['runs'][-1]['seconds']} s", file=sys.stderr)
            # Written after every run, so a long benchmark stopped part-way keeps what it measured.
            args.out.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
