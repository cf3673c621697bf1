"""Attention of a rewritten decoder layer: projects to reduced dims, applies RoPE per key mode, caches packed latents.

Parameters are built at full rank (the checkpoint stores every transform at full rank, ordered by
importance) and sliced to the requested ranks once after loading (`set_ranks`).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvrewrite.errors import CorruptCheckpointError
from kvrewrite.key_modes import allowed_key_modes, key_mode
from kvrewrite.key_modes.rows import block_prefix_rows, slice_linear_rows
from kvrewrite.runtime.codecs.readout import CodedReadout
from kvrewrite.runtime.codecs.static_cache import CountedReadout
from kvrewrite.runtime.inplace_cache import InPlaceLayer, in_place_layer
from kvrewrite.runtime.kernels.cache_layout import COLUMNS, ROWS, packed_view, to_storage
from kvrewrite.runtime.kernels.coded_attention import blockwise_coded_attention
from kvrewrite.runtime.kernels.dispatch import PackedAttentionFn, build_attention, resolve_backend
from kvrewrite.runtime.kernels.latent_decode import latent_decode_attention
from kvrewrite.runtime.kernels.reference import (
    PackedLayout,
    boolean_mask,
    grouped_attention,
    packed_attention,
    shared_key_attention,
)
from kvrewrite.runtime.kernels.rope_table import rope_phases, rope_table, rotates_half_pairs
from kvrewrite.spec import LayerSpec

PACKED_ATTENTION = "kvrewrite_packed"
# Cache layers that may hold column-major packed latents (see CompressedAttention.cache_order).
_COLUMN_CACHE_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer, InPlaceLayer)
# Up to this many new tokens, latent layers rebuild keys tile by tile (kernels.latent_decode) instead of all at once.
LATENT_DECODE_ROWS = 16


class CompressedAttention(nn.Module):
    """The compressed attention of any supported family; `adapter` says which biases, norms and RoPE it has."""

    def __init__(self, config, layer_idx: int, layer_spec: LayerSpec, rotary_embedding: nn.Module | None, adapter):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.key_mode = layer_spec.key_mode
        geometry, features = adapter.geometry(config), adapter.features(config)
        if self.key_mode not in allowed_key_modes(adapter, config):
            raise CorruptCheckpointError(
                f"layer {layer_idx}: key mode {self.key_mode!r} is impossible for {adapter.family} "
                f"(allowed: {', '.join(allowed_key_modes(adapter, config))})"
            )
        self.mode = key_mode(self.key_mode)  # the KeyMode (kvrewrite.key_modes) behind the name
        self.num_heads = geometry.num_attention_heads
        self.num_kv_heads = geometry.num_key_value_heads
        self.group_size = geometry.group_size
        self.head_dim = geometry.head_dim
        # The original model's scale, whatever the kept rank.
        self.scaling = features.scaling if features.scaling is not None else self.head_dim**-0.5
        self.is_causal = True
        # Held in a tuple so the shared rotary module is not registered (and saved) once per layer.
        self._rotary = (rotary_embedding,)
        self._apply_rope = adapter.apply_rope

        hidden, d = geometry.hidden_size, self.head_dim
        q_width = self.mode.query_width(self.num_kv_heads, d)
        self.q_proj = nn.Linear(hidden, self.num_heads * q_width, bias=features.q_bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * d, bias=features.k_bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * d, bias=features.v_bias)
        self.o_proj = nn.Linear(self.num_heads * d, hidden, bias=features.o_bias)
        norms = adapter.make_qk_norms(config) if features.qk_norm else None
        self.q_norm, self.k_norm = norms if norms is not None else (None, None)
        self.mode.add_parameters(self)
        # Plain data, not buffers: transformers builds models on the meta device and materialises only
        # what the checkpoint holds, so index tensors are built lazily on first use.
        self.freq_order = layer_spec.freq_order
        self.key_ranks = self.mode.full_key_ranks(self.num_kv_heads, d)
        self.value_ranks = [d] * self.num_kv_heads
        self.layout = PackedLayout(tuple(self.key_ranks), tuple(self.value_ranks), self.group_size)
        self._indices: dict[str, torch.Tensor] | None = None
        # The attention implementation for the current layout and device (kernels.dispatch), built lazily.
        self._runner: tuple[str, torch.device, PackedAttentionFn] | None = None

    # ---- rank selection -------------------------------------------------------------------
    def set_ranks(self, key_ranks: list[int], value_ranks: list[int]) -> None:
        """Slice the full-rank parameters down to the given per-KV-head ranks (prefixes; never grows)."""
        if any(new > old for new, old in zip(key_ranks, self.key_ranks)) or any(
            new > old for new, old in zip(value_ranks, self.value_ranks)
        ):
            raise ValueError(f"layer {self.layer_idx}: ranks can only shrink ({self.key_ranks} -> {key_ranks})")
        g = self.group_size
        with torch.no_grad():
            self.mode.slice_query_key(self, key_ranks)
            slice_linear_rows(self.v_proj, self.value_ranks, value_ranks)
            old_o = [r for r in self.value_ranks for _ in range(g)]
            new_o = [r for r in value_ranks for _ in range(g)]
            self.o_proj.weight = nn.Parameter(block_prefix_rows(self.o_proj.weight.T, old_o, new_o).T.contiguous())
            self.o_proj.in_features = self.o_proj.weight.shape[1]
        self.key_ranks, self.value_ranks = list(key_ranks), list(value_ranks)
        self.layout = PackedLayout(tuple(self.key_ranks), tuple(self.value_ranks), self.group_size)
        self._indices = None
        self._runner = None

    def packed_attention_runner(self, device: torch.device) -> PackedAttentionFn:
        """The packed attention for this layer's layout: Triton on CUDA, torch rank buckets otherwise."""
        backend = resolve_backend(device)
        if self._runner is None or self._runner[:2] != (backend, device):
            self._runner = (backend, device, build_attention(self.layout, backend))
        return self._runner[2]

    def _index(self, name: str, device) -> torch.Tensor:
        if self._indices is None or next(iter(self._indices.values())).device != device:
            self._indices = {k: v.to(device) for k, v in self._build_indices().items()}
        return self._indices[name]

    def _build_indices(self) -> dict[str, torch.Tensor]:
        return {"empty": torch.empty(0, dtype=torch.long), **self.mode.indices(self)}

    def kv_elements_per_token(self) -> int:
        return sum(self.key_ranks) + sum(self.value_ranks)

    # ---- forward --------------------------------------------------------------------------
    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        batch, length, _ = x.shape
        return x.view(batch, length, n, self.head_dim).transpose(1, 2)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs):
        query, key, value = self.project(hidden_states, position_embeddings)

        if getattr(past_key_values, "is_tiered", False):
            # kvrewrite.runtime.tiers: full-rank recent window, older tokens at fewer dims; the cache attends tier by tier.
            return self.o_proj(past_key_values.attend(self, query, key, value, attention_mask)), None

        past_len = 0
        if past_key_values is not None:
            past_len = past_key_values.get_seq_length(self.layer_idx)
            if isinstance(past_len, torch.Tensor):  # a StaticLayer's length tensor, which update() grows in place
                past_len = past_len.clone()
            reads_coded = getattr(past_key_values, "reads_coded", None)
            if reads_coded is not None and reads_coded(self.layer_idx):
                # A codec cache whose blocks attention reads in place (int4/int2): no decoded copy of the store.
                readout = past_key_values.update_coded(to_storage(key, ROWS), to_storage(value, ROWS), self.layer_idx)
                return self.o_proj(self.attend_coded(query, readout, attention_mask, past_len)), None
            in_place_layer(past_key_values, self.layer_idx)  # a stock DynamicLayer would torch.cat every step
            order = self.cache_order(past_key_values, query.device)
            key, value = past_key_values.update(to_storage(key, order), to_storage(value, order), self.layer_idx)
            key, value = packed_view(key), packed_view(value)  # logical [B, 1, S, C] views, no copy
        else:
            key, value = key.unsqueeze(1), value.unsqueeze(1)
        return self.o_proj(self.attend(query, key, value, attention_mask, past_len, **kwargs)), None

    def project(
        self, hidden_states: torch.Tensor, position_embeddings=None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The new tokens' packed query [B, T, Qsum] and the key and value latents [B, T, Ksum / Vsum] they cache."""
        batch, q_len, _ = hidden_states.shape
        cos, sin = position_embeddings if position_embeddings is not None else (None, None)
        query = self.q_proj(hidden_states)
        key = self.k_proj(hidden_states)
        value = self.v_proj(hidden_states)
        if self.q_norm is not None:  # per-head q/k norms (only modes that project after RoPE allow them)
            query = self.q_norm(query.view(batch, q_len, self.num_heads, self.head_dim)).flatten(2)
            key = self.k_norm(key.view(batch, q_len, self.num_kv_heads, self.head_dim)).flatten(2)

        # The mode's packed query and key (a mode that rebuilds keys keeps the pre-RoPE latent; attend rotates it).
        query, key = self.mode.project(self, query, key, cos, sin)

        return query, key, value

    def attend(self, query, key, value, attention_mask, past_len: int, **kwargs) -> torch.Tensor:
        """Attention of the new queries over the packed keys/values [B, 1, S, C] (cache indices 0..S-1; the
        queries sit at past_len..past_len+T-1) -> o_proj's input [B, T, Osum]."""
        if self.mode.rebuilds_keys:
            return self._latent_attention(query, key, value, attention_mask, past_len)
        if self.mode.shared_key_block:
            return shared_key_attention(query, key, value, attention_mask, self.scaling, self.layout)
        attend = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]
        output, _ = attend(self, query, key, value, attention_mask, scaling=self.scaling, dropout=0.0, **kwargs)
        return output

    def attend_coded(
        self, query: torch.Tensor, readout: CodedReadout | CountedReadout, attention_mask, past_len: int
    ) -> torch.Tensor:
        """attend() over a codec cache's coded blocks and float16 window (codecs.readout), dequantised chunk by
        chunk inside the attention (kernels.coded_attention) -> o_proj's input [B, T, Osum].

        Each chunk is scored for all query heads at once ([B, H, T, n]) and multiplied with all packed value
        columns; each head then keeps its own KV head's columns.
        """
        if isinstance(readout, CountedReadout):
            return self._attend_counted(query, readout, attention_mask, past_len)
        batch, q_len, _ = query.shape
        if not self.mode.shared_key_block and resolve_backend(query.device) == "triton":
            from kvrewrite.runtime.kernels import triton_coded_attention as triton_coded

            if triton_coded.supports(readout):
                return self._triton_coded(triton_coded, query, readout, attention_mask, past_len)
        allowed = boolean_mask(attention_mask, q_len, readout.length, query.device)
        group, n_kv, scaling = self.group_size, self.num_kv_heads, self.scaling
        ko, vo = self.layout.key_offsets, self.layout.value_offsets
        n_q = group * n_kv
        if self.mode.rebuilds_keys:
            # Cache indices as positions, as in _latent_attention.
            cos, sin = rope_table(self._rotary[0], query, readout.length, transposed=False)

            def rope(start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
                return cos[None, start : start + n], sin[None, start : start + n]

            heads = self._rotate_queries(query, past_len, cos, sin)
            grouped = heads.reshape(batch, n_kv, group * q_len, self.head_dim)  # a KV head's query rows

            def score(start: int, keys: torch.Tensor) -> torch.Tensor:
                cos, sin = rope(start, keys.shape[-2])
                # Per KV head: rebuild its keys [B, 1, n, d], score its query rows; only the scores are joined.
                scores = torch.cat(
                    [
                        torch.matmul(
                            grouped[:, g : g + 1],
                            self.mode.rebuild_keys(self, keys[..., ko[g] : ko[g + 1]], g, cos, sin).transpose(-1, -2),
                        )
                        for g in range(n_kv)
                    ],
                    dim=1,
                )
                return (scores * scaling).view(batch, n_q, q_len, -1)
        elif self.mode.shared_key_block:
            rows = (
                query.view(batch, q_len, n_q, self.layout.key_ranks[0]).transpose(1, 2).reshape(batch, n_q * q_len, -1)
            )

            def score(start: int, keys: torch.Tensor) -> torch.Tensor:
                return (torch.matmul(rows, keys[:, 0].transpose(-1, -2)) * scaling).view(batch, n_q, q_len, -1)
        else:
            # Block-diagonal queries: head h's columns at its KV head's key offset, so one GEMM scores every head.
            qo = self.layout.query_offsets
            spread = query.new_zeros(batch, n_q, q_len, ko[-1])
            for g, rk in enumerate(self.layout.key_ranks):
                spread[:, g * group : (g + 1) * group, :, ko[g] : ko[g + 1]] = (
                    query[..., qo[g] : qo[g + 1]].view(batch, q_len, group, rk).transpose(1, 2)
                )

            spread = spread.view(batch, n_q * q_len, ko[-1])  # one GEMM per request, not one per head

            def score(start: int, keys: torch.Tensor) -> torch.Tensor:
                return (torch.matmul(spread, keys[:, 0].transpose(-1, -2)) * scaling).view(batch, n_q, q_len, -1)

        out = blockwise_coded_attention(readout, score, allowed, query.dtype)  # [B, H, T, Vsum]
        return torch.cat(
            [
                out[:, g * group : (g + 1) * group, :, vo[g] : vo[g + 1]]
                .transpose(1, 2)
                .reshape(batch, q_len, group * (vo[g + 1] - vo[g]))
                for g in range(n_kv)
            ],
            dim=-1,
        )

    def _coded_flash_decode(
        self,
        query: torch.Tensor,
        readout: CodedReadout | CountedReadout,
        keep: torch.Tensor,
        n_coded: torch.Tensor | None = None,
        window_len: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One decode token [B, 1, Qsum] over coded blocks and the window (kernels.flash_decode_coded, the blocks
        split across programs; the live counts read from device memory where given) -> [B, 1, Osum]."""
        from kvrewrite.runtime.kernels import flash_decode_coded

        return flash_decode_coded.coded_flash_decode(
            query[:, 0],
            readout.layout,
            readout.keys,
            readout.values,
            readout.key_window[:, 0],
            readout.value_window[:, 0],
            keep,
            n_coded,
            window_len,
            self.scaling,
            self.layout,
        )[:, None]

    def _attend_counted(self, query: torch.Tensor, readout: CountedReadout, attention_mask, past_len) -> torch.Tensor:
        """A decode step (one query per sequence) over a static codec cache (codecs.static_cache): static shapes, the
        live counts read on the device. On CUDA the flash-decoding kernel reads the coded blocks in place up to the
        counts; elsewhere (CPU; latent keys, which no counted kernel rebuilds yet; key modes that share one key block
        across heads; blocks the kernel does not take) the whole store is decoded into the cache's slots, the slots
        past the counts masked, and attend() runs as on any static cache."""
        from kvrewrite.runtime.kernels import flash_decode_coded

        batch, q_len, _ = query.shape
        allowed = boolean_mask(attention_mask, q_len, readout.positions, query.device)
        if (
            not self.mode.rebuilds_keys
            and not self.mode.shared_key_block
            and resolve_backend(query.device) == "triton"
            and flash_decode_coded.supports_block_tokens(readout.layout.block_tokens)
        ):
            keep = allowed.expand(batch, 1, 1, readout.positions)[:, 0, 0]
            return self._coded_flash_decode(query, readout, keep, readout.n_coded, readout.window_len)
        allowed = allowed & readout.live()
        key, value = readout.dense("key", query.dtype), readout.dense("value", query.dtype)
        if self.mode.rebuilds_keys or self.mode.shared_key_block:
            return self.attend(query, key, value, allowed, past_len)
        # Per KV head over the decoded slots: the packed runner reads storage offsets, which a trace of tensors
        # made inside the step cannot give.
        return packed_attention(query, key, value, allowed, self.scaling, self.layout)

    def _triton_coded(
        self, triton_coded, query: torch.Tensor, readout: CodedReadout, attention_mask, past_len: int
    ) -> torch.Tensor:
        """attend_coded on CUDA: the Triton kernel dequantises each block in registers (latent keys rebuilt and
        rotated there too, with the cache indices' cos/sin)."""
        from kvrewrite.runtime.kernels import flash_decode_coded

        batch, q_len, _ = query.shape
        if (
            not self.mode.rebuilds_keys
            and q_len == 1
            and readout.keys is not None
            and flash_decode_coded.supports_block_tokens(readout.layout.block_tokens)
        ):
            keep = boolean_mask(attention_mask, 1, readout.length, query.device)
            keep = keep.expand(batch, 1, 1, readout.length)[:, 0, 0]
            return self._coded_flash_decode(query, readout, keep)
        if not self.mode.rebuilds_keys:
            return triton_coded.triton_coded_attention(query, readout, attention_mask, self.scaling, self.layout)
        cos, sin = rope_table(self._rotary[0], query, readout.length, transposed=False)  # [>= S, d]
        heads = self._rotate_queries(query, past_len, cos, sin)
        rotated = heads.transpose(1, 2).reshape(batch, q_len, self.num_heads * self.head_dim)
        return triton_coded.triton_coded_attention(
            rotated, readout, attention_mask, self.scaling, self.layout, self.k_up,
            (cos[: readout.length], sin[: readout.length]),
        )  # fmt: skip

    def cache_order(self, cache, device: torch.device) -> str:
        """Memory order of this layer's cache tensors (kernels.cache_layout): the packed runner's choice.

        COLUMNS tensors are [B, sum rk, S, 1] for keys and [B, sum rv, S, 1] for values, so only cache layers
        that size keys and values independently take them: transformers' DynamicLayer and its sliding-window
        variant (also under offloading). Static layers size values by the keys' dim 1, quantized and codec
        layers code whole token rows: those keep token-major rows, as do latent and crosshead layers, which
        attend with their own torch code.
        """
        layers = getattr(cache, "layers", None)
        layer = layers[self.layer_idx] if layers is not None and self.layer_idx < len(layers) else None
        if type(layer) in _COLUMN_CACHE_LAYERS and self.mode.rebuilds_keys and resolve_backend(device) == "torch":
            return COLUMNS  # kernels.latent_decode reads each head's latent block C_g^T as contiguous rows
        if (
            type(layer) not in _COLUMN_CACHE_LAYERS
            or not self.mode.uses_packed_kernel
            or self.config._attn_implementation != PACKED_ATTENTION
        ):
            return ROWS
        return getattr(self.packed_attention_runner(device), "cache_layout", ROWS)

    def _rotate_queries(self, query: torch.Tensor, past_len, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The new tokens' queries [B, H, T, d] rotated at cache positions past_len.. (cos/sin [>= S, d]).

        Gathered, not sliced: past_len is a tensor on a StaticCache, and a slice by it would give the queries a
        data-dependent length under torch.compile."""
        at = torch.arange(query.shape[1], device=query.device) + past_len
        return self._apply_rope(self._heads(query, self.num_heads), cos.index_select(0, at)[None],
                                sin.index_select(0, at)[None])  # fmt: skip

    def _latent_attention(self, query, key_latent, value, attention_mask, past_len: int) -> torch.Tensor:
        """Rebuild each head's pre-RoPE key from its latent and rotate q and k by cache position.

        Positions are cache indices (queries at past_len + i, keys at 0..S-1): RoPE scores depend only on
        the offset between query and key, which equals HF's own (padding-adjusted) offsets for every
        contiguous sequence, including left-padded batches.
        """
        batch, q_len, _ = query.shape
        kv_len = key_latent.shape[-2]
        rotary = self._rotary[0]
        if q_len == 1 and resolve_backend(query.device) == "triton":
            return self._latent_flash_decode(query, key_latent, value, attention_mask, past_len)
        cos, sin = rope_table(rotary, query, kv_len, transposed=False)  # [>= S, d], one table for every layer
        q = self._rotate_queries(query, past_len, cos, sin)
        if q_len <= LATENT_DECODE_ROWS:
            cos_t, sin_t = rope_table(rotary, query, kv_len)  # [d, >= S] for the tiles
            allowed = boolean_mask(attention_mask, q_len, kv_len, query.device)
            return latent_decode_attention(
                q,
                key_latent,
                value,
                allowed,
                self.scaling,
                self.key_ranks,
                self.value_ranks,
                self.k_up,
                cos_t,
                sin_t,
                # rope_phases' table is float32: other dtypes keep their own cos/sin precision through rotate_half
                phases=rope_phases(rotary, query, kv_len)
                if rotates_half_pairs(self) and query.dtype == torch.float32
                else None,
            )
        cos_k, sin_k = cos[None, :kv_len], sin[None, :kv_len]
        allowed = boolean_mask(attention_mask, q_len, kv_len, query.device)
        ko, vo = self.layout.key_offsets, self.layout.value_offsets
        outputs = []
        for g, rv in enumerate(self.value_ranks):
            k = self.mode.rebuild_keys(self, key_latent[..., ko[g] : ko[g + 1]], g, cos_k, sin_k)  # [B, 1, S, d]
            q_g = q[:, g * self.group_size : (g + 1) * self.group_size]
            out = grouped_attention(q_g, k, value[..., vo[g] : vo[g + 1]], allowed, self.scaling)
            outputs.append(out.transpose(1, 2).reshape(batch, q_len, self.group_size * rv))
        return torch.cat(outputs, dim=-1)

    def _latent_flash_decode(self, query, key_latent, value, attention_mask, past_len) -> torch.Tensor:
        """One decode step on CUDA: kernels.flash_decode_latent rebuilds and rotates the keys in registers."""
        from kvrewrite.runtime.kernels.flash_decode_latent import latent_flash_decode

        batch, kv_len = query.shape[0], key_latent.shape[-2]
        cos, sin = rope_table(self._rotary[0], query, kv_len, transposed=False)  # [>= S, d]
        q = self._rotate_queries(query, past_len, cos, sin)  # [B, H, 1, d]
        keep = boolean_mask(attention_mask, 1, kv_len, query.device).expand(batch, 1, 1, kv_len)[:, 0, 0]
        out = latent_flash_decode(
            q[:, :, 0].reshape(batch, -1),
            key_latent[:, 0],
            value[:, 0],
            keep,
            None,
            self.scaling,
            self.layout,
            self.k_up,
            cos,
            sin,
        )
        return out[:, None]


def packed_attention_forward(module: CompressedAttention, query, key, value, attention_mask, scaling, **kwargs):
    """AttentionInterface entry: packed variable-rank attention (rank buckets on CPU, Triton on CUDA)."""
    return module.packed_attention_runner(query.device)(query, key, value, attention_mask, scaling), None
