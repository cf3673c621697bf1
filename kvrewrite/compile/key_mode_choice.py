"""`--rope-mode auto`: choose the key mode of every layer by measured quality against runtime cost.

For each candidate mode the rewrite in that mode runs at full rank (exact, so every other layer is the
original), with ONE layer's keys truncated to the probe rank, and we measure the KL divergence of the
next-token distribution against the original on calibration text. Layer-streamed like the sensitivity
pass (probes.probe_kls: one pass over the weights per mode, all layers' probes side by side). The layer takes the
mode with the smallest  KL x (1 + cost_weight x KeyMode.run_time_cost):  cost_weight 0 is quality only; with weight W a
mode of runtime cost c must be (1 + W c) times better than a free one to be chosen.
"""

from __future__ import annotations

import torch

from kvrewrite.compile.folded_weights import FoldedWeights
from kvrewrite.compile.layer_streaming import StreamedModel
from kvrewrite.compile.probes import log_probs, probe_kls
from kvrewrite.compile.rewrite_spec import build_spec, full_rank_ranks
from kvrewrite.key_modes import key_mode

# Each mode's extra runtime per decode step, relative to the latent mode (the costliest), is its
# KeyMode.run_time_cost: latent rebuilds and rotates every cached key at every step (r x d multiply-adds per
# cached token and KV head, as much as the attention itself or more); post-rope projects only the new token's
# q and k (context-independent); freq and crosshead fold entirely into q_proj/k_proj.

PROBE_WINDOWS = 2
PROBE_TOKENS = 256
# Share of key dims removed in the probe. Sensitivity allocation at p = 0.5 removes 55-70% of key dims.
PROBE_KEY_RATE = 0.6


def probe_key_rank(mode: str, num_kv_heads: int, head_dim: int, rate: float = PROBE_KEY_RATE) -> list[int]:
    """Uniform key ranks removing `rate` of the key dims (whole pairs where the mode stores pairs)."""
    per_head = max(2, 2 * round((1 - rate) * head_dim / 2))
    return key_mode(mode).uniform_key_ranks(per_head, num_kv_heads)


def key_probe_kl(
    ctx,
    transforms: list,
    original: StreamedModel,
    tokens: torch.Tensor,
    reference: torch.Tensor,
    label: str = "key mode probes",
) -> list[float]:
    """Per layer: KL to the original when only that layer's keys are truncated to the probe rank."""
    plan, geo, d = ctx.plan, ctx.geometry, ctx.geometry.head_dim
    full_keys, full_values = full_rank_ranks(ctx, transforms)
    spec = build_spec(ctx, full_keys, full_values, transforms=transforms)
    rewritten = FoldedWeights(ctx.source, transforms, geo).streamed(spec, plan.compute_dtype(ctx.config), plan.device)
    layer_probes = [
        {"key": (probe_key_rank(t.key.mode, geo.num_key_value_heads, d), full_values[idx])}
        for idx, t in enumerate(transforms)
    ]
    kls = probe_kls(original, rewritten, layer_probes, tokens, plan.progress, label=label, reference=reference)
    return [kls[(idx, "key")] for idx in range(len(transforms))]


def choose_key_modes(ctx, candidates: dict[str, list], cost_weight: float) -> tuple[list[str], dict]:
    """The chosen mode per layer, and a report of every probe. candidates: mode -> LayerTransforms per layer."""
    tokens = ctx.calibration_tokens[:PROBE_WINDOWS, :PROBE_TOKENS]
    original = ctx.source.streamed(ctx.plan.compute_dtype(ctx.config), ctx.plan.device)
    reference = None
    kl = {}
    num_layers = ctx.geometry.num_layers
    for mode, transforms in candidates.items():
        cache_key = (ctx.plan.objective, mode)
        probes = ctx.memo.key_mode_probes  # shared by compile_variants' variants (they share the statistics)
        if cache_key not in probes:
            if reference is None:
                with torch.inference_mode():
                    reference = original.forward(tokens, head=log_probs)
            probes[cache_key] = key_probe_kl(
                ctx, transforms, original, tokens, reference, label=f"key mode probes ({mode})"
            )
        kl[mode] = probes[cache_key]
    chosen = []
    for layer in range(num_layers):
        scores = {m: kl[m][layer] * (1 + cost_weight * key_mode(m).run_time_cost) for m in candidates}
        chosen.append(min(scores, key=scores.get))
    report = {
        "candidates": list(candidates),
        "cost_weight": cost_weight,
        "runtime_cost": {m: key_mode(m).run_time_cost for m in candidates},
        "probe_key_rate": PROBE_KEY_RATE,
        "probe_tokens": int(tokens.numel()),
        "probe_kl": kl,
        "chosen": chosen,
    }
    return chosen, report
