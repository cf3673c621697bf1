"""How many device operations one decode step of each cache form launches, per decoder layer, on the CUDA code path.

A decode step at small batch runs as fast as the host can launch its operations when each reads little; then the
count of launches per layer, not the bytes, sets tokens/s in eager mode (under CUDA graphs the launches are replayed
without the host). This counts them without a GPU: each form's model (benchmarks/gpu_decode.py's, random weights)
takes one decode step on CPU with the Triton backend under the interpreter (the kernels CUDA would run), and a
TorchDispatchMode counts every aten operation that does work (views, empty allocations and copies that copy
nothing are not launches) outside the Triton kernels, which are counted as one launch each. Running the model with
1 and with 2 decoder layers separates the per-layer launches from the embedding, final norm and head. The model runs
in bfloat16 by default, as on a GPU: a dtype conversion is a launch too.

    TRITON_INTERPRET=1 python benchmarks/decode_launch_count.py --out benchmarks/results/decode_launch_count.json

The counts are of the CPU run: a few operations differ on CUDA (a fused kernel torch picks there for one it
decomposes here), so they are close to, not exactly, what a CUDA profile shows.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).parent))

from gpu_decode import FORMS, SHAPES, build_model, filled_cache, provenance  # noqa: E402

# Operations that launch nothing on a device: views, allocations, and reading a number back.
NOT_LAUNCHES = {
    "view", "_unsafe_view", "unsqueeze", "squeeze", "slice", "select", "narrow", "transpose", "expand", "as_strided",
    "permute", "alias", "detach", "t", "empty", "empty_like", "new_empty", "empty_strided", "lift_fresh", "split",
    "split_with_sizes", "unbind", "view_as_real", "view_as_complex", "_reshape_alias", "_local_scalar_dense",
    "is_nonzero", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "resolve_conj", "resolve_neg",
}  # fmt: skip
# Operations that make the host wait for the device: a number read back, or an output whose size depends on the data.
# In eager mode each one drains the queue of launches, so the host's launch time no longer overlaps the device's work.
HOST_SYNCS = {"_local_scalar_dense", "nonzero", "masked_select", "repeat_interleave", "unique", "_unique2"}
ROOT = str(Path(__file__).resolve().parents[1]) + "/"
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class LaunchCounter(TorchDispatchMode):
    """Counts the aten operations that do work, and where in kvrewrite (or transformers) each was called from."""

    def __init__(self) -> None:
        super().__init__()
        # Set while a Triton kernel runs under the interpreter: its own torch calls are not launches.
        self.paused = False
        self.ops: collections.Counter = collections.Counter()
        self.sites: collections.Counter = collections.Counter()
        self.syncs: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if not self.paused and name in HOST_SYNCS:
            self.syncs[self._site()] += 1
        if not self.paused and name not in NOT_LAUNCHES:
            self.ops[name] += 1
            self.sites[self._site()] += 1
        return func(*args, **(kwargs or {}))

    @staticmethod
    def _site() -> str:
        """The innermost kvrewrite or transformers function on the stack."""
        frames = [
            f for f in traceback.extract_stack() if ROOT + "kvrewrite/" in f.filename or "/transformers/" in f.filename
        ]
        where = frames[-1] if frames else None
        return (
            "other" if where is None else where.filename.split(ROOT)[-1].split("site-packages/")[-1] + f" {where.name}"
        )


@contextmanager
def counting_kernels(counter: LaunchCounter) -> Iterator[collections.Counter]:
    """Within the block, the interpreter's kernel launches each count as one launch, the torch calls inside them as
    none; yields the launches by kernel name."""
    from triton.runtime import interpreter

    kernels: collections.Counter = collections.Counter()
    launch_with_grid = interpreter.InterpretedFunction.__getitem__

    def getitem(self, grid):
        launch = launch_with_grid(self, grid)

        def counted(*args, **kwargs):
            kernels[self.fn.__name__] += 1
            counter.paused = True
            try:
                return launch(*args, **kwargs)
            finally:
                counter.paused = False

        return counted

    interpreter.InterpretedFunction.__getitem__ = getitem
    try:
        yield kernels
    finally:
        interpreter.InterpretedFunction.__getitem__ = launch_with_grid


def counted_steps(form: str, layers: int, args: argparse.Namespace) -> dict:
    """Launches of `args.steps` decode steps of `form` with `layers` decoder layers, after a first step (tables,
    maps). Several steps, because an evicting cache's settle evicts a token on some steps and not on others."""
    device, dtype = torch.device("cpu"), DTYPES[args.dtype]
    model = build_model(form, SHAPES[args.shape], layers, device, dtype)
    cache = filled_cache(model, form, args.batch, args.context, args.context + args.steps + 4, device, dtype)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, 1), generator=torch.Generator().manual_seed(0))
    counter = LaunchCounter()
    # no_grad, not inference_mode: under inference_mode the dispatch mode would see composite operations (a to() or
    # contiguous() that copies nothing) before they decompose into what runs.
    with torch.no_grad(), counting_kernels(counter) as kernels:
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        kernels.clear()
        with counter:
            for _ in range(args.steps):
                model(input_ids=ids, past_key_values=cache, use_cache=True)
    return {
        "torch_ops": sum(counter.ops.values()),
        "kernels": dict(kernels),
        "sites": counter.sites,
        "syncs": counter.syncs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--forms", default=",".join(f for f in FORMS if f not in ("stock-compiled", "stock-dynamic")))
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="the model's (bf16: as on a GPU)")
    parser.add_argument("--steps", type=int, default=4, help="decode steps counted (the figures are per step)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("set TRITON_INTERPRET=1: the count runs the CUDA code path on CPU under Triton's interpreter")
    os.environ["KVREWRITE_ATTENTION"] = "triton"
    args.layers = 2  # for provenance()
    record = {**provenance(args, torch.device("cpu")), "batch": args.batch, "context": args.context, "results": {}}
    record["command"] = "TRITON_INTERPRET=1 " + record["command"]
    print(f"{'form':14s} {'per layer':>10s} {'of them kernels':>16s} {'host syncs':>11s} {'rest of the model':>18s}")
    for form in [f.strip() for f in args.forms.split(",") if f.strip()]:
        one, two = counted_steps(form, 1, args), counted_steps(form, 2, args)
        launches = {n: r["torch_ops"] + sum(r["kernels"].values()) for n, r in ((1, one), (2, two))}
        kernels = sum(two["kernels"].values()) - sum(one["kernels"].values())
        syncs = sum(two["syncs"].values()) - sum(one["syncs"].values())
        per_layer_sites = {site: two["sites"][site] - one["sites"].get(site, 0) for site in two["sites"]}
        sync_sites = {site: two["syncs"][site] - one["syncs"].get(site, 0) for site in two["syncs"]}

        def per_step(n: float) -> float:
            return round(n / args.steps, 2)

        record["results"][form] = {
            "launches_per_layer": per_step(launches[2] - launches[1]),
            "kernels_per_layer": per_step(kernels),
            "host_syncs_per_layer": per_step(syncs),
            "launches_outside_layers": per_step(2 * launches[1] - launches[2]),
            "per_layer_by_caller": {
                s: per_step(n) for s, n in sorted(per_layer_sites.items(), key=lambda x: -x[1]) if n
            },
            "host_syncs_by_caller": {s: per_step(n) for s, n in sorted(sync_sites.items(), key=lambda x: -x[1]) if n},
        }
        row = record["results"][form]
        print(
            f"{form:14s} {row['launches_per_layer']:>10g} {row['kernels_per_layer']:>16g} "
            f"{row['host_syncs_per_layer']:>11g} {row['launches_outside_layers']:>18g}",
            flush=True,
        )
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
