"""Absorbed multi-head latent attention: stock DeepseekV3 weights and semantics, a latent-only cache.

Stock DeepseekV3 (transformers) caches the latent too, but rebuilds every head's keys and values from ALL cached
latents on every step (kv_b_proj over [B, S, r]). Here decode never rebuilds them: with kv_b_proj split per head
into W_uk [d_nope, r] and W_uv [d_v, r],

    score(h, s) = q_nope_h . (W_uk_h c_s) + q_pe_h . k_pe_s = [W_uk_h^T q_nope_h | q_pe_h] . [c_s | k_pe_s]
    out_h       = W_uv_h (sum_s p(h, s) c_s)

so every query head is scored against the cached row [c | k_pe] itself (all heads of all new tokens folded into
the rows of one GEMM per sequence), the weighted latents are summed, and W_uv is applied once per head after
attention. Where the new tokens are many (prefill), rebuilding keys and values once is cheaper than scoring
every head against the wider latent; `expansion_is_cheaper` picks by multiply-add count.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb, apply_rotary_pos_emb_interleave

from kvrewrite.errors import CorruptCheckpointError
from kvrewrite.key_modes.rows import complex_pairs, phase_table
from kvrewrite.runtime.kernels.cpu_decode_mla import mla_block_decode
from kvrewrite.runtime.kernels.dispatch import resolve_backend
from kvrewrite.runtime.kernels.reference import boolean_mask, softmax_dtype
from kvrewrite.runtime.mla.latent_cache import cache_latent_rows

# The stock attention's submodules, taken over under the same names so the state dict stays the stock one.
_STOCK_SUBMODULES = (
    "q_proj",
    "q_a_proj",
    "q_a_layernorm",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_a_layernorm",
    "kv_b_proj",
    "o_proj",
)


def expansion_is_cheaper(
    new_tokens: int, cached_tokens: int, heads: int, rank: int, nope_dim: int, rope_dim: int, value_dim: int
) -> bool:
    """True when rebuilding per-head K/V from the latents costs fewer multiply-adds than absorbed attention."""
    absorbed = new_tokens * heads * (nope_dim * rank + cached_tokens * (2 * rank + rope_dim) + rank * value_dim)
    expanded = cached_tokens * heads * rank * (nope_dim + value_dim) + new_tokens * heads * cached_tokens * (
        nope_dim + rope_dim + value_dim
    )
    return expanded < absorbed


def rope_interleaved_to_halves(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' apply_rotary_pos_emb_interleave (pairs stored interleaved, rotated into [evens | odds] halves)
    with fewer launches when eager: each side one complex product (in float32, float64 for a float64 model) and one
    copy into the halves' layout, instead of six elementwise products and a concatenation (at small batch a decode
    step costs its launches). Under torch.compile, transformers' own, which the compiler fuses."""
    if torch.compiler.is_compiling():
        return apply_rotary_pos_emb_interleave(q, k, cos, sin)
    half = cos.shape[-1] // 2  # cos / sin [B, T, dr] are cat(freqs, freqs)
    phase = phase_table(cos, sin)[..., :half].unsqueeze(1)  # [B, 1, T, dr / 2], made once per forward
    real = torch.float64 if phase.dtype == torch.complex128 else torch.float32

    def turn(x: torch.Tensor) -> torch.Tensor:
        halves = torch.view_as_real(complex_pairs(x, real) * phase).transpose(-1, -2)  # evens' results, then odds'
        return halves.to(x.dtype, memory_format=torch.contiguous_format).flatten(-2)  # one copy into the halves

    return turn(q), turn(k)


class PaddedWidthRMSNorm(nn.Module):
    """The stock latent RMSNorm of a layer narrowed from a zero-padded width: the dropped dims were 0 for every token,
    so the mean square still divides by the padded width, exactly as the stock model computes it."""

    def __init__(self, stock_norm: nn.Module, width: int):
        super().__init__()
        self.weight = nn.Parameter(stock_norm.weight.detach()[:width].clone(), requires_grad=False)
        self.variance_epsilon = stock_norm.variance_epsilon
        self.padded_width = stock_norm.weight.shape[0]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).sum(-1, keepdim=True) / self.padded_width
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


def _narrowed_linear(weight: torch.Tensor) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
    linear.weight = nn.Parameter(weight.detach().contiguous(), requires_grad=False)
    return linear


def narrow_latent(stock: nn.Module, rank: int, exported: int | None = None) -> None:
    """Slice stock's latent weights (in place) from the padded width to `rank`. The dims between `exported` (the width
    the export records for this layer) and the padded width must be zero, or the file is not what it says."""
    padded, rope = stock.config.kv_lora_rank, stock.config.qk_rope_head_dim
    kv_a, kv_b = stock.kv_a_proj_with_mqa.weight, stock.kv_b_proj.weight
    recorded = padded if exported is None else exported
    if bool(kv_a[recorded:padded].any()) or bool(kv_b[:, recorded:].any()):
        raise CorruptCheckpointError(
            f"layer {stock.layer_idx}: latent width {recorded} is recorded, but its latent weights beyond it are not zero"
        )
    stock.kv_a_proj_with_mqa = _narrowed_linear(torch.cat([kv_a[:rank], kv_a[padded : padded + rope]]))
    stock.kv_b_proj = _narrowed_linear(kv_b[:, :rank])
    stock.kv_a_layernorm = PaddedWidthRMSNorm(stock.kv_a_layernorm, rank)


class AbsorbedMLAAttention(nn.Module):
    """Drop-in replacement for a DeepseekV3Attention (same parameters, same outputs) with a latent-only cache.

    kv_lora_rank: the latent width this layer runs at, where it is below the config's (an allocated export zero-pads
    its layers to the widest; a rate of its table narrows them further); its latent weights are sliced to it, so the
    cache holds that width. exported_rank: the width the export records (the zero padding starts there)."""

    def __init__(self, stock: nn.Module, kv_lora_rank: int | None = None, exported_rank: int | None = None):
        super().__init__()
        config = stock.config
        self.config = config
        self.layer_idx = stock.layer_idx
        self.num_heads = config.num_attention_heads
        self.kv_lora_rank = config.kv_lora_rank if kv_lora_rank is None else kv_lora_rank
        if self.kv_lora_rank != config.kv_lora_rank:
            narrow_latent(stock, self.kv_lora_rank, exported_rank)
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.scaling = stock.scaling  # stock's, including any YaRN mscale
        self.is_causal = True
        # "auto" picks per call by cost; "absorbed" / "expanded" force one path (tests, benchmarks).
        self.path = "auto"
        self._rope = rope_interleaved_to_halves if config.rope_interleave else apply_rotary_pos_emb
        for name in _STOCK_SUBMODULES:
            setattr(self, name, getattr(stock, name))

    # ---- weights ----------------------------------------------------------------------------
    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj split per head: W_uk [H, d_nope, r] and W_uv [H, d_v, r] (views, never copies)."""
        per_head = self.kv_b_proj.weight.view(
            self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank
        )
        return per_head[:, : self.qk_nope_head_dim], per_head[:, self.qk_nope_head_dim :]

    # ---- forward ----------------------------------------------------------------------------
    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
        batch, q_len, _ = hidden_states.shape
        r, dn, dr = self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim
        if self.q_proj is not None:
            query = self.q_proj(hidden_states)
        else:
            query = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        query = query.view(batch, q_len, self.num_heads, dn + dr)
        q_nope, q_pe = torch.split(query, [dn, dr], dim=-1)

        latent, k_pe = torch.split(self.kv_a_proj_with_mqa(hidden_states), [r, dr], dim=-1)
        latent = self.kv_a_layernorm(latent)
        cos, sin = position_embeddings
        q_pe, k_pe = self._rope(
            q_pe.transpose(1, 2), k_pe.view(batch, 1, q_len, dr), cos, sin
        )  # [B,H,T,dr], [B,1,T,dr]
        rows = torch.cat([latent.view(batch, 1, q_len, r), k_pe], dim=-1)
        if past_key_values is not None:
            rows = cache_latent_rows(past_key_values, self.layer_idx, rows)
        kv_len = rows.shape[-2]
        allowed = boolean_mask(attention_mask, q_len, kv_len, hidden_states.device)  # [B|1, 1, T, S]

        if self.path == "expanded" or (
            self.path == "auto" and expansion_is_cheaper(q_len, kv_len, self.num_heads, r, dn, dr, self.v_head_dim)
        ):
            output = self._expanded(q_nope, q_pe, rows, allowed)
        else:
            output = self._absorbed(q_nope, q_pe, rows, allowed)
        return self.o_proj(output.reshape(batch, q_len, self.num_heads * self.v_head_dim)), None

    def _absorbed(self, q_nope, q_pe, rows, allowed) -> torch.Tensor:
        """Decode: scores against the cached rows, values summed in latent space, W_uv after -> [B, T, H, d_v]."""
        batch, q_len, heads, _ = q_nope.shape
        kv_len = rows.shape[-2]
        w_uk, w_uv = self.absorbed_weights()
        q_latent = torch.einsum("bthn,hnr->bthr", q_nope, w_uk)
        # All heads of all new tokens become rows of one query matrix per sequence: one GEMM over the latent.
        queries = torch.cat([q_latent, q_pe.transpose(1, 2)], dim=-1).reshape(batch, q_len * heads, -1)
        keys = rows.view(batch, kv_len, -1)
        if q_len == 1 and resolve_backend(rows.device) == "triton":
            # CUDA: one flash-decoding kernel (kernels.flash_decode_mla), the value sum kept in latent space.
            from kvrewrite.runtime.kernels.flash_decode_mla import mla_flash_decode

            keep = allowed.expand(batch, 1, 1, kv_len)[:, 0, 0]
            latent_out = mla_flash_decode(queries, keys, keep, None, self.scaling, self.kv_lora_rank)
            return torch.einsum("bhr,hvr->bhv", latent_out, w_uv)[:, None]
        queries = queries * self.scaling  # on the T*H query rows, not on the T*H*S scores
        if q_len == 1 and rows.device.type == "cpu":
            # CPU decode: the rows read once, block by block (kernels.cpu_decode_mla); same masking as below.
            latent_out = mla_block_decode(queries, keys, allowed[:, 0, 0], self.kv_lora_rank)
            return torch.einsum("bhr,hvr->bhv", latent_out, w_uv)[:, None]
        scores = torch.bmm(queries, keys.transpose(1, 2)).view(batch, q_len, heads, kv_len)
        scores = scores.to(softmax_dtype(scores.dtype))
        # Always masked (no test of whether any slot is masked: that would be a host sync, and data-dependent control
        # flow that torch.compile / CUDA graphs cannot capture); a StaticCache's unfilled slots are masked here too.
        scores = scores.masked_fill_(~allowed[:, 0, :, None, :], torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1).to(rows.dtype).view(batch, q_len * heads, kv_len)
        latent_out = torch.bmm(probs, keys[..., : self.kv_lora_rank]).view(batch, q_len, heads, -1)
        return torch.einsum("bthr,hvr->bthv", latent_out, w_uv)

    def _expanded(self, q_nope, q_pe, rows, allowed) -> torch.Tensor:
        """Prefill: rebuild every head's keys and values once, as stock does -> [B, T, H, d_v]."""
        batch, q_len, heads, dn = q_nope.shape
        kv_len = rows.shape[-2]
        latent, k_pe = torch.split(rows, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(latent[:, 0]).view(batch, kv_len, heads, dn + self.v_head_dim).transpose(1, 2)
        k_nope, values = torch.split(kv, [dn, self.v_head_dim], dim=-1)
        keys = torch.cat([k_nope, k_pe.expand(batch, heads, kv_len, self.qk_rope_head_dim)], dim=-1)
        queries = torch.cat([q_nope.transpose(1, 2), q_pe], dim=-1)
        # An additive mask with finite minima: a fully masked (padding) row gets uniform weights, never NaN.
        bias = torch.zeros(allowed.shape, dtype=queries.dtype, device=queries.device)
        bias = bias.masked_fill(~allowed, torch.finfo(queries.dtype).min)
        output = F.scaled_dot_product_attention(queries, keys, values, attn_mask=bias, scale=self.scaling)
        return output.transpose(1, 2)
