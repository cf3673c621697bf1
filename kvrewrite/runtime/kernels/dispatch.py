"""Which attention implementation runs a layer: Triton kernels on CUDA, torch rank buckets elsewhere.

`KVREWRITE_ATTENTION` overrides the choice: `torch` (rank buckets), `reference` (the per-head oracle) or
`triton` (needs triton; on CPU only under `TRITON_INTERPRET=1`, which is how the kernel tests run).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Callable

import torch

from kvrewrite.errors import InvalidArgumentError
from kvrewrite.runtime.kernels.buckets import BucketedAttention
from kvrewrite.runtime.kernels.reference import PackedLayout, packed_attention

BACKENDS = ("auto", "torch", "reference", "triton")

# query [B,T,Qsum], key [B,1,S,Ksum], value [B,1,S,Vsum], mask, scaling -> output [B,T,Osum]
PackedAttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, float], torch.Tensor]


# Looked up once: resolve_backend runs in every forward, and torch.compile refuses to trace find_spec (the first GPU
# run's compiled forms all failed there).
_TRITON_FOUND = importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    return _TRITON_FOUND


def requested_backend() -> str:
    backend = os.environ.get("KVREWRITE_ATTENTION", "auto").strip().lower() or "auto"
    if backend not in BACKENDS:
        raise InvalidArgumentError(f"KVREWRITE_ATTENTION={backend!r}; choose one of {', '.join(BACKENDS)}")
    return backend


def resolve_backend(device: torch.device) -> str:
    """The backend a layer on `device` runs: triton on CUDA when importable, torch buckets otherwise."""
    backend = requested_backend()
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if backend == "triton" and not triton_available():
        raise InvalidArgumentError("KVREWRITE_ATTENTION=triton but triton is not installed (pip install triton)")
    return backend


def build_attention(layout: PackedLayout, backend: str) -> PackedAttentionFn:
    if backend == "torch":
        return BucketedAttention(layout)
    if backend == "triton":
        from kvrewrite.runtime.kernels.triton_attention import TritonPackedAttention

        return TritonPackedAttention(layout)
    return lambda q, k, v, mask, scaling: packed_attention(q, k, v, mask, scaling, layout)
