"""The fault cases of issue 14 that end in one `error:` line and exit 2, each set up the way a user hits it.

Shared by tests/test_faults.py (which asserts them) and benchmarks/fault_table.py (which prints the table in
docs/reliability.md from real runs). A case's setup builds its bad input under `root` from a good tiny source
and a compiled tiny checkpoint, and returns the CLI arguments.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from kvrewrite.io.checkpoint_io import write_checksums
from kvrewrite.cli.app import app

SENTINEL_NAME = "CODE-RAN"


@dataclass(frozen=True)
class FaultCase:
    name: str  # what the user did
    setup: Callable[[Path, Path, Path], list[str]]  # (root, good source, compiled checkpoint) -> CLI args
    needles: tuple[str, ...]  # what the message must contain
    stdin: str | None = None


def flat(text: str) -> str:
    return " ".join(text.split())


def run_cli(args: list[str], stdin: str | None = None) -> tuple[int, str]:
    result = CliRunner().invoke(app, args, input=stdin)
    return result.exit_code, flat(result.output)


def error_line(output: str) -> str:
    return output[output.index("error:"):] if "error:" in output else output


def _copy(src: Path, dst: Path) -> Path:
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    return dst


def _edit_config(directory: Path, **changes) -> None:
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))


def _edit_tensors(directory: Path, edit: Callable[[dict], None], checksums: bool = False) -> None:
    path = directory / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata=metadata)
    if checksums:  # re-sign, as someone re-saving the file with a tool would
        write_checksums(directory, ["model.safetensors"])


def _compress(source: Path, out: Path, *extra: str) -> list[str]:
    return ["compress", str(source), "-o", str(out), *extra]


def _self_output(root, source, ckpt):
    d = _copy(source, root / "selfsrc")
    return ["compress", str(d), "-p", "0.5", "-o", str(d), "--overwrite"]


def _parent_output(root, source, ckpt):
    d = _copy(source, root / "proj" / "model")
    (root / "proj" / "notes.txt").write_text("my notes")
    return _compress(d, root / "proj", "--overwrite")


def _inside_output(root, source, ckpt):
    return _compress(source, source / "out")


def _dotdot_output(root, source, ckpt):
    os.chdir(source)  # `-o ..` from inside the model directory
    return _compress(Path("."), Path(".."), "--overwrite")


def _foreign_overwrite(root, source, ckpt):
    d = root / "mine"
    d.mkdir(exist_ok=True)
    (d / "thesis.tex").write_text("years of work")
    return _compress(source, d, "--overwrite")


def _eval_self(root, source, ckpt):
    return ["eval", str(ckpt), "--baseline", str(ckpt)]


def _eval_compressed_baseline(root, source, ckpt):
    return ["eval", str(ckpt), "--baseline", str(_copy(ckpt, root / "other-ckpt"))]


def _eval_json_missing_dir(root, source, ckpt):
    return ["eval", str(ckpt), "--json", "/nonexistent_dir_kvrewrite/x.json"]


def _bad_json(root, source, ckpt):
    d = _copy(source, root / "badjson")
    (d / "config.json").write_text('{"model_type": "llama",')
    return _compress(d, root / "out")


def _kv_heads(root, source, ckpt):
    d = _copy(source, root / "kvheads")
    _edit_config(d, num_key_value_heads=3)
    return _compress(d, root / "out")


def _wrong_shape(root, source, ckpt):
    d = _copy(source, root / "shape")
    _edit_tensors(d, lambda t: t.__setitem__("model.layers.1.self_attn.k_proj.weight", torch.zeros(30, 64)))
    return _compress(d, root / "out")


def _nan_weight(root, source, ckpt):
    d = _copy(source, root / "nan")
    _edit_tensors(d, lambda t: t["model.layers.0.mlp.up_proj.weight"].__setitem__((3, 5), float("nan")))
    return _compress(d, root / "out")


def _unknown_type(root, source, ckpt):
    d = _copy(source, root / "mtype")
    _edit_config(d, model_type="mamba-x")
    return _compress(d, root / "out")


def _already_compressed(root, source, ckpt):
    return _compress(ckpt, root / "out")


def _percent_rate(root, source, ckpt):
    return _compress(source, root / "out", "-p", "50%")


def _probe_rates(root, source, ckpt):
    return _compress(source, root / "out", "--probe-rates", "abc")


def _missing_local(root, source, ckpt):
    os.chdir(root)
    return ["compress", "models/llama-3/8b-typo", "-o", str(root / "out")]


def custom_tokenizer_source(root: Path, source: Path) -> Path:
    """A source whose tokenizer is custom code; importing that code would create root/CODE-RAN."""
    d = _copy(source, root / "remote")
    (d / "tokenization_evil.py").write_text(
        f"import pathlib\npathlib.Path({str(root / SENTINEL_NAME)!r}).write_text('ran')\n"
        "from transformers import PreTrainedTokenizerFast\nclass EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    tok = json.loads((d / "tokenizer_config.json").read_text())
    tok.update(tokenizer_class="EvilTokenizer", auto_map={"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]})
    (d / "tokenizer_config.json").write_text(json.dumps(tok))
    return d


def _remote_code(root, source, ckpt):
    return _compress(custom_tokenizer_source(root, source), root / "out")


def _misshaped_compressed(root, source, ckpt):
    d = _copy(ckpt, root / "ckpt-bad")
    name = "model.layers.0.self_attn.k_proj.weight"
    _edit_tensors(d, lambda t: t.__setitem__(name, torch.zeros(t[name].shape[0] + 1, t[name].shape[1])), checksums=True)
    return ["eval", str(d), "--baseline", str(source), "--tokens", "128", "--seq-len", "32"]


CASES = [
    FaultCase("`compress selfsrc -o selfsrc --overwrite` (output is the source)", _self_output, ("is the source model directory",)),
    FaultCase("`compress proj/model -o proj --overwrite` (output holds the source)", _parent_output, ("contains the source model",)),
    FaultCase("`-o` inside the source directory", _inside_output, ("lies inside the source model directory",)),
    FaultCase("`-o ..` run from inside the model directory", _dotdot_output, ("contains the source model",)),
    FaultCase("`--overwrite` on a directory kvrewrite did not write", _foreign_overwrite, ("is not a kvrewrite checkpoint", "nothing was deleted")),
    FaultCase("`eval CKPT --baseline CKPT` (compared with itself)", _eval_self, ("itself",)),
    FaultCase("`eval` with a compressed checkpoint as baseline", _eval_compressed_baseline, ("is itself a kvrewrite checkpoint",)),
    FaultCase("`eval --json /nonexistent_dir/x.json`", _eval_json_missing_dir, ("--json", "does not exist")),
    FaultCase("config.json that is not JSON", _bad_json, ("config.json is not valid JSON",)),
    FaultCase("num_key_value_heads that does not divide num_attention_heads", _kv_heads, ("num_key_value_heads (3)", "num_attention_heads (4)")),
    FaultCase("a weight of the wrong shape", _wrong_shape, ("model.safetensors", "model.layers.1.self_attn.k_proj.weight", "[30, 64]", "[32, 64]")),
    FaultCase("NaN in a weight", _nan_weight, ("model.safetensors", "model.layers.0.mlp.up_proj.weight", "non-finite")),
    FaultCase("unknown model_type", _unknown_type, ("'mamba-x'", "supported model types: ", "llama")),
    FaultCase("a compressed checkpoint given to compress", _already_compressed, ("already a kvrewrite checkpoint", "rate=")),
    FaultCase("`-p 50%`", _percent_rate, ("'50%'", "pass 0.5")),
    FaultCase("`--probe-rates abc`", _probe_rates, ("--probe-rates", "'abc'")),
    FaultCase("a local path that does not exist", _missing_local, ("models/llama-3/8b-typo", "does not exist")),
    FaultCase("custom tokenizer code (auto_map), `y` on stdin", _remote_code, ("custom tokenizer code", "never runs code"), stdin="y\ny\ny\n"),
    FaultCase("a mis-shaped tensor in a compressed checkpoint (`eval`)", _misshaped_compressed, ("model.safetensors", "model.layers.0.self_attn.k_proj.weight", "[33, 64]")),
]
