"""Run the fault suite's cases through the CLI and record what the user sees: benchmarks/results/fault_table.json,
which docs/reliability.md's table is rendered from (tools/docs_tables.py, template fault-table).

    PYTHONPATH=. python benchmarks/fault_table.py

Builds a tiny random Llama and compiles it once (seconds on 2 CPU cores), then runs every case of
tests/fault_cases.py (the cases tests/test_faults.py asserts) in its own temporary directory, and the two interrupt
cases in a real `kvrewrite` process; paths are shown relative to that directory. As root, three more cases run on
tmpfs mounts (a read-only and a full filesystem).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from fault_cases import CASES, INTERRUPT_CASES, SENTINEL_NAME, error_line, interrupted_run, run_cli  # noqa: E402
from tiny_models import save_tiny_llama, tiny_pipeline  # noqa: E402

from kvrewrite.compile.passes.pipeline import run_pipeline  # noqa: E402
from kvrewrite.compile.plan import Plan  # noqa: E402

RESULT = ROOT / "benchmarks" / "results" / "fault_table.json"


def shown(text: str, *roots: Path) -> str:
    for root in roots:
        text = text.replace(str(root) + "/", "").replace(str(root), ".")
    return text


def command_line(args: list[str], stdin: str | None, *roots: Path) -> str:
    line = " ".join(["kvrewrite", *(shown(a, *roots) for a in args)])
    return line + (f" (stdin: {stdin.count(chr(10))} x 'y')" if stdin else "")


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    home = Path.cwd()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        source = save_tiny_llama(base / "src")
        ckpt = base / "ckpt"
        # The tests' pipeline (fixed random calibration windows, tests/tiny_models.py), not kvrewrite.compress: the
        # table's checkpoint is the one tests/test_faults.py builds, so the table shows what the tests check.
        run_pipeline(Plan(model=str(source), output=ckpt, progress=False), tiny_pipeline())
        for i, case in enumerate(CASES):
            root = base / f"case{i}"
            root.mkdir()
            args = case.setup(root, source, ckpt)
            code, output = run_cli(args, case.stdin)
            os.chdir(home)
            rows.append(
                {
                    "case": case.name,
                    "command": command_line(args, case.stdin, root, base),
                    "message": shown(error_line(output), root, base),
                    "exit": code,
                    "code_ran": (root / SENTINEL_NAME).exists(),
                }
            )
        for j, case in enumerate(INTERRUPT_CASES):
            root = base / f"interrupt{j}"
            root.mkdir()
            args = case.args(source, root)
            code, err, left = interrupted_run(case, source, root)
            rows.append(
                {
                    "case": case.name,
                    "command": command_line(args, None, root, base) + f" ({case.signal_name})",
                    "message": shown(err.strip().splitlines()[-1], root, base),
                    "exit": code,
                    "left_behind": left,
                }
            )
        rows += list(mounted_cases(base, source, ckpt))
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    commit = git.stdout.strip()
    RESULT.write_text(
        json.dumps(
            {
                "command": "PYTHONPATH=. python benchmarks/fault_table.py",
                "commit": commit,
                "machine": platform.platform(),
                "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                "cases": rows,
            },
            indent=1,
        )
        + "\n",
        encoding="utf-8",
    )
    print(
        f"wrote {RESULT.relative_to(ROOT)}: {len(rows)} cases, "
        f"{sum(r['exit'] in (2, 130) for r in rows)} ended in one error line"
    )


def mounted_cases(base: Path, source: Path, ckpt: Path):
    """Read-only and full outputs, on tmpfs mounts (root only; root ignores chmod)."""
    if os.geteuid() != 0:
        return
    ro, full = base / "ro", base / "full"
    for where, options in ((ro, "size=16m"), (full, "size=1m")):
        where.mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)]).returncode:
            return
    try:
        shutil.copytree(ckpt, ro / "ckpt")
        subprocess.run(["mount", "-o", "remount,ro", str(ro)], check=True)
        for name, args in (
            ("output on a read-only filesystem", ["compress", str(source), "-o", str(ro / "out")]),
            ("`eval --json` to a read-only path", ["eval", str(ro / "ckpt"), "--json", str(ro / "x.json")]),
            ("output on a full filesystem (1 MiB tmpfs)", ["compress", str(source), "-o", str(full / "out")]),
        ):
            code, output = run_cli(args)
            yield {
                "case": name,
                "command": command_line(args, None, base),
                "message": shown(error_line(output), base),
                "exit": code,
            }
    finally:
        for where in (ro, full):
            subprocess.run(["umount", str(where)])


if __name__ == "__main__":
    main()
