"""What a compile cost, as the benchmarks record it: from a `/usr/bin/time -v` report (wall time, peak RSS of the
whole process) and from a checkpoint's compress_report.json (the pipeline's own timings and peak RSS).
"""

from __future__ import annotations

import json
import re
from pathlib import Path


def time_v_report(text: str) -> dict:
    """The command, wall seconds and peak RSS (MiB) of one `/usr/bin/time -v` report."""

    def field(label: str) -> str:
        found = re.search(rf"{re.escape(label)}: (.+)", text)
        if found is None:
            raise SystemExit(f"not a `/usr/bin/time -v` report: no {label!r} line")
        return found.group(1).strip()

    wall = field("Elapsed (wall clock) time (h:mm:ss or m:ss)")
    return {
        "command": field("Command being timed").strip('"'),
        "wall_s": round(sum(float(part) * 60**i for i, part in enumerate(reversed(wall.split(":")))), 1),
        "peak_rss_mib": round(int(field("Maximum resident set size (kbytes)")) / 1024, 1),
    }


def compress_report_cost(checkpoint: Path) -> dict | None:
    """The calibration, pipeline wall time and peak RSS a `kvrewrite compress` checkpoint records in its
    compress_report.json (None for a checkpoint without one, e.g. an MLA export)."""
    path = checkpoint / "compress_report.json"
    if not path.is_file():
        return None
    report = json.loads(path.read_text(encoding="utf-8"))
    return {
        "calibration": report["calibration"],
        "pipeline_total_s": report["timings_s"]["total"],
        "pipeline_peak_rss_mib": report.get("peak_rss_mib"),
        "sequential_statistics": report.get("sequential_statistics"),
    }
