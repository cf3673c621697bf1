"""Rate-conditional o_proj of an MLA export (`export-mla --refit-rates`): one refitted o_proj per served rate.

A closed-form o_proj refit is fitted to the latent widths it saw, so it serves one rate. An export made with
`--refit-rates` keeps the widest rate's o_proj in the stock weights (what every engine loads) and every narrower
rate's in a side file, `kvrewrite_rates/o_proj.safetensors`, that no engine reads: stock transformers loads the
model's own weight files only, and llama.cpp's converter and vLLM read `*.safetensors` at the top level only.
`kvrewrite.load(dir, rate=p)` copies rate p's o_proj into the model when it loads, so nothing runs at decode time.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from kvrewrite.errors import CorruptCheckpointError

# The marker key listing the rates (rate keys) whose o_proj the side file holds.
RATE_O_PROJ_KEY = "rate_o_proj"
RATE_O_PROJ_FILE = Path("kvrewrite_rates") / "o_proj.safetensors"


def rate_o_proj_name(rate: str, layer: int) -> str:
    """The side file's tensor name of rate `rate`'s o_proj in decoder layer `layer`."""
    return f"rate_{rate}.layers.{layer}.o_proj.weight"


def rates_with_o_proj(marker: dict) -> list[str]:
    """The rate keys whose own o_proj an export holds (empty for an export without --refit-rates)."""
    rates = marker.get(RATE_O_PROJ_KEY, [])
    if not isinstance(rates, list) or not all(isinstance(r, str) for r in rates):
        raise CorruptCheckpointError(f"kvrewrite_mla.{RATE_O_PROJ_KEY} must list rate keys, got {rates!r}")
    return rates


def load_rate_o_proj(model: nn.Module, directory: Path, rate: str) -> None:
    """Copy rate `rate`'s o_proj from the side file into every decoder layer of the stock model (in place)."""
    from safetensors import safe_open

    path = Path(directory) / RATE_O_PROJ_FILE
    if not path.is_file():
        raise CorruptCheckpointError(
            f"{directory}'s config lists an o_proj for rate {rate}, but {path} is missing; "
            "re-download the checkpoint or re-export it"
        )
    layers = model.model.layers
    try:
        opened = safe_open(str(path), framework="pt")
    except Exception as exc:  # safetensors raises its own error types for a damaged header
        raise CorruptCheckpointError(
            f"{path} is not a readable safetensors file ({exc}); re-download the checkpoint or re-export it"
        ) from None
    with opened as tensors:
        stored = set(tensors.keys())
        for idx, layer in enumerate(layers):
            name = rate_o_proj_name(rate, idx)
            target = layer.self_attn.o_proj.weight
            if name not in stored:
                raise CorruptCheckpointError(f"{path} has no tensor {name}; re-download the checkpoint or re-export it")
            if target.is_meta:  # offloaded (device_map): there is nothing here to copy into
                raise CorruptCheckpointError(
                    f"rate {rate}'s o_proj cannot be loaded into offloaded weights; load "
                    f"{directory} at that rate without a device_map that offloads layers"
                )
            weight = tensors.get_tensor(name)
            if weight.shape != target.shape:
                raise CorruptCheckpointError(
                    f"{path}: {name} has shape {list(weight.shape)}, the model's o_proj {list(target.shape)}"
                )
            with torch.no_grad():
                target.copy_(weight.to(target.dtype))
