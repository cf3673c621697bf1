"""The key-mode interface and its registry.

A key mode is how a layer compresses its keys: the transform it solves from the calibration statistics, how
that transform folds into q_proj/k_proj (and what else the checkpoint stores), how its key ranks move and are
laid out, which families may use it, and what the compressed attention does with it at run time. Each mode is
one file in this package; `kvrewrite/key_modes/__init__.py` imports them, which registers them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, TypeVar

import torch
from torch import nn

from kvrewrite.adapters.base import AttentionFeatures, AttentionGeometry
from kvrewrite.errors import InvalidArgumentError
from kvrewrite.key_modes.rows import Linear64, map_rows, slice_linear_rows
from kvrewrite.method.statistics import LayerStatistics
from kvrewrite.spec import KEY_MODE_REGISTRY, LayerSpec


@dataclass(frozen=True, eq=False)
class KeyTransform:
    """A layer's key-side transform at full rank, ordered by importance. Each mode extends it with its tensors."""

    mode: str
    spectrum: (
        torch.Tensor
    )  # [n_kv, d] ([1, n_kv*d] for a shared key block), descending; truncation error ~ removed squares


class KeyMode(ABC):
    """One key mode. Subclasses set the class facts and implement `allowed_for` and `transform`; the other hooks
    have the defaults of a mode whose packed query and key come straight out of q_proj/k_proj, prefix-ordered
    per head (like folded)."""

    name: ClassVar[str]
    # Key ranks move in steps of this many dims (2: whole rotary pairs).
    rank_step: ClassVar[int] = 1
    # One key block per layer, scored by every query head (key_ranks [R, 0, ...]), instead of one per KV head.
    shared_key_block: ClassVar[bool] = False
    # The cache holds a pre-RoPE latent: attention rotates the full queries and rebuilds every key (rebuild_keys).
    rebuilds_keys: ClassVar[bool] = False
    # Extra run-time work per decode step relative to latent (the costliest), for --rope-mode auto.
    run_time_cost: ClassVar[float] = 0.0
    # Run-time work that does not grow with the context (the modes of --prefer zero-overhead).
    context_independent: ClassVar[bool] = True
    # What the mode does at decode time beyond the stock model's work, for the model card.
    run_time_sentence: ClassVar[str]

    # ---- which families -----------------------------------------------------------------------
    @abstractmethod
    def allowed_for(self, features: AttentionFeatures) -> bool:
        """Whether a family with these attention features can use this mode exactly."""

    # ---- compile: transform and fold ------------------------------------------------------------
    @abstractmethod
    def transform(self, objective: str, stats: LayerStatistics, geometry: AttentionGeometry) -> KeyTransform:
        """The layer's key transform at full rank from its calibration statistics."""

    def fold(
        self, transform: KeyTransform, q: Linear64, k: Linear64, geometry: AttentionGeometry
    ) -> tuple[Linear64, Linear64]:
        """New q_proj and k_proj (weight, bias) in float64 from the original ones; unchanged by default."""
        return map_rows(q, ()), map_rows(k, ())

    def stored_tensors(self, transform: KeyTransform) -> dict[str, torch.Tensor]:
        """Extra tensors of the compressed attention, by name (the parameters `add_parameters` declares)."""
        return {}

    def stored_order(self, transform: KeyTransform) -> list[list[int]] | None:
        """The spec's freq_order for this layer: the rotary frequency of every stored pair, or None."""
        return None

    # ---- key ranks and the spec -------------------------------------------------------------------
    def uniform_key_ranks(self, per_head: int, num_kv_heads: int) -> list[int]:
        """Key ranks keeping `per_head` dims for every KV head (one shared block of as many dims in all)."""
        if self.shared_key_block:
            return [per_head * num_kv_heads] + [0] * (num_kv_heads - 1)
        return [per_head] * num_kv_heads

    def full_key_ranks(self, num_kv_heads: int, head_dim: int) -> list[int]:
        return self.uniform_key_ranks(head_dim, num_kv_heads)

    def per_head_key_ranks(self, key_ranks: list[int]) -> list[int]:
        """Key dims per KV head for display: a shared block is split evenly over the heads."""
        if not self.shared_key_block:
            return list(key_ranks)
        n, total = len(key_ranks), key_ranks[0]
        return [total // n + (1 if g < total % n else 0) for g in range(n)]

    def key_rank_problems(self, index: int, layer: LayerSpec, num_kv_heads: int, head_dim: int) -> list[str]:
        """What is wrong with a layer's key ranks (their count is already checked)."""
        if any(not (0 <= r <= head_dim) for r in layer.key_ranks):
            return [f"layer {index}: key ranks {layer.key_ranks} outside [0, {head_dim}]"]
        return []

    def layer_problems(self, index: int, layer: LayerSpec, num_kv_heads: int, head_dim: int) -> list[str]:
        """Any other inconsistency of a layer spec in this mode (e.g. its freq_order)."""
        return []

    # ---- run time: the compressed attention ----------------------------------------------------------
    def query_width(self, num_kv_heads: int, head_dim: int) -> int:
        """q_proj rows per query head at full rank."""
        return head_dim

    def add_parameters(self, attn: nn.Module) -> None:
        """Declare the extra parameters the checkpoint stores for this mode (empty; loaded later)."""
        return None  # a mode without stored tensors declares none

    def slice_query_key(self, attn: nn.Module, key_ranks: list[int]) -> None:
        """Slice q_proj/k_proj from attn.key_ranks down to `key_ranks`: both keep a prefix per head by default."""
        g = attn.group_size
        slice_linear_rows(attn.k_proj, attn.key_ranks, key_ranks)
        slice_linear_rows(
            attn.q_proj, [r for r in attn.key_ranks for _ in range(g)], [r for r in key_ranks for _ in range(g)]
        )

    def indices(self, attn: nn.Module) -> dict[str, torch.Tensor]:
        """Index tensors the mode needs at the current ranks (built on CPU, cached on the module per device)."""
        return {}

    def project(
        self, attn: nn.Module, query: torch.Tensor, key: torch.Tensor, cos, sin
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The packed query and key latents from q_proj/k_proj's outputs (and RoPE's cos/sin); unchanged by default."""
        return query, key

    def rebuild_keys(
        self,
        attn: nn.Module,
        latent: torch.Tensor,
        g: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        latent_map: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """KV head g's rotated keys [B, 1, S, d] from its cached latent [B, 1, S, r] (modes with rebuilds_keys);
        latent_map (matrix [B, r, r], offset [B, r]): the cache holds a code y of the latent, latent = y @ matrix +
        offset."""
        raise NotImplementedError(f"key mode {self.name!r} caches its keys; nothing to rebuild")

    @property
    def uses_packed_kernel(self) -> bool:
        """Whether attention runs through the packed kernels (the other modes attend with their own torch code)."""
        return not (self.rebuilds_keys or self.shared_key_block)


# ---- the registry -----------------------------------------------------------------------------------
# The dict itself lives in kvrewrite.spec: the spec sits below the modes yet validates each layer by its mode.
_REGISTRY = KEY_MODE_REGISTRY
M = TypeVar("M", bound=type[KeyMode])


def register_key_mode(cls: M) -> M:
    """Class decorator: register one instance of a KeyMode under its name (checkpoints store the name)."""
    if cls.name in _REGISTRY:
        raise ValueError(f"key mode {cls.name!r} is already registered")
    _REGISTRY[cls.name] = cls()
    return cls


def unregister_key_mode(name: str) -> None:
    """Remove a registered mode (for tests and experiments that register their own)."""
    _REGISTRY.pop(name, None)


def key_mode(name: str) -> KeyMode:
    mode = _REGISTRY.get(name)
    if mode is None:
        raise InvalidArgumentError(f"unknown key mode {name!r}; known: {', '.join(_REGISTRY)}")
    return mode


def key_mode_names() -> tuple[str, ...]:
    """Every registered mode, in registration order."""
    return tuple(_REGISTRY)


def key_transform(name: str, objective: str, stats: LayerStatistics, geometry: AttentionGeometry) -> KeyTransform:
    """The named mode's transform of one layer."""
    return key_mode(name).transform(objective, stats, geometry)
