"""Model card and Hub upload, without the Hub.

The card is rendered from a real tiny compile and a real `kvrewrite eval`, then parsed back with huggingface_hub's
ModelCard. The upload runs huggingface_hub's real `upload_folder` (its file listing and filtering) with only the
network calls replaced (create_repo, create_branch, create_commit, the README YAML check), so the test sees the exact
operations a real push would commit. Failures use real HTTP against a local server / a closed port.
"""

from __future__ import annotations

import http.server
import json
import re
import threading
from pathlib import Path

import pytest
import torch
from huggingface_hub import HfApi, ModelCard
from tiny_models import save_tiny_llama, tiny_pipeline
from typer.testing import CliRunner

from kvrewrite.cli.app import app
from kvrewrite.compile.passes.pipeline import run_pipeline
from kvrewrite.compile.plan import Plan
from kvrewrite.errors import CorruptCheckpointError, HubError, InvalidArgumentError
from kvrewrite.publish.eval_results import EVAL_RESULTS_FILE
from kvrewrite.publish.hub import push_checkpoint, upload_file_list
from kvrewrite.publish.model_card import (
    BUNDLED_UPSTREAM,
    EVAL_COLUMNS,
    GENERATED_MARKER,
    base_model_id,
    eval_markdown_rows,
    render_model_card,
)

runner = CliRunner()


def flat(output: str) -> str:
    return " ".join(output.split())


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    """A tiny compiled checkpoint on which `kvrewrite eval` has run (so eval_results.json is real)."""
    root = tmp_path_factory.mktemp("hub")
    src = save_tiny_llama(root / "src")
    out = root / "tiny-p50"
    run_pipeline(Plan(model=str(src), output=out, target_rate=0.5, progress=False), tiny_pipeline())
    result = runner.invoke(app, ["eval", str(out), "--rates", "0.3,0.5", "--tokens", "256", "--seq-len", "64"])
    assert result.exit_code == 0, result.output
    return out


def copy_checkpoint(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def markdown_table_after(text: str, header: list[str]) -> list[list[str]]:
    """The body rows of the markdown table whose header row is `header`."""
    lines = text.splitlines()
    start = lines.index("| " + " | ".join(header) + " |")
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip())[1:-1]])
    return rows


# ----------------------------------------------------------------------------------------------------------------
# Model card
# ----------------------------------------------------------------------------------------------------------------


def test_eval_saves_results_next_to_the_weights(evaluated):
    saved = json.loads((evaluated / EVAL_RESULTS_FILE).read_text())
    assert [r["rate"] for r in saved["rows"]] == [0.0, 0.3, 0.5]
    assert saved["rows"][0]["baseline"] and saved["settings"] == {**saved["settings"], "tokens": 256, "seq_len": 64}
    assert "--rates 0.3,0.5" in saved["command"]
    # KV bytes per token were measured on the real cache: the p=0.5 model keeps half the baseline's.
    assert saved["rows"][2]["kv_bytes_per_token"] == pytest.approx(saved["rows"][0]["kv_bytes_per_token"] / 2)


def test_card_renders_and_parses_back(evaluated, tmp_path):
    ckpt = copy_checkpoint(evaluated, tmp_path / "ckpt")
    result = runner.invoke(app, ["card", str(ckpt), "--repo-id", "someone/tiny-p50", "--base-model", "someone/tiny"])
    assert result.exit_code == 0, result.output
    card = ModelCard.load(ckpt / "README.md")
    data = card.data
    assert data.base_model == "someone/tiny"
    assert data.library_name == "transformers" and data.pipeline_tag == "text-generation"
    assert {"kvrewrite", "kv-cache-compression", "kv-cache-rate-50"} <= set(data.tags)
    assert data.model_name == "tiny-p50"

    rows = json.loads((ckpt / EVAL_RESULTS_FILE).read_text())["rows"]
    # The model-index metrics are the measured values, per rate.
    parsed = {(r.metric_config, r.metric_type): r.metric_value for r in data.eval_results}
    for row in rows[1:]:
        config = f"p={row['rate']:.2f}"
        assert parsed[(config, "perplexity")] == pytest.approx(row["perplexity"], rel=1e-6)
        assert parsed[(config, "kl_divergence")] == pytest.approx(row["kl_mean"], abs=1e-6)
        assert parsed[(config, "accuracy")] == pytest.approx(row["top1_agreement"], abs=1e-6)
    # The markdown table is the same numbers, formatted as `kvrewrite eval` prints them.
    table = markdown_table_after(card.text, EVAL_COLUMNS)
    assert table == eval_markdown_rows(rows)
    assert [float(r[2]) for r in table] == [round(r["perplexity"], 2) for r in rows]

    spec = json.loads((ckpt / "config.json").read_text())["kvrewrite"]
    kept = sum(sum(l["key_ranks"]) + sum(l["value_ranks"]) for l in spec["layers"])
    assert f"{kept:,} of " in card.text
    assert "![kept rank per layer and KV head](rank_heatmap.png)" in card.text
    assert (ckpt / "rank_heatmap.png").read_bytes()[:4] == b"\x89PNG"
    assert 'from_pretrained("someone/tiny-p50")' in card.text
    ranks = markdown_table_after(card.text, ["layer", "key ranks", "value ranks", "kept"])
    assert [list(map(int, r[1].split())) for r in ranks] == [l["key_ranks"] for l in spec["layers"]]


def test_card_without_eval_says_how_to_add_one(evaluated, tmp_path):
    ckpt = copy_checkpoint(evaluated, tmp_path / "ckpt")
    (ckpt / EVAL_RESULTS_FILE).unlink()
    card = render_model_card(ckpt)
    assert card.data.eval_results is None
    assert "kvrewrite eval DIR" in card.text


def test_base_model_comes_from_the_spec_source():
    assert base_model_id("smollm2-135m") == BUNDLED_UPSTREAM == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert base_model_id("meta-llama/Llama-3.1-8B") == "meta-llama/Llama-3.1-8B"
    assert base_model_id("/home/me/models/llama") is None


# ----------------------------------------------------------------------------------------------------------------
# Upload (network calls intercepted, huggingface_hub's upload_folder real)
# ----------------------------------------------------------------------------------------------------------------


class HubRecorder:
    """Stands in for the Hub's HTTP endpoints; records what upload_folder would send."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple[str, dict]] = []
        self.uploaded: dict[str, bytes] = {}
        recorder = self

        def create_repo(self, repo_id, **kwargs):
            recorder.calls.append(("create_repo", {"repo_id": repo_id, **kwargs}))
            return f"https://huggingface.co/{repo_id}"

        def create_branch(self, repo_id, **kwargs):
            recorder.calls.append(("create_branch", {"repo_id": repo_id, **kwargs}))

        def create_commit(self, repo_id, operations, **kwargs):
            recorder.calls.append(("create_commit", {"repo_id": repo_id, **kwargs}))
            for op in operations:
                recorder.uploaded[op.path_in_repo] = Path(op.path_or_fileobj).read_bytes()

            class Info:
                commit_url = f"https://huggingface.co/{repo_id}/commit/0"
                pr_url = f"https://huggingface.co/{repo_id}/discussions/1" if kwargs.get("create_pr") else None

            return Info()

        def validate_yaml(self, content, **kwargs):  # the Hub's README check is an HTTP call
            recorder.calls.append(("validate_yaml", {}))

        monkeypatch.setattr(HfApi, "create_repo", create_repo)
        monkeypatch.setattr(HfApi, "create_branch", create_branch)
        monkeypatch.setattr(HfApi, "create_commit", create_commit)
        monkeypatch.setattr(HfApi, "_validate_yaml", validate_yaml)
        # With hf_xet installed upload_folder streams through its xet pipeline; take the single-commit path so the
        # commit is one create_commit call holding every operation.
        monkeypatch.setattr("huggingface_hub.hf_api.is_xet_available", lambda: False)

    def call(self, name: str) -> dict:
        matches = [kwargs for n, kwargs in self.calls if n == name]
        assert len(matches) == 1, self.calls
        return matches[0]


def add_junk(ckpt: Path) -> list[str]:
    """Files that must never be uploaded: temp files of interrupted atomic writes, hidden and cache files."""
    junk = [
        ".model.safetensors.tmp-1234",
        ".README.md.x.tmp",
        "sub/.DS_Store",
        "__pycache__/modeling.cpython-311.pyc",
        ".git/config",
        "notes.tmp",
    ]
    for name in junk:
        (ckpt / name).parent.mkdir(parents=True, exist_ok=True)
        (ckpt / name).write_text("junk")
    return junk


def test_push_uploads_exactly_the_checkpoint_files(evaluated, tmp_path, monkeypatch):
    ckpt = copy_checkpoint(evaluated, tmp_path / "ckpt")
    junk = add_junk(ckpt)
    hub = HubRecorder(monkeypatch)
    result = push_checkpoint(
        ckpt,
        "someone/tiny-p50",
        private=True,
        revision="experiment",
        commit_message="first upload",
        api=HfApi(token="hf_test"),
    )

    assert hub.call("create_repo") == {
        "repo_id": "someone/tiny-p50",
        "private": True,
        "repo_type": "model",
        "exist_ok": True,
    }
    assert hub.call("create_branch")["branch"] == "experiment"
    commit = hub.call("create_commit")
    assert commit["revision"] == "experiment" and not commit["create_pr"] and commit["commit_message"] == "first upload"

    expected = sorted(
        {
            "README.md",
            "rank_heatmap.png",
            EVAL_RESULTS_FILE,
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "kvrewrite_checksums.json",
            "kernel_metadata.json",
            "compress_report.json",
            "modeling_kvrewrite.py",
            "tokenizer.json",
            "tokenizer_config.json",
        }
    )
    assert sorted(hub.uploaded) == expected
    assert not set(junk) & set(hub.uploaded)
    assert result.files == sorted(hub.uploaded)  # the dry-run listing is what upload_folder really selects
    assert hub.uploaded["model.safetensors"] == (ckpt / "model.safetensors").read_bytes()
    card = ModelCard(hub.uploaded["README.md"].decode())
    assert GENERATED_MARKER in card.text and card.data.model_name == "tiny-p50"


def test_push_create_pr_is_forwarded(evaluated, tmp_path, monkeypatch):
    ckpt = copy_checkpoint(evaluated, tmp_path / "ckpt")
    hub = HubRecorder(monkeypatch)
    result = push_checkpoint(ckpt, "someone/tiny-p50", create_pr=True, api=HfApi(token="hf_test"))
    assert hub.call("create_repo")["private"] is False
    assert hub.call("create_commit")["create_pr"] is True
    assert not [n for n, _ in hub.calls if n == "create_branch"]
    assert result.pr_url.endswith("/discussions/1")
    with pytest.raises(InvalidArgumentError, match="`create_pr`.*`revision`"):
        push_checkpoint(ckpt, "someone/tiny-p50", create_pr=True, revision="dev", api=HfApi(token="hf_test"))


def test_hand_written_card_is_kept(evaluated, tmp_path, monkeypatch):
    ckpt = copy_checkpoint(evaluated, tmp_path / "ckpt")
    (ckpt / "README.md").write_text("# my own card\n")
    refused = runner.invoke(app, ["card", str(ckpt)])
    assert refused.exit_code == 2 and "was not written by kvrewrite" in flat(refused.output)
    assert (ckpt / "README.md").read_text() == "# my own card\n"
    hub = HubRecorder(monkeypatch)
    result = push_checkpoint(ckpt, "someone/tiny-p50", api=HfApi(token="hf_test"))
    assert not result.card_written and hub.uploaded["README.md"] == b"# my own card\n"


def test_push_refuses_a_damaged_checkpoint(evaluated, tmp_path, monkeypatch):
    ckpt = copy_checkpoint(evaluated, tmp_path / "ckpt")
    data = bytearray((ckpt / "model.safetensors").read_bytes())
    data[-10] ^= 0xFF
    (ckpt / "model.safetensors").write_bytes(bytes(data))
    hub = HubRecorder(monkeypatch)
    with pytest.raises(CorruptCheckpointError, match="model.safetensors"):
        push_checkpoint(ckpt, "someone/tiny-p50", api=HfApi(token="hf_test"))
    assert hub.calls == []


def test_push_dry_run_lists_files_and_uploads_nothing(evaluated, tmp_path, monkeypatch):
    ckpt = copy_checkpoint(evaluated, tmp_path / "ckpt")
    add_junk(ckpt)
    hub = HubRecorder(monkeypatch)
    result = runner.invoke(app, ["push", str(ckpt), "someone/tiny-p50", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert hub.calls == [] and (ckpt / "README.md").is_file()
    assert "would upload to someone/tiny-p50:" in flat(result.output)
    assert "model.safetensors" in result.output and ".tmp" not in result.output
    assert upload_file_list(ckpt) == sorted(upload_file_list(ckpt))


def test_compress_push_to_hub(tmp_path, monkeypatch):
    src = save_tiny_llama(tmp_path / "src")
    text = tmp_path / "calib.txt"
    g = torch.Generator().manual_seed(0)
    text.write_text(" ".join(f"w{int(i)}" for i in torch.randint(3, 96, (2000,), generator=g)))
    hub = HubRecorder(monkeypatch)
    result = runner.invoke(
        app,
        [
            "compress",
            str(src),
            "-o",
            str(tmp_path / "out"),
            "--calibration",
            str(text),
            "--calib-tokens",
            "512",
            "--seq-len",
            "64",
            "--push-to-hub",
            "someone/pushed",
            "--hub-private",
        ],
    )
    assert result.exit_code == 0, result.output
    assert hub.call("create_repo")["private"] is True
    assert {"model.safetensors", "README.md", "rank_heatmap.png"} <= set(hub.uploaded)
    assert "https://huggingface.co/someone/pushed/commit/0" in flat(result.output)


# ----------------------------------------------------------------------------------------------------------------
# Hub failures, over real HTTP
# ----------------------------------------------------------------------------------------------------------------


class Unauthorized(http.server.BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 - http.server's naming
        body = json.dumps({"error": "Invalid credentials in Authorization header"}).encode()
        self.send_response(401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_not_logged_in_is_a_clear_error(evaluated, tmp_path):
    ckpt = copy_checkpoint(evaluated, tmp_path / "ckpt")
    server = http.server.HTTPServer(("127.0.0.1", 0), Unauthorized)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        api = HfApi(endpoint=f"http://127.0.0.1:{server.server_port}", token="hf_invalid")
        with pytest.raises(HubError, match=r"HTTP 401.*hf auth login"):
            push_checkpoint(ckpt, "someone/tiny-p50", api=api)
    finally:
        server.shutdown()


def test_network_down_is_a_clear_error(evaluated, tmp_path):
    ckpt = copy_checkpoint(evaluated, tmp_path / "ckpt")
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    api = HfApi(endpoint=f"http://127.0.0.1:{port}", token="hf_test")
    with pytest.raises(HubError, match="could not reach the Hugging Face Hub"):
        push_checkpoint(ckpt, "someone/tiny-p50", api=api)


def test_invalid_repo_id_is_refused_before_any_work(evaluated):
    with pytest.raises(InvalidArgumentError, match="repo id"):
        push_checkpoint(evaluated, "not a repo id!", api=HfApi(token="hf_test"))
