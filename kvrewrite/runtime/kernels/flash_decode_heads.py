"""Per-KV-head bookkeeping shared by the decode kernels over a packed layout (packed, latent and coded caches).

Heads of different ranks carry different work per token (rk + rv + 1, ZACK §5.3): it sets each head's share of the
splits (plan_splits) and the order its (head, split) programs launch in. A launch reads the layout and the plan as
small device tables, built once per (layout, plan, device): the task list, one row per kernel argument of per-head
values, and the per-query-head tables merge_splits reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrewrite.runtime.kernels.flash_decode_splits import SplitPlan, int_table, plan_splits
from kvrewrite.runtime.kernels.reference import PackedLayout
from kvrewrite.runtime.kernels.scheduling import head_work


def head_costs(layout: PackedLayout) -> tuple[int, ...]:
    """Per-token work of each KV head: the bytes it reads and the multiply-adds it does both scale with rk + rv + 1."""
    return tuple(head_work(rk, rv) for rk, rv in zip(layout.key_ranks, layout.value_ranks))


def heaviest_head(layout: PackedLayout) -> int:
    """The KV head with the most work per token (the first of equals): the plan sizes splits by its programs."""
    costs = head_costs(layout)
    return costs.index(max(costs))


def partial_share(layout: PackedLayout, s_cap: int, element_bytes: int) -> float:
    """A split's partial (G rows of rv + 2 fp32, written and read back) over what an unsplit program of the heaviest
    head reads (S_cap slots of rk + rv elements)."""
    h = heaviest_head(layout)
    rk, rv = layout.key_ranks[h], layout.value_ranks[h]
    return 2 * layout.group_size * (rv + 2) * 4 / max(1, s_cap * (rk + rv) * element_bytes)


def layout_plan(
    layout: PackedLayout,
    batch: int,
    s_cap: int,
    block_n: int,
    element_bytes: int,
    device: torch.device | str,
    splits: int | None,
    programs_per_sm: int,
) -> SplitPlan:
    """plan_splits for a kernel that reads each head's key and value columns of S_cap slots of element_bytes."""
    return plan_splits(
        head_costs(layout),
        batch,
        s_cap,
        block_n,
        device,
        splits,
        programs_per_sm,
        partial_share(layout, s_cap, element_bytes),
    )


def head_columns(layout: PackedLayout) -> tuple[tuple[int, ...], ...]:
    """The per-head rows every packed-layout kernel reads, in its argument order: key, value and output column
    offsets, then key and value ranks."""
    return (
        tuple(layout.key_offsets[:-1]),
        tuple(layout.value_offsets[:-1]),
        tuple(layout.output_offsets[:-1]),
        layout.key_ranks,
        layout.value_ranks,
    )


@dataclass(frozen=True)
class HeadTables:
    """Device tables of one launch: tasks, the flat (head, split) pairs of SplitPlan.tasks (grid axis 0); heads, one
    int32 row per per-head kernel argument; merge, merge_splits' output offset, width and split count per query
    head."""

    tasks: torch.Tensor
    heads: tuple[torch.Tensor, ...]
    merge: tuple[torch.Tensor, torch.Tensor, torch.Tensor]

    @property
    def n_tasks(self) -> int:
        return self.tasks.numel() // 2


def head_tables(layout: PackedLayout, plan: SplitPlan, device: str, rows: tuple[tuple[int, ...], ...]) -> HeadTables:
    """The tables of a launch whose kernel reads the per-head `rows` (callers cache the result per layout, plan and
    device: a CUDA graph may not copy from the host during capture)."""
    g = layout.group_size
    per_query = range(len(layout.key_ranks) * g)
    tasks = plan.tasks(head_costs(layout))
    return HeadTables(
        tasks=int_table(tuple(x for t in tasks for x in t), device),
        heads=tuple(int_table(tuple(row), device) for row in rows),
        merge=(
            int_table(
                tuple(layout.output_offsets[h // g] + (h % g) * layout.value_ranks[h // g] for h in per_query), device
            ),
            int_table(tuple(layout.value_ranks[h // g] for h in per_query), device),
            int_table(tuple(plan.splits[h // g] for h in per_query), device),
        ),
    )
