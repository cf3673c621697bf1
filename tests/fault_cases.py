"""The fault cases of issue 14 that end in one `error:` line and exit 2, each set up the way a user hits it.

Shared by tests/test_faults.py (which asserts them) and benchmarks/fault_table.py (which prints the table in
docs/reliability.md from real runs). A case's setup builds its bad input under `root` from a good tiny source
and a compiled tiny checkpoint, and returns the CLI arguments.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from kvrewrite.cli.app import app
from kvrewrite.io.checkpoint_io import write_checksums
from kvrewrite.io.manifest import write_manifest

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
    return output[output.index("error:") :] if "error:" in output else output


def _copy(src: Path, dst: Path) -> Path:
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    return dst


def _edit_config(directory: Path, **changes) -> None:
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))


def _edit_tensors(
    directory: Path,
    edit: Callable[[dict], None],
    checksums: bool = False,
    metadata: Callable[[dict], dict] | None = None,
) -> None:
    path = directory / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        stored = f.metadata()
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata=stored if metadata is None else metadata(stored))
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


# ---- issue 38: foreign code in a compressed checkpoint, edited or added files, options checked before any work ----


def _prompt(root: Path) -> Path:
    path = root / "prompt.txt"
    path.write_text("w3 w4 w5 w6 w7 w8 w9 w10")
    return path


def _custom_tokenizer_checkpoint(root, ckpt) -> Path:
    """A compressed checkpoint whose tokenizer is custom code, the manifest re-signed (as whoever edited it would)."""
    d = custom_tokenizer_source(root, ckpt)
    write_manifest(d)
    return d


def _prefill_remote_tokenizer(root, source, ckpt):
    return ["prefill-parallel", str(_custom_tokenizer_checkpoint(root, ckpt)), "--prompt-file", str(_prompt(root))]


def _prefill_config_auto_map(root, source, ckpt):
    d = _copy(ckpt, root / "automap")
    (d / "modeling_evil.py").write_text(
        f"import pathlib\npathlib.Path({str(root / SENTINEL_NAME)!r}).write_text('ran')\n"
    )
    config = json.loads((d / "config.json").read_text())
    config["auto_map"] = {
        "AutoConfig": "modeling_evil.C",
        "AutoModelForCausalLM": "modeling_evil.M",
        "AutoTokenizer": ["modeling_evil.T", None],
    }
    (d / "config.json").write_text(json.dumps(config))
    return ["prefill-parallel", str(d), "--prompt-file", str(_prompt(root))]


def _eval_remote_tokenizer(root, source, ckpt):
    return [
        "eval",
        str(_custom_tokenizer_checkpoint(root, ckpt)),
        "--baseline",
        str(source),
        "--tokens",
        "128",
        "--seq-len",
        "32",
    ]


def _push_foreign_code(root, source, ckpt):
    d = _copy(ckpt, root / "withcode")
    (d / "helper.py").write_text(f"import pathlib\npathlib.Path({str(root / SENTINEL_NAME)!r}).write_text('ran')\n")
    write_manifest(d)
    return ["push", str(d), "someone/model", "--dry-run"]


def _edit_spec(directory: Path, edit: Callable[[dict], None], *, shards: bool = False, resign: bool = True) -> None:
    """Edit the kvrewrite spec in config.json (and, with shards, the one the weights carry), then re-sign."""
    config = json.loads((directory / "config.json").read_text())
    edit(config["kvrewrite"])
    (directory / "config.json").write_text(json.dumps(config))
    if shards:
        _edit_tensors(
            directory, lambda t: None, metadata=lambda m: {**m, "kvrewrite_spec": json.dumps(config["kvrewrite"])}
        )
    if resign:
        write_manifest(directory)


def _eval_at(d: Path, source: Path, rate: str = "0.3") -> list[str]:
    return ["eval", str(d), "--baseline", str(source), "--rates", rate, "--tokens", "128", "--seq-len", "32"]


def _rate_table_edited(root, source, ckpt):
    d = _copy(ckpt, root / "edited")
    _edit_spec(d, lambda s: s["rate_table"].__setitem__("0.30", s["rate_table"]["0.00"]), resign=False)
    return _eval_at(d, source)


def _rate_table_edited_resigned(root, source, ckpt):
    d = _copy(ckpt, root / "edited")
    _edit_spec(d, lambda s: s["rate_table"].__setitem__("0.30", s["rate_table"]["0.00"]))
    return _eval_at(d, source)


def _key_ranks_edited_resigned(root, source, ckpt):
    d = _copy(ckpt, root / "edited")
    _edit_spec(d, lambda s: s["layers"][0].__setitem__("key_ranks", [16, 16]))
    return _eval_at(d, source)


def _codec_edited_resigned(root, source, ckpt):
    d = _copy(ckpt, root / "edited")
    _edit_spec(d, lambda s: s.__setitem__("kv_codec", "int4"))
    return _eval_at(d, source)


def _target_rate_edited_resigned(root, source, ckpt):
    d = _copy(ckpt, root / "edited")
    _edit_spec(d, lambda s: s.__setitem__("target_rate", 0.3))
    return _eval_at(d, source)


def _token_policy_dropped_in(root, source, ckpt):
    d = _copy(ckpt, root / "policy")
    (d / "token_policy.json").write_text(
        json.dumps({"load": {"rate": 0.0, "recent_window": 4, "kv_codec": "none", "evict": None}})
    )
    return _eval_at(d, source)


def _tokenizer_edited(root, source, ckpt):
    d = _copy(ckpt, root / "tok")
    tok = json.loads((d / "tokenizer.json").read_text())
    tok["model"]["vocab"]["w3"], tok["model"]["vocab"]["w4"] = tok["model"]["vocab"]["w4"], tok["model"]["vocab"]["w3"]
    (d / "tokenizer.json").write_text(json.dumps(tok))
    return _eval_at(d, source)


def shared_mla_export(ckpt: Path) -> Path:
    """An MLA export with a rate table and a side file (--refit-rates), built once beside the compiled checkpoint
    from the source next to it."""
    out = ckpt.parent / "mla-export"
    if not out.is_dir():
        code, output = run_cli(
            [
                "export-mla",
                str(ckpt.parent / "src"),
                "--kv-share",
                "0.5",
                "-o",
                str(out),
                "--calibration",
                "synthetic",
                "--calib-tokens",
                "512",
                "--verify-tokens",
                "32",
                "--refit-rates",
                "0.5,0.7",
                "--refit-tokens",
                "256",
            ]
        )
        assert code == 0, output
    return out


def _mla_eval(d: Path, source: Path) -> list[str]:
    return ["eval", str(d), "--baseline", str(source), "--rates", "0.7", "--tokens", "128", "--seq-len", "32"]


def _mla_side_file_scaled(root, source, ckpt):
    d = _copy(shared_mla_export(ckpt), root / "mla")
    path = d / "kvrewrite_rates" / "o_proj.safetensors"
    save_file({k: v * 3 for k, v in load_file(path).items()}, path, metadata={"kvrewrite_form": "mla-rate-o-proj"})
    return _mla_eval(d, source)


def _mla_kv_b_zeroed(root, source, ckpt):
    d = _copy(shared_mla_export(ckpt), root / "mla")
    _edit_tensors(d, lambda t: t["model.layers.0.self_attn.kv_b_proj.weight"].zero_())
    return _mla_eval(d, source)


def _mla_refit_entry_deleted(root, source, ckpt):
    d = _copy(shared_mla_export(ckpt), root / "mla")
    config = json.loads((d / "config.json").read_text())
    config["kvrewrite_mla"]["rate_o_proj"] = []
    (d / "config.json").write_text(json.dumps(config))
    return _mla_eval(d, source)


def _prefill(option: str, value: str):
    def setup(root, source, ckpt):
        return ["prefill-parallel", str(ckpt), "--prompt-file", str(_prompt(root)), option, value]

    return setup


def _prefill_prompt(kind: str):
    def setup(root, source, ckpt):
        if kind == "binary":
            path = root / "prompt.bin"
            path.write_bytes(bytes(range(256)) * 4)
        else:
            path = root / "prompts"
            path.mkdir()
        return ["prefill-parallel", str(ckpt), "--prompt-file", str(path)]

    return setup


def _budget_context(value: str):
    def setup(root, source, ckpt):
        return ["budget", str(ckpt), "--kv-budget", "0.5", "--context", value, "--calibration", str(_prompt(root))]

    return setup


def _budget_on_mla_export(root, source, ckpt):
    return ["budget", str(shared_mla_export(ckpt)), "--kv-budget", "0.5", "--calibration", str(_prompt(root))]


def _export_mla_verify_tokens(root, source, ckpt):
    return [
        "export-mla",
        str(source),
        "-o",
        str(root / "out"),
        "--calibration",
        "synthetic",
        "--calib-tokens",
        "512",
        "--verify-tokens",
        "0",
    ]


def _eval_option(option: str, value: str):
    def setup(root, source, ckpt):
        return ["eval", str(ckpt), "--baseline", str(source), "--no-save", option, value]

    return setup


def _export_mla_key_weight(root, source, ckpt):
    return [
        "export-mla",
        str(source),
        "-o",
        str(root / "out"),
        "--calibration",
        "synthetic",
        "--calib-tokens",
        "512",
        "--key-weight",
        "-1",
    ]


def _tiny_kv_budget(root, source, ckpt):
    return _compress(source, root / "out", "--kv-budget", "1e-9")


CASES = [
    FaultCase(
        "`compress selfsrc -o selfsrc --overwrite` (output is the source)",
        _self_output,
        ("is the source model directory",),
    ),
    FaultCase(
        "`compress proj/model -o proj --overwrite` (output holds the source)",
        _parent_output,
        ("contains the source model",),
    ),
    FaultCase("`-o` inside the source directory", _inside_output, ("lies inside the source model directory",)),
    FaultCase("`-o ..` run from inside the model directory", _dotdot_output, ("contains the source model",)),
    FaultCase(
        "`--overwrite` on a directory kvrewrite did not write",
        _foreign_overwrite,
        ("is not a kvrewrite checkpoint", "nothing was deleted"),
    ),
    FaultCase("`eval CKPT --baseline CKPT` (compared with itself)", _eval_self, ("itself",)),
    FaultCase(
        "`eval` with a compressed checkpoint as baseline",
        _eval_compressed_baseline,
        ("is itself a kvrewrite checkpoint",),
    ),
    FaultCase("`eval --json /nonexistent_dir/x.json`", _eval_json_missing_dir, ("--json", "does not exist")),
    FaultCase("config.json that is not JSON", _bad_json, ("config.json is not valid JSON",)),
    FaultCase(
        "num_key_value_heads that does not divide num_attention_heads",
        _kv_heads,
        ("num_key_value_heads (3)", "num_attention_heads (4)"),
    ),
    FaultCase(
        "a weight of the wrong shape",
        _wrong_shape,
        ("model.safetensors", "model.layers.1.self_attn.k_proj.weight", "[30, 64]", "[32, 64]"),
    ),
    FaultCase("NaN in a weight", _nan_weight, ("model.safetensors", "model.layers.0.mlp.up_proj.weight", "non-finite")),
    FaultCase("unknown model_type", _unknown_type, ("'mamba-x'", "supported model types: ", "llama")),
    FaultCase(
        "a compressed checkpoint given to compress", _already_compressed, ("already a kvrewrite checkpoint", "rate=")
    ),
    FaultCase("`-p 50%`", _percent_rate, ("'50%'", "pass 0.5")),
    FaultCase("`--probe-rates abc`", _probe_rates, ("--probe-rates", "'abc'")),
    FaultCase("a local path that does not exist", _missing_local, ("models/llama-3/8b-typo", "does not exist")),
    FaultCase(
        "custom tokenizer code (auto_map), `y` on stdin",
        _remote_code,
        ("custom tokenizer code", "never runs code"),
        stdin="y\ny\ny\n",
    ),
    FaultCase(
        "a mis-shaped tensor in a compressed checkpoint (`eval`)",
        _misshaped_compressed,
        ("model.safetensors", "model.layers.0.self_attn.k_proj.weight", "[33, 64]"),
    ),
    # issue 38
    FaultCase(
        "`prefill-parallel` on a checkpoint whose tokenizer is custom code (auto_map, manifest re-signed), `y` on stdin",
        _prefill_remote_tokenizer,
        ("custom tokenizer code", "never runs code"),
        stdin="y\ny\ny\n",
    ),
    FaultCase(
        "`prefill-parallel` on a checkpoint whose config.json gained an auto_map and a modeling_evil.py, `y` on stdin",
        _prefill_config_auto_map,
        ("config.json", "corrupt or modified"),
        stdin="y\ny\ny\n",
    ),
    FaultCase(
        "`eval` of a checkpoint whose tokenizer is custom code (manifest re-signed), `y` on stdin",
        _eval_remote_tokenizer,
        ("custom tokenizer code", "never runs code"),
        stdin="y\ny\ny\n",
    ),
    FaultCase(
        "`push --dry-run` of a checkpoint holding a foreign helper.py (manifest re-signed)",
        _push_foreign_code,
        ("helper.py", "nothing was uploaded"),
    ),
    FaultCase(
        "config.json's rate-table entry 0.30 replaced by 0.00's (`eval --rates 0.3`)",
        _rate_table_edited,
        ("config.json", "corrupt or modified"),
    ),
    FaultCase(
        "the same edit with the manifest re-signed",
        _rate_table_edited_resigned,
        ("rate_table entry 0.30", "in the weights"),
    ),
    FaultCase(
        "layer 0's key_ranks edited, manifest re-signed",
        _key_ranks_edited_resigned,
        ("layer 0 key_ranks", "in the weights"),
    ),
    FaultCase(
        "kv_codec edited to int4, manifest re-signed",
        _codec_edited_resigned,
        ("kv_codec is 'int4' in config.json", "None in the weights"),
    ),
    FaultCase(
        "target_rate edited, manifest re-signed",
        _target_rate_edited_resigned,
        ("target_rate is 0.3 in config.json", "0.5 in the weights"),
    ),
    FaultCase(
        "a token_policy.json dropped into a checkpoint that never had one",
        _token_policy_dropped_in,
        ("token_policy.json is not listed",),
    ),
    FaultCase(
        "tokenizer.json edited (two tokens swapped)", _tokenizer_edited, ("tokenizer.json", "corrupt or modified")
    ),
    FaultCase(
        "MLA export: side file kvrewrite_rates/o_proj.safetensors scaled by 3 (`eval --rates 0.7`)",
        _mla_side_file_scaled,
        ("kvrewrite_rates/o_proj.safetensors", "corrupt or modified"),
    ),
    FaultCase("MLA export: layer 0's kv_b_proj zeroed", _mla_kv_b_zeroed, ("model.safetensors", "corrupt or modified")),
    FaultCase(
        "MLA export: a rate's refit entry deleted from the kvrewrite_mla marker",
        _mla_refit_entry_deleted,
        ("config.json", "corrupt or modified"),
    ),
    FaultCase(
        "`prefill-parallel --rate 0.33` (not in the rate table)",
        _prefill("--rate", "0.33"),
        ("rate 0.33", "rate table"),
    ),
    FaultCase("`prefill-parallel --threads 0`", _prefill("--threads", "0"), ("--threads 0",)),
    FaultCase(
        "`prefill-parallel --prompt-file` on a binary file", _prefill_prompt("binary"), ("--prompt-file", "not UTF-8")
    ),
    FaultCase(
        "`prefill-parallel --prompt-file` on a directory",
        _prefill_prompt("directory"),
        ("--prompt-file", "is a directory"),
    ),
    FaultCase("`budget --context 0`", _budget_context("0"), ("--context 0",)),
    FaultCase("`budget --context -5`", _budget_context("-5"), ("--context -5",)),
    FaultCase("`budget --context 2` (below the full-rank window)", _budget_context("2"), ("--context 2",)),
    FaultCase("`budget` on an MLA export", _budget_on_mla_export, ("is an MLA export", "kvrewrite budget")),
    FaultCase("`export-mla --verify-tokens 0`", _export_mla_verify_tokens, ("--verify-tokens 0",)),
    FaultCase("`eval --tokens 0`", _eval_option("--tokens", "0"), ("--tokens 0",)),
    FaultCase("`eval --chunk 0`", _eval_option("--chunk", "0"), ("--chunk 0",)),
    FaultCase("`export-mla --key-weight -1`", _export_mla_key_weight, ("--key-weight -1",)),
    FaultCase("`compress --kv-budget 1e-9` (no split can fit)", _tiny_kv_budget, ("--kv-budget", "no split")),
]


# ---- interrupts: a real `kvrewrite` process, signalled while it imports or while it compiles ----------------------

CONSOLE = "import sys; sys.argv[0] = 'kvrewrite'; from kvrewrite.cli.app import main; main()"  # as the console script


@dataclass(frozen=True)
class InterruptCase:
    name: str
    args: Callable[[Path, Path], list[str]]  # (source, working directory) -> CLI args
    signal_name: str  # SIGINT or SIGTERM
    after_line: str | None = None  # signal once stdout shows a line starting so; None: 0.5 s in, inside the imports


def interrupted_run(case: InterruptCase, source: Path, cwd: Path) -> tuple[int, str, list[str]]:
    """Run the case in a fresh process in `cwd`, signal it; (exit code, stderr, what is left in cwd)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    process = subprocess.Popen(
        [sys.executable, "-c", CONSOLE, *case.args(source, cwd)],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    sig = getattr(signal, case.signal_name)
    if case.after_line is None:
        time.sleep(0.5)  # torch and transformers take seconds to import: the signal lands inside an import
        process.send_signal(sig)
    else:
        for line in process.stdout:
            if line.startswith(case.after_line):
                process.send_signal(sig)
                break
    out, err = process.communicate(timeout=180)
    return (
        process.returncode,
        err + ("Traceback in stdout" if "Traceback" in out else ""),
        sorted(p.name for p in cwd.iterdir()),
    )


def _compress_synthetic(source: Path, cwd: Path) -> list[str]:
    return ["compress", str(source), "-o", str(cwd / "out"), "--calibration", "synthetic", "--calib-tokens", "512"]


INTERRUPT_CASES = [
    InterruptCase("Ctrl-C while the command imports", lambda source, cwd: ["--help"], "SIGINT"),
    InterruptCase("SIGTERM while the command imports", lambda source, cwd: ["--help"], "SIGTERM"),
    InterruptCase("Ctrl-C during `compress` (at its third pass)", _compress_synthetic, "SIGINT", after_line="[3/"),
    InterruptCase("SIGTERM during `compress` (at its third pass)", _compress_synthetic, "SIGTERM", after_line="[3/"),
]
