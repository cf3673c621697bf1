"""Every cache form's decode step through its kernels against the same step through torch ops, on one device.

The kernel tests run on CPU under Triton's interpreter; this checks the kernels compiled for the device, end to end
through each form's model, before anything is timed (the first step of benchmarks/gpu_decode_device.sh). For every
form of benchmarks/gpu_decode.py but stock, two copies of the same random model (same seed) and of the same filled
cache take a few decode steps: one with the backend the runtime picks on the device (`KVREWRITE_ATTENTION` unset: the
Triton kernels on CUDA), one with `KVREWRITE_ATTENTION=torch`. The last step's logits must agree within the dtype's tolerance: by then each step has
read what the previous ones wrote (an evicting cache's settle, for one, runs after the forward).

    python benchmarks/decode_kernel_check.py --out OUT.json                                # CUDA, Llama-3-8B shapes
    TRITON_INTERPRET=1 python benchmarks/decode_kernel_check.py --device cpu --out OUT.json  # the check itself, on CPU
    TRITON_INTERPRET=1 python benchmarks/decode_kernel_check.py --device cpu --dtype bf16 --out OUT.json  # in bf16

For `evict` it also reports how alike the two runs' kept stores are after the steps (the same tokens kept, the same
codes): the settle kernel writes them, and logits alone would hide a code that differs.

`int4-compiled` is the int4 form on its static codec cache (runtime.codecs.static_cache), whose decode step reads the
block and window counts from device memory; the check steps it eagerly (compiling adds nothing to what is compared).

Exits 1 if any form disagrees or fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from gpu_decode import FORMS, SHAPES, build_model, filled_cache, provenance  # noqa: E402

TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 1e-2, torch.float32: 1e-3}  # relative L2 error of the logits


@contextmanager
def backend(name: str | None):
    """KVREWRITE_ATTENTION for the block (None: unset, the runtime's own choice)."""
    before = os.environ.get("KVREWRITE_ATTENTION")
    if name is None:
        os.environ.pop("KVREWRITE_ATTENTION", None)
    else:
        os.environ["KVREWRITE_ATTENTION"] = name
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("KVREWRITE_ATTENTION", None)
        else:
            os.environ["KVREWRITE_ATTENTION"] = before


def last_step(
    form: str, shape: dict, layers: int, batch: int, context: int, device, dtype, chosen: str | None, steps: int
) -> tuple[torch.Tensor, list | None]:
    """Logits [B, vocab] (float32) of the last of `steps` decode steps of a fresh model and cache under backend
    `chosen` (the same tokens every run), and an evicting cache's kept stores (per layer, on the CPU; else None)."""
    with backend(chosen), torch.inference_mode():
        model = build_model(form, shape, layers, device, dtype)
        cache = filled_cache(model, form, batch, context, context + steps + 4, device, dtype)
        ids = torch.randint(0, shape["vocab_size"], (batch, steps), generator=torch.Generator().manual_seed(2))
        for step in range(steps):
            out = model(input_ids=ids[:, step : step + 1].to(device), past_key_values=cache, use_cache=True)
        logits = out.logits[:, -1].float()
        stores = None
        if form == "evict":
            stores = [{n: t.cpu() for n, t in layer._store("kept").items()} for layer in cache.layers]
    del model, cache
    return logits, stores


def store_agreement(kernels: list, plain: list) -> dict:
    """How alike two runs' kept stores are: the share of (layer, request) rows holding the same tokens, and over the
    tokens both hold, the share of code bytes, scales and minimums that are equal (the torch settle and the settle
    kernel sum the code space's turn in different orders, so a code can differ at a rounding boundary)."""
    same_tokens, rows, equal, total = 0, 0, 0, 0
    for mine, theirs in zip(kernels, plain):
        for b in range(mine["positions"].shape[0]):
            rows += 1
            order_a, order_b = mine["positions"][b].argsort(), theirs["positions"][b].argsort()
            if not torch.equal(mine["positions"][b, order_a], theirs["positions"][b, order_b]):
                continue
            same_tokens += 1
            for name in mine:
                if name != "positions":
                    a, c = mine[name][b, order_a], theirs[name][b, order_b]
                    equal += int((a == c).sum())
                    total += a.numel()
    return {"kept_rows_same_tokens": same_tokens / max(rows, 1), "kept_values_equal": equal / max(total, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--forms", default=",".join([*(f for f in FORMS if not f.startswith("stock")), "int4-compiled"])
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--steps", type=int, default=3, help="decode steps; the last one's logits are compared")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("on a CPU the kernels run under Triton's interpreter: set TRITON_INTERPRET=1")
    # CUDA: Llama-3-8B's attention at a context that is not a multiple of any block; CPU (interpreter): tiny.
    if device.type == "cuda":
        name, layers, batch, context, dtype, fast = "llama3-8b", 2, 2, 1000, torch.bfloat16, None
    else:
        name, layers, batch, context, dtype, fast = "smollm2", 1, 2, 75, torch.float32, "triton"
    if args.dtype is not None:  # e.g. bf16 under the interpreter: the dtype handling the GPU run will meet
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    shape = SHAPES[name]
    forms = [f.strip() for f in args.forms.split(",") if f.strip()]
    results, failed = {}, False
    for form in forms:
        try:
            kernels, kernel_stores = last_step(form, shape, layers, batch, context, device, dtype, fast, args.steps)
            plain, plain_stores = last_step(form, shape, layers, batch, context, device, dtype, "torch", args.steps)
            error = float((kernels - plain).norm() / plain.norm())
            agree = float((kernels.argmax(-1) == plain.argmax(-1)).float().mean())
            ok = bool(torch.isfinite(kernels).all()) and error <= TOLERANCE[dtype]
            results[form] = {"relative_error": float(f"{error:.3g}"), "argmax_agreement": agree, "ok": ok}
            if kernel_stores is not None:  # reported, not judged: what the settle kernel wrote against the torch settle
                results[form].update(store_agreement(kernel_stores, plain_stores))
        except Exception as exc:  # a compile failure in one form must not hide the others'
            results[form] = {"error": f"{type(exc).__name__}: {exc}"[:500], "ok": False}
        failed |= not results[form]["ok"]
        print(f"{form:10s} {results[form]}", flush=True)
    record = {
        **provenance(argparse.Namespace(shape=name, layers=layers, dtype=str(dtype), steps=args.steps), device),
        "batch": batch,
        "context": context,
        "tolerance": TOLERANCE[dtype],
        "results": results,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
