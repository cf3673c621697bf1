"""Issue 14's fault suite: nothing lost, nothing run, no tracebacks.

* every case of tests/fault_cases.py ends in one `error:` line and exit 2, and the user's files are intact;
* kills (SIGINT, SIGTERM, SIGKILL) at every write step of emit, through the KVREWRITE_FAULT hook: after each,
  the old or the new output is complete in place, and after the next run's recovery nothing hidden remains;
* read-only and full outputs, concurrent compiles to one output, and code in a model directory never running.

Kills run Emit in a forked child of this process (the compile before it is done once), so each costs
milliseconds instead of an interpreter start.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from fault_cases import (
    CASES,
    INTERRUPT_CASES,
    SENTINEL_NAME,
    custom_tokenizer_source,
    error_line,
    interrupted_run,
    run_cli,
)
from tiny_models import save_tiny_llama, tiny_pipeline

from kvrewrite.compile.passes.base import run_pass
from kvrewrite.compile.passes.context import CompileContext
from kvrewrite.compile.passes.emit import MODELING_FILE, Emit
from kvrewrite.compile.passes.load_checkpoint import LoadCheckpoint
from kvrewrite.compile.passes.pipeline import prepare_output, run_pipeline
from kvrewrite.compile.plan import Plan
from kvrewrite.errors import CorruptCheckpointError, KVRewriteWarning, ModelSourceError, OutputError
from kvrewrite.io.checkpoint_io import verify_checksums
from kvrewrite.io.fault_injection import FAULT_ENV, NO_EXCHANGE_ENV
from kvrewrite.io.output_safety import recover_leftovers

OLD_MARKER = "old-output-marker.txt"
IS_ROOT = os.geteuid() == 0


def tree_digest(directory: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(p for p in Path(directory).rglob("*") if p.is_file()):
        h.update(str(path.relative_to(directory)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def hidden(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("faults")


@pytest.fixture(scope="module")
def source(root):
    d = save_tiny_llama(root / "src")
    (d / "helper.py").write_text("raise SystemExit('a source .py must never be copied or run')\n")
    return d


@pytest.fixture(scope="module")
def compiled(root, source):
    """A finished compile: the context just before Emit (for kills) and its checkpoint."""
    ckpt = root / "ckpt"
    passes = tiny_pipeline()
    ctx = run_pipeline(Plan(model=str(source), output=ckpt, progress=False), passes)
    return ctx, ckpt


# ---------------------------------------------------------------------------------------------------------------------
# Every case: one error line, exit 2, nothing lost
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_fault_case_is_one_error_line(case, tmp_path, source, compiled, monkeypatch):
    monkeypatch.chdir(tmp_path)
    src = shutil.copytree(source, tmp_path / "src-copy")
    before = tree_digest(src)
    args = case.setup(tmp_path, src, compiled[1])
    code, output = run_cli(args, case.stdin)
    assert code == 2 and output.count("error:") == 1 and "Traceback" not in output, output
    message = error_line(output)
    assert "trust_remote_code=True" not in message  # never the advice to run shipped code
    for needle in case.needles:
        assert needle in message, f"{needle!r} not in {message}"
    assert tree_digest(src) == before  # the source is untouched whatever happened
    assert not (tmp_path / "out").exists()
    assert not (tmp_path / SENTINEL_NAME).exists()


def test_data_loss_cases_keep_every_user_file(tmp_path, source):
    selfsrc = shutil.copytree(source, tmp_path / "selfsrc")
    proj = tmp_path / "proj"
    shutil.copytree(source, proj / "model")
    (proj / "notes.txt").write_text("my notes")
    digests = {p: tree_digest(p) for p in (selfsrc, proj)}
    assert run_cli(["compress", str(selfsrc), "-p", "0.5", "-o", str(selfsrc), "--overwrite"])[0] == 2
    assert run_cli(["compress", str(proj / "model"), "-o", str(proj), "--overwrite"])[0] == 2
    assert {p: tree_digest(p) for p in digests} == digests
    assert hidden(tmp_path) == []


# ---------------------------------------------------------------------------------------------------------------------
# Kills at every write step
# ---------------------------------------------------------------------------------------------------------------------

EMIT_POINTS = [
    "emit:tmp",
    "emit:shard-1",
    "emit:shard-2",
    "emit:shards",
    "emit:config",
    "emit:tokenizer",
    "emit:metadata",
    "emit:report",
    "emit:checksums",
    "swap:start",
    "swap:exchanged",
]
# The two-rename swap (systems without RENAME_EXCHANGE) has a moment with no output in place; recovery covers it.
FALLBACK_POINTS = ["swap:old-moved", "swap:replaced"]
SIGNALS = ["SIGINT", "SIGTERM", "SIGKILL"]


def child_setup() -> None:
    """In a forked child: one torch thread (OpenMP's pool does not survive fork and would hang), default
    signal handling, and a watchdog so a hang fails the test instead of blocking the suite."""
    import faulthandler

    import torch

    torch.set_num_threads(1)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    faulthandler.dump_traceback_later(60, exit=True)


def emit_in_child(ctx: CompileContext, out: Path, env: dict[str, str], overwrite: bool = True) -> int:
    """Run Emit into `out` in a forked child with `env` set; its wait status (signal or exit code 0/3)."""
    # Small shards, so the kills also land between two shard writes.
    plan = dataclasses.replace(ctx.plan, output=out, overwrite=overwrite, max_shard_size="100KB")
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 0
        try:
            child_setup()
            os.environ.update(env)
            Emit().run(dataclasses.replace(ctx, plan=plan))
        except BaseException as exc:  # noqa: BLE001 - the child reports by exit code only
            code = 4 if isinstance(exc, OutputError) else 3
            if os.environ.get("KVREWRITE_TEST_DEBUG"):
                print(repr(exc), file=sys.stderr)
        finally:
            os._exit(code)
    return os.waitpid(pid, 0)[1]


def old_output(ctx, where: Path) -> Path:
    """A complete previous output, told apart from a new one by a marker file."""
    status = emit_in_child(ctx, where, {}, overwrite=False)
    assert status == 0 and where.is_dir()
    (where / OLD_MARKER).write_text("old")
    return where


def state_of(out: Path) -> str:
    if not out.is_dir():
        return "missing"
    verify_checksums(out)  # complete: every listed file present and matching
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    return "old" if (out / OLD_MARKER).is_file() else "new"


@pytest.mark.parametrize("sig", SIGNALS)
@pytest.mark.parametrize("point", EMIT_POINTS + FALLBACK_POINTS)
def test_kill_at_every_write_step(point, sig, tmp_path, compiled):
    ctx = compiled[0]
    out = old_output(ctx, tmp_path / "out")
    env = {FAULT_ENV: f"{point}:{sig}", "TOKENIZERS_PARALLELISM": "false"}
    if point in FALLBACK_POINTS:
        env[NO_EXCHANGE_ENV] = "1"
    status = emit_in_child(ctx, out, env)
    assert status != 0, "the fault point was never reached"
    state = state_of(out)
    # Before the swap the old output stands; after it the new one. Only a hard kill between the two renames of
    # the fallback swap leaves no output in place, and the next run restores the old one.
    before_swap = point.startswith("emit:") or point == "swap:start" or (point == "swap:old-moved" and sig == "SIGINT")
    if point == "swap:old-moved" and sig != "SIGINT":
        assert state == "missing"
    else:
        assert state == ("old" if before_swap else "new"), (point, sig, state)
    if sig == "SIGINT":  # an interrupt cleans up after itself at once (bar the deletion of the replaced copy)
        assert hidden(tmp_path) == [] or point == "swap:replaced"
    with warnings.catch_warnings(record=True):
        notes = recover_leftovers(out)  # what the next run does first
    assert state_of(out) == ("old" if state == "missing" else state)
    assert hidden(tmp_path) == [], notes


def test_next_run_reports_and_clears_leftovers(tmp_path, compiled, source):
    ctx = compiled[0]
    out = old_output(ctx, tmp_path / "out")
    assert emit_in_child(ctx, out, {FAULT_ENV: "emit:config:SIGKILL"}) != 0
    assert emit_in_child(ctx, out, {FAULT_ENV: "swap:old-moved:SIGKILL", NO_EXCHANGE_ENV: "1"}) != 0
    assert not out.exists() and len(hidden(tmp_path)) == 3  # two partial writes and the moved-aside output
    plan = Plan(model=str(source), output=out, overwrite=True, progress=False)
    with pytest.warns(KVRewriteWarning) as caught:
        prepare_output(out, plan)
    messages = " | ".join(str(w.message) for w in caught)
    assert "partial checkpoint left by an interrupted run" in messages and f"restored {out}" in messages
    assert state_of(out) == "old" and hidden(tmp_path) == []


def test_live_write_is_left_alone(tmp_path, compiled):
    """Recovery never removes the temporary directory of a compile that is still running (it holds the lock)."""
    from kvrewrite.io.checkpoint_io import atomic_output_dir

    out = tmp_path / "out"
    with atomic_output_dir(out) as tmp:
        notes = recover_leftovers(out)
        assert tmp.is_dir() and any("another kvrewrite run" in n for n in notes)


def test_concurrent_compiles_to_one_output(tmp_path, compiled):
    ctx = compiled[0]
    out = tmp_path / "out"
    plan = dataclasses.replace(ctx.plan, output=out, overwrite=False)
    children = []
    for _ in range(2):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            code = 0
            try:
                child_setup()
                Emit().run(dataclasses.replace(ctx, plan=plan))
            except Exception as exc:  # noqa: BLE001
                code = 5 if "already exists" in str(exc) or "appeared while writing" in str(exc) else 3
            finally:
                os._exit(code)
        children.append(pid)
    codes = sorted(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children)
    assert codes == [0, 5], codes  # one wins, the other is refused with a message; neither clobbers
    assert state_of(out) == "new" and hidden(tmp_path) == []


# ---------------------------------------------------------------------------------------------------------------------
# Read-only and full outputs
# ---------------------------------------------------------------------------------------------------------------------


def _mount_tmpfs(where: Path, options: str) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    if not IS_ROOT:
        return False
    return (
        subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True).returncode
        == 0
    )


def _umount(where: Path) -> None:
    subprocess.run(["umount", str(where)], capture_output=True)


@pytest.fixture
def read_only_dir(tmp_path, compiled):
    """A read-only directory holding a checkpoint: a read-only tmpfs as root (root ignores chmod), else chmod 555."""
    where = tmp_path / "ro"
    if _mount_tmpfs(where, "size=16m,mode=0755"):
        shutil.copytree(compiled[1], where / "ckpt")
        assert subprocess.run(["mount", "-o", "remount,ro", str(where)], capture_output=True).returncode == 0
        yield where
        _umount(where)
        return
    if IS_ROOT:
        pytest.skip(
            "running as root without permission to mount a tmpfs: root ignores chmod, so no read-only directory"
        )
    shutil.copytree(compiled[1], where / "ckpt")
    os.chmod(where / "ckpt", 0o555)
    os.chmod(where, 0o555)
    yield where
    os.chmod(where, 0o755)
    os.chmod(where / "ckpt", 0o755)


def test_read_only_output_refused_before_work(read_only_dir, source):
    code, output = run_cli(["compress", str(source), "-o", str(read_only_dir / "out")])
    assert code == 2 and "is not writable" in error_line(output) and "[1/" not in output, output
    code, output = run_cli(["eval", str(read_only_dir / "ckpt"), "--json", str(read_only_dir / "x.json")])
    assert code == 2 and "--json" in error_line(output) and "not writable" in error_line(output), output


def test_inspect_read_only_checkpoint_prints_tables(read_only_dir):
    code, output = run_cli(["inspect", str(read_only_dir / "ckpt")])
    assert code == 0 and "warning:" in output and "--plot" in output and "Traceback" not in output, output


def test_full_output_refused_before_work(tmp_path, source):
    where = tmp_path / "full"
    if not _mount_tmpfs(where, "size=1m"):
        pytest.skip("needs root and permission to mount a 1 MiB tmpfs (a full disk cannot be faked otherwise)")
    try:
        code, output = run_cli(["compress", str(source), "-o", str(where / "out")])
        assert code == 2 and "not enough free space" in error_line(output) and "[1/" not in output, output
    finally:
        _umount(where)


def test_disk_full_during_emit_keeps_old_output(tmp_path, compiled):
    """Space running out mid-write (another process filled the disk): an error, and the old output intact."""
    where = tmp_path / "tiny"
    if not _mount_tmpfs(where, "size=200k"):
        pytest.skip("needs root and permission to mount a small tmpfs")
    try:
        ctx = compiled[0]
        out = where / "out"
        out.mkdir()  # a small old output: the new one cannot fit beside it
        shutil.copy(compiled[1] / "config.json", out)
        (out / "kvrewrite_checksums.json").write_text("{}")
        (out / OLD_MARKER).write_text("old")
        before = tree_digest(out)
        status = emit_in_child(ctx, out, {})
        assert os.waitstatus_to_exitcode(status) == 4  # OutputError, not a traceback
        assert tree_digest(out) == before and hidden(where) == []
    finally:
        _umount(where)


# ---------------------------------------------------------------------------------------------------------------------
# Code in a model directory never runs; nothing of it is copied
# ---------------------------------------------------------------------------------------------------------------------


def test_custom_code_never_runs_with_y_on_stdin(tmp_path, source):
    remote = custom_tokenizer_source(tmp_path, source)
    code, output = run_cli(["compress", str(remote), "-o", str(tmp_path / "out")], "y\n" * 5)
    assert code == 2 and "never runs code" in output
    with pytest.raises(ModelSourceError):
        LoadCheckpoint().run(CompileContext(plan=Plan(model=str(remote), progress=False)))
    assert not (tmp_path / SENTINEL_NAME).exists()


def test_config_auto_map_is_ignored(tmp_path, source):
    """A supported model_type with an auto_map loads the built-in class; the shipped modeling code never runs."""
    import json

    d = shutil.copytree(source, tmp_path / "automap")
    (d / "modeling_evil.py").write_text(
        f"import pathlib\npathlib.Path({str(tmp_path / SENTINEL_NAME)!r}).write_text('ran')\n"
    )
    config = json.loads((d / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "modeling_evil.C", "AutoModelForCausalLM": "modeling_evil.M"}
    (d / "config.json").write_text(json.dumps(config))
    ctx = run_pass(CompileContext(plan=Plan(model=str(d), progress=False)), LoadCheckpoint())
    assert type(ctx.config).__module__.startswith("transformers.")
    assert not (tmp_path / SENTINEL_NAME).exists()


def test_compressed_checkpoint_code_is_not_run(tmp_path, compiled):
    """A tampered modeling_kvrewrite.py in a checkpoint is never imported by kvrewrite.load (which names it: the
    manifest lists it) or inspect."""
    import kvrewrite

    ckpt = shutil.copytree(compiled[1], tmp_path / "ckpt")
    (ckpt / MODELING_FILE).write_text(
        f"import pathlib\npathlib.Path({str(tmp_path / SENTINEL_NAME)!r}).write_text('ran')\n"
    )
    with pytest.raises(CorruptCheckpointError, match=MODELING_FILE):
        kvrewrite.load(ckpt)
    assert run_cli(["inspect", str(ckpt)])[0] == 0
    assert not (tmp_path / SENTINEL_NAME).exists()


def test_output_holds_no_source_code(compiled):
    assert sorted(p.name for p in compiled[1].rglob("*.py")) == [MODELING_FILE]


# ---------------------------------------------------------------------------------------------------------------------
# Messages that are warnings, and the load-time mismatch as an exception type
# ---------------------------------------------------------------------------------------------------------------------


def test_extra_tensor_is_named_in_a_warning(tmp_path, source):
    from fault_cases import _edit_tensors

    d = shutil.copytree(source, tmp_path / "extra")
    _edit_tensors(d, lambda t: t.__setitem__("model.stray_adapter.weight", __import__("torch").zeros(3)))
    with pytest.warns(KVRewriteWarning, match=r"model\.stray_adapter\.weight \(model\.safetensors\)"):
        LoadCheckpoint().run(CompileContext(plan=Plan(model=str(d), progress=False)))


def test_misshaped_compressed_tensor_is_corrupt_checkpoint(tmp_path, source, compiled):
    from fault_cases import _misshaped_compressed

    import kvrewrite

    _misshaped_compressed(tmp_path, source, compiled[1])
    with pytest.raises(CorruptCheckpointError, match=r"k_proj\.weight' in .*model\.safetensors"):
        kvrewrite.load(tmp_path / "ckpt-bad")


# ---------------------------------------------------------------------------------------------------------------------
# Issue 38: no foreign code, every written file verified, permissions, export-mla at compress's standard
# ---------------------------------------------------------------------------------------------------------------------


def _from_pretrained_calls_without_trust_remote_code_false() -> list[str]:
    """Every `X.from_pretrained(...)` call in the package that does not pass trust_remote_code=False itself."""
    import ast

    import kvrewrite

    package = Path(kvrewrite.__file__).parent
    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "from_pretrained"
            ):
                passed = {k.arg: k.value for k in node.keywords if k.arg}
                value = passed.get("trust_remote_code")
                if not (isinstance(value, ast.Constant) and value.value is False):
                    found.append(f"{path.relative_to(package.parent)}:{node.lineno}")
    return found


def test_every_from_pretrained_passes_trust_remote_code_false():
    assert _from_pretrained_calls_without_trust_remote_code_false() == []


def test_load_refuses_a_request_to_run_shipped_code(compiled):
    import kvrewrite
    from kvrewrite.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="never runs code"):
        kvrewrite.load(compiled[1], trust_remote_code=True)


def test_manifest_lists_every_file_of_a_checkpoint_and_an_mla_export(compiled):
    from fault_cases import shared_mla_export

    from kvrewrite.io.manifest import read_manifest

    ckpt = compiled[1]
    listed = set(read_manifest(ckpt))
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "modeling_kvrewrite.py",
        "kernel_metadata.json",
        "compress_report.json",
    } <= listed
    assert listed == {p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file()} - {
        "kvrewrite_checksums.json"
    }
    mla = shared_mla_export(ckpt)
    assert set(read_manifest(mla)) == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "kvrewrite_rates/o_proj.safetensors",
    }


def test_a_token_policy_dropped_in_is_refused_by_load(tmp_path, compiled):
    import json

    import kvrewrite

    ckpt = shutil.copytree(compiled[1], tmp_path / "ckpt")
    (ckpt / "token_policy.json").write_text(
        json.dumps({"load": {"rate": 0.0, "recent_window": 4, "kv_codec": "none", "evict": None}})
    )
    with pytest.raises(CorruptCheckpointError, match=r"token_policy\.json is not listed"):
        kvrewrite.load(ckpt)
    from transformers import AutoModelForCausalLM  # the `import kvrewrite` path verifies the same way

    with pytest.raises(CorruptCheckpointError, match=r"token_policy\.json is not listed"):
        AutoModelForCausalLM.from_pretrained(ckpt)


def test_an_edited_config_is_named_whichever_path_loads_it(tmp_path, compiled):
    import json

    from transformers import AutoModelForCausalLM

    import kvrewrite

    ckpt = shutil.copytree(compiled[1], tmp_path / "ckpt")
    config = json.loads((ckpt / "config.json").read_text())
    config["kvrewrite"]["rate_table"]["0.30"] = config["kvrewrite"]["rate_table"]["0.00"]
    (ckpt / "config.json").write_text(json.dumps(config))
    for load in (lambda: kvrewrite.load(ckpt, rate=0.3), lambda: AutoModelForCausalLM.from_pretrained(ckpt, rate=0.3)):
        with pytest.raises(CorruptCheckpointError, match=r"config\.json is corrupt or modified"):
            load()


def test_a_checkpoint_written_before_the_manifest_verifies_what_it_can(tmp_path, compiled):
    """Backwards compatibility, chosen: a shard-only checksum file (kvrewrite before issue 38) loads with one warning;
    its listed shards are verified, config.json is checked field by field against the shards' spec, and a token
    policy it does not list is refused."""
    import json

    import kvrewrite
    from kvrewrite.io.checkpoint_io import write_checksums

    ckpt = shutil.copytree(compiled[1], tmp_path / "old")
    write_checksums(ckpt, ["model.safetensors"])  # what an old compile wrote
    with pytest.warns(KVRewriteWarning, match="lists the weight files only"):
        model = kvrewrite.load(ckpt, rate=0.3)
    assert model.compression_spec.target_rate == 0.3
    config = json.loads((ckpt / "config.json").read_text())
    config["kvrewrite"]["layers"][1]["value_ranks"] = [16, 16]
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.warns(KVRewriteWarning), pytest.raises(CorruptCheckpointError, match="layer 1 value_ranks"):
        kvrewrite.load(ckpt)
    shutil.copy(compiled[1] / "config.json", ckpt / "config.json")
    (ckpt / "token_policy.json").write_text("{}")
    with pytest.raises(CorruptCheckpointError, match=r"token_policy\.json is not listed"):
        kvrewrite.load(ckpt)


def test_an_mla_export_without_a_manifest_loads_with_a_warning(tmp_path, compiled):
    from fault_cases import shared_mla_export

    import kvrewrite

    mla = shutil.copytree(shared_mla_export(compiled[1]), tmp_path / "old-mla")
    (mla / "kvrewrite_checksums.json").unlink()
    with pytest.warns(KVRewriteWarning, match="none of its files can be verified"):
        kvrewrite.load(mla, rate=0.7)


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_written_files_get_the_users_umask(tmp_path, compiled, umask):
    """Shards included (safetensors creates its files 0600): a shared checkpoint is readable as the umask allows."""
    from fault_cases import run_cli

    old = os.umask(umask)
    try:
        out = tmp_path / "ckpt"
        assert emit_in_child(compiled[0], out, {}, overwrite=False) == 0
        mla = tmp_path / "mla"
        code, output = run_cli(
            [
                "export-mla",
                str(compiled[1].parent / "src"),
                "--kv-share",
                "0.5",
                "-o",
                str(mla),
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
    finally:
        os.umask(old)
    files = [p for d in (out, mla) for p in d.rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"model.safetensors", "o_proj.safetensors", "config.json"}
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in files} == {p.name: oct(0o666 & ~umask) for p in files}


def test_export_mla_overwrites_its_own_export_and_records_an_absolute_source(tmp_path, compiled, monkeypatch):
    import json

    from fault_cases import run_cli

    monkeypatch.chdir(compiled[1].parent)
    args = [
        "export-mla",
        "src",
        "--kv-share",
        "0.5",
        "-o",
        str(tmp_path / "mla"),
        "--calibration",
        "synthetic",
        "--calib-tokens",
        "512",
        "--verify-tokens",
        "32",
    ]
    assert run_cli(args)[0] == 0
    first = json.loads((tmp_path / "mla" / "config.json").read_text())
    assert first["kvrewrite_mla"]["source_model"] == str(compiled[1].parent / "src")  # `eval` elsewhere finds it
    code, output = run_cli([*args, "--kv-share", "0.75", "--overwrite"])
    assert code == 0, output
    assert json.loads((tmp_path / "mla" / "config.json").read_text())["kv_lora_rank"] > first["kv_lora_rank"]
    assert hidden(tmp_path) == []


def test_export_mla_clears_what_a_killed_export_left(tmp_path, compiled):
    from fault_cases import run_cli

    leftover = tmp_path / ".mla.tmp-1a2b3c4d"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"partial")
    code, output = run_cli(
        [
            "export-mla",
            str(compiled[1].parent / "src"),
            "--kv-share",
            "0.5",
            "-o",
            str(tmp_path / "mla"),
            "--calibration",
            "synthetic",
            "--calib-tokens",
            "512",
            "--verify-tokens",
            "32",
        ]
    )
    assert code == 0 and "partial checkpoint left by an interrupted run" in output, output
    assert hidden(tmp_path) == []


def _spec_edited_everywhere(directory: Path, edit) -> None:
    """The spec edited in config.json and in the shards alike, manifest re-signed: only the values' own checks remain."""
    from fault_cases import _edit_spec

    _edit_spec(directory, edit, shards=True)


@pytest.mark.parametrize("entry", ["rank 99", "rank -3", "rank '8'", "too few layers"])
def test_a_bad_rate_table_entry_is_refused_on_the_tier_path(tmp_path, compiled, entry):
    import kvrewrite

    def edit(spec):
        ranks = spec["rate_table"]["0.30"]
        if entry == "too few layers":
            ranks["key"] = ranks["key"][:1]
        else:
            ranks["key"][0][0] = {"rank 99": 99, "rank -3": -3, "rank '8'": "8"}[entry]

    ckpt = shutil.copytree(compiled[1], tmp_path / "ckpt")
    _spec_edited_everywhere(ckpt, edit)
    with pytest.raises(CorruptCheckpointError, match="rate table's entry for rate 0.30"):
        kvrewrite.load(ckpt, rate=0.3, recent_window=4, kv_codec="none")


@pytest.mark.parametrize(
    "keywords",
    [
        {"evict": "x", "recent_window": 4},
        {"kv_codec": 5},
        {"important": 3, "recent_window": 4},
        {"evict": {"keep": "0.5"}, "recent_window": 4, "kv_codec": "none"},
        {"evict": {"keep": 0.5, "bits": 8.0}, "recent_window": 4, "kv_codec": "none"},
    ],
    ids=["evict str", "kv_codec int", "important int", "keep str", "bits float"],
)
def test_load_keyword_types_are_refused_before_any_file_is_read(tmp_path, keywords):
    import kvrewrite
    from kvrewrite.errors import InvalidArgumentError

    name = next(iter(keywords))
    with pytest.raises(InvalidArgumentError, match=f"{name}="):
        kvrewrite.load(tmp_path / "no-such-checkpoint", **keywords)  # refused before the directory is even looked at


@pytest.mark.parametrize(
    "evict", [{"keep": 0.5, "bits": 8.0}, {"keep": "0.5", "bits": 8}], ids=["bits 8.0", "keep '0.5'"]
)
def test_hand_edited_policy_values_name_the_file(tmp_path, compiled, evict):
    import json

    import kvrewrite
    from kvrewrite.io.manifest import write_manifest

    ckpt = shutil.copytree(compiled[1], tmp_path / "ckpt")
    (ckpt / "token_policy.json").write_text(
        json.dumps({"load": {"rate": 0.3, "recent_window": 4, "kv_codec": "none", "evict": evict}})
    )
    write_manifest(ckpt)  # re-signed: only the values' own check is left
    with pytest.raises(CorruptCheckpointError, match=r"token_policy\.json: recorded load option evict="):
        kvrewrite.load(ckpt)


def test_prefill_parallel_runs_the_plain_cache_of_a_checkpoint_with_a_token_policy(tmp_path, compiled):
    import json

    from fault_cases import run_cli

    from kvrewrite.io.manifest import write_manifest

    ckpt = shutil.copytree(compiled[1], tmp_path / "ckpt")
    (ckpt / "token_policy.json").write_text(
        json.dumps({"load": {"rate": 0.3, "recent_window": 4, "kv_codec": "none", "evict": {"keep": 0.5, "bits": 8}}})
    )
    write_manifest(ckpt)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("w3 w4 w5 w6 w7 w8")
    code, output = run_cli(["prefill-parallel", str(ckpt), "--prompt-file", str(prompt), "--new-tokens", "2"])
    assert code == 0 and "token policy recorded by `kvrewrite budget` is not used" in output, output


@pytest.mark.parametrize("case", INTERRUPT_CASES, ids=[c.name for c in INTERRUPT_CASES])
def test_an_interrupt_is_one_line_and_leaves_nothing(tmp_path, source, case):
    code, err, left = interrupted_run(case, source, tmp_path)
    assert code == 130, err
    # The last line, and the only error (earlier stderr lines are the compile's own progress bars).
    assert err.strip().splitlines()[-1] == "error: interrupted; nothing was written", err
    assert err.count("error:") == 1 and "Traceback" not in err and "Aborted" not in err, err
    assert left == []  # no output, nothing hidden


def test_a_rate_whose_first_layer_keeps_no_key_dims_prefills_in_chunks(compiled):
    """At p = 0.75 the tiny checkpoint's layer 0 caches zero key dims; chunked prefill through the model's own cache
    (eval --chunk, --positions, generate) must give the one-shot forward's logits, not a mask of the wrong length."""
    import torch
    from tiny_models import random_windows

    import kvrewrite

    model = kvrewrite.load(compiled[1], rate=0.75)
    assert sum(model.compression_spec.ranks_for_rate(0.75)[0][0]) == 0
    tokens = random_windows(n=1, length=32, seed=3)
    with torch.no_grad():
        one_shot = model(tokens).logits
        cache = model.make_kv_cache()
        chunked = torch.cat(
            [model(tokens[:, i : i + 8], past_key_values=cache, use_cache=True).logits for i in range(0, 32, 8)], dim=1
        )
        generated = model.generate(tokens[:, :16], max_new_tokens=4, do_sample=False)
    assert cache.get_seq_length() == 32
    torch.testing.assert_close(chunked, one_shot, atol=1e-4, rtol=1e-4)
    assert generated.shape == (1, 20)


def test_the_documented_fault_table_is_the_suites_own_run():
    """docs/reliability.md renders benchmarks/results/fault_table.json; that run holds exactly this suite's cases, each
    one error line with exit 2 (130 for an interrupt) and no code run. A case added here without re-running
    benchmarks/fault_table.py fails this test."""
    import json

    recorded = json.loads((Path(__file__).resolve().parents[1] / "benchmarks/results/fault_table.json").read_text())
    names = [r["case"] for r in recorded["cases"]]
    assert names[: len(CASES) + len(INTERRUPT_CASES)] == [c.name for c in CASES] + [c.name for c in INTERRUPT_CASES]
    for row in recorded["cases"]:
        assert row["message"].startswith("error: ") and row["exit"] in (2, 130) and not row.get("code_ran"), row
        assert row["exit"] == 2 or (
            row["message"] == "error: interrupted; nothing was written" and row["left_behind"] == []
        )
