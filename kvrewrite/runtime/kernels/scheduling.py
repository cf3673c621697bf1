"""Load balancing for variable-rank attention kernels (ZACK §5.3).

Heads of different ranks carry different work, so a plain one-program-per-head grid leaves some SMs idle
while others finish long heads.

- Decode: one task per (request, KV head), cost ~ context x (rk + rv + 1). Tasks are sorted longest first
  and each goes to the worker (SM) with the least work so far (longest-processing-time first).
- Prefill: a task is a block of query rows of one (request, KV head). Row blocks are sized inversely to
  the head's d_sum = rk + rv + 1, so every block carries the same work; the remainder rows of a head form
  a shorter last block.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass


@dataclass(frozen=True)
class DecodeSchedule:
    """Tasks (request, head) grouped by worker: worker w runs tasks[starts[w]:starts[w + 1]] in order."""

    tasks: list[tuple[int, int]]
    starts: list[int]
    loads: list[float]

    @property
    def makespan(self) -> float:
        return max(self.loads) if self.loads else 0.0


def head_work(key_rank: int, value_rank: int) -> int:
    """d_sum of ZACK §5.3: flops per (query row, key) are 2 * (rk + rv + 1)."""
    return key_rank + value_rank + 1


def lpt_decode_schedule(costs: dict[tuple[int, int], float], workers: int) -> DecodeSchedule:
    """Longest-processing-time-first assignment of decode tasks to `workers` workers."""
    workers = max(1, min(workers, len(costs))) if costs else 1
    order = sorted(costs, key=lambda task: (-costs[task], task))
    heap = [(0.0, w) for w in range(workers)]
    assigned: list[list[tuple[int, int]]] = [[] for _ in range(workers)]
    loads = [0.0] * workers
    for task in order:
        load, w = heapq.heappop(heap)
        assigned[w].append(task)
        loads[w] = load + costs[task]
        heapq.heappush(heap, (loads[w], w))
    tasks, starts = [], [0]
    for worker_tasks in assigned:
        tasks.extend(worker_tasks)
        starts.append(len(tasks))
    return DecodeSchedule(tasks, starts, loads)


def prefill_row_blocks(
    q_len: int, key_ranks: tuple[int, ...], value_ranks: tuple[int, ...], base_rows: int, multiple: int
) -> list[int]:
    """Rows per block for each KV head: base_rows * d_sum_max / d_sum_h, rounded down to `multiple`."""
    work = [head_work(rk, rv) for rk, rv in zip(key_ranks, value_ranks)]
    top = max(work) if work else 1
    rows = []
    for w in work:
        r = max(multiple, (base_rows * top // w) // multiple * multiple)
        rows.append(min(r, max(multiple, -(-q_len // multiple) * multiple)))
    return rows


def prefill_tasks(
    batch: int, q_len: int, key_ranks: tuple[int, ...], value_ranks: tuple[int, ...], base_rows: int, multiple: int
) -> list[tuple[int, int, int, int]]:
    """(request, head, first row, last row + 1) for every equal-work row block, heaviest first."""
    rows = prefill_row_blocks(q_len, key_ranks, value_ranks, base_rows, multiple)
    tasks = []
    for b in range(batch):
        for h, block in enumerate(rows):
            for start in range(0, q_len, block):
                tasks.append((b, h, start, min(q_len, start + block)))
    work = [head_work(rk, rv) for rk, rv in zip(key_ranks, value_ranks)]
    # Heaviest first, so the hardware block scheduler starts the long ones early (the short tail
    # blocks of each head fill the last wave).
    return sorted(tasks, key=lambda t: (-(t[3] - t[2]) * work[t[1]], t))
