"""Linear layers with their weights prepacked for oneDNN while a CPU model generates text.

A decode step on a CPU is almost all matrix products of a few dozen rows against every weight matrix. oneDNN reads a
weight faster in its own blocked layout than in torch's row-major one (the generator's speed with and without:
benchmarks/results/synthetic_calibration_cpu_8l.json, `--unpacked`). So for the length of the generation each CPU
``nn.Linear`` computes from a packed copy of its weight; the row-major weight is released meanwhile, and it is
rebuilt from the packed copy (exactly) on the way out, also on an error or Ctrl-C.

How a weight is packed depends on its dtype and on the CPU (`choose_packing`):

- bfloat16 on a CPU that multiplies bfloat16 natively (AVX512-BF16 or AMX): packed as bfloat16. The products are
  oneDNN's bfloat16 ones, as the row-major linear computes them, so the text is the same.
- bfloat16 on a CPU without (oneDNN emulates bfloat16 products there; on such a core the bfloat16 generator ran at
  3.91 tokens/s packed as bfloat16 and 9.85 widened: benchmarks/results/synthetic_calibration_cpu_8l_xeon.json and
  synthetic_calibration_cpu_8l_xeon_widened.json): packed *widened* to float32, the activations cast to float32 and
  the outputs back to bfloat16 at each linear. Host memory then holds the linears at 4 bytes a number instead of 2,
  so this is chosen only when that fits in the available memory, with room to spare; else bfloat16 packing.
- float32: packed as float32.

Products in float32 add up in another order than torch's own, so they can round differently in the last place;
`PackingPlan.arithmetic` names that, for the synthetic text's cache key. Anything else (CUDA, a weight shared with
another module, meta tensors, a torch without oneDNN) is left as it is.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

__all__ = ["PackingPlan", "can_pack", "choose_packing", "native_bfloat16", "packed_cpu_linears"]

# Widening must leave this much of the available memory free, on top of the float32 copies' extra bytes.
_WIDEN_HEADROOM_BYTES = 1 << 30
_WIDEN_HEADROOM_SHARE = 0.25


@dataclass(frozen=True)
class PackingPlan:
    """How `packed_cpu_linears` packs a model's linears.

    dtypes: the weight dtypes it packs (empty: nothing is packed). widen: bfloat16 weights are packed as float32.
    arithmetic: None when the products are torch's own row-major ones (the text does not change), else a name of
    the products used instead, for cache keys."""

    dtypes: tuple[torch.dtype, ...] = ()
    widen: bool = False

    @property
    def arithmetic(self) -> str | None:
        return "onednn-float32" if torch.float32 in self.dtypes or self.widen else None


def can_pack(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether this torch build runs oneDNN's linear on packed weights of this dtype."""
    mkldnn = getattr(torch.ops, "mkldnn", None)
    try:
        available = bool(
            torch.backends.mkldnn.is_available()
            and mkldnn is not None
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        )
        if dtype == torch.bfloat16:
            return available and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        return available and dtype == torch.float32
    except (AttributeError, RuntimeError):
        return False


def native_bfloat16() -> bool:
    """Whether this CPU has bfloat16 multiply instructions (AVX512-BF16 or AMX), rather than oneDNN emulating them."""
    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except (AttributeError, RuntimeError):
        return False


def _available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where there is none: widening is then not chosen)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _shared_weights(model: torch.nn.Module) -> set[int]:
    """ids of parameters held by more than one module (a tied lm_head and embedding): those stay row-major."""
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    return {key for key, count in owners.items() if count > 1}


def _packable(module: torch.nn.Module, shared: set[int], dtypes: tuple[torch.dtype, ...]) -> bool:
    weight = getattr(module, "weight", None)
    return (
        type(module) is torch.nn.Linear  # subclasses (quantized, LoRA) compute something else
        and "forward" not in module.__dict__  # already wrapped by someone (offload hooks)
        and isinstance(weight, torch.nn.Parameter)
        and weight.device.type == "cpu"
        and weight.dtype in dtypes
        and weight.layout == torch.strided
        and id(weight) not in shared
    )


def choose_packing(model: Any, widen: bool | None = None) -> PackingPlan:
    """The packing `packed_cpu_linears` applies to ``model`` on this CPU. ``widen``: None decides by the CPU and the
    available memory (module docstring); True / False force it where bfloat16 weights are packed at all."""
    if not isinstance(model, torch.nn.Module):
        return PackingPlan()
    supported = tuple(d for d in (torch.bfloat16, torch.float32) if can_pack(d))
    shared = _shared_weights(model)
    present = {m.weight.dtype for m in model.modules() if _packable(m, shared, supported)}
    dtypes = tuple(d for d in supported if d in present)  # on CUDA, or with nothing to pack: none
    if torch.bfloat16 not in dtypes or torch.float32 not in supported:
        return PackingPlan(dtypes)
    if widen is None:
        widen = not native_bfloat16() and _widening_fits(model, shared)
    return PackingPlan(dtypes, widen=bool(widen))


def _widening_fits(model: torch.nn.Module, shared: set[int]) -> bool:
    extra = sum(
        m.weight.numel() * 2  # float32's 4 bytes a number against the released bfloat16's 2
        for m in model.modules()
        if _packable(m, shared, (torch.bfloat16,))
    )
    available = _available_memory_bytes()
    if available is None:
        return False
    return extra * (1 + _WIDEN_HEADROOM_SHARE) + _WIDEN_HEADROOM_BYTES <= available


@dataclass
class _Packed:
    module: torch.nn.Linear
    packed: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype


def _packed_forward(packed: torch.Tensor, bias: torch.Tensor | None, io_dtype: torch.dtype | None):
    def forward(x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if io_dtype is not None:  # widened: float32 products of the bfloat16 activations, the outputs rounded back
            rows = rows.to(torch.float32)
        out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
        if io_dtype is not None:
            out = out.to(io_dtype)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    return forward


@contextmanager
def packed_cpu_linears(model: Any, rows: int, plan: PackingPlan | None = None) -> Iterator[int]:
    """Inside the block, every packable linear of ``model`` runs on a oneDNN-packed weight laid out for ``rows`` rows,
    as ``plan`` says (default: `choose_packing(model)`).

    Yields how many layers were packed (0 when nothing qualifies). Gradients are not supported inside the block.
    """
    plan = choose_packing(model) if plan is None else plan
    if not isinstance(model, torch.nn.Module) or not plan.dtypes:
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
                if not _packable(module, shared, plan.dtypes):
                    continue
                weight, bias = module.weight, module.bias
                widened = plan.widen and weight.dtype == torch.bfloat16
                source = weight.detach().to(torch.float32) if widened else weight.detach()
                packed = torch.ops.mkldnn._reorder_linear_weight(source, max(1, int(rows)))
                del source
                done.append(_Packed(module, packed, weight.shape, weight.dtype))
                if widened and bias is not None:
                    bias = bias.detach().to(torch.float32)
                module.forward = _packed_forward(packed, bias, weight.dtype if widened else None)
                # Release the row-major copy while the packed one is in use.
                weight.data = torch.empty(0, dtype=weight.dtype)
        yield len(done)
    finally:
        with torch.no_grad():
            for entry in reversed(done):
                entry.module.__dict__.pop("forward", None)
                if entry.module.weight.shape != entry.shape:  # released: rebuild it from the packed copy
                    # Exact: the reorder is a permutation, and a widened bfloat16 number is exact in float32.
                    dense = entry.packed.to_dense().reshape(entry.shape)
                    entry.module.weight.data = dense.to(entry.dtype)
