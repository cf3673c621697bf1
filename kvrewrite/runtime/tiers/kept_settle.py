"""The settle of a decode step on an evicting layer in one kernel launch, where the kept-tier kernels run (CUDA).

After a decode forward exactly one token leaves the window. tiers.eviction's settle codes it and re-cuts the kept
tier in torch, about seventy small operations a layer, and on a step that evicts its top mask and row scatter read
device numbers back to the host twice. A decode step that launches a few dozen operations a layer and never
waits for the device is what lets an eager GPU step overlap the host's launches with the device's work.

Here the host decides only what it knows without the device: whether this step evicts (the kept rows plus the
moving token against the budget, both counts on the host), and whether the store needs one more row. The kernel
(kernels.kept_settle_kernel) does the rest, as the torch settle does it: the same row chosen (the lowest score, the
newest among equals, as the top mask ranks ties), the same code space, group ranges and rounding (IEEE divisions);
under Triton's interpreter tests/test_kept_settle.py holds the stores equal bit for bit after many steps. On a GPU
(not run yet) a code may differ by one where the turn's float32 sum, in another order than torch's GEMM, lands on a
rounding boundary; benchmarks/decode_kernel_check.py reports how alike the stores are. The first settle of a sequence (it sets the channel statistics), a forward that moves more than one token
out of the window, a floor, unquantized sides, groups that split a byte and CPU keep the torch settle.
"""

from __future__ import annotations

from kvrewrite.runtime.kernels.dispatch import resolve_backend
from kvrewrite.runtime.tiers.cache import prefix_columns


def _applies(layer, beyond: int) -> bool:
    if beyond != 1 or layer.holding or layer.floor_key_ranks is not None:
        return False
    if layer.channel_stats is None or layer.rotations is None or layer.kept_positions is None:
        return False
    bits = layer.side_bits
    if any(bits[side] is None or layer.group_size * bits[side] % 8 for side in ("key", "value")):
        return False
    if len(layer.kept_key_ranks) != len(layer.kept_value_ranks) or not layer.kept_positions.shape[-1]:
        return False
    return resolve_backend(layer.keys.device) == "triton"


def _tables(layer) -> dict:
    """Per side, the settle kernel's device tables (kernels.kept_settle_kernel.SideTables), made once per layer and
    device: derived from the ranks and the fixed rotations, not cache content (a frozen dataclass, which the cache's
    byte count does not walk into), and no copy from the host on later steps."""
    from kvrewrite.runtime.kernels.kept_settle_kernel import side_tables

    held = layer.settle_tables
    if held is None or held["key"].rotations.device != layer.keys.device:
        held = {
            side: side_tables(prefix_columns(layer.head_dim, ranks), ranks, layer.rotations, layer.keys.device)
            for side, ranks in (("key", layer.kept_key_ranks), ("value", layer.kept_value_ranks))
        }
        layer.settle_tables = held
    return held


def settle_in_kernel(layer, beyond: int) -> bool:
    """Settle the evicting `layer` (tokens `beyond` its window) in one kernel if it can; whether it did."""
    if not _applies(layer, beyond):
        return False
    n_old = layer.kept_positions.shape[-1]
    seen_beyond = layer.cumulative_length - layer.window
    budget = layer.budget(seen_beyond)
    evict = n_old + 1 > budget
    kept_scores, recent_scores = layer._received_kept, layer._received_recent
    if evict and (
        budget != n_old or kept_scores is None or kept_scores.shape[-1] != n_old or recent_scores is None
    ):  # more than one row to free, or no evidence to choose it by: the torch settle decides
        return False
    from kvrewrite.runtime.kernels.kept_settle_kernel import settle_moving_token

    if evict:  # the sinks' scores raised as the torch settle raises them (host ints; no wait for the device)
        kept_scores = layer._with_sinks(kept_scores, layer.kept_positions)
        moving = layer.cumulative_length - layer.keys.shape[-2]
        recent_scores = layer._with_sinks(recent_scores[:, :1], moving)

    # Evicting, the moving token takes a freed row; else one row more, its contents from the kernel.
    store = layer._store("kept") if evict else layer._grown_store("kept", n_old + 1)
    settle_moving_token(
        layer.keys[:, 0, 0],
        layer.values[:, 0, 0],
        _tables(layer),
        layer.channel_stats,
        layer.side_bits,
        layer.group_size,
        store,
        n_old,
        layer.cumulative_length - layer.keys.shape[-2],
        kept_scores if evict else None,
        recent_scores[:, 0] if evict else None,
    )
    layer._leave_window(1)
    layer._received_recent = layer._received_kept = None
    return True
