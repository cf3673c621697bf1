"""Start N local processes on one machine, each in a gloo process group, and collect what each returns.

Used by the CLI (`kvrewrite prefill-parallel`) and the tests; a multi-machine or NCCL run starts its processes
with torchrun instead and calls `prefill` directly. Rendezvous is through a file, so no port has to be free.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, fn: Callable, world: int, directory: str, args: tuple, threads: int) -> None:
    torch.set_num_threads(threads)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # all processes are on this machine
    dist.init_process_group("gloo", init_method=f"file://{directory}/rendezvous", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    torch.save(result, Path(directory) / f"rank{rank}.pt")


def run_processes(fn: Callable[..., Any], nprocs: int, *args, threads: int = 1) -> list[Any]:
    """Run fn(rank, world_size, *args) in `nprocs` spawned processes (gloo group initialised); their results in rank
    order. fn must be importable (a module-level function) and return something torch.save can write."""
    with tempfile.TemporaryDirectory(prefix="kvrewrite-sp-") as directory:
        mp.spawn(_worker, args=(fn, nprocs, directory, args, threads), nprocs=nprocs, join=True)
        return [torch.load(Path(directory) / f"rank{r}.pt", weights_only=False) for r in range(nprocs)]
