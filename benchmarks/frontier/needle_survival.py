"""Does an evicting recipe keep the passkey line, and is keeping it enough? A diagnostic for the eighth's misses.

    KVREWRITE_FRONTIER_CHECKPOINT=DIR python benchmarks/frontier/needle_survival.py \
        --inputs benchmarks/results/frontier_inputs_wiki15.safetensors --max-length 1500 \
        --recipe kvrewrite-W16-evict0.225-k8v8-rec --modes scored,kept,kept:15-25,kept:0-15 -o RESULT.json

For each passkey prompt the context goes through the recipe's reconstruction-scored prefill
(kvrewrite.runtime.tiers.reconstruction); then each layer's held positions (kept tier and recent window) are read,
and the key line's tokens and its key digits counted among them. The question and the key follow, teacher-forced,
as answer_nll.py reads them (answer NLL; found when every answer token is the argmax, which is when greedy
decoding writes the key).

Modes:
- `scored`: the recipe as it is.
- `kept`: an oracle. After the repeat has been scored, the key line's positions get a score above every other
  token in every layer before the one settle. They take the first places of the same budget: the keep share and the
  bytes are unchanged, and a few filler tokens leave instead. `kept:A-B` does this in layers A..B-1 only.
What the oracle separates: a recipe that loses the key because its score drops the line (the oracle brings the
answer back) from one that loses it with the line kept.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.frontier.inputs import load_inputs  # noqa: E402
from benchmarks.frontier.kvrewrite_recipes import RECIPES, _method  # noqa: E402
from benchmarks.frontier.prompt_set_options import add_prompt_set_options, checkpoint_directory  # noqa: E402


def needle_positions(tokenizer, prompt) -> tuple[list[int], list[int]]:
    """(the key line's token positions in the context, those of its key digits). The line was tokenized on its own
    when the prompt was built (inputs.passkey_prompts), so its tokens appear as one run in the context."""
    from kvrewrite.compile.key_probes import key_line

    line = tokenizer(key_line(prompt.key), add_special_tokens=False)["input_ids"]
    ids = prompt.context_ids
    starts = [i for i in range(len(ids) - len(line) + 1) if ids[i : i + len(line)] == line]
    if len(starts) != 1:
        raise SystemExit(f"the key line of key {prompt.key} occurs {len(starts)} times in its context, not once")
    span = list(range(starts[0], starts[0] + len(line)))
    digits = [i for i in span if tokenizer.decode([ids[i]]).strip().isdigit()]
    return span, digits


def held_positions(cache) -> list[set[int]]:
    """Per layer, the original positions the cache holds: its kept tier and its recent window."""
    held = []
    for layer in cache.layers:
        recent = range(layer.cumulative_length - layer.keys.shape[-2], layer.cumulative_length)
        kept = layer.kept_positions[0].long().tolist() if layer.kept_positions is not None else []
        held.append(set(kept) | set(recent))
    return held


def keep_line_in(cache, span: list[int], layers: range) -> None:
    """Make the cache's one settle after the repeat keep `span` in `layers`: cache.crop() runs after the repeat and
    before each layer's release(), so the collected reconstruction scores are raised there."""
    crop = cache.crop

    def crop_then_raise(length: int) -> None:
        crop(length)
        for i in layers:
            collected = cache.layers[i]._collected  # [B, n] reconstruction scores, read by release()
            if collected is not None:
                collected[:, span] = collected.max() + 1

    cache.crop = crop_then_raise


def parse_mode(mode: str, num_layers: int) -> range | None:
    """`scored` -> None; `kept` -> every layer; `kept:A-B` -> layers A..B-1."""
    if mode == "scored":
        return None
    if mode == "kept":
        return range(num_layers)
    if mode.startswith("kept:"):
        first, last = (int(x) for x in mode[5:].split("-"))
        if 0 <= first < last <= num_layers:
            return range(first, last)
    raise SystemExit(f"unknown mode {mode!r}: scored, kept, or kept:A-B with 0 <= A < B <= {num_layers}")


def main() -> None:
    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_prompt_set_options(parser)
    parser.add_argument("--recipe", default="kvrewrite-W16-evict0.225-k8v8-rec", help="a kvrewrite_recipes name")
    parser.add_argument("--modes", default="scored,kept")
    parser.add_argument(
        "--bands", default="0-4,4-15,15-30", help="layer bands A-B (layers A..B-1) to average the held digits over"
    )
    args = parser.parse_args()
    directory = checkpoint_directory(args)
    options = RECIPES.get(args.recipe)
    if options is None or options.get("prefill") != "reconstruction":
        raise SystemExit(f"{args.recipe!r} is not a kvrewrite recipe with a reconstruction-scored prefill")
    method = _method(args.recipe, directory, options)
    model = method.load(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    _, prompts, _ = load_inputs(args.inputs)
    prompts = [p for p in prompts if args.min_length <= p.length <= args.max_length]
    num_layers = len(model.make_kv_cache().layers)
    modes = {m.strip(): parse_mode(m.strip(), num_layers) for m in args.modes.split(",") if m.strip()}
    bands = {b: parse_mode(f"kept:{b}", num_layers) for b in args.bands.split(",") if b.strip()}
    results = {}
    for mode, layers in modes.items():
        rows = []
        for prompt in prompts:
            started = time.perf_counter()
            span, digits = needle_positions(tokenizer, prompt)
            cache = model.make_kv_cache()
            if layers is not None:
                keep_line_in(cache, span, layers)
            answer = tokenizer(" " + prompt.key, add_special_tokens=False)["input_ids"]
            with torch.inference_mode():
                method.prefill(model, torch.tensor([prompt.context_ids]), cache)
                held = held_positions(cache)
                step, nll, found = torch.tensor([prompt.question_ids]), 0.0, True
                for target in answer:
                    logits = model(step, past_key_values=cache, use_cache=True).logits[0, -1].float()
                    nll += float(F.cross_entropy(logits[None], torch.tensor([target])))
                    found = found and int(logits.argmax()) == target
                    step = torch.tensor([[target]])
            rows.append(
                {
                    "length": prompt.length,
                    "depth": prompt.depth,
                    "key": prompt.key,
                    "line_tokens": len(span),
                    "digit_tokens": len(digits),
                    "line_held_per_layer": [sum(i in h for i in span) for h in held],
                    "digits_held_per_layer": [sum(i in h for i in digits) for h in held],
                    "answer_nll": nll / len(answer),
                    "found": found,
                    "seconds": round(time.perf_counter() - started, 1),
                }
            )
            row = rows[-1]
            print(
                f"[{mode}] {prompt.length} tokens, depth {prompt.depth}: digits held per layer "
                f"{min(row['digits_held_per_layer'])}-{max(row['digits_held_per_layer'])} of {len(digits)}, "
                f"answer NLL {row['answer_nll']:.3f}, found {found}",
                flush=True,
            )
        results[mode] = {
            "layers_kept_in": None if layers is None else [layers.start, layers.stop],
            "answer_nll": sum(r["answer_nll"] for r in rows) / len(rows),
            "found": sum(r["found"] for r in rows),
            "prompts": len(rows),
            "digits_held_mean": sum(sum(r["digits_held_per_layer"]) for r in rows) / (len(rows) * num_layers),
            "digits_held_mean_by_band": {
                name: sum(sum(r["digits_held_per_layer"][band.start : band.stop]) for r in rows)
                / (len(rows) * len(band))
                for name, band in bands.items()
            },
            "line_held_mean": sum(sum(r["line_held_per_layer"]) for r in rows) / (len(rows) * num_layers),
            "rows": rows,
        }
        print(f"[{mode}] answer NLL {results[mode]['answer_nll']:.3f}, found {results[mode]['found']}/{len(rows)}")
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    record = {
        "command": "python benchmarks/frontier/needle_survival.py " + " ".join(sys.argv[1:]),
        "commit": commit,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}, torch threads "
        f"{torch.get_num_threads()}",
        "checkpoint": directory,
        "recipe": args.recipe,
        "inputs": str(args.inputs),
        "modes": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
