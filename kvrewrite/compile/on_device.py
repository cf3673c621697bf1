"""A whole model on the compile device for one block of work, and back in host memory after it.

The passes that need a whole model (not layer-streamed: Fisher, the output refits, the distillations, the MLA
export's probes and checks) share one host copy of the original (CompileContext.original_model). Each moves it to
`--device` for its own work and returns it to the CPU afterwards, also when that work fails, so that the next pass
finds it where it expects and the GPU holds one whole model at a time."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


@contextmanager
def whole_model_on(model: nn.Module, device: str | torch.device) -> Iterator[nn.Module]:
    """`model` moved to `device` inside the block (in place, as nn.Module.to moves it), on the CPU again after it."""
    target = torch.device(device)
    if target.type == "cpu":
        yield model
        return
    model.to(target)
    try:
        yield model
    finally:
        model.to("cpu")
