"""Commit command-line runs as one result file: each run's command, wall time and peak RSS (`/usr/bin/time -f "%e s
wall, %M KiB max RSS"`), and its console output as printed, so a page can show the transcript and the number check
finds every figure in it.

    python tools/record_runs.py OUT.json --commit C --note "..." NAME=COMMAND=LOG=TIME [NAME=COMMAND=LOG=TIME ...]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output", type=Path)
    parser.add_argument("runs", nargs="+", help="NAME=COMMAND=CONSOLE_LOG=TIME_LOG")
    parser.add_argument("--commit", required=True)
    parser.add_argument("--note", default="")
    args = parser.parse_args()
    runs = {}
    for spec in args.runs:
        name, command, log, time_log = spec.split("=", 3)
        wall, rss = Path(time_log).read_text().strip().splitlines()[-1].split(", ")
        runs[name] = {
            "command": command,
            "wall_s": float(wall.split()[0]),
            "peak_rss_mib": round(int(rss.split()[0]) / 1024, 1),
            "console": Path(log).read_text(encoding="utf-8", errors="replace"),
        }
    record = {
        "command": "; ".join(run["command"] for run in runs.values()),
        "commit": args.commit,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()} (no GPU)"
        + (f"; {args.note}" if args.note else ""),
        "date": datetime.date.today().isoformat(),
        "runs": runs,
    }
    args.output.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
