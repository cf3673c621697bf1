"""Sequence-parallel (Ulysses-style) long-prompt prefill whose all-to-alls carry the packed compressed latents.

`prefill(model, input_ids, group)` on every rank of a torch.distributed group (gloo on CPU, NCCL on GPUs);
`run_processes` starts N local processes for it (docs/sequence-parallel.md).
"""

from kvrewrite.runtime.sequence_parallel.collectives import CollectiveCall, CountingCollectives
from kvrewrite.runtime.sequence_parallel.launch import run_processes
from kvrewrite.runtime.sequence_parallel.plan import RankShare, check_world_size, head_runs, layer_shares, token_runs
from kvrewrite.runtime.sequence_parallel.prefill import PrefillResult, greedy_continue, prefill

__all__ = [
    "CollectiveCall",
    "CountingCollectives",
    "PrefillResult",
    "RankShare",
    "check_world_size",
    "greedy_continue",
    "head_runs",
    "layer_shares",
    "prefill",
    "run_processes",
    "token_runs",
]
