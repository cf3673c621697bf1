"""Linear layers with their weights prepacked for oneDNN while a CPU model generates text in bfloat16.

A decode step on a CPU is almost all matrix products of a few dozen rows against every weight matrix. oneDNN reads a
weight faster in its own blocked layout than in torch's row-major one, and it returns the same numbers (the
generator's speed with and without: benchmarks/results/synthetic_calibration_cpu_8l.json, `--unpacked`; the tests
compare logits and sampled tokens). So for the length of the generation each CPU
bfloat16 ``nn.Linear`` computes from a packed copy of its weight; the row-major weight is released meanwhile, so host
memory does not double, and it is rebuilt from the packed copy (exactly: the reorder is a permutation) on the way out,
also on an error or Ctrl-C. Anything else (CUDA, float32, a weight shared with another module, meta tensors, a
torch without oneDNN bfloat16) is left as it is.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch

__all__ = ["packed_cpu_linears", "can_pack"]


def can_pack() -> bool:
    """Whether this torch build and CPU run oneDNN's bfloat16 linear on packed weights."""
    mkldnn = getattr(torch.ops, "mkldnn", None)
    try:
        return bool(
            torch.backends.mkldnn.is_available()
            and mkldnn is not None
            and torch.ops.mkldnn._is_mkldnn_bf16_supported()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        )
    except (AttributeError, RuntimeError):
        return False


@dataclass
class _Packed:
    module: torch.nn.Linear
    packed: torch.Tensor
    shape: torch.Size


def _shared_weights(model: torch.nn.Module) -> set[int]:
    """ids of parameters held by more than one module (a tied lm_head and embedding): those stay row-major."""
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    return {key for key, count in owners.items() if count > 1}


def _packable(module: torch.nn.Module, shared: set[int]) -> bool:
    weight = getattr(module, "weight", None)
    return (
        type(module) is torch.nn.Linear  # subclasses (quantized, LoRA) compute something else
        and "forward" not in module.__dict__  # already wrapped by someone (offload hooks)
        and isinstance(weight, torch.nn.Parameter)
        and weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.layout == torch.strided
        and id(weight) not in shared
    )


def _packed_forward(packed: torch.Tensor, bias: torch.Tensor | None):
    def forward(x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
        return out.reshape(*x.shape[:-1], out.shape[-1])

    return forward


@contextmanager
def packed_cpu_linears(model: Any, rows: int) -> Iterator[int]:
    """Inside the block, every packable linear of ``model`` runs on a oneDNN-packed weight laid out for ``rows`` rows.

    Yields how many layers were packed (0 when nothing qualifies). Gradients are not supported inside the block.
    """
    if not isinstance(model, torch.nn.Module) or not can_pack():
        yield 0
        return
    if torch.is_inference_mode_enabled():
        # The weights rebuilt on the way out would be inference tensors, unusable by a later backward pass.
        raise RuntimeError("packed_cpu_linears must be entered outside torch.inference_mode().")
    shared = _shared_weights(model)
    done: list[_Packed] = []
    try:
        with torch.no_grad():
            for module in model.modules():
                if not _packable(module, shared):
                    continue
                weight = module.weight
                packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), max(1, int(rows)))
                done.append(_Packed(module, packed, weight.shape))
                module.forward = _packed_forward(packed, module.bias)
                # Release the row-major copy while the packed one is in use.
                weight.data = torch.empty(0, dtype=weight.dtype)
        yield len(done)
    finally:
        with torch.no_grad():
            for entry in reversed(done):
                entry.module.__dict__.pop("forward", None)
                if entry.module.weight.shape != entry.shape:  # released: rebuild it from the packed copy
                    entry.module.weight.data = entry.packed.to_dense().reshape(entry.shape)
