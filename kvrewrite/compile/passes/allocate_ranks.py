"""Pass 5: the target rate (the plan's, or a quality budget's choice), ranks per layer, KV head and side for it,
and the rate -> ranks table."""

from __future__ import annotations

from kvrewrite.compile.passes.context import CompileContext
from kvrewrite.compile.passes.quality_budget import largest_rate_within_budget
from kvrewrite.errors import InvalidArgumentError
from kvrewrite.key_modes import key_mode
from kvrewrite.method.curve_allocation import curve_removal_order
from kvrewrite.method.rank_allocation import RankItem, allocate, allocate_greedy
from kvrewrite.spec import rate_key


def rank_items(transforms) -> list[RankItem]:
    # Unweighted: the sensitivity allocation orders these items by measured KL curves (curve_removal_order).
    items = []
    for layer, t in enumerate(transforms):
        key_step = key_mode(t.key.mode).rank_step
        # One key item per stored key block: per KV head, or one shared block (crosshead, head 0).
        for g in range(t.key.spectrum.shape[0]):
            items.append(RankItem(layer, g, "key", t.key.spectrum[g].numpy(), step=key_step))
        for g in range(t.value.spectrum.shape[0]):
            items.append(RankItem(layer, g, "value", t.value.spectrum[g].numpy()))
    return items


class AllocateRanks:
    name = "allocate_ranks"
    description = "pick the target rate (given, or the largest within --max-ppl-increase / --max-kl on held-back calibration text), a rank per layer/KV head/side for it, plus a rate table"

    produces = (
        "rank_solver",
        "target_rate",
        "allocation",
        "rate_table",
        "report.quality_budget",
        "report.allocation",
        "report.rate_table",
    )

    def run(self, ctx: CompileContext) -> dict:
        plan, geo = ctx.plan, ctx.geometry
        items = rank_items(ctx.transforms)
        order = None
        if plan.allocation == "sensitivity":
            # Measured KL curves per (layer, side): one removal order, every rate a prefix of it.
            order = curve_removal_order(
                items, ctx.sensitivity_curves, min_rank=plan.min_rank, rank_multiple=plan.rank_multiple
            )

        def solve(rate: float):
            if order is not None:
                return allocate_greedy(
                    items, rate, min_rank=plan.min_rank, rank_multiple=plan.rank_multiple, order=order
                )
            return allocate(items, rate, plan.allocation, min_rank=plan.min_rank, rank_multiple=plan.rank_multiple)

        results = {"rank_solver": solve}
        # Rate strategy: the plan's target rate, or (quality budget) the largest rate measured within budget.
        if plan.has_quality_budget():
            target_rate, results["report.quality_budget"] = largest_rate_within_budget(ctx, solve)
        else:
            target_rate = plan.target_rate
        allocation = solve(target_rate)
        table = {}
        for rate in sorted({*plan.rate_grid, target_rate}):
            try:
                key, value = solve(rate).as_lists(geo.num_layers, geo.num_key_value_heads)
            except InvalidArgumentError:
                continue  # unreachable under --min-rank; the table simply omits it
            table[rate_key(rate)] = {"key": key, "value": value}
        results["report.allocation"] = {
            "method": plan.allocation,
            "target_rate": target_rate,
            "achieved_rate": allocation.rate,
            "kept_elements_per_token": allocation.kept,
            "baseline_elements_per_token": allocation.total,
            "eps": allocation.eps,
        }
        return {
            **results,
            "target_rate": target_rate,
            "allocation": allocation,
            "rate_table": table,
            "report.rate_table": table,
        }
