"""Publishing a compiled checkpoint on the Hugging Face Hub: check it, write its card, create the repo, upload.

The upload is huggingface_hub's own `upload_folder` (its file selection, its commit); kvrewrite only decides which
files must never leave the machine (temp files of interrupted writes, hidden files) and turns Hub failures into
messages that say what to do.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from huggingface_hub import HfApi, constants
from huggingface_hub.errors import (  # HTTPError: huggingface_hub's HTTP client's base error (connection failures too)
    HfHubHTTPError,
    HFValidationError,
    HTTPError,
    LocalTokenNotFoundError,
    OfflineModeIsEnabled,
)
from huggingface_hub.utils import DEFAULT_IGNORE_PATTERNS, filter_repo_objects, validate_repo_id

from kvrewrite.errors import HubError, InvalidArgumentError
from kvrewrite.io.manifest import MODELING_FILE, verify_manifest
from kvrewrite.publish.model_card import (
    CARD_FILE,
    HEATMAP_FILE,
    is_generated_card,
    read_checkpoint_facts,
    render_model_card,
    write_model_card,
)

# Hidden entries are the temp files of atomic writes (".name.tmp-…") and editor/OS litter; never upload them.
UPLOAD_IGNORE_PATTERNS = (".*", "*/.*", "*.tmp", "__pycache__/*", "*/__pycache__/*")


@dataclass
class PushResult:
    repo_id: str
    files: list[str]  # paths in the repo, as upload_folder selects them
    card_written: bool  # False when a hand-written README.md was kept
    repo_url: str | None = None
    commit_url: str | None = None
    pr_url: str | None = None
    dry_run: bool = False
    notes: list[str] = field(default_factory=list)


def upload_file_list(directory: Path) -> list[str]:
    """The files `upload_folder` will send for this directory (same filter, same patterns, same order)."""
    directory = Path(directory).expanduser().resolve()
    files = sorted(p.relative_to(directory).as_posix() for p in directory.glob("**/*") if p.is_file())
    return list(filter_repo_objects(files, ignore_patterns=[*UPLOAD_IGNORE_PATTERNS, *DEFAULT_IGNORE_PATTERNS]))


def refuse_foreign_code(directory: Path) -> None:
    """Never publish code: the only Python file a checkpoint may carry is kvrewrite's own modeling stub."""
    foreign = [name for name in upload_file_list(directory) if name.endswith(".py") and name != MODELING_FILE]
    if foreign:
        raise InvalidArgumentError(
            f"{Path(directory) / foreign[0]} is Python code that kvrewrite did not write"
            + (f" (and {len(foreign) - 1} more .py file(s))" if len(foreign) > 1 else "")
            + "; a kvrewrite checkpoint carries no code but its modeling_kvrewrite.py stub, so nothing was uploaded. "
            "Delete it, or push the folder with huggingface_hub yourself"
        )


def ensure_heatmap(directory: Path) -> Path:
    """DIR/rank_heatmap.png, drawn from the spec if `kvrewrite inspect` has not made one yet."""
    path = Path(directory) / HEATMAP_FILE
    if not path.is_file():
        from kvrewrite.extras import PLOTS, require_package

        require_package("matplotlib", f"drawing the model card's rank heat map ({PLOTS})")
        from kvrewrite.publish.rank_plot import plot_rank_heatmap

        spec = read_checkpoint_facts(directory).spec
        plot_rank_heatmap(
            [l.key_ranks for l in spec.layers],
            [l.value_ranks for l in spec.layers],
            spec.head_dim,
            path,
            title=f"{spec.source_model}: p = {spec.target_rate:.2f} ({spec.objective}/{spec.allocation})",
        )
    return path


def prepare_for_upload(
    directory: Path, repo_id: str | None, *, base_model: str | None = None, license: str | None = None
) -> bool:
    """Verify the weights, draw the heat map, write the card unless a hand-written one exists. True if written."""
    verify_manifest(directory)  # never publish a damaged or edited checkpoint
    ensure_heatmap(directory)
    card_path = Path(directory) / CARD_FILE
    if card_path.is_file() and not is_generated_card(card_path):
        return False
    write_model_card(directory, render_model_card(directory, repo_id=repo_id, base_model=base_model, license=license))
    return True


def push_checkpoint(
    directory: Path,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    create_pr: bool = False,
    commit_message: str | None = None,
    token: str | None = None,
    base_model: str | None = None,
    license: str | None = None,
    dry_run: bool = False,
    api: HfApi | None = None,
) -> PushResult:
    """Upload a kvrewrite checkpoint directory to the Hub repo `repo_id` (created if needed) with a generated card."""
    directory = Path(directory).expanduser()
    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        raise InvalidArgumentError(f"{repo_id!r} is not a valid Hub repo id ({exc}); use 'user/name'") from exc
    if create_pr and revision not in (None, constants.DEFAULT_REVISION):
        raise InvalidArgumentError(
            "`create_pr` opens a pull request against main; it cannot be combined with `revision`"
        )
    if not directory.is_dir():
        raise InvalidArgumentError(f"{directory} is not a directory; pass a kvrewrite output directory")
    read_checkpoint_facts(directory)  # a kvrewrite checkpoint with a readable spec, or a clear error
    refuse_foreign_code(directory)
    card_written = prepare_for_upload(directory, repo_id, base_model=base_model, license=license)
    result = PushResult(repo_id=repo_id, files=upload_file_list(directory), card_written=card_written, dry_run=dry_run)
    if not card_written:
        result.notes.append(f"kept the hand-written {CARD_FILE} (delete it to get a generated card)")
    if dry_run:
        return result
    if constants.HF_HUB_OFFLINE:
        raise HubError("HF_HUB_OFFLINE is set, so nothing can be uploaded; unset it to push")

    api = api or HfApi(token=token)
    try:
        repo_url = api.create_repo(repo_id, private=private, repo_type="model", exist_ok=True)
        if revision and not create_pr and revision != constants.DEFAULT_REVISION:
            api.create_branch(repo_id, branch=revision, repo_type="model", exist_ok=True)
        info = api.upload_folder(
            repo_id=repo_id,
            folder_path=os.fspath(directory),
            repo_type="model",
            revision=revision,
            create_pr=create_pr,
            commit_message=commit_message or f"Upload kvrewrite checkpoint {directory.resolve().name}",
            ignore_patterns=list(UPLOAD_IGNORE_PATTERNS),  # upload_folder extends the list it is given
        )
    except (LocalTokenNotFoundError, HfHubHTTPError, OfflineModeIsEnabled, HTTPError) as exc:
        raise HubError(_explain(exc, repo_id)) from exc
    result.repo_url = str(repo_url)
    result.commit_url = getattr(info, "commit_url", None)
    result.pr_url = getattr(info, "pr_url", None)
    return result


def _explain(exc: Exception, repo_id: str) -> str:
    login = "log in with `hf auth login` or set HF_TOKEN to a token with write access"
    if isinstance(exc, LocalTokenNotFoundError):
        return f"not logged in to the Hugging Face Hub: {login}"
    if isinstance(exc, OfflineModeIsEnabled):
        return f"the Hub is in offline mode ({exc}); unset HF_HUB_OFFLINE to push"
    if isinstance(exc, HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else None
        if status in (401, 403):
            return f"the Hub refused the upload to {repo_id} (HTTP {status}): {login}"
        return f"the Hub refused the upload to {repo_id}: {exc}"
    return f"could not reach the Hugging Face Hub ({type(exc).__name__}: {exc}); check the network and retry"
