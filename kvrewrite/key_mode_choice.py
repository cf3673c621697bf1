"""`--rope-mode auto`: choose the key mode of every layer by measured quality against runtime cost.

For each candidate mode we fold the whole model in that mode at full rank (exact, so every other layer
is the original), then truncate ONE layer's keys to the probe rank and measure the KL divergence of the
next-token distribution against the original on calibration text. The layer takes the mode with the
smallest  KL x (1 + cost_weight x RUNTIME_COST[mode]):  cost_weight 0 is quality only; with weight W a
mode of runtime cost c must be (1 + W c) times better than a free one to be chosen.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvrewrite.compressed_model import build_compressed_model
from kvrewrite.passes.fold_weights import build_spec, folded_state_dict
from kvrewrite.progress import progress_bar
from kvrewrite.spec import (
    KEY_MODE_CROSSHEAD,
    KEY_MODE_FREQ,
    KEY_MODE_LATENT,
    KEY_MODE_POST_ROPE,
    KEY_MODES,
    ZERO_OVERHEAD_KEY_MODES,
    full_key_ranks,
)

# Extra runtime per decode step, relative to the latent mode (the costliest). latent rebuilds and rotates
# every cached key at every step (r x d multiply-adds per cached token and KV head, as much as the
# attention itself or more); post-rope projects only the new token's q and k (context-independent);
# freq and crosshead fold entirely into q_proj/k_proj.
RUNTIME_COST = {KEY_MODE_FREQ: 0.0, KEY_MODE_CROSSHEAD: 0.0, KEY_MODE_POST_ROPE: 0.1, KEY_MODE_LATENT: 1.0}
PREFERENCES = {"quality": KEY_MODES, "zero-overhead": ZERO_OVERHEAD_KEY_MODES}

PROBE_WINDOWS = 2
PROBE_TOKENS = 256
# Share of key dims removed in the probe. Sensitivity allocation at p = 0.5 removes 55-70% of key dims.
PROBE_KEY_RATE = 0.6


def probe_key_rank(mode: str, num_kv_heads: int, head_dim: int, rate: float = PROBE_KEY_RATE) -> list[int]:
    """Uniform key ranks removing `rate` of the key dims (whole pairs where the mode stores pairs)."""
    per_head = max(2, 2 * round((1 - rate) * head_dim / 2))
    if mode == KEY_MODE_CROSSHEAD:
        return [per_head * num_kv_heads] + [0] * (num_kv_heads - 1)
    return [per_head] * num_kv_heads


def key_probe_kl(ctx, transforms: list, tokens: torch.Tensor, reference: torch.Tensor) -> list[float]:
    """Per layer: KL to the original when only that layer's keys are truncated to the probe rank."""
    geo, d = ctx.geometry, ctx.geometry.head_dim
    full_values = [[d] * geo.num_key_value_heads for _ in range(geo.num_layers)]
    full_keys = [full_key_ranks(t.key.mode, geo.num_key_value_heads, d) for t in transforms]
    spec = build_spec(ctx, full_keys, full_values, transforms=transforms)
    model = build_compressed_model(ctx.model.config, spec, folded_state_dict(ctx.model, ctx.adapter, transforms, geo))
    kls = []
    with torch.inference_mode():
        for idx, (layer, t) in enumerate(zip(ctx.adapter.decoder_layers(model), transforms)):
            attn = ctx.adapter.attention(layer)
            attn.probe_ranks = (probe_key_rank(t.key.mode, geo.num_key_value_heads, d), full_values[idx])
            logp = F.log_softmax(model(input_ids=tokens, use_cache=False).logits.float(), dim=-1)
            attn.probe_ranks = None
            kls.append(float((reference.exp() * (reference - logp)).sum(-1).mean()))
    return kls


def choose_key_modes(ctx, candidates: dict[str, list], cost_weight: float) -> tuple[list[str], dict]:
    """The chosen mode per layer, and a report of every probe. candidates: mode -> LayerTransforms per layer."""
    tokens = ctx.calibration_tokens[:PROBE_WINDOWS, :PROBE_TOKENS]
    with torch.inference_mode():
        reference = F.log_softmax(ctx.model(input_ids=tokens, use_cache=False).logits.float(), dim=-1)
    kl = {}
    num_layers = ctx.geometry.num_layers
    with progress_bar("choosing key modes", len(candidates) * num_layers, ctx.plan.progress) as bar:
        for mode, transforms in candidates.items():
            cache_key = (ctx.plan.objective, mode)
            if cache_key not in ctx.key_mode_probes:
                ctx.key_mode_probes[cache_key] = key_probe_kl(ctx, transforms, tokens, reference)
            kl[mode] = ctx.key_mode_probes[cache_key]
            bar.advance(num_layers)
    chosen = []
    for layer in range(num_layers):
        scores = {m: kl[m][layer] * (1 + cost_weight * RUNTIME_COST[m]) for m in candidates}
        chosen.append(min(scores, key=scores.get))
    report = {
        "candidates": list(candidates),
        "cost_weight": cost_weight,
        "runtime_cost": {m: RUNTIME_COST[m] for m in candidates},
        "probe_key_rate": PROBE_KEY_RATE,
        "probe_tokens": int(tokens.numel()),
        "probe_kl": kl,
        "chosen": chosen,
    }
    return chosen, report
