"""Flash-decoding bookkeeping shared by the decode kernels: how the cache is split, and the merge of the splits.

A decode step has few natural programs (batch x KV heads, or just batch for MLA), far fewer than a GPU's
streaming multiprocessors can run at once, so every decode kernel also splits the cache's sequence axis: split s
of a head walks the slots [s * chunk, (s + 1) * chunk) up to the live length, and writes its unnormalised partial
output with its running max and normaliser to a small fp32 workspace; `merge_splits` then rescales every split to
the common max and normalises (the same step the online softmax takes between key tiles).

The plan depends only on the ranks, the batch, the cache's capacity S_cap and the device, never on the live
length, so one CUDA graph captures one grid that stays valid as the cache fills. A head's chunk is a whole number
of key blocks; heads of different ranks (ZACK §5.3) get split counts proportional to their per-token work, so
every program of a launch carries about the same bytes, and programs are launched heaviest first. How many splits:
a wave model of the launch on the device's multiprocessors (choose_splits).

Running maxima are kept in log2 units (the kernels score with exp2 and fold log2(e) into the scaling).
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

NEG_INF = tl.constexpr(-1.0e30)  # finite: a fully masked split must not make max - max = nan
LOG2E = 1.4426950408889634
MIN_SPLIT_TOKENS = 256  # no split reads fewer slots (a split costs a partial and its share of the merge)
MAX_SPLITS = 128
INTERPRETER_SMS = 4  # under TRITON_INTERPRET=1 on CPU: a small pretend device, so automatic plans still split
MERGE_TILE = 8192  # fp32 elements of one merge program's [splits, columns] tile (32 KB of registers)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def pow2(n: int, floor: int = 16) -> int:
    """A power of two >= n and >= floor (tl.dot needs tiles of at least 16 on the GPU). Plain Python: called a few
    times per launch on the host, where triton.next_power_of_2 (a constexpr function) costs microseconds a call."""
    return max(floor, 1 << (max(n, 1) - 1).bit_length())


@functools.lru_cache(maxsize=16)
def multiprocessor_count(device: str) -> int:
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_properties(dev).multi_processor_count
    return INTERPRETER_SMS


def choose_splits(
    programs: int, s_cap: int, block_n: int, slots: int, partial_share: float, min_split_tokens: int = MIN_SPLIT_TOKENS
) -> int:
    """The split count that minimises a wave model of the launch's time.

    `programs` unsplit tasks of equal work run on `slots` resident programs (multiprocessors x programs that fit on
    one). With s splits each program does 1/s of a task plus writing a partial worth `partial_share` of a task's
    bytes (and the merge reads it back), in ceil(programs * s / slots) waves:
        time(s) = waves(s) * (1 / s + partial_share) + programs * s * partial_share / slots.
    So splits fill the device's idle slots up to a whole wave, and stop where another wave or the partials cost
    more than they save. No split is shorter than min_split_tokens slots (nor one key block); ties go to fewer.
    """
    blocks = max(1, -(-s_cap // block_n))
    limit = max(1, min(blocks, s_cap // max(1, min_split_tokens), MAX_SPLITS))
    programs = max(1, programs)

    def time(s: int) -> float:
        waves = -(-programs * s // slots)
        return waves * (1.0 / s + partial_share) + programs * s * partial_share / slots

    return min(range(1, limit + 1), key=lambda s: (time(s), s))


@dataclass(frozen=True)
class SplitPlan:
    """Per KV head (or per MLA layer: one entry): tokens per split (a multiple of block_n) and the split count."""

    block_n: int
    chunks: tuple[int, ...]
    splits: tuple[int, ...]

    @property
    def max_splits(self) -> int:
        return max(self.splits)

    @property
    def partial(self) -> bool:
        """Whether any head is split (then every head goes through the workspace and the merge)."""
        return self.max_splits > 1

    def tasks(self, work: tuple[int, ...]) -> list[tuple[int, int]]:
        """(head, split) for every program of one request, heaviest first (ties: head order, then split)."""
        tasks = [(h, s) for h, n in enumerate(self.splits) for s in range(n)]
        return sorted(tasks, key=lambda t: (-self.chunks[t[0]] * work[t[0]], t))


def plan_splits(
    work: tuple[int, ...],
    batch: int,
    s_cap: int,
    block_n: int,
    device: torch.device | str,
    splits: int | None = None,
    programs_per_sm: int = 4,
    partial_share: float = 0.0,
) -> SplitPlan:
    """Split counts per head: the heaviest head gets `splits` (default: choose_splits for the whole launch on this device), a head
    of work w gets about splits * w / max(work), at least one. A given `splits` is kept even when it exceeds the key
    blocks (the extra programs find no slots and write an empty partial); a chosen one never leaves a split empty.
    programs_per_sm: how many programs of the kernel fit on one multiprocessor; partial_share: a split's partial
    (written and read back) over the bytes an unsplit program of the heaviest head reads."""
    slots = programs_per_sm * multiprocessor_count(str(device))
    min_tokens = block_n if interpreting() else MIN_SPLIT_TOKENS
    return _split_plan(tuple(work), batch, s_cap, block_n, splits, slots, min_tokens, partial_share)


# Memoised: an eager decode step plans every layer's launch on the host, and choose_splits walks up to MAX_SPLITS
# counts in Python (tens of microseconds a layer). The device facts the plan depends on (its slots, the
# interpreter's shorter splits) are part of the key.
@functools.lru_cache(maxsize=1024)
def _split_plan(
    work: tuple[int, ...],
    batch: int,
    s_cap: int,
    block_n: int,
    splits: int | None,
    slots: int,
    min_tokens: int,
    partial_share: float,
) -> SplitPlan:
    top = max(work)
    blocks = max(1, -(-s_cap // block_n))
    chosen = splits is None
    if chosen:
        # The launch in units of heaviest-head programs: a request's heads weigh sum(work) / top of them.
        programs = max(1, math.floor(batch * sum(work) / top))
        splits = choose_splits(programs, s_cap, block_n, slots, partial_share, min_tokens)
    counts, chunks = [], []
    for w in work:
        n = max(1, round(splits * w / top))
        chunk_blocks = -(-blocks // n)
        if chosen:
            n = -(-blocks // chunk_blocks)
        counts.append(n)
        chunks.append(chunk_blocks * block_n)
    return SplitPlan(block_n, tuple(chunks), tuple(counts))


def decode_tile(width: int, element_bytes: int) -> int:
    """Key block height for a decode kernel: a K tile of about 8 KB (bf16 rank 64: 64 tokens; rank 128: 32), at
    least 16 (tl.dot) and at most 128 tokens. Under the interpreter: 16, so tiny test caches span several blocks."""
    if interpreting():
        return 16
    return max(16, min(128, 8192 // max(1, pow2(width) * element_bytes)))


def column_alignment(offsets: list[int], element_bytes: float) -> int:
    """The largest power of two (at most 16 bytes' worth of elements) dividing every packed column offset (and so
    every rank): the kernels round offsets and ranks to it, which lets the compiler prove 16-byte loads aligned.
    element_bytes may be a fraction (half a byte per 4-bit code)."""
    align = max(1, int(16 / element_bytes))
    while align > 1 and any(o % align for o in offsets):
        align //= 2
    return align


@functools.lru_cache(maxsize=256)
def int_table(values: tuple[int, ...], device: str) -> torch.Tensor:
    """A small int32 table on the device, built once (a CUDA graph may not copy from the host during capture: the
    first, eager call of a shape builds it)."""
    return torch.tensor(values, dtype=torch.int32, device=device)


@dataclass(frozen=True)
class Workspace:
    """fp32 partials of one launch: acc [B, heads, splits, width], running max and normaliser [B, heads, splits]."""

    acc: torch.Tensor
    running_max: torch.Tensor
    normaliser: torch.Tensor


def workspace(batch: int, heads: int, splits: int, width: int, device: torch.device) -> Workspace:
    """Sized by the plan (S_cap), never by the live length. Uninitialised: every slot the merge reads is written."""
    acc = torch.empty(batch, heads, splits, width, device=device, dtype=torch.float32)
    stats = torch.empty(2, batch, heads, splits, device=device, dtype=torch.float32)
    return Workspace(acc, stats[0], stats[1])


def plan_workspace(plan: SplitPlan, batch: int, heads: int, width: int, device: torch.device) -> Workspace | None:
    """The workspace of a launch by this plan, or None when no head is split (the kernel then writes the output)."""
    return workspace(batch, heads, plan.max_splits, width, device) if plan.partial else None


def workspace_arguments(
    ws: Workspace | None, output: torch.Tensor
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], tuple[int, ...]]:
    """The split kernels' workspace arguments: the (acc, running max, normaliser) pointers and their strides
    (s_ab, s_ah, s_as, s_lb, s_lh). Without a workspace (PARTIAL=False, nothing is written there) the output stands
    in for the pointers and the strides are 0."""
    if ws is None:
        return (output, output, output), (0,) * 5
    acc, m = ws.acc, ws.running_max
    return (acc, m, ws.normaliser), (acc.stride(0), acc.stride(1), acc.stride(2), m.stride(0), m.stride(1))


def interpreter_upcast(dtype: torch.dtype) -> bool:
    """The kernels' UPCAST: under the CPU interpreter, which computes bf16 / fp16 dots wrongly, tiles are widened to
    fp32 before each dot; compiled kernels keep the narrow dtype."""
    return dtype != torch.float32 and interpreting()


@triton.jit
def program_task(tasks_ptr):
    """This program's request b (grid axis 1) and its (KV head, split) task (grid axis 0: SplitPlan.tasks order)."""
    task = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    h = tl.load(tasks_ptr + 2 * task)
    split = tl.load(tasks_ptr + 2 * task + 1)
    return b, h, split


@triton.jit
def split_slots(split, chunk, kv_len_ptr, s_cap, HAS_KV_LEN: tl.constexpr):
    """The slots [start, stop) split `split` walks: its chunk, cut at the live length (loaded from device memory, so
    a replayed CUDA graph sees it grow; without HAS_KV_LEN every slot up to S_cap is live)."""
    kv_len = s_cap
    if HAS_KV_LEN:
        kv_len = tl.minimum(tl.load(kv_len_ptr).to(tl.int32), s_cap)
    start = split * chunk
    return start, tl.minimum(start + chunk, kv_len)


@triton.jit
def online_softmax_tile(s, slot_ok, v, m_i, l_i, acc):
    """One key tile of a split's online softmax: scores s [G, N] (log2 units) of the slots slot_ok [N] allows, values
    v [N, D] -> the running max, normaliser and unnormalised value sum after it."""
    s = tl.where(slot_ok[None, :], s, NEG_INF)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.where(slot_ok[None, :], tl.exp2(s - m_new[:, None]), 0.0)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def store_head_split(
    acc,
    m_i,
    l_i,
    hq,
    row_ok,
    dims,
    dims_ok,
    b,
    split,
    acc_ptr,
    m_ptr,
    l_ptr,
    s_ab,
    s_ah,
    s_as,
    s_lb,
    s_lh,
    o_ptr,
    o_cols,
    s_ob,
    PARTIAL: tl.constexpr,
):
    """A split's result for the query heads hq [G]: its partial and statistics into the workspace (PARTIAL), or,
    when the head is not split, the normalised output at o_cols [G, D] (zeros where no slot was allowed)."""
    if PARTIAL:
        tl.store(
            acc_ptr + b * s_ab + hq[:, None] * s_ah + split * s_as + dims[None, :],
            acc,
            mask=row_ok[:, None] & dims_ok[None, :],
        )
        tl.store(m_ptr + b * s_lb + hq * s_lh + split, m_i, mask=row_ok)
        tl.store(l_ptr + b * s_lb + hq * s_lh + split, l_i, mask=row_ok)
    else:
        out = tl.where(l_i[:, None] > 0, acc / tl.maximum(l_i, 1e-30)[:, None], 0.0)
        tl.store(o_ptr + b * s_ob + o_cols, out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & dims_ok[None, :])


@triton.jit
def _merge_kernel(
    acc_ptr,
    m_ptr,
    l_ptr,
    o_ptr,
    o_off_ptr,
    o_width_ptr,
    n_split_ptr,
    s_ab,
    s_ah,
    s_as,
    s_mb,
    s_mh,
    s_ob,
    SPLITS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    hq = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    d0 = tl.program_id(2) * BLOCK_D
    n = tl.load(n_split_ptr + hq)
    sp = tl.arange(0, SPLITS)
    ok = sp < n
    stat = b * s_mb + hq * s_mh + sp
    m = tl.load(m_ptr + stat, mask=ok, other=NEG_INF)
    l = tl.load(l_ptr + stat, mask=ok, other=0.0)
    weight = tl.where(ok, tl.exp2(m - tl.max(m, 0)), 0.0)  # a split that saw no allowed slot has l = 0
    total = tl.sum(weight * l, 0)
    width = tl.load(o_width_ptr + hq)
    dims = d0 + tl.arange(0, BLOCK_D)
    d_ok = dims < width
    acc = tl.load(
        acc_ptr + b * s_ab + hq * s_ah + sp[:, None] * s_as + dims[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0
    )
    out = tl.sum(acc * weight[:, None], 0)
    out = tl.where(total > 0, out / tl.maximum(total, 1e-30), 0.0)  # no allowed slot at all (padding row): zeros
    tl.store(o_ptr + b * s_ob + tl.load(o_off_ptr + hq) + dims, out.to(o_ptr.dtype.element_ty), mask=d_ok)


def merge_splits(
    ws: Workspace,
    output: torch.Tensor,
    out_offsets: torch.Tensor,
    out_widths: torch.Tensor,
    split_counts: torch.Tensor,
    max_width: int,
) -> None:
    """Write output[b, out_offsets[h] : + out_widths[h]] = the merged splits of query head h (output: [B, C], unit
    last stride). split_counts[h]: how many of the workspace's splits head h's programs wrote."""
    batch, heads, splits, _ = ws.acc.shape
    split_tile = pow2(splits, floor=2)
    block_d = min(pow2(max_width), max(16, MERGE_TILE // split_tile))
    grid = (heads, batch, max(1, -(-max_width // block_d)))
    _merge_kernel[grid](
        ws.acc,
        ws.running_max,
        ws.normaliser,
        output,
        out_offsets,
        out_widths,
        split_counts,
        ws.acc.stride(0),
        ws.acc.stride(1),
        ws.acc.stride(2),
        ws.running_max.stride(0),
        ws.running_max.stride(1),
        output.stride(0),
        SPLITS=split_tile,
        BLOCK_D=block_d,
        num_warps=4,
    )


def kv_len_argument(kv_len: torch.Tensor | None, reference: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The live length as the kernels take it: a 1-element device tensor they load (so a replayed CUDA graph sees it
    grow), or a dummy and HAS_KV_LEN=False (every slot up to S_cap is live)."""
    if kv_len is None:
        return reference, False
    return kv_len.reshape(1), True


def mask_argument(allowed: torch.Tensor) -> torch.Tensor:
    """allowed [B, S_cap] as bytes the kernels read: in eager mode a bool tensor is reinterpreted in place, never
    copied. Inside a compiled graph it is converted instead: the H200 run's compiled steps (torch 2.11) failed in
    inductor asking torch.iinfo(torch.bool), which lowering a bool -> int8 bitcast asks unless bool is special-cased
    (torch 2.13 does); a mask built inside the graph gets the conversion fused into the kernel that builds it."""
    if allowed.dtype != torch.bool:
        return allowed
    return allowed.to(torch.int8) if torch.compiler.is_compiling() else allowed.view(torch.int8)
