"""The tensors of a safetensors checkpoint, read on demand (the loader's completeness check and the layer streamer)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from kvrewrite.errors import CorruptCheckpointError, ModelSourceError
from kvrewrite.io.checkpoint_io import SAFETENSORS_INDEX_FILE, SINGLE_SHARD_FILE


class LazyCheckpoint:
    """The tensors of a safetensors checkpoint (one file or an indexed set of shards), read on demand.

    Each `read` opens the shards it needs and closes them again, so no memory map of a multi-GB shard
    stays resident between layers.
    """

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.weight_map = self._weight_map()
        self.tensors_read = 0  # how many tensors were read so far (tests use it to check streaming)

    def _weight_map(self) -> dict[str, str]:
        index = self.directory / SAFETENSORS_INDEX_FILE
        if index.is_file():
            try:
                return dict(json.loads(index.read_text(encoding="utf-8"))["weight_map"])
            except (ValueError, KeyError, TypeError) as exc:
                raise CorruptCheckpointError(f"{index} is not a valid safetensors index ({exc})") from exc
        files = (
            [SINGLE_SHARD_FILE]
            if (self.directory / SINGLE_SHARD_FILE).is_file()
            else sorted(p.name for p in self.directory.glob("*.safetensors"))
        )
        if not files:
            raise ModelSourceError(
                f"no *.safetensors weights in {self.directory}; kvrewrite reads safetensors checkpoints only"
            )
        weight_map = {}
        for name in files:
            with safe_open(str(self.directory / name), framework="pt") as f:
                weight_map.update({key: name for key in f.keys()})
        return weight_map

    def names(self) -> list[str]:
        return list(self.weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        by_file: dict[str, list[str]] = {}
        for name in names:
            if name not in self.weight_map:
                raise CorruptCheckpointError(f"tensor {name!r} is missing from the checkpoint in {self.directory}")
            by_file.setdefault(self.weight_map[name], []).append(name)
        out = {}
        for filename, wanted in by_file.items():
            with safe_open(str(self.directory / filename), framework="pt") as f:
                for name in wanted:
                    out[name] = f.get_tensor(name).clone()  # own memory, not a view of the closed map
        self.tensors_read += len(out)
        return out

    def total_bytes(self) -> int:
        """Size of the weights on disk (sum of the shard files)."""
        return sum((self.directory / f).stat().st_size for f in set(self.weight_map.values()))
