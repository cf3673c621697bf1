"""An FP8 (e4m3) KV cache: keys and values stored as float8_e4m3fn, upcast for attention.

transformers has no stock float8 cache, so this is ours; it is only a storage dtype (no scaling, as vLLM's fp8
cache with its default scale of 1.0). e4m3 spans +-448, enough for SmolLM2's keys and values.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

FP8 = torch.float8_e4m3fn


class FP8Layer(DynamicLayer):
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, cache_kwargs: dict[str, Any] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.keys, self.values = self.keys.to(FP8), self.values.to(FP8)
        self.keys = torch.cat([self.keys, key_states.to(FP8)], dim=-2)
        self.values = torch.cat([self.values, value_states.to(FP8)], dim=-2)
        return self.keys.to(key_states.dtype), self.values.to(value_states.dtype)


class FP8Cache(Cache):
    def __init__(self, config: Any) -> None:
        config = config.get_text_config(decoder=True)
        super().__init__(layers=[FP8Layer() for _ in range(config.num_hidden_layers)])
