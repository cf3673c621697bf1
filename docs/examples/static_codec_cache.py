"""Generate through the int4 static codec cache and through the default codec cache: same tokens, what each holds.

python docs/examples/static_codec_cache.py CHECKPOINT_DIR     (a kvrewrite checkpoint with its tokenizer)
"""

import sys

import torch
from transformers import AutoTokenizer

import kvrewrite

directory = sys.argv[1]
model = kvrewrite.load(directory, kv_codec="int4").eval()
tokenizer = AutoTokenizer.from_pretrained(directory)
inputs = tokenizer(["The capital of France is"] * 2, return_tensors="pt")
with torch.no_grad():
    static = model.generate(
        **inputs, max_new_tokens=300, do_sample=False, cache_implementation="static", return_dict_in_generate=True
    )
    default = model.generate(**inputs, max_new_tokens=300, do_sample=False, return_dict_in_generate=True)
cache = static.past_key_values
layer = cache.layers[0]
print(type(cache).__name__, "max_cache_len", cache.max_cache_len)
print(
    "layer 0: coded blocks", int(layer.n_coded), "of", layer.block_capacity,
    "| window", int(layer.window_len), "of", layer.window_capacity,
)  # fmt: skip
print("same tokens as the default codec cache:", torch.equal(static.sequences, default.sequences))
print("held bytes: static", cache.stored_bytes(), "| default", default.past_key_values.stored_bytes())
