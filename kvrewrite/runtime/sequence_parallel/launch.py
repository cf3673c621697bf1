"""Start N local processes on one machine, each in a gloo process group, and collect what each returns.

Used by the CLI (`kvrewrite prefill-parallel`) and the tests; a multi-machine or NCCL run starts its processes
with torchrun instead and calls `prefill` directly. Rendezvous is through a file, so no port has to be free.
Results come back through a queue (tensors in shared memory), not through files: nothing is unpickled from disk.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, fn: Callable, world: int, directory: str, args: tuple, threads: int, results, collected) -> None:
    torch.set_num_threads(threads)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # all processes are on this machine
    dist.init_process_group("gloo", init_method=f"file://{directory}/rendezvous", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    results.put((rank, result))
    collected.wait()  # a tensor in shared memory must outlive its sender until the parent has received it


def run_processes(fn: Callable[..., Any], nprocs: int, *args, threads: int = 1) -> list[Any]:
    """Run fn(rank, world_size, *args) in `nprocs` spawned processes (gloo group initialised); their results in rank
    order. fn must be importable (a module-level function) and return plain containers, numbers, strings and tensors."""
    context = mp.get_context("spawn")
    results, collected = context.SimpleQueue(), context.Event()
    with tempfile.TemporaryDirectory(prefix="kvrewrite-sp-") as directory:
        processes = mp.start_processes(
            _worker,
            args=(fn, nprocs, directory, args, threads, results, collected),
            nprocs=nprocs,
            join=False,
            start_method="spawn",
        )
        gathered: dict[int, Any] = {}
        try:
            while len(gathered) < nprocs:
                if not results.empty():
                    rank, result = results.get()
                    gathered[rank] = result
                elif processes.join(timeout=0.1):  # all exited (a failure raises here, with the child's traceback)
                    break
        finally:
            collected.set()
        while not processes.join():
            pass
        if len(gathered) < nprocs:
            raise RuntimeError(f"only {len(gathered)} of {nprocs} processes returned a result")
        return [gathered[r] for r in range(nprocs)]
