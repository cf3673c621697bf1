"""Generate through the int4 static codec cache and through the default codec cache: same tokens, what each holds.

python docs/examples/static_codec_cache.py CHECKPOINT_DIR [--out RESULT.json]   (a checkpoint with its tokenizer)
"""

import argparse
import datetime
import json
import platform
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer

import kvrewrite
from kvrewrite.runtime.cache_bytes import cache_tensor_bytes

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("checkpoint")
parser.add_argument("--out", type=Path, default=None, help="also write what it prints, with command and commit")
args = parser.parse_args()
model = kvrewrite.load(args.checkpoint, kv_codec="int4").eval()
tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
inputs = tokenizer(["The capital of France is"] * 2, return_tensors="pt")
with torch.no_grad():
    static = model.generate(
        **inputs, max_new_tokens=300, do_sample=False, cache_implementation="static", return_dict_in_generate=True
    )
    default = model.generate(**inputs, max_new_tokens=300, do_sample=False, return_dict_in_generate=True)
cache = static.past_key_values
layer = cache.layers[0]
result = {
    "cache": type(cache).__name__,
    "max_cache_len": cache.max_cache_len,
    "layer0_coded_blocks": int(layer.n_coded),
    "layer0_block_capacity": layer.block_capacity,
    "layer0_window": int(layer.window_len),
    "layer0_window_capacity": layer.window_capacity,
    "same_tokens": torch.equal(static.sequences, default.sequences),
    "held_bytes_static": cache_tensor_bytes(cache),
    "held_bytes_default": cache_tensor_bytes(default.past_key_values),
}
print(result["cache"], "max_cache_len", result["max_cache_len"])
print(
    "layer 0: coded blocks", result["layer0_coded_blocks"], "of", result["layer0_block_capacity"],
    "| window", result["layer0_window"], "of", result["layer0_window_capacity"],
)  # fmt: skip
print("same tokens as the default codec cache:", result["same_tokens"])
print("held bytes: static", result["held_bytes_static"], "| default", result["held_bytes_default"])
if args.out:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    header = {
        "command": " ".join(["python", *sys.argv]),
        "commit": commit,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.node()}: {platform.machine()}, torch {torch.__version__}",
    }
    args.out.write_text(json.dumps({**header, **result}, indent=1) + "\n")
