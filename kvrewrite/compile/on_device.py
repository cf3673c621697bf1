"""A whole model on the compile device for one block of work, and back where it was after it.

The passes that need a whole model rather than one streamed layer (compress's Fisher, output refit and
distillation; the MLA export's expected rotations, sensitivity probes, refits, distillation and checks) share one
host copy of the original (CompileContext.original_model). Each moves it to `--device` for its own work and returns
it afterwards, also when that work fails, so that the next step finds it in host memory and the GPU holds one whole
model at a time besides the step's own copy. A block inside another for the same device
moves nothing: a pass that calls several such steps wraps them once, and the model crosses to the GPU once."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


@contextmanager
def whole_model_on(model: nn.Module, device: str | torch.device) -> Iterator[nn.Module]:
    """`model` moved to `device` inside the block (in place, as nn.Module.to moves it), back on its own device after."""
    target, start = torch.device(device), next(model.parameters()).device
    if target.type == start.type and (target.index is None or target.index == start.index):
        yield model
        return
    model.to(target)
    try:
        yield model
    finally:
        model.to(start)
