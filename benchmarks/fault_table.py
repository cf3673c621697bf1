"""Print docs/reliability.md's fault table from real runs: each case of tests/fault_cases.py through the CLI.

    PYTHONPATH=. python benchmarks/fault_table.py > /tmp/table.md

Builds a tiny random Llama and compiles it once (about 20 s on 2 CPU cores), then runs every case in its own
temporary directory; paths are shown relative to that directory.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from fault_cases import CASES, error_line, run_cli  # noqa: E402
from tiny_models import save_tiny_llama, tiny_pipeline  # noqa: E402

from kvrewrite.compile.passes.pipeline import run_pipeline  # noqa: E402
from kvrewrite.compile.plan import Plan  # noqa: E402


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    home = Path.cwd()
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        source = save_tiny_llama(base / "src")
        ckpt = base / "ckpt"
        run_pipeline(Plan(model=str(source), output=ckpt, progress=False), tiny_pipeline())
        print("| case | message (real output) | exit |")
        print("|---|---|---|")
        for i, case in enumerate(CASES):
            root = base / f"case{i}"
            root.mkdir()
            args = case.setup(root, source, ckpt)
            code, output = run_cli(args, case.stdin)
            os.chdir(home)
            message = error_line(output).replace(str(root) + "/", "").replace(str(root), ".")
            message = message.replace(str(base) + "/", "").replace(str(base), ".").replace("|", "\\|")
            print(f"| {case.name} | `{message}` | {code} |")
        for name, args in mounted_cases(base, source, ckpt):
            code, output = run_cli(args)
            message = error_line(output).replace(str(base) + "/", "")
            print(f"| {name} | `{message}` | {code} |")


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
        yield "output on a read-only filesystem", ["compress", str(source), "-o", str(ro / "out")]
        yield "`eval --json` to a read-only path", ["eval", str(ro / "ckpt"), "--json", str(ro / "x.json")]
        yield "output on a full filesystem (1 MiB tmpfs)", ["compress", str(source), "-o", str(full / "out")]
    finally:
        for where in (ro, full):
            subprocess.run(["umount", str(where)])


if __name__ == "__main__":
    main()
