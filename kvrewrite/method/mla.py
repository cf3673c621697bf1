"""Multi-head latent attention (MLA) weights for one layer, in DeepSeek's parametrisation with q_lora_rank = None.

What the layer caches per token: a latent c = A x of width r (kv_lora_rank) and a shared RoPE key k_pe of width d_r
(qk_rope_head_dim). Query head h scores  q_nope_h . k_nope_h(c)  +  RoPE(q_pe_h) . RoPE(k_pe),  and reads its value
v_h(c); k_nope_h and v_h come out of c through kv_b_proj.

RoPE part (RoRoPE-like, query-aware; crosshead_keys.frequency_components): for every rotary frequency j a complex mix
across the layer's KV heads orders the components l by query-weighted key energy. The first `rope_components`
components of every frequency are kept as k_pe: a complex-linear map per frequency commutes with RoPE, so rotating the
mixed pair with frequency j is exact. d_r = rope_components * head_dim. With rope_components = 1 the pairs are the
source frequencies in order (pair p = frequency p), so DeepSeek's own schedule base^(-2p/d_r) with d_r = head_dim and
the source rope_theta rotates every pair exactly as the source did. Pairs are laid out interleaved (Re, Im) at dims
(2p, 2p + 1), DeepSeek's rope_interleave = True layout.

A narrower k_pe (`rope_frequency_stride` s > 1, one component): only every s-th frequency keeps its rotation, pair p
= frequency s p, d_r = head_dim / s. DeepSeek's schedule base^(-2p/d_r) = base^(-2 (s p) / head_dim) is still the
source's own frequency for every kept pair; the other frequencies' components join the position-free part. This is
what reaches an engine's fixed cached width (vLLM's MLA kernels: d_r = 64) from a head_dim of 128.

Position-free part: what the kept components do not carry of head g's key, r_g = k_g - (kept components mapped back),
is scored WITHOUT rotation (qk_nope_head_dim = head_dim) against q_nope_h = D_h q_h. D_h is the identity when no
rope_response is given (the source query: the rotation simply dropped, exact at distance 0 only), or, per frequency
pair, the head's expected rotation over the distances it attends to (position_free_query_maps; measured by
compile/mla/rope_response.py): the least-squares fixed stand-in for the rotation. Either way this is the one
approximation besides the latent's width. With rope_components = n_kv the residual is zero and the form is exact
(the full-width test).

Latent part: one latent reconstructs the coordinates of every r_g (n_kv*d - d_r of them) and every value v_g jointly,
as a whitened low-rank projection (linalg.whitened_projection) of y = T x with the Gram T H T^T of the attention input
x (H, [hidden, hidden]). Errors are measured query-aware on keys (r_g's error e scored as e^T D S_g D^T e with S_g
the group's pre-RoPE query Gram and D the group's mean query map) and output-aware on values (through the group's W_O
rows), each side normalised by its total energy and the key side weighted by `key_weight`. At full width (r = 2 n_kv d - d_r) it is exact.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvrewrite.adapters.base import AttentionGeometry
from kvrewrite.errors import InvalidArgumentError
from kvrewrite.method.crosshead_keys import frequency_components
from kvrewrite.method.linalg import psd_sqrt, whitened_projection
from kvrewrite.method.statistics import LayerStatistics
from kvrewrite.method.value_transforms import stacked_output_rows

# The key side's weight against the value side in the latent's objective. Chosen on SmolLM2-135M at 50% of K+V on
# held-back calibration windows (wiki, 4,096 tokens not used for the statistics): 0.125/0.25/0.5/1/2/4 gave
# +51.6/+48.2/+48.7/+50.9/+59.7/+73.0% perplexity (benchmarks/results/mla_quality.json has the held-out figure).
DEFAULT_KEY_WEIGHT = 0.25


@dataclass
class MLALayer:
    """One layer's MLA weights (float64), stock DeepseekV3 names and layouts."""

    q_proj: torch.Tensor  # [n_h * (d_nope + d_r), hidden]; per head: q_nope rows then q_pe rows
    kv_a_proj_with_mqa: torch.Tensor  # [r + d_r, hidden]: the latent rows, then the shared k_pe rows
    kv_b_proj: torch.Tensor  # [n_h * (d_nope + d_v), r]; per head: k_nope rows then value rows
    o_proj: torch.Tensor  # [hidden, n_h * d_v]
    pair_frequency: torch.Tensor  # [d_r / 2] source rotary frequency index of every k_pe pair
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    kv_lora_rank: int
    latent_spectrum: torch.Tensor  # the latent objective's singular values at full width, descending
    rope_energy_kept: float  # share of the query-weighted key energy in the kept RoPE components

    @property
    def cached_values_per_token(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


def full_latent_rank(geometry: AttentionGeometry, rope_components: int, rope_frequency_stride: int = 1) -> int:
    """The latent width at which the latent part is exact: residual-key coordinates plus every value."""
    return (
        2 * geometry.num_key_value_heads * geometry.head_dim
        - rope_components * geometry.head_dim // rope_frequency_stride
    )


def check_rope_frequency_stride(geometry: AttentionGeometry, rope_components: int, rope_frequency_stride: int) -> None:
    half = geometry.head_dim // 2
    if rope_frequency_stride < 1 or half % rope_frequency_stride:
        raise InvalidArgumentError(
            f"the RoPE frequency stride must divide head_dim / 2 = {half} (qk_rope_head_dim = head_dim / stride), "
            f"got {rope_frequency_stride}"
        )
    if rope_frequency_stride > 1 and rope_components != 1:
        raise InvalidArgumentError("a qk_rope_head_dim below head_dim keeps one RoPE component per kept frequency")


def _complex_pair_rows(coeff: torch.Tensor, j: int, n_kv: int, d: int) -> torch.Tensor:
    """Rows (Re c, Im c) of c = sum_g coeff_g z_{g,j}, z_{g,j} = k[g d + j] + i k[g d + j + d/2], over k [n_kv d]."""
    rows = torch.zeros(2, n_kv * d, dtype=torch.float64)
    a = torch.arange(n_kv) * d + j
    b = a + d // 2
    rows[0, a], rows[0, b] = coeff.real, -coeff.imag
    rows[1, a], rows[1, b] = coeff.imag, coeff.real
    return rows


def mla_layer(
    stats: LayerStatistics,
    geometry: AttentionGeometry,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    v_weight: torch.Tensor,
    o_weight: torch.Tensor,
    hidden_gram: torch.Tensor,
    *,
    rope_components: int,
    latent_rank: int,
    source_scaling: float,
    key_weight: float = DEFAULT_KEY_WEIGHT,
    rope_frequency_stride: int = 1,
    rope_response: torch.Tensor | None = None,
) -> MLALayer:
    n_kv, d, n_q = geometry.num_key_value_heads, geometry.head_dim, geometry.num_attention_heads
    half = d // 2
    if not 1 <= rope_components <= n_kv:
        raise InvalidArgumentError(f"rope_components must be within 1..{n_kv} (KV heads), got {rope_components}")
    check_rope_frequency_stride(geometry, rope_components, rope_frequency_stride)
    full = full_latent_rank(geometry, rope_components, rope_frequency_stride)
    if not 1 <= latent_rank <= full:
        raise InvalidArgumentError(
            f"latent rank must be within 1..{full} at {rope_components} RoPE components, got {latent_rank}"
        )
    q_weight, k_weight, v_weight, o_weight = (w.double() for w in (q_weight, k_weight, v_weight, o_weight))
    downs, ups, values = frequency_components(stats, geometry)

    # Kept pairs: block l holds component l of every kept frequency in order, so with one block pair p is frequency
    # stride * p. Frequencies between the kept ones lose the rotation of all their components.
    kept_frequencies = range(0, half, rope_frequency_stride)
    kept = [(j, l) for l in range(rope_components) for j in kept_frequencies]
    dropped = [
        (j, l) for j in range(half) for l in range(rope_components if j % rope_frequency_stride == 0 else 0, n_kv)
    ]
    k_pe = torch.cat([_complex_pair_rows(downs[j][:, l], j, n_kv, d) for j, l in kept])  # [d_r, n_kv d] over keys
    k_np = (
        torch.cat([_complex_pair_rows(downs[j][:, l], j, n_kv, d) for j, l in dropped])
        if dropped
        else torch.zeros(0, n_kv * d, dtype=torch.float64)
    )
    d_r, n_np = k_pe.shape[0], k_np.shape[0]

    # residual[g] [d, n_np]: head g's key part carried by the dropped components, from their coordinates.
    residual = torch.zeros(n_kv, d, n_np, dtype=torch.float64)
    # q_pe_map[g] [d_r, d]: the kept coordinates of a query of group g (dual of the key mix).
    q_pe_map = torch.zeros(n_kv, d_r, d, dtype=torch.float64)
    for g in range(n_kv):
        for m, (j, l) in enumerate(dropped):
            u = ups[j][l, g]
            residual[g, j, 2 * m], residual[g, j, 2 * m + 1] = u.real, -u.imag
            residual[g, j + half, 2 * m], residual[g, j + half, 2 * m + 1] = u.imag, u.real
        for p, (j, l) in enumerate(kept):
            mu = ups[j][l, g].conj()
            q_pe_map[g, 2 * p, j], q_pe_map[g, 2 * p, j + half] = mu.real, -mu.imag
            q_pe_map[g, 2 * p + 1, j], q_pe_map[g, 2 * p + 1, j + half] = mu.imag, mu.real

    # Position-free queries: each head's source query, or with a rope_response the query that scores the dropped
    # components by their expected rotation over the attention's distances (position_free_query_maps).
    # The key side's query Gram is per KV group, so it sees the group's mean response.
    query_maps = position_free_query_maps(rope_response, n_q, d)
    group_maps = position_free_query_maps(
        None if rope_response is None else rope_response.view(n_kv, -1, half).mean(1), n_kv, d
    )

    # Latent: y = T x = [dropped-component coordinates; values of every KV head].
    target = torch.cat([k_np @ k_weight, v_weight])
    gram = target @ hidden_gram.double() @ target.T
    key_map = torch.cat(
        [residual[g].T @ psd_sqrt(group_maps[g] @ stats.gram("query_pre", g) @ group_maps[g].T) for g in range(n_kv)],
        dim=1,
    )  # [n_np, n_kv d]
    value_map = torch.block_diag(
        *[stacked_output_rows(o_weight, geometry, g) for g in range(n_kv)]
    )  # [n_kv d, n_kv*group*hidden]
    root = psd_sqrt(gram)

    def energy(rows: slice, m: torch.Tensor) -> float:
        return float((root[:, rows] @ m).square().sum().clamp_min(1e-300))

    value_scale = energy(slice(n_np, None), value_map) ** -0.5
    output_map = torch.block_diag(key_map, value_map * value_scale)
    if n_np:
        output_map[:n_np] *= (key_weight / energy(slice(0, n_np), key_map)) ** 0.5
    pair = whitened_projection(gram, output_map)
    latent_rows = pair.down[:, :latent_rank].T @ target  # [r, hidden]
    up = pair.up[:latent_rank]  # [r, n_np + n_kv d]: y ~ up^T c

    scale_fix = source_scaling * (d + d_r) ** 0.5  # DeepSeek scales scores by (d_nope + d_r)^-0.5
    q_rows, kv_b_rows = [], []
    for h in range(n_q):
        g = h // geometry.group_size
        q_h = q_weight[h * d : (h + 1) * d]
        q_rows += [query_maps[h] @ q_h * scale_fix, q_pe_map[g] @ q_h * scale_fix]
        kv_b_rows += [residual[g] @ up[:, :n_np].T, up[:, n_np + g * d : n_np + (g + 1) * d].T]
    kept_energy = sum(float(values[j][:rope_components].square().sum()) for j in kept_frequencies)
    total_energy = sum(float(v.square().sum()) for v in values)
    return MLALayer(
        q_proj=torch.cat(q_rows),
        kv_a_proj_with_mqa=torch.cat([latent_rows, k_pe @ k_weight]),
        kv_b_proj=torch.cat(kv_b_rows),
        o_proj=o_weight.clone(),
        pair_frequency=torch.tensor([j for j, _ in kept]),
        qk_nope_head_dim=d,
        qk_rope_head_dim=d_r,
        v_head_dim=d,
        kv_lora_rank=latent_rank,
        latent_spectrum=pair.spectrum,
        rope_energy_kept=kept_energy / max(total_energy, 1e-300),
    )


def position_free_query_maps(rope_response: torch.Tensor | None, num_heads: int, head_dim: int) -> torch.Tensor:
    """[n_h, d, d]: the map applied to each head's source query before it scores the position-free key part.

    A dropped component of frequency j really scores q^T R(-theta_j delta) k at distance delta = n - m; the
    position-free part scores it with one fixed 2x2 map instead. Without a response that map is the identity
    (rotation dropped: exact at delta = 0 only). With rope_response[h, j] = E[exp(i theta_j delta)] over the
    distances head h attends to (attention-weighted), the map is E[R(theta_j delta)] on the query pair (j, j + d/2):
    the least-squares fixed map over those distances. High frequencies average out (|E| ~ 0: the dropped part is not
    scored at all rather than scored wrongly); low ones keep ~ the identity."""
    maps = torch.eye(head_dim, dtype=torch.float64).repeat(num_heads, 1, 1)
    if rope_response is None:
        return maps
    half = head_dim // 2
    if tuple(rope_response.shape) != (num_heads, half):
        raise InvalidArgumentError(f"rope_response must be [{num_heads}, {half}], got {tuple(rope_response.shape)}")
    c, s = rope_response.real.double(), rope_response.imag.double()
    j = torch.arange(half)
    maps[:, j, j], maps[:, j, j + half] = c, -s
    maps[:, j + half, j], maps[:, j + half, j + half] = s, c
    return maps


def balance_latent_gauge(layer: MLALayer) -> MLALayer:
    """The same layer with every latent dim i rescaled so that its kv_a row and its kv_b column have equal norms.

    c_i -> t_i c_i with kv_b's column i divided by t_i changes no output. The whitened latent comes out at the
    calibration Gram's scale (a token's c is ~ 1 / sqrt(calibration tokens)), with kv_a's latent rows tiny and
    kv_b's columns large; a per-element optimiser (Adam, --distill) would move the former by far more, relatively,
    than the latter. Balanced, both sit at the source projections' scale. The RoPE rows are untouched."""
    r = layer.kv_lora_rank
    down_norms = layer.kv_a_proj_with_mqa[:r].norm(dim=1)
    up_norms = layer.kv_b_proj.norm(dim=0)
    t = (
        (up_norms / down_norms.clamp_min(1e-300))
        .sqrt()
        .where((down_norms > 0) & (up_norms > 0), torch.ones_like(up_norms))
    )
    kv_a = layer.kv_a_proj_with_mqa.clone()
    kv_a[:r] *= t[:, None]
    return replace(layer, kv_a_proj_with_mqa=kv_a, kv_b_proj=layer.kv_b_proj / t)


def truncate_latent(layer: MLALayer, rank: int) -> MLALayer:
    """The layer at latent width `rank` <= its own: the first `rank` latent dims, which is exactly mla_layer computed
    at that rank (the whitened projection's dims are ordered by importance, so every width is a prefix)."""
    if not 1 <= rank <= layer.kv_lora_rank:
        raise InvalidArgumentError(f"latent rank must be within 1..{layer.kv_lora_rank}, got {rank}")
    r = layer.kv_lora_rank
    kv_a = torch.cat([layer.kv_a_proj_with_mqa[:rank], layer.kv_a_proj_with_mqa[r:]])
    return replace(layer, kv_a_proj_with_mqa=kv_a, kv_b_proj=layer.kv_b_proj[:, :rank].clone(), kv_lora_rank=rank)
