"""Each optional package is needed by its own feature only: a compile with synthetic calibration runs without
gensim, scikit-learn or matplotlib; asking for a feature whose package is missing fails up front, in one line that
names the package and the feature. The packages are made unimportable in a fresh interpreter (sys.modules[name]
= None: `import gensim` raises ImportError and find_spec answers None), nothing is uninstalled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import save_tiny_llama

ROOT = Path(__file__).resolve().parents[1]
OPTIONAL = ("gensim", "sklearn", "matplotlib")


def _kvrewrite(args: list[str], blocked: tuple[str, ...], cache: Path) -> subprocess.CompletedProcess:
    script = (
        "import sys\n"
        f"for name in {list(blocked)!r}:\n"
        "    sys.modules[name] = None\n"
        "from kvrewrite.cli.app import main\n"
        f"sys.argv = ['kvrewrite', *{args!r}]\n"
        "main()\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KVREWRITE_CACHE": str(cache), "COLUMNS": "1000"}
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("src") / "tiny")


def test_compress_with_synthetic_calibration_needs_no_optional_package(tiny_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    run = _kvrewrite(
        [
            "compress",
            str(tiny_dir),
            "-o",
            str(out),
            "--target-rate",
            "0.5",
            "--calibration",
            "synthetic",
            "--calib-tokens",
            "256",
            "--seq-len",
            "64",
            "--verify-tokens",
            "32",
        ],
        OPTIONAL,
        tmp_path / "cache",
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((out / "compress_report.json").read_text())
    assert report["calibration"]["source"] == "synthetic" and report["calibration"]["tokens"] == 256


@pytest.mark.parametrize(
    "extra,blocked,package,feature",
    [
        (["--calibration", "wiki"], ("gensim",), "gensim", "--calibration wiki"),
        (["--calibration", "synthetic", "--reduce", "kmeans"], ("sklearn",), "scikit-learn", "--reduce kmeans"),
    ],
)
def test_a_feature_without_its_package_fails_up_front_naming_both(
    tiny_dir: Path, tmp_path: Path, extra, blocked, package, feature
) -> None:
    run = _kvrewrite(
        ["compress", str(tiny_dir), "-o", str(tmp_path / "out"), "--calib-tokens", "256", *extra],
        blocked,
        tmp_path / "cache",
    )
    assert run.returncode == 2
    error = [line for line in run.stdout.splitlines() if line.startswith("error:")]
    assert len(error) == 1, run.stdout
    assert f"needs {package}, which is not installed" in error[0] and feature in error[0]
    assert "[1/" not in run.stdout, "no pass may start"
    assert not (tmp_path / "out").exists()
