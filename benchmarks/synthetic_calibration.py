"""Synthetic calibration text: the static-cache decoder against the generator it replaced, at equal tokens.

Builds a random-weight Llama of a named shape from a config (nothing downloaded; vocab 49152 so SmolLM2's
tokenizer serves), then in one process generates `--tokens` tokens of synthetic calibration text three ways with
the same sampling settings: the previous generator (transformers' generate(), float32 on the CPU, read from git at
`--baseline` so it runs unchanged), and the static-cache decoder in float32 and in bfloat16 (the compile dtype of
the headline command). Records tokens per second of each (kept tokens, counted as the compile counts them) and
the ratios, with command, commit, machine and date:

    OMP_NUM_THREADS=1 python benchmarks/synthetic_calibration.py --shape llama3-8b --layers 1 --tokens 4096

`--real-smollm2` runs the bundled SmolLM2-135M-Instruct instead: real texts end at different lengths, which random
weights never do, so it measures what ended rows leaving the batch saves.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import subprocess
import sys
import time
import types
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvrewrite.io.calibration_data import synthetic  # noqa: E402

# Decoder-layer shapes of public models (the config fields that size them); vocab stays SmolLM2's.
SHAPES = {
    "llama3-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_hidden_layers=32,
        rope_theta=500000.0,
    ),
    "llama3-70b": dict(
        hidden_size=8192,
        intermediate_size=28672,
        num_attention_heads=64,
        num_key_value_heads=8,
        num_hidden_layers=80,
        rope_theta=500000.0,
    ),
    "smollm2-135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_attention_heads=9,
        num_key_value_heads=3,
        num_hidden_layers=30,
        rope_theta=100000.0,
    ),
}


def shape_config(shape: str, layers: int | None):
    from transformers import LlamaConfig

    fields = dict(SHAPES[shape])
    if layers is not None:
        fields["num_hidden_layers"] = layers
    return LlamaConfig(
        vocab_size=49152,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        **fields,
    )


PACKAGE = "kvrewrite/io/calibration_data"


def module_at(commit: str, filename: str, name: str) -> types.ModuleType:
    """`PACKAGE/filename` as it was at `commit`, run as a module of its own registered as `name` (dataclasses look
    their module up in sys.modules)."""
    source = subprocess.run(
        ["git", "show", f"{commit}:{PACKAGE}/{filename}"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    module = types.ModuleType(name)
    sys.modules[name] = module
    exec(compile(source, f"{commit[:10]}:{filename}", "exec"), module.__dict__)
    return module


def baseline_generator(commit: str) -> types.ModuleType:
    """synthetic.py as it was at `commit` (it imports only unchanged helpers)."""
    return module_at(commit, "synthetic.py", "baseline_synthetic")


def decoder_at(commit: str) -> types.ModuleType:
    """synthetic.py as it was at `commit`, with the static_decoding.py of that commit under it (the static-cache
    decoder before a change, to time it in the same run as the decoder after it)."""
    decoding = module_at(commit, "static_decoding.py", "previous_static_decoding")
    name = "kvrewrite.io.calibration_data.static_decoding"
    current = sys.modules[name]
    sys.modules[name] = decoding  # what `from ...static_decoding import` binds while the old synthetic.py runs
    try:
        return module_at(commit, "synthetic.py", "previous_synthetic")
    finally:
        sys.modules[name] = current


@contextlib.contextmanager
def _row_major_linears(model, rows, plan=None):
    """Stands in for packed_cpu_linears: nothing packed (the decoder as it ran before the packing)."""
    yield 0


def timed(generate, tokenizer, model) -> dict:
    """Runs one generator; records its time, the tokens it kept, and the rows its forwards computed: the prefills'
    rows, and the row-steps of its one-token decode steps (rows summed over steps, the work a CPU pays for)."""
    prefill_rows, decode_row_steps = [], [0]

    def count_rows(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None:
            if ids.shape[1] == 1:
                decode_row_steps[0] += ids.shape[0]
            else:
                prefill_rows.append(ids.shape[0])

    hook = model.register_forward_pre_hook(count_rows, with_kwargs=True)
    try:
        start = time.perf_counter()
        texts = generate()
        seconds = time.perf_counter() - start
    finally:
        hook.remove()
    kept = sum(synthetic._count_tokens(tokenizer, t) for t in texts)
    return {
        "seconds": round(seconds, 1),
        "texts": len(texts),
        "kept_tokens": kept,
        "tokens_per_s": round(kept / seconds, 2),
        "prefill_rows": prefill_rows,
        "decode_row_steps": decode_row_steps[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument(
        "--real-smollm2",
        action="store_true",
        help="the bundled SmolLM2-135M-Instruct's real weights instead of a random shape: its texts end at an "
        "end-of-sequence token, as a real compile's do",
    )
    parser.add_argument("--layers", type=int, default=8, help="decoder layers (default 8 of Llama-3-8B's 32)")
    parser.add_argument("--tokens", type=int, default=4096, help="calibration tokens each way generates")
    parser.add_argument("--max-new-tokens", type=int, default=synthetic.DEFAULT_SETTINGS.max_new_tokens)
    parser.add_argument(
        "--batch-size", type=int, default=None, help="static-cache rows per forward (default: the device's)"
    )
    parser.add_argument("--baseline", default="6fe868b", help="commit whose generator is the baseline")
    parser.add_argument(
        "--skip-float32",
        action="store_true",
        help="leave out the static-cache decoder in float32 (the slowest new run; the compile runs in bfloat16)",
    )
    parser.add_argument(
        "--unpacked",
        action="store_true",
        help="also run the bfloat16 decoder with the linears left row-major (what the oneDNN packing gains)",
    )
    parser.add_argument(
        "--previous",
        default=None,
        help="also time the bfloat16 static-cache decoder as it was at this commit (what a change gained)",
    )
    parser.add_argument("--note", default="", help="what else ran on the machine")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "synthetic_calibration_cpu.json")
    args = parser.parse_args()

    from transformers import AutoTokenizer, LlamaForCausalLM

    from kvrewrite.io.sources import bundled_smollm2_path

    # The commit whose code runs: read before the minutes of generation, in which the tree may move on.
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    tokenizer = AutoTokenizer.from_pretrained(bundled_smollm2_path())
    if args.real_smollm2:
        model = LlamaForCausalLM.from_pretrained(bundled_smollm2_path(), dtype=torch.float32).eval()
        config = model.config
        shape, weights = "smollm2-135m", "real (the bundled SmolLM2-135M-Instruct)"
    else:
        config = shape_config(args.shape, args.layers)
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).eval()
        shape, weights = args.shape, "random (LlamaForCausalLM init, seed 0)"
    parameters = sum(p.numel() for p in model.parameters())
    baseline = baseline_generator(args.baseline)
    old_settings = replace(baseline.DEFAULT_SETTINGS, max_new_tokens=args.max_new_tokens)
    new_settings = replace(synthetic.DEFAULT_SETTINGS, max_new_tokens=args.max_new_tokens)
    runs = {}
    print(
        f"{shape} x {config.num_hidden_layers} layers, {parameters / 1e9:.2f}B parameters, {args.tokens} tokens each way"
    )
    runs["generate_float32"] = timed(
        lambda: baseline._generate(model, tokenizer, args.tokens, 0, old_settings), tokenizer, model
    )
    print("previous generator (transformers generate, float32):", runs["generate_float32"])
    if not args.skip_float32:
        runs["static_cache_float32"] = timed(
            lambda: synthetic._generate(model, tokenizer, args.tokens, 0, new_settings, args.batch_size),
            tokenizer,
            model,
        )
        print("static-cache decoder, float32:", runs["static_cache_float32"])
    model = model.to(torch.bfloat16)
    runs["static_cache_bfloat16"] = timed(
        lambda: synthetic._generate(model, tokenizer, args.tokens, 0, new_settings, args.batch_size), tokenizer, model
    )
    print("static-cache decoder, bfloat16:", runs["static_cache_bfloat16"])
    if args.previous:
        previous = decoder_at(args.previous)
        runs["static_cache_bfloat16_previous"] = timed(
            lambda: previous._generate(model, tokenizer, args.tokens, 0, new_settings, args.batch_size),
            tokenizer,
            model,
        )
        print(f"static-cache decoder at {args.previous}, bfloat16:", runs["static_cache_bfloat16_previous"])
    if args.unpacked:
        packing = synthetic.packed_cpu_linears
        synthetic.packed_cpu_linears = _row_major_linears
        try:
            runs["static_cache_bfloat16_unpacked"] = timed(
                lambda: synthetic._generate(model, tokenizer, args.tokens, 0, new_settings, args.batch_size),
                tokenizer,
                model,
            )
        finally:
            synthetic.packed_cpu_linears = packing
        print("static-cache decoder, bfloat16, row-major linears:", runs["static_cache_bfloat16_unpacked"])
    base = runs["generate_float32"]["tokens_per_s"]
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "")
    record = {
        "command": " ".join([f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '')}", "python", *sys.argv]),
        "commit": commit,
        "baseline_commit": args.baseline,
        "previous_commit": args.previous,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{cpu}, {os.cpu_count()} CPUs, torch {torch.__version__}, {torch.get_num_threads()} torch thread(s), "
        f"no GPU; shared with other engineers' jobs ({args.note or 'load not controlled'}): ratios are same-run",
        "model": {
            "shape": shape,
            "layers": config.num_hidden_layers,
            "parameters": parameters,
            "vocab_size": config.vocab_size,
            "weights": weights,
        },
        "tokens_asked": args.tokens,
        "max_new_tokens": args.max_new_tokens,
        "batch_size": args.batch_size or synthetic._default_batch_size(torch.device("cpu")),
        "runs": runs,
        **{
            f"speedup_{name}": round(run["tokens_per_s"] / base, 2)
            for name, run in runs.items()
            if name != "generate_float32"
        },
        "platform": platform.platform(),
    }
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k.startswith("speedup_")}))


if __name__ == "__main__":
    main()
