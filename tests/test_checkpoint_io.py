"""Tests for kvrewrite.io.checkpoint_io: atomic output directories, sharded safetensors, checksums."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from kvrewrite.errors import CorruptCheckpointError, InvalidArgumentError, OutputError
from kvrewrite.io import checkpoint_io
from kvrewrite.io.checkpoint_io import (
    CHECKSUM_FILE,
    atomic_output_dir,
    read_safetensors_metadata,
    verify_checksums,
    write_checksums,
    write_safetensors_shards,
)
from kvrewrite.io.fault_injection import NO_EXCHANGE_ENV


def _tree(root: Path) -> dict[str, bytes]:
    """Every file under root with its bytes, to compare directories byte for byte."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _siblings(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir())


def _state_dict() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(64, 32, generator=g),  # 8 KiB
        "model.layers.0.self_attn.q_proj.weight": torch.randn(32, 32, generator=g),  # 4 KiB
        "model.layers.0.self_attn.k_proj.weight": torch.randn(16, 32, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(32, 64, generator=g).t(),  # non-contiguous
        "model.norm.weight": torch.ones(32),
        "lm_head.weight": torch.randn(64, 32, generator=g),
    }


# ---------------------------------------------------------------------------------------------------------------
# atomic_output_dir
# ---------------------------------------------------------------------------------------------------------------


def test_atomic_dir_creates_output(tmp_path: Path) -> None:
    out = tmp_path / "nested" / "out"
    with atomic_output_dir(out) as tmp:
        assert tmp.parent == out.parent  # same filesystem, so the rename is atomic
        assert tmp.name.startswith(".out.tmp-")
        assert not out.exists()
        (tmp / "a.txt").write_text("hello")
    assert (out / "a.txt").read_text() == "hello"
    assert _siblings(out.parent) == ["out"]


def test_atomic_dir_refuses_existing_without_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("keep")
    with pytest.raises(InvalidArgumentError, match="`overwrite`"):
        with atomic_output_dir(out):
            pytest.fail("block must not run")
    assert (out / "keep.txt").read_text() == "keep"
    assert _siblings(tmp_path) == ["out"]


def _mark_checkpoint(directory: Path) -> Path:
    """What makes a directory a kvrewrite checkpoint that --overwrite may replace (output_safety.py)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text('{"kvrewrite": {}}')
    (directory / "kvrewrite_checksums.json").write_text("{}")
    return directory


def test_atomic_dir_overwrite_replaces_and_cleans_old(tmp_path: Path) -> None:
    out = _mark_checkpoint(tmp_path / "out")
    (out / "old.txt").write_text("old")
    with atomic_output_dir(out, overwrite=True) as tmp:
        (tmp / "new.txt").write_text("new")
        # The old output stays visible until the swap.
        assert (out / "old.txt").read_text() == "old"
    assert _tree(out) == {"new.txt": b"new"}
    assert _siblings(tmp_path) == ["out"]  # no .tmp-/.old- leftovers


def test_atomic_dir_exception_removes_temp(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_output_dir(out) as tmp:
            (tmp / "partial.bin").write_bytes(b"x" * 100)
            raise RuntimeError("boom")
    assert not out.exists()
    assert _siblings(tmp_path) == []


@pytest.mark.parametrize("exc_type", [KeyboardInterrupt, RuntimeError])
def test_atomic_dir_interrupt_keeps_previous_output_intact(tmp_path: Path, exc_type: type[BaseException]) -> None:
    out = _mark_checkpoint(tmp_path / "out")
    (out / "sub").mkdir(parents=True)
    (out / "model.safetensors").write_bytes(bytes(range(256)) * 10)
    (out / "sub" / "config.json").write_text('{"a": 1}')
    before = _tree(out)
    with pytest.raises(exc_type):
        with atomic_output_dir(out, overwrite=True) as tmp:
            (tmp / "model.safetensors").write_bytes(b"half-written")
            raise exc_type()
    assert _tree(out) == before
    assert _siblings(tmp_path) == ["out"]


def test_atomic_dir_failed_swap_restores_previous(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = _mark_checkpoint(tmp_path / "out")
    (out / "weights.bin").write_bytes(b"previous")
    monkeypatch.setenv(NO_EXCHANGE_ENV, "1")  # the two-rename swap, whose second rename fails here
    before = _tree(out)

    def failing_replace(src: object, dst: object) -> None:
        raise OSError("simulated rename failure")

    monkeypatch.setattr(checkpoint_io.os, "replace", failing_replace)
    with pytest.raises(OutputError, match="simulated"):
        with atomic_output_dir(out, overwrite=True) as tmp:
            (tmp / "weights.bin").write_bytes(b"new")
    monkeypatch.undo()
    assert _tree(out) == before
    assert _siblings(tmp_path) == ["out"]


def test_atomic_dir_output_has_normal_permissions(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with atomic_output_dir(out):
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask


# ---------------------------------------------------------------------------------------------------------------
# write_safetensors_shards / read_safetensors_metadata
# ---------------------------------------------------------------------------------------------------------------


def test_sharded_round_trip(tmp_path: Path) -> None:
    sd = _state_dict()
    meta = {"kvrewrite_version": "0.1.0", "spec": json.dumps({"ranks": [1, 2]})}
    files = write_safetensors_shards(tmp_path, sd, meta, max_shard_size=10_000)
    assert len(files) >= 2
    assert all((tmp_path / f).is_file() for f in files)
    assert files == [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]

    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index) == {"metadata", "weight_map"}
    assert set(index["weight_map"]) == set(sd)
    assert set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in sd.values())

    loaded: dict[str, torch.Tensor] = {}
    for f in files:
        part = load_file(str(tmp_path / f))
        assert all(index["weight_map"][k] == f for k in part)
        loaded.update(part)
        with safe_open(str(tmp_path / f), framework="pt") as h:
            assert h.metadata() == {**meta, "format": "pt"}
    assert set(loaded) == set(sd)
    for k, t in sd.items():
        assert loaded[k].dtype == t.dtype
        assert torch.equal(loaded[k], t), k

    assert read_safetensors_metadata(tmp_path) == {**meta, "format": "pt"}


def test_single_shard_has_no_index(tmp_path: Path) -> None:
    sd = _state_dict()
    files = write_safetensors_shards(tmp_path, sd, {})
    assert files == ["model.safetensors"]
    assert not (tmp_path / "model.safetensors.index.json").exists()
    loaded = load_file(str(tmp_path / "model.safetensors"))
    assert all(torch.equal(loaded[k], sd[k]) for k in sd)
    assert read_safetensors_metadata(tmp_path) == {"format": "pt"}


def test_shared_storage_tensors_are_saved_independently(tmp_path: Path) -> None:
    fused = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    sd = {"q.weight": fused[:2], "k.weight": fused[2:4], "v.weight": fused[4:], "alias": fused}
    files = write_safetensors_shards(tmp_path, sd, {"a": "b"})
    loaded = load_file(str(tmp_path / files[0]))
    for k, t in sd.items():
        assert torch.equal(loaded[k], t)


def test_write_shards_rejects_bad_metadata(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError):
        write_safetensors_shards(tmp_path, _state_dict(), {"n": 3})  # type: ignore[dict-item]
    with pytest.raises(InvalidArgumentError, match="format"):
        write_safetensors_shards(tmp_path, _state_dict(), {"format": "np"})
    with pytest.raises(InvalidArgumentError, match="empty"):
        write_safetensors_shards(tmp_path, {}, {})


def test_read_metadata_without_weights_raises(tmp_path: Path) -> None:
    with pytest.raises(CorruptCheckpointError, match=str(tmp_path)):
        read_safetensors_metadata(tmp_path)


# ---------------------------------------------------------------------------------------------------------------
# checksums
# ---------------------------------------------------------------------------------------------------------------


def _written_checkpoint(tmp_path: Path) -> list[str]:
    files = write_safetensors_shards(tmp_path, _state_dict(), {"k": "v"}, max_shard_size=10_000)
    write_checksums(tmp_path, files + ["model.safetensors.index.json"])
    return files


def test_checksums_round_trip(tmp_path: Path) -> None:
    files = _written_checkpoint(tmp_path)
    sums = json.loads((tmp_path / CHECKSUM_FILE).read_text())
    assert set(sums) == set(files) | {"model.safetensors.index.json"}
    assert all(len(v) == 64 for v in sums.values())
    verify_checksums(tmp_path)  # does not raise


def test_flipped_byte_is_detected(tmp_path: Path) -> None:
    files = _written_checkpoint(tmp_path)
    target = tmp_path / files[-1]
    data = bytearray(target.read_bytes())
    data[-5] ^= 0x01  # inside the tensor data, so the header still parses
    target.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=rf"{files[-1]}.*corrupt or modified"):
        verify_checksums(tmp_path)


def test_truncated_shard_is_detected(tmp_path: Path) -> None:
    files = _written_checkpoint(tmp_path)
    target = tmp_path / files[0]
    data = target.read_bytes()
    target.write_bytes(data[: len(data) - 100])
    with pytest.raises(CorruptCheckpointError, match=rf"{files[0]}.*truncated"):
        verify_checksums(tmp_path)
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        read_safetensors_metadata(tmp_path)


def test_truncated_non_safetensors_file_is_detected(tmp_path: Path) -> None:
    _written_checkpoint(tmp_path)
    index = tmp_path / "model.safetensors.index.json"
    index.write_bytes(index.read_bytes()[:-10])
    with pytest.raises(CorruptCheckpointError, match="model.safetensors.index.json.*corrupt or modified"):
        verify_checksums(tmp_path)


def test_missing_shard_is_detected(tmp_path: Path) -> None:
    files = _written_checkpoint(tmp_path)
    (tmp_path / files[1]).unlink()
    with pytest.raises(CorruptCheckpointError, match=rf"{files[1]}.*missing"):
        verify_checksums(tmp_path)


def test_missing_checksum_file_is_detected(tmp_path: Path) -> None:
    _written_checkpoint(tmp_path)
    (tmp_path / CHECKSUM_FILE).unlink()
    with pytest.raises(CorruptCheckpointError, match=CHECKSUM_FILE):
        verify_checksums(tmp_path)


@pytest.mark.parametrize(
    "content", ["{not json", "[]", "{}", '{"model.safetensors": 5}', '{"../x": "' + "0" * 64 + '"}']
)
def test_bad_checksum_file_is_detected(tmp_path: Path, content: str) -> None:
    _written_checkpoint(tmp_path)
    (tmp_path / CHECKSUM_FILE).write_text(content)
    with pytest.raises(CorruptCheckpointError, match=CHECKSUM_FILE):
        verify_checksums(tmp_path)


def test_write_checksums_rejects_missing_file(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="nope.safetensors"):
        write_checksums(tmp_path, ["nope.safetensors"])


def test_full_atomic_write_then_verify(tmp_path: Path) -> None:
    out = tmp_path / "compiled"
    with atomic_output_dir(out) as d:
        files = write_safetensors_shards(d, _state_dict(), {"k": "v"}, max_shard_size=10_000)
        write_checksums(d, files)
    verify_checksums(out)
    assert read_safetensors_metadata(out)["k"] == "v"


def test_transformers_loads_sharded_output(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
    )
    model = LlamaForCausalLM(config).eval()
    out = tmp_path / "ckpt"
    with atomic_output_dir(out) as d:
        config.save_pretrained(d)
        files = write_safetensors_shards(d, model.state_dict(), {"kvrewrite": "1"}, max_shard_size=40_000)
        write_checksums(d, files)
    assert len(files) >= 2
    verify_checksums(out)
    reloaded = LlamaForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, reloaded(ids).logits)
