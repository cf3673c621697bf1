"""The options the single-process screens (answer_nll.py, needle_survival.py) share: a saved prompt set, a length
filter, the checkpoint and the result file."""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def add_prompt_set_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--inputs", type=Path, required=True, help="a saved input set (run.py inputs)")
    parser.add_argument("--min-length", type=int, default=0)
    parser.add_argument("--max-length", type=int, default=1 << 30)
    parser.add_argument("--checkpoint", default=None, help="default: $KVREWRITE_FRONTIER_CHECKPOINT")
    parser.add_argument("-o", "--out", type=Path, required=True)


def checkpoint_directory(args: argparse.Namespace) -> str:
    """--checkpoint, or $KVREWRITE_FRONTIER_CHECKPOINT; exits naming both when neither is given."""
    directory = args.checkpoint or os.environ.get("KVREWRITE_FRONTIER_CHECKPOINT")
    if not directory:
        raise SystemExit("give --checkpoint or set KVREWRITE_FRONTIER_CHECKPOINT")
    return directory
