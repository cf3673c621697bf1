"""A codec cache with fixed storage and its lengths on the device: a decode step CUDA graphs can capture.

`generate(..., cache_implementation="static")` on a checkpoint with an in-place codec (`int4`, `int2`) builds a
StaticCodecCache instead of transformers' StaticCache (which would hold the latents uncoded). Each layer holds, for
a capacity of `max_cache_len` tokens:

- the coded store: every tensor of KIVI's `QuantizedBlocks` with room for ceil(max_cache_len / G) blocks plus one
  scratch block (below);
- the float16 window [B, 1, residual + G, C] for keys and for values;
- `n_coded` and `window_len`, 0-dim int64 tensors on the device (the tokens held: n_coded * G + window_len).

It codes the same blocks as the CodecCache (codecs.cache): once the window holds `residual + G` tokens, its oldest G
are coded. A decode step (one token) does this without reading a length on the host, so it has one shape and no
branch: first the block that came due in the step before is coded (every step codes the window's first G tokens and
writes them to block `n_coded` when due, else to the scratch block; the window shifts by G only when due), then the
new token is written at `window_len`. Attention then reads a `CountedReadout`: the whole buffers and the two counts,
which the flash-decoding kernel (kernels.flash_decode_coded) loads from device memory, so a replayed graph reads
what the cache holds now. Coding the due block at the start of the next step rather than at the end of this one
reads the same tokens at the same precision as the CodecCache: what a step attends to is the store coded by earlier
steps and the window with this step's token.

A prefill (several tokens) reads the two lengths on the host, attends over the store and the window it stages (a
CodedReadout, as the CodecCache's), and codes its overflow at once. It always runs eagerly (transformers does not
compile it; inside a compiled forward it is a graph break, and under fullgraph=True an error): compile the decode
step, not the prefill. The buffers hold at most (max_cache_len - residual) // G live blocks, since the newest
`residual` tokens always stay in the window; a step past max_cache_len fails an assertion on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvrewrite.errors import InvalidArgumentError
from kvrewrite.runtime.codecs.base import SIDES, LayerCodec
from kvrewrite.runtime.codecs.cache import RESIDUAL_DTYPE
from kvrewrite.runtime.codecs.kivi import kivi_decode
from kvrewrite.runtime.codecs.readout import CodedReadout, QuantizedBlocks


def held_tokens(n_coded: torch.Tensor, window_len: torch.Tensor, block_tokens: int) -> torch.Tensor:
    """Tokens a static codec layer holds (every token is in a coded block or in the window), on the device."""
    return n_coded * block_tokens + window_len


@dataclass(frozen=True)
class CountedReadout:
    """One layer's static codec cache as a decode step reads it: whole buffers and the live counts on the device.

    Token positions (what the attention mask of `positions` slots is indexed by): block i holds positions
    i * G .. i * G + G - 1 for i < n_coded, window token w is at position n_coded * G + w for w < window_len."""

    layout: QuantizedBlocks
    keys: dict[str, torch.Tensor]  # [B, n_cap + 1, ...] coded key blocks (the last: scratch, never live)
    values: dict[str, torch.Tensor]
    key_window: torch.Tensor  # [B, 1, W_cap, sum key ranks] float16
    value_window: torch.Tensor  # [B, 1, W_cap, sum value ranks] float16
    n_coded: torch.Tensor  # 0-dim int64
    window_len: torch.Tensor  # 0-dim int64
    positions: int  # the cache's capacity in tokens: the attention mask's length

    def live(self) -> torch.Tensor:
        """[positions] bool: the slots that hold a token now."""
        held = held_tokens(self.n_coded, self.window_len, self.layout.block_tokens)
        return torch.arange(self.positions, device=self.n_coded.device) < held

    def dense(self, side: str, dtype: torch.dtype) -> torch.Tensor:
        """[B, 1, positions, C]: every block decoded and the window written at its positions (slots past the live
        ones hold stale or zero numbers, finite; attention masks them with live()). One static shape, no host sync:
        the reference the attention falls back to where no kernel reads the blocks in place."""
        store, window = (self.keys, self.key_window) if side == "key" else (self.values, self.value_window)
        window = window[:, 0]
        batch, w_cap, c = window.shape
        g = self.layout.block_tokens
        blocks = kivi_decode(store, side, self.layout.bits, self.layout.value_group, g, c)  # [B, n_cap + 1, G, C]
        n_cap = blocks.shape[1] - 1
        flat = blocks.reshape(batch, -1, c).to(dtype)
        room = max(n_cap * g + w_cap, self.positions) - flat.shape[1]
        if room > 0:
            flat = torch.cat([flat, flat.new_zeros(batch, room, c)], dim=1)
        at = self.n_coded * g + torch.arange(w_cap, device=flat.device)
        flat = flat.index_copy(1, at, window.to(dtype))
        return flat[:, None, : self.positions]


class StaticCodecLayer(CacheLayerMixin):
    """One decoder layer's coded store and window in buffers allocated once (see the module docstring)."""

    is_compileable = True
    is_sliding = False

    def __init__(self, codec: LayerCodec, residual: int, max_cache_len: int):
        super().__init__()
        layout = codec.fused_layout()
        if layout is None:
            raise InvalidArgumentError(
                f"the {codec.config.describe()} codec is decoded whole for every forward and has no static cache: use "
                "int4 / int2, or the default codec cache (generate without cache_implementation)"
            )
        if max_cache_len < 1:
            raise InvalidArgumentError(f"max_cache_len must be a positive number of tokens, got {max_cache_len}")
        self.codec, self.layout = codec, layout
        self.residual_length, self.max_cache_len = residual, max_cache_len
        g = layout.block_tokens
        # The newest `residual` tokens are never coded: at most this many blocks are live. A scratch block follows.
        self.block_capacity = max(0, max_cache_len - residual) // g
        self.window_capacity = residual + g
        self.n_coded = torch.tensor(0, dtype=torch.long)
        self.window_len = torch.tensor(0, dtype=torch.long)
        self.coded_keys: dict[str, torch.Tensor] = {}
        self.coded_values: dict[str, torch.Tensor] = {}

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.early_initialization(key_states.shape[0], key_states.device)

    def early_initialization(self, batch: int, device: torch.device | str) -> None:
        """Allocate every buffer for `batch` sequences (generate() does this before the prefill, so the buffers are
        marked static outside any compiled region)."""
        self.device = torch.device(device)
        g = self.layout.block_tokens
        for side in SIDES:
            c = self.codec.channels[side]
            window = torch.zeros(batch, 1, self.window_capacity, c, dtype=RESIDUAL_DTYPE, device=self.device)
            # The store's tensor shapes are the codec's: read off one coded block of zeros.
            shapes = self.codec.encode(torch.zeros(batch, 1, g, c, device=self.device), side)
            store = {
                name: torch.zeros(batch, self.block_capacity + 1, *t.shape[2:], dtype=t.dtype, device=self.device)
                for name, t in shapes.items()
            }
            if side == "key":
                self.keys, self.coded_keys = window, store
            else:
                self.values, self.coded_values = window, store
        for name in ("n_coded", "window_len"):
            setattr(self, name, getattr(self, name).to(self.device))
        if not torch.compiler.is_compiling():  # fixed addresses: CUDA graphs replay on these buffers
            for t in self._batch_buffers() + self._counts():
                torch._dynamo.mark_static_address(t)
        self.is_initialized = True

    def _batch_buffers(self) -> list[torch.Tensor]:
        """The buffers with a batch dim: the windows and the coded stores."""
        return [self.keys, self.values, *self.coded_keys.values(), *self.coded_values.values()]

    def _counts(self) -> list[torch.Tensor]:
        return [self.n_coded, self.window_len]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> None:
        raise InvalidArgumentError("a StaticCodecLayer is read in place: attention calls update_coded()")

    def update_coded(self, key_states: torch.Tensor, value_states: torch.Tensor) -> CodedReadout | CountedReadout:
        """Write the new tokens ([B, 1, T, C]) and return what attention reads: a CountedReadout for one token
        (static shapes, no host sync), a CodedReadout for a prefill."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != self.keys.shape[0]:
            raise InvalidArgumentError(
                f"this static codec cache holds batches of {self.keys.shape[0]}, got {key_states.shape[0]} sequences"
            )
        if (key_states.shape[-1], value_states.shape[-1]) != (self.keys.shape[-1], self.values.shape[-1]):
            raise InvalidArgumentError(
                f"this static codec cache holds {self.keys.shape[-1]} key and {self.values.shape[-1]} value channels a "
                f"token, got {key_states.shape[-1]} and {value_states.shape[-1]}"
            )
        self._code_due_block()
        if key_states.shape[-2] == 1:
            at = self.window_len.reshape(1)
            self.keys.index_copy_(2, at, key_states.to(RESIDUAL_DTYPE))
            self.values.index_copy_(2, at, value_states.to(RESIDUAL_DTYPE))
            self.window_len.add_(1)
            # No host check in a captured step: past the capacity the device asserts instead of writing nowhere.
            torch._assert_async(self.get_seq_length() <= self.max_cache_len, "static codec cache is full")
            return CountedReadout(
                self.layout,
                self.coded_keys,
                self.coded_values,
                self.keys,
                self.values,
                self.n_coded,
                self.window_len,
                self.max_cache_len,
            )
        return self._prefill(key_states, value_states)

    def _code_due_block(self) -> None:
        """Code the window's first G tokens into block n_coded if they are due (the window holds residual + G),
        else into the scratch block; shift the window and move the counts only when due. No branch on the device."""
        g = self.layout.block_tokens
        due = self.window_len >= self.residual_length + g
        slot = torch.where(due, self.n_coded, self.block_capacity).reshape(1)
        for side, window, store in (("key", self.keys, self.coded_keys), ("value", self.values, self.coded_values)):
            batch, _, _, c = window.shape
            coded = self.codec.encode(window[:, 0, :g].float().reshape(batch, 1, g, c), side)
            for name, t in coded.items():
                store[name].index_copy_(1, slot, t.to(store[name].dtype))
            window.copy_(torch.where(due, window.roll(-g, dims=2), window))
        self.n_coded.add_(due.long())
        self.window_len.sub_(due.long() * g)

    @torch.compiler.disable
    def _prefill(self, key_states: torch.Tensor, value_states: torch.Tensor) -> CodedReadout:
        """Several tokens: attend over the store and the staged window (host-side lengths), then code the blocks
        beyond `residual` at once, as CodecLayer does."""
        n, w, t = int(self.n_coded), int(self.window_len), key_states.shape[-2]
        if n * self.layout.block_tokens + w + t > self.max_cache_len:
            raise InvalidArgumentError(
                f"this static codec cache holds {self.max_cache_len} tokens; it holds {n * self.layout.block_tokens + w} "
                f"and {t} more do not fit (pass a larger max_cache_len)"
            )
        staged = [
            torch.cat([window[:, :, :w], states.to(RESIDUAL_DTYPE)], dim=-2)
            for window, states in ((self.keys, key_states), (self.values, value_states))
        ]
        readout = CodedReadout(
            self.layout,
            {name: s[:, :n] for name, s in self.coded_keys.items()} if n else None,
            {name: s[:, :n] for name, s in self.coded_values.items()} if n else None,
            *staged,
        )
        g = self.layout.block_tokens
        blocks = max(0, w + t - self.residual_length) // g
        for side, window, store, rows in zip(
            SIDES, (self.keys, self.values), (self.coded_keys, self.coded_values), staged
        ):
            batch, _, _, c = rows.shape
            if blocks:
                coded = self.codec.encode(rows[:, 0, : blocks * g].float().reshape(batch, blocks, g, c), side)
                for name, tensor in coded.items():
                    store[name][:, n : n + blocks].copy_(tensor)  # past the readout's views: they stay as read
            kept = rows[:, :, blocks * g :]
            window[:, :, : kept.shape[-2]].copy_(kept)
        self.n_coded.fill_(n + blocks)
        self.window_len.fill_(w + t - blocks * g)
        return readout

    def get_seq_length(self) -> torch.Tensor | int:
        """The tokens held, on the device (0 before the first update)."""
        if not self.is_initialized:
            return 0
        return held_tokens(self.n_coded, self.window_len, self.layout.block_tokens)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_cache_len, 0

    def get_max_length(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        if self.is_initialized:
            for t in self._batch_buffers() + self._counts():
                t.zero_()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: every batch-first buffer reordered in place (its address stays what a graph captured)."""
        if self.is_initialized:
            for t in self._batch_buffers():
                t.copy_(t.index_select(0, beam_idx.to(t.device)))

    def crop(self, max_length: int) -> None:
        raise InvalidArgumentError("a static codec cache cannot be cropped; use the default codec cache")

    def offload(self) -> None:
        raise InvalidArgumentError("a static codec cache stays on its device; use the default codec cache")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise InvalidArgumentError("a static codec cache holds a fixed batch; build it for the batch you run")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise InvalidArgumentError("a static codec cache holds a fixed batch; build it for the batch you run")


class StaticCodecCache(Cache):
    """One StaticCodecLayer per decoder layer, each with room for `max_cache_len` tokens."""

    def __init__(
        self,
        layer_codecs: list[LayerCodec],
        residual: int,
        max_cache_len: int,
        batch: int | None = None,
        device: torch.device | str | None = None,
    ):
        """batch and device (both or neither): allocate the buffers now, as generate() does; else at the first
        update."""
        super().__init__(layers=[StaticCodecLayer(codec, residual, max_cache_len) for codec in layer_codecs])
        if batch is not None:
            for layer in self.layers:
                layer.early_initialization(batch, device)

    @property
    def max_cache_len(self) -> int:
        # A property, not an attribute: some transformers versions define Cache.max_cache_len as a read-only
        # property (the GPU machines' 5.17 refused the assignment), and generate() reads it either way.
        return self.layers[0].max_cache_len

    def reads_coded(self, layer_idx: int) -> bool:
        return True

    def update_coded(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int
    ) -> CodedReadout | CountedReadout:
        return self.layers[layer_idx].update_coded(key_states, value_states)
