"""Rate strategy (only with `max_ppl_increase` / `max_kl`): the largest rate that meets a quality budget.

The allocation pass asks it for the target rate (allocate_ranks.py) before anything is built from one, so the
fold builds the spec once, at the chosen rate.

ZDC §5.2 targets a perplexity budget rather than a rate. One full-rank folded rewrite serves every rate
(the allocator's ranks for any rate are a prefix slice of the same transforms), so the search only
changes ranks: it bisects over rates in steps of RATE_STEP, measuring perplexity and KL against the
original on calibration windows held back from the statistics (never the held-out evaluation
articles). Perplexity grows with the rate in practice; the bisection assumes it, and the report keeps
every probe so a non-monotone case is visible. The chosen rate becomes the compiled target rate (allocate_ranks returns it as target_rate).
Layer-streamed: each probed rate is one pass over the folded weights (one layer resident at a time).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from kvrewrite.compile.folded_weights import FoldedWeights
from kvrewrite.compile.layer_streaming import StreamedModel
from kvrewrite.compile.passes.context import CompileContext
from kvrewrite.compile.probes import log_probs, truncating
from kvrewrite.compile.rewrite_spec import build_spec
from kvrewrite.errors import InvalidArgumentError
from kvrewrite.spec import full_key_ranks

RATE_STEP = 0.01
MAX_RATE = 0.95
EVAL_BATCH = 4


def streamed_log_probs(
    model: StreamedModel, batches: list[torch.Tensor], layer_ranks: list | None = None
) -> list[torch.Tensor]:
    """Next-token log-probabilities of every batch (all but the last position), layer-streamed.

    layer_ranks[i]: (key ranks, value ranks) layer i is truncated to (probes.truncated on a full-rank rewrite).
    """
    with torch.inference_mode():
        return model.forward(
            batches,
            on_layer=truncating(model.adapter, layer_ranks) if layer_ranks is not None else None,
            head=lambda logits: log_probs(logits)[:, :-1],
        )


def nll_and_kl(
    logprobs: list[torch.Tensor], reference_logprobs: list[torch.Tensor], batches: list[torch.Tensor]
) -> tuple[float, float]:
    """Mean next-token NLL on the data and mean KL(original || model) over the same positions."""
    nll, kl, count = 0.0, 0.0, 0
    for tokens, logp, ref in zip(batches, logprobs, reference_logprobs):
        nll += float(-logp.gather(-1, tokens[:, 1:, None]).sum())
        kl += float((ref.exp() * (ref - logp)).sum())
        count += tokens[:, 1:].numel()
    return nll / count, kl / count


def within_budget(plan, ppl_increase: float, kl: float) -> bool:
    ok = True
    if plan.max_ppl_increase is not None:
        ok &= ppl_increase <= plan.max_ppl_increase
    if plan.max_kl is not None:
        ok &= kl <= plan.max_kl
    return ok


def largest_rate_within_budget(ctx: CompileContext, rank_solver: Callable) -> tuple[float, dict]:
    """The largest rate (in steps of RATE_STEP, up to MAX_RATE) whose ranks meet the plan's budget, and the report.

    rank_solver: rate -> RankAllocation, the allocation pass's own (the same items and order at every rate)."""
    plan = ctx.plan
    if ctx.budget_tokens is None or len(ctx.budget_tokens) == 0:
        raise InvalidArgumentError(
            "a quality budget needs held-back calibration windows; set it on the plan that builds the calibration"
        )
    geo, d = ctx.geometry, ctx.geometry.head_dim
    full_values = [[d] * geo.num_key_value_heads for _ in range(geo.num_layers)]
    full_keys = [full_key_ranks(t.key.mode, geo.num_key_value_heads, d) for t in ctx.transforms]
    # The full-rank rewrite, folded layer by layer as each probe runs (fold_weights makes the checkpoint's own).
    model = FoldedWeights(ctx.source, ctx.transforms, geo).streamed(
        build_spec(ctx, full_keys, full_values), plan.compute_dtype(ctx.config), plan.device
    )
    batches = list(ctx.budget_tokens.split(EVAL_BATCH))
    reference = streamed_log_probs(ctx.source.streamed(plan.compute_dtype(ctx.config), plan.device), batches)
    base_nll = sum(float(-r.gather(-1, b[:, 1:, None]).sum()) for r, b in zip(reference, batches)) / sum(
        b[:, 1:].numel() for b in batches
    )

    probes: dict[float, dict] = {}

    def measure(rate: float) -> bool:
        if rate not in probes:
            allocation = rank_solver(rate)
            # Zeroing the latent dims beyond each rank is exactly that truncation (tested), and keeps one model.
            ranks = list(zip(*allocation.as_lists(geo.num_layers, geo.num_key_value_heads)))
            nll, kl = nll_and_kl(streamed_log_probs(model, batches, ranks), reference, batches)
            increase = math.exp(nll - base_nll) - 1
            probes[rate] = {
                "rate": rate,
                "ppl_increase": increase,
                "kl_mean": kl,
                "ok": within_budget(plan, increase, kl),
            }
        return probes[rate]["ok"]

    grid = [round(i * RATE_STEP, 4) for i in range(int(round(MAX_RATE / RATE_STEP)) + 1)]
    lo, hi = 0, len(grid) - 1  # invariant: grid[lo] meets the budget (rate 0 is the original model)
    if measure(grid[hi]):
        lo = hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if measure(grid[mid]):
            lo = mid
        else:
            hi = mid
    chosen = grid[lo]
    if chosen not in probes:
        measure(chosen)
    return chosen, {
        "max_ppl_increase": plan.max_ppl_increase,
        "max_kl": plan.max_kl,
        "held_back_tokens": int(ctx.budget_tokens.numel()),
        "baseline_ppl": math.exp(base_nll),
        "chosen_rate": chosen,
        "chosen": probes[chosen],
        "probes": sorted(probes.values(), key=lambda p: p["rate"]),
    }
