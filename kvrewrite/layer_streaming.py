"""Running a causal LM one decoder layer at a time, with weights read lazily from safetensors shards.

The model is built once on the meta device (its shape, no weights). A module gets real weights only
while it runs (`StreamedModel.materialised`) and goes back to meta afterwards, so peak memory is about
one decoder layer plus the activations being carried, whatever the model's size. Every pass that needs
activations (statistics, sensitivity probes, verification) runs through this one runner.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import init_empty_weights
from safetensors import safe_open
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.masking_utils import create_causal_mask

from kvrewrite.checkpoint_io import SAFETENSORS_INDEX_FILE, SINGLE_SHARD_FILE
from kvrewrite.errors import CorruptCheckpointError, ModelSourceError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}

TensorSource = Callable[[list[str]], dict[str, torch.Tensor]]


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
        files = [SINGLE_SHARD_FILE] if (self.directory / SINGLE_SHARD_FILE).is_file() else sorted(
            p.name for p in self.directory.glob("*.safetensors")
        )
        if not files:
            raise ModelSourceError(f"no *.safetensors weights in {self.directory}; kvrewrite reads safetensors checkpoints only")
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


def empty_model(model_class_or_config, config=None) -> nn.Module:
    """A model on the meta device (parameters only; buffers such as RoPE frequencies stay real)."""
    with init_empty_weights(include_buffers=False):
        if config is None:
            model = AutoModelForCausalLM.from_config(model_class_or_config)
        else:
            model = model_class_or_config(config)
    return model.eval()


def module_prefixes(model: nn.Module) -> dict[int, str]:
    return {id(module): name for name, module in model.named_modules()}


class StreamedModel:
    """A meta-device model whose modules are given real weights only while they run."""

    def __init__(self, skeleton: nn.Module, adapter, tensors: TensorSource, dtype: torch.dtype, device: str | torch.device = "cpu"):
        self.skeleton, self.adapter, self.tensors = skeleton, adapter, tensors
        self.dtype, self.device = dtype, torch.device(device)
        self.prefixes = module_prefixes(skeleton)
        self.layers = adapter.decoder_layers(skeleton)
        self.rotary = adapter.rotary_embedding(skeleton).to(self.device)
        # Parameters holding real data right now, and the most there ever were (a memory check for tests).
        self.resident_params = 0
        self.peak_resident_params = 0

    def name_of(self, module: nn.Module) -> str:
        return self.prefixes[id(module)]

    @contextlib.contextmanager
    def materialised(self, module: nn.Module) -> Iterator[nn.Module]:
        """Give `module` its weights (read now, cast to the compute dtype) for the duration of the block."""
        prefix = self.name_of(module)
        local = list(module.state_dict().keys())
        full = [f"{prefix}.{k}" if prefix else k for k in local]
        loaded = self.tensors(full)
        state = {k: loaded[name].to(device=self.device, dtype=self.dtype) for k, name in zip(local, full)}
        del loaded
        module.load_state_dict(state, strict=True, assign=True)
        del state
        count = sum(p.numel() for p in module.parameters())
        self.resident_params += count
        self.peak_resident_params = max(self.peak_resident_params, self.resident_params)
        try:
            yield module
        finally:
            module.to("meta")
            self.resident_params -= count

    def layer(self, idx: int):
        return self.materialised(self.layers[idx])

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed_batches([tokens])[0]

    def embed_batches(self, batches: list[torch.Tensor]) -> list[torch.Tensor]:
        """Input embeddings of several token batches, reading the embedding matrix once."""
        embedding = self.skeleton.get_input_embeddings()
        with self.materialised(embedding):
            return [embedding(tokens.to(self.device)) for tokens in batches]

    def layer_inputs(self, hidden: torch.Tensor) -> dict:
        """Mask, positions and RoPE tables for a batch of full windows (no padding, no cache)."""
        batch, length = hidden.shape[:2]
        positions = torch.arange(length, device=self.device)[None].expand(batch, -1)
        mask = create_causal_mask(
            config=self.skeleton.config, inputs_embeds=hidden, attention_mask=None, past_key_values=None, position_ids=positions
        )
        return {"attention_mask": mask, "position_ids": positions, "position_embeddings": self.rotary(hidden, positions)}

    @staticmethod
    def run_layer(layer: nn.Module, hidden: torch.Tensor, inputs: dict) -> torch.Tensor:
        out = layer(hidden, use_cache=False, **inputs)
        return out[0] if isinstance(out, tuple) else out

    @contextlib.contextmanager
    def output_head(self) -> Iterator[Callable[[torch.Tensor], torch.Tensor]]:
        """final norm + LM head, materialised once for several hidden-state streams."""
        norm = self.adapter.final_norm(self.skeleton)
        head = self.skeleton.get_output_embeddings()
        with self.materialised(norm), self.materialised(head):
            yield lambda hidden: head(norm(hidden))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with self.output_head() as head:
            return head(hidden)


@dataclass
class SourceModel:
    """The original checkpoint: its config, adapter, lazily read tensors and a meta-device skeleton."""

    directory: Path
    config: object
    adapter: object
    checkpoint: LazyCheckpoint
    skeleton: nn.Module

    @classmethod
    def open(cls, directory: Path, config, adapter) -> "SourceModel":
        return cls(Path(directory), config, adapter, LazyCheckpoint(directory), empty_model(config))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.skeleton.parameters())

    def tensor_name(self, name: str) -> str:
        """Where a parameter lives in the checkpoint (a tied lm_head is stored as the embedding)."""
        if name in self.checkpoint:
            return name
        if getattr(self.config, "tie_word_embeddings", False) and name == self.output_embedding_name():
            return self.input_embedding_name()
        raise CorruptCheckpointError(f"tensor {name!r} is missing from the checkpoint in {self.directory}")

    def input_embedding_name(self) -> str:
        return module_prefixes(self.skeleton)[id(self.skeleton.get_input_embeddings())] + ".weight"

    def output_embedding_name(self) -> str:
        return module_prefixes(self.skeleton)[id(self.skeleton.get_output_embeddings())] + ".weight"

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        stored = {name: self.tensor_name(name) for name in names}
        tensors = self.checkpoint.read(sorted(set(stored.values())))
        return {name: tensors[where] for name, where in stored.items()}

    def attention_prefix(self, layer_idx: int) -> str:
        layer = self.adapter.decoder_layers(self.skeleton)[layer_idx]
        return module_prefixes(self.skeleton)[id(self.adapter.attention(layer))]

    def streamed(self, dtype: torch.dtype = torch.float32, device: str = "cpu") -> StreamedModel:
        return StreamedModel(self.skeleton, self.adapter, self.read, dtype, device)
