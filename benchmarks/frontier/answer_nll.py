"""How close each method comes to the passkey, not only whether it finds it: the answer's teacher-forced NLL.

    KVREWRITE_FRONTIER_CHECKPOINT=DIR python benchmarks/frontier/answer_nll.py \
        --inputs benchmarks/results/frontier_inputs_multi.safetensors --max-length 2048 \
        --recipes original,kvrewrite-W16-evict0.225-k8v8-rec0.5 -o RESULT.json

Each passkey prompt of a saved input set is read as the harness's greedy decoding reads it (the context through
the method's prefill, the question, then the key one token at a time, teacher-forced), with the budget search's
own measure (kvrewrite.compile.key_probes.key_recall). A prompt counts as found when every answer token is the
argmax, which is exactly when greedy decoding writes the key. The mean NLL separates methods that all miss, or all
find, a handful of keys. Each prompt also records the bytes its cache held at the end against the original's fp16
cache of the tokens fed (`bytes_share`, read off the cache tensors as the frontier reads them). `original` is the
checkpoint at full rank with a plain cache. Extra recipes for a screening run can be given as JSON
(`--extra '{"name": {load() keywords}}'`).
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

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.frontier.cache_bytes import cache_bytes, fp16_bytes_per_token  # noqa: E402
from benchmarks.frontier.inputs import load_inputs  # noqa: E402
from benchmarks.frontier.kvrewrite_recipes import RECIPES, _method  # noqa: E402
from benchmarks.frontier.prompt_set_options import add_prompt_set_options, checkpoint_directory  # noqa: E402
from kvrewrite.compile.key_probes import KeyProbe, key_recall  # noqa: E402


def _probe(prompt, tokenizer) -> KeyProbe:
    answer = tokenizer(" " + prompt.key, add_special_tokens=False)["input_ids"]
    return KeyProbe(tuple(prompt.context_ids), tuple(prompt.question_ids), tuple(answer), prompt.depth)


def main() -> None:
    from transformers import AutoTokenizer

    import kvrewrite

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_prompt_set_options(parser)
    parser.add_argument("--recipes", required=True, help="comma-separated: original and/or kvrewrite_recipes names")
    parser.add_argument("--extra", default="{}", help="JSON {name: load() keywords} of recipes to screen")
    args = parser.parse_args()
    directory = checkpoint_directory(args)
    recipes = {**RECIPES, **json.loads(args.extra)}
    names = [n.strip() for n in args.recipes.split(",") if n.strip()]
    unknown = [n for n in names if n != "original" and n not in recipes]
    if unknown:
        raise SystemExit(f"unknown recipes {unknown}")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    _, prompts, _ = load_inputs(args.inputs)
    prompts = [p for p in prompts if args.min_length <= p.length <= args.max_length]
    tokenizer = AutoTokenizer.from_pretrained(directory)
    results = []
    for name in names:
        started = time.perf_counter()
        if name == "original":
            model = kvrewrite.load(directory, rate=0.0, kv_codec="none", token_policy=False).eval()
            make_cache, prefill = model.make_kv_cache, None
        else:
            method = _method(name, directory, recipes[name])
            model = method.load(directory)
            make_cache = model.make_kv_cache
            prefill = None if method.prefill is None else (lambda m, cache, ids, f=method.prefill: f(m, ids, cache)[0])
        rows = []
        caches = []

        def fresh_cache(make=make_cache):
            caches.append(make())
            return caches[-1]

        with torch.inference_mode():
            for prompt in prompts:
                # The harness prefills 512 tokens per forward (Method.prefill_chunk) unless the method prefills itself.
                probe = _probe(prompt, tokenizer)
                recall = key_recall(model, [probe], fresh_cache, 512, prefill)
                # Bytes held at the end against the original's fp16 cache of the tokens fed (the last answer token
                # is scored, never fed), read off the cache tensors as the frontier reads them.
                fed = len(probe.context_ids) + len(probe.question_ids) + len(probe.answer_ids) - 1
                share = cache_bytes(caches.pop()) / (fp16_bytes_per_token(model.config) * fed)
                rows.append(
                    {
                        "length": prompt.length,
                        "depth": prompt.depth,
                        "key": prompt.key,
                        "answer_nll": recall.answer_nll,
                        "found": bool(recall.answered),
                        "bytes_share": round(share, 4),
                    }
                )
        results.append(
            {
                "name": name,
                "settings": recipes.get(name, {"cache": "full rank"}),
                "answer_nll": sum(r["answer_nll"] for r in rows) / len(rows),
                "bytes_share": round(sum(r["bytes_share"] for r in rows) / len(rows), 4),
                "found": sum(r["found"] for r in rows),
                "prompts": len(rows),
                "seconds": round(time.perf_counter() - started, 1),
                "items": rows,
            }
        )
        print(
            f"{name}: answer NLL {results[-1]['answer_nll']:.3f}, found {results[-1]['found']}/{len(rows)}, "
            f"{results[-1]['bytes_share']:.1%} of the fp16 bytes"
        )
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    record = {
        "command": " ".join(["python", *sys.argv]),
        "commit": commit,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.platform()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"{torch.get_num_threads()} thread(s)",
        "checkpoint": directory,
        "inputs": str(args.inputs),
        "results": results,
    }
    args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
