"""Every bad input of issue 5 item 4, hit the way a user hits it (mostly through the CLI).

Each test names one bad input; each asserts a non-zero exit (or the error type), a message that names the
offending file or value, and that nothing the user had is lost.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import save_tiny_llama, tiny_pipeline, word_tokenizer
from typer.testing import CliRunner

import kvrewrite
from kvrewrite.cli.app import app
from kvrewrite.compile.passes.pipeline import run_pipeline
from kvrewrite.compile.plan import Plan
from kvrewrite.errors import CorruptCheckpointError
from kvrewrite.io.checkpoint_io import read_safetensors_metadata, write_checksums, write_safetensors_shards
from kvrewrite.io.manifest import write_manifest

runner = CliRunner()
PACKAGE = Path(kvrewrite.__file__).parent


def flat(output: str) -> str:
    """CLI output with rich's line wrapping undone."""
    return " ".join(output.split())


def fails_with(args: list[str], *needles: str) -> str:
    result = runner.invoke(app, args)
    text = flat(result.output)
    assert result.exit_code == 2, result.output
    assert "error:" in text and "Traceback" not in result.output, text
    message = text[text.index("error:") :]
    for needle in needles:
        assert needle in message, f"{needle!r} not in: {message}"
    return message


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("bad")


@pytest.fixture(scope="module")
def source(root):
    return save_tiny_llama(root / "src")


@pytest.fixture(scope="module")
def calib_text(root):
    path = root / "calib.txt"
    g = torch.Generator().manual_seed(0)
    path.write_text(" ".join(f"w{int(i)}" for i in torch.randint(3, 96, (2000,), generator=g)))
    return path


@pytest.fixture(scope="module")
def compiled(root, source):
    """Compiled tiny checkpoints (latent keys, and freq keys for the rotary-order case); tests work on copies."""
    out = {}
    for mode in ("latent", "freq"):
        out[mode] = root / f"ckpt-{mode}"
        run_pipeline(Plan(model=str(source), output=out[mode], rope_mode=mode, progress=False), tiny_pipeline())
    return out


def copy_of(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def compress_args(source: Path, out: Path, calib: Path, *extra: str) -> list[str]:
    return [
        "compress",
        str(source),
        "-o",
        str(out),
        "--calibration",
        str(calib),
        "--calib-tokens",
        "512",
        "--seq-len",
        "64",
        *extra,
    ]


def tree_digest(directory: Path) -> dict[str, str]:
    return {
        p.relative_to(directory).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


# ----------------------------------------------------------------------------------------------------------------
# Rates
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rate", ["1.0", "1.5", "-0.1", "nan"])
def test_target_rate_outside_unit_interval(rate):
    fails_with(["compress", "smollm2-135m", "--target-rate", rate], "[0, 1)", rate)


def test_compress_of_a_plan_takes_no_other_options(tmp_path):
    """kvrewrite.compress(plan) compiles the plan as it stands (the command line's call): an option given beside it
    would be silently dropped, so it is refused before anything is read or written."""
    plan = Plan(model="smollm2-135m", output=tmp_path / "out", target_rate=0.3, progress=False)
    with pytest.raises(ValueError, match="set output, target_rate in the Plan instead"):
        kvrewrite.compress(plan, target_rate=0.5, output=tmp_path / "other")
    with pytest.raises(ValueError, match="set calib_tokens in the Plan instead"):
        kvrewrite.compress(plan, calib_tokens=1024)
    assert not (tmp_path / "out").exists() and not (tmp_path / "other").exists()


def test_rate_the_rank_floor_cannot_reach(source, calib_text, tmp_path):
    # head_dim is 16: a floor of 12 per head keeps at least 75% of the cache, so removing 50% is impossible.
    fails_with(
        compress_args(source, tmp_path / "out", calib_text, "--target-rate", "0.5", "--min-rank", "12"),
        "rate 0.5 cannot be reached with --min-rank 12",
    )
    assert not (tmp_path / "out").exists()


def test_rate_missing_from_the_checkpoints_rate_table(compiled):
    available = sorted(
        json.loads((compiled["latent"] / "config.json").read_text())["kvrewrite"]["rate_table"], key=float
    )
    assert "0.33" not in available
    text = fails_with(
        ["eval", str(compiled["latent"]), "--rates", "0.3,0.33", "--no-save"],
        "rate 0.33 is not in this checkpoint's rate table",
    )
    assert ", ".join(available) in text
    fails_with(
        ["inspect", str(compiled["latent"]), "--rate", "0.33"], "rate 0.33 is not in this checkpoint's rate table"
    )


# ----------------------------------------------------------------------------------------------------------------
# Source models
# ----------------------------------------------------------------------------------------------------------------


def test_source_model_without_a_k_proj_weight(source, calib_text, tmp_path):
    broken = copy_of(source, tmp_path / "no-k-proj")
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    fails_with(
        compress_args(broken, tmp_path / "out", calib_text), "model.layers.1.self_attn.k_proj.weight", str(broken)
    )
    assert not (tmp_path / "out").exists()


def test_truncated_source_shard(source, calib_text, tmp_path):
    broken = copy_of(source, tmp_path / "truncated")
    shard = broken / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    fails_with(compress_args(broken, tmp_path / "out", calib_text), str(shard), "truncated")


def test_source_shard_missing_from_its_index(calib_text, tmp_path):
    from transformers import LlamaForCausalLM

    sharded = tmp_path / "sharded"
    model = LlamaForCausalLM.from_pretrained(save_tiny_llama(tmp_path / "one"))
    model.save_pretrained(sharded, max_shard_size="100KB")
    word_tokenizer().save_pretrained(sharded)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2
    (sharded / shards[1]).unlink()
    fails_with(
        compress_args(sharded, tmp_path / "out", calib_text), str(sharded / shards[1]), "model.safetensors.index.json"
    )


def test_pickled_source_is_refused_without_unpickling(source, calib_text, tmp_path, monkeypatch):
    pickled = copy_of(source, tmp_path / "pickled")
    tensors = load_file(pickled / "model.safetensors")
    torch.save(tensors, pickled / "pytorch_model.bin")
    (pickled / "model.safetensors").unlink()

    def no_unpickling(*args, **kwargs):
        raise AssertionError("torch.load was called")

    monkeypatch.setattr(torch, "load", no_unpickling)
    fails_with(compress_args(pickled, tmp_path / "out", calib_text), "pytorch_model.bin", "safetensors only")


def test_no_pickle_loading_or_remote_code_in_the_package():
    offending = []
    for path in PACKAGE.rglob("*.py"):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if re.search(
                r"torch\.load\(|\bpickle\b|weights_only\s*=\s*False|trust_remote_code\s*=\s*True|np\.load\(", code
            ):
                offending.append(f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}")
    assert offending == []


# ----------------------------------------------------------------------------------------------------------------
# Compiled checkpoints
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["flipped byte", "truncated"])
def test_corrupt_or_truncated_compiled_shard(compiled, tmp_path, damage):
    ckpt = copy_of(compiled["latent"], tmp_path / "ckpt")
    shard = ckpt / "model.safetensors"
    data = bytearray(shard.read_bytes())
    if damage == "flipped byte":
        data[-100] ^= 0xFF
    else:
        data = data[: len(data) - 1000]
    shard.write_bytes(bytes(data))
    fails_with(["eval", str(ckpt), "--no-save"], str(shard), "truncated" if damage == "truncated" else "corrupt")
    with pytest.raises(CorruptCheckpointError, match=re.escape(str(shard))):
        kvrewrite.load(ckpt)


def test_compiled_shard_missing_from_its_index(compiled, tmp_path):
    ckpt = copy_of(compiled["latent"], tmp_path / "ckpt")
    tensors = load_file(ckpt / "model.safetensors")
    metadata = read_safetensors_metadata(ckpt)
    (ckpt / "model.safetensors").unlink()
    shards = write_safetensors_shards(ckpt, tensors, metadata, max_shard_size="100KB")
    write_checksums(ckpt, shards)
    assert len(shards) > 2 and kvrewrite.load(ckpt) is not None  # the re-sharded copy itself is fine
    (ckpt / shards[1]).unlink()
    fails_with(["eval", str(ckpt), "--no-save"], str(ckpt / shards[1]), "missing")


@pytest.mark.parametrize("edit", ["key_mode", "freq_order", "num_key_value_heads"])
def test_compiled_spec_that_does_not_match_its_tensors(compiled, tmp_path, edit):
    ckpt = copy_of(compiled["freq" if edit == "freq_order" else "latent"], tmp_path / "ckpt")
    config_path = ckpt / "config.json"
    config = json.loads(config_path.read_text())
    spec = config["kvrewrite"]
    if edit == "key_mode":
        spec["layers"][1]["key_mode"] = "post-rope"
    elif edit == "freq_order":
        # A swapped rotary pair: same shapes, so only the spec comparison can notice.
        order = spec["layers"][0]["freq_order"][0]
        order[0], order[1] = order[1], order[0]
    else:
        spec["num_key_value_heads"] = 4
        config["num_key_value_heads"] = 4
        for layer in spec["layers"]:
            layer["key_ranks"] = layer["key_ranks"] * 2
            layer["value_ranks"] = layer["value_ranks"] * 2
    config_path.write_text(json.dumps(config))
    write_manifest(ckpt)  # re-signed, as whoever edited it would: the spec comparison must still catch the edit
    text = fails_with(
        ["eval", str(ckpt), "--no-save", "--rates", "0.5"]
        if edit != "num_key_value_heads"
        else ["eval", str(ckpt), "--no-save"],
        str(config_path),
        str(ckpt / "model.safetensors"),
    )
    assert edit in text
    with pytest.raises(CorruptCheckpointError, match=edit):
        kvrewrite.load(ckpt)


# ----------------------------------------------------------------------------------------------------------------
# Output directory and interrupted compiles
# ----------------------------------------------------------------------------------------------------------------


def test_existing_output_directory_needs_overwrite(source, calib_text, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.txt").write_text("last week's numbers")
    fails_with(compress_args(source, out, calib_text), f"output directory {out} already exists", "--overwrite")
    assert [p.name for p in out.iterdir()] == ["results.txt"]
    # --overwrite replaces only what kvrewrite wrote (issue 14): a directory of user files is refused, intact.
    fails_with(
        compress_args(source, out, calib_text, "--overwrite"), "is not a kvrewrite checkpoint", "nothing was deleted"
    )
    assert [p.name for p in out.iterdir()] == ["results.txt"]
    (out / "results.txt").unlink()
    out.rmdir()
    assert runner.invoke(app, compress_args(source, out, calib_text)).exit_code == 0
    ok = runner.invoke(app, compress_args(source, out, calib_text, "--overwrite"))
    assert ok.exit_code == 0, ok.output
    assert (out / "config.json").is_file()


@pytest.mark.parametrize("where", ["first shard written", "config written"])
def test_ctrl_c_mid_emit_keeps_the_previous_output(source, tmp_path, monkeypatch, where):
    out = tmp_path / "out"
    run_pipeline(Plan(model=str(source), output=out, target_rate=0.3, progress=False), tiny_pipeline())
    before = tree_digest(out)

    import kvrewrite.compile.passes.emit as emit
    import kvrewrite.io.checkpoint_io as checkpoint_io

    if where == "first shard written":
        real_save = checkpoint_io.save_file

        def save_then_interrupt(tensors, filename, metadata=None):
            real_save(tensors, filename, metadata=metadata)  # the shard is on disk, then Ctrl-C
            raise KeyboardInterrupt

        monkeypatch.setattr(checkpoint_io, "save_file", save_then_interrupt)
    else:

        def interrupt(*args, **kwargs):
            raise KeyboardInterrupt

        monkeypatch.setattr(emit, "write_manifest", interrupt)
    with pytest.raises(KeyboardInterrupt):
        run_pipeline(
            Plan(model=str(source), output=out, target_rate=0.6, overwrite=True, progress=False), tiny_pipeline()
        )
    assert tree_digest(out) == before  # the previous compile, byte for byte
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary directory left behind
    assert kvrewrite.load(out).compression_spec.target_rate == pytest.approx(0.3)


# ----------------------------------------------------------------------------------------------------------------
# Calibration text
# ----------------------------------------------------------------------------------------------------------------


def test_calibration_text_shorter_than_needed(source, tmp_path):
    text = tmp_path / "short.txt"
    text.write_text(" ".join(f"w{i % 90 + 3}" for i in range(300)))
    available = len(word_tokenizer()(text.read_text())["input_ids"])  # counted independently of kvrewrite
    fails_with(
        [
            "compress",
            str(source),
            "-o",
            str(tmp_path / "out"),
            "--calibration",
            str(text),
            "--calib-tokens",
            "4096",
            "--seq-len",
            "64",
        ],
        str(text),
        f"has {available} tokens",
        "4096 tokens",
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", [["card"], ["push", "--dry-run"], ["inspect"]])
def test_per_head_commands_name_an_mla_export_as_such(tmp_path, command):
    # An export-mla checkpoint has no per-head spec; the error says what it is and what runs it instead.
    config = {"model_type": "deepseek_v3", "kvrewrite_mla": {"format_version": 1}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    args = [command[0], str(tmp_path)] + (["me/repo"] if command[0] == "push" else []) + command[1:]
    result = runner.invoke(app, args)
    assert result.exit_code != 0
    text = flat(result.output)
    assert "is an MLA export" in text and "kvrewrite eval" in text, text
