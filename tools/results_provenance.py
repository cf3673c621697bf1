"""Where a result file does not record its run's commit and date itself, the commit that last wrote it.

Most files under benchmarks/results/ record the command, commit, machine and date of the run that produced them.
Older ones record only the command and the machine. `python tools/results_provenance.py` writes
benchmarks/results/provenance.json: for each file missing a field, the git commit that last changed the file and
that commit's date (when it was committed, which is after the run), and "not recorded" for a missing machine.
tests/test_doc_numbers.py checks that every result file has the four fields, itself or here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SIDECAR = RESULTS / "provenance.json"
FIELDS = ("command", "commit", "machine", "date")


def missing_fields(path: Path) -> list[str]:
    """The provenance fields a result file does not name anywhere in it."""
    text = path.read_text(encoding="utf-8").lower()
    return [f for f in FIELDS if f'"{f}' not in text and f'{f}"' not in text and f"_{f}" not in text]


def result_files() -> list[Path]:
    return sorted(p for p in RESULTS.glob("*.json") if p != SIDECAR)


def main() -> int:
    entries = {}
    for path in result_files():
        missing = missing_fields(path)
        if not missing:
            continue
        log = subprocess.run(
            ["git", "log", "-1", "--format=%H %cI", "--", str(path.relative_to(ROOT))],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        entry = {"missing_in_file": missing}
        if "commit" in missing or "date" in missing:
            entry |= {
                "commit": log[0] if log else "unknown",
                "date": log[1] if log else "unknown",
                "note": "the commit that last wrote this file and its date, not the run's own (not recorded)",
            }
        if "machine" in missing:
            entry["machine"] = "not recorded"
        if "command" in missing:
            entry["command"] = "not recorded"
        entries[path.name] = entry
    SIDECAR.write_text(json.dumps({"what": __doc__.strip().splitlines()[0], "files": entries}, indent=1) + "\n")
    print(f"wrote {SIDECAR.relative_to(ROOT)}: {len(entries)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
