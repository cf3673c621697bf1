"""Trained codec tables (CSR dictionaries, TaDA bit widths) in `kv_codec.safetensors` next to the weights."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from kvrewrite.errors import CorruptCheckpointError
from kvrewrite.io.checkpoint_io import save_safetensors

CODEC_TABLES_FILE = "kv_codec.safetensors"


def write_codec_tables(directory: Path, tables: dict[str, torch.Tensor]) -> list[str]:
    """Write the tables (if any); returns the file names written, for the checksum list."""
    if not tables:
        return []
    save_safetensors(
        {k: v.detach().cpu().contiguous() for k, v in tables.items()},
        Path(directory) / CODEC_TABLES_FILE,
        metadata={"format": "pt"},
    )
    return [CODEC_TABLES_FILE]


def read_codec_tables(directory: Path) -> dict[str, torch.Tensor]:
    path = Path(directory) / CODEC_TABLES_FILE
    if not path.is_file():
        return {}
    try:
        return load_file(str(path))
    except Exception as exc:  # safetensors raises its own error types
        raise CorruptCheckpointError(f"{path} is damaged ({exc}); re-run the compile") from exc
