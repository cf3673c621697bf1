"""Issue 20: where does our int2 lose to transformers' QuantizedCache? One change per row, same protocol.

Every row runs SmolLM2-135M-Instruct on held-out wiki text and scores it against the original model with a
float32 DynamicCache under the *same* protocol:
  - `window`: 512-token windows, chunked prefill in 64-token chunks, every token scored (docs/codecs.md's protocol).
  - `continuation`: 1024-token sequences; the first 512 tokens are prefilled in one forward, the next 512 are fed
    64 tokens at a time and scored (the protocol of QuantizedCache's own numbers in issue 20).

Caches compared:
  - `ours:SPEC`     kvrewrite's CodecCache (kvrewrite.runtime.codecs) applied to the *original* model's raw K/V (post-RoPE
                    keys, [B, H, S, D] packed as [B, 1, S, H*D]): the codec alone, no rewrite.
  - `latent:SPEC`   the same codec on the full-rank rewrite (rate 0 of a compiled checkpoint, `--checkpoint`): what
                    docs/codecs.md's "codec alone" row measures (pre-RoPE, whitened latents).
  - `quanto:b,ak,av,gs,res`  transformers' QuantizedCache, optimum-quanto backend: nbits, axis_key, axis_value,
                    q_group_size, residual_length (axis 0 = per token groups of gs channels, -1 = per channel groups
                    of gs tokens; KIVI's axes are keys -1, values 0).

Bytes per token: every tensor the cache holds at the end of a sequence (quanto's tensor subclasses unpacked into
their packed data, scales and shifts), divided by the sequence length; `fp16 share` counts float tensors at 2 bytes
per element (what a float16 deployment stores: our residual window is float16 already, quanto keeps the model's
float32 residual and float32 scales) against the float16 cache, 23,040 bytes/token.

  PYTHONPATH=/tmp/quanto-site:. python benchmarks/kivi_faithful.py --rows ablation --eval-tokens 4096
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import Cache

RESULTS = Path(__file__).parent / "results" / "kivi_faithful.json"
FP16_BYTES = 2 * 30 * 3 * 64 * 2
CHUNK = 64


# ---- our codec on the original model's raw K/V -------------------------------------------------------------


def _heads_layer_class():
    from kvrewrite.runtime.codecs import CodecLayer

    class HeadsCodecLayer(CodecLayer):
        """A CodecLayer taking the original attention's [B, H, S, D] states (packed as [B, 1, S, H*D])."""

        def update(self, key_states, value_states, *args, **kwargs):
            b, h, s, d = key_states.shape
            pack = lambda t: t.transpose(1, 2).reshape(b, 1, s, h * d)  # noqa: E731
            k, v = super().update(pack(key_states), pack(value_states))
            unpack = lambda t: t.reshape(b, t.shape[2], h, d).transpose(1, 2)  # noqa: E731
            return unpack(k), unpack(v)

    return HeadsCodecLayer


def ours_cache(spec: str, num_layers: int = 30, heads: int = 3, dim: int = 64) -> Cache:
    from kvrewrite.runtime.codecs import CodecCache, build_layer_codecs, parse_codec

    config = parse_codec(spec)
    cache = CodecCache([], config.residual)
    layer_cls = _heads_layer_class()
    cache.layers = [layer_cls(codec, config.residual)
                    for codec in build_layer_codecs(config, [[dim] * heads] * num_layers, [[dim] * heads] * num_layers)]
    return cache


def quanto_cache(spec: str) -> Cache:
    from transformers.cache_utils import QuantoQuantizedLayer

    nbits, ak, av, gs, res = (int(x) for x in spec.split(","))
    return Cache(layers=[QuantoQuantizedLayer(nbits=nbits, axis_key=ak, axis_value=av, q_group_size=gs, residual_length=res)
                         for _ in range(30)])


# ---- bytes ---------------------------------------------------------------------------------------------------


def _leaves(t: torch.Tensor) -> list[torch.Tensor]:
    if type(t) is torch.Tensor or not hasattr(t, "__tensor_flatten__"):
        return [t]
    names, _ = t.__tensor_flatten__()
    return [x for n in names for x in _leaves(getattr(t, n))]


def held_tensors(cache: Cache) -> list[torch.Tensor]:
    out = []
    for layer in cache.layers:
        for value in vars(layer).values():
            items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
            out += [leaf for v in items if isinstance(v, torch.Tensor) for leaf in _leaves(v)]
    return out


def cache_bytes(cache: Cache) -> tuple[int, int]:
    """(bytes as held, bytes with every float tensor counted at float16)."""
    tensors = held_tensors(cache)
    held = sum(t.numel() * t.element_size() for t in tensors)
    fp16 = sum(t.numel() * (2 if t.is_floating_point() else t.element_size()) for t in tensors)
    return held, fp16


# ---- protocols -----------------------------------------------------------------------------------------------


def run_sequence(model, make_cache, ids: torch.Tensor, protocol: str) -> tuple[torch.Tensor, Cache]:
    """-> logits predicting the scored tokens (ids[:, start+1:]), and the cache at the end."""
    cache = make_cache()
    pieces = []
    if protocol == "window":
        starts, first = range(0, ids.shape[1], CHUNK), None
    else:  # continuation: prefill half, then chunks
        half = ids.shape[1] // 2
        out = model(input_ids=ids[:, :half], past_key_values=cache, use_cache=True)
        first = out.logits[:, -1:]  # predicts token `half`
        starts = range(half, ids.shape[1], CHUNK)
    if first is not None:
        pieces.append(first)
    for s in starts:
        pieces.append(model(input_ids=ids[:, s : s + CHUNK], past_key_values=cache, use_cache=True).logits)
    logits = torch.cat(pieces, dim=1)[:, :-1]
    return logits, cache


def evaluate(model, make_cache, windows: torch.Tensor, protocol: str, base_logits: list[torch.Tensor] | None):
    nll, kl, n, held, fp16 = 0.0, 0.0, 0, 0.0, 0.0
    logits_out = []
    with torch.inference_mode():
        for i, ids in enumerate(windows):
            ids = ids.unsqueeze(0)
            logits, cache = run_sequence(model, make_cache, ids, protocol)
            target = ids[:, -logits.shape[1]:] if protocol == "continuation" else ids[:, 1:]
            logp = F.log_softmax(logits.float(), -1)
            nll += float(-logp.gather(-1, target.unsqueeze(-1)).sum())
            n += target.numel()
            if base_logits is not None:
                base = F.log_softmax(base_logits[i].float(), -1)
                kl += float((base.exp() * (base - logp)).sum())
            else:
                logits_out.append(logits)
            h, f = cache_bytes(cache)
            held += h / ids.shape[1]
            fp16 += f / ids.shape[1]
    stats = {"ppl": float(torch.tensor(nll / n).exp()), "kl": kl / n, "bytes_held": held / len(windows),
             "bytes_fp16": fp16 / len(windows)}
    return stats, logits_out


# ---- rows ----------------------------------------------------------------------------------------------------

# (label, cache, protocol): one change per row, from QuantizedCache's KIVI setting towards our codec and back.
ABLATION = [
    ("quanto int2 KIVI axes, G64, res128", "quanto:2,-1,0,64,128"),
    ("quanto int2 default axes (per token), G64, res128", "quanto:2,0,0,64,128"),
    ("quanto int2 KIVI axes, G32, res128", "quanto:2,-1,0,32,128"),
    ("quanto int2 KIVI axes, G64, res64", "quanto:2,-1,0,64,64"),
    ("quanto int4 KIVI axes, G64, res128", "quanto:4,-1,0,64,128"),
    ("quanto int4 default axes, G64, res128", "quanto:4,0,0,64,128"),
    ("ours int2 raw K/V, defaults", "ours:int2"),
    ("ours int2 raw K/V, G64", "ours:int2:group_size=64"),
    ("ours int2 raw K/V, residual128", "ours:int2:residual=128"),
    ("ours int2 raw K/V, G64 res128", "ours:int2:group_size=64,residual=128"),
    ("ours int4 raw K/V, defaults", "ours:int4"),
]


def make_factory(spec: str, original, checkpoint):
    kind, _, rest = spec.partition(":")
    if kind == "quanto":
        return original, lambda: quanto_cache(rest)
    if kind == "ours":
        return original, lambda: ours_cache(rest)
    if kind == "latent":
        import kvrewrite

        model = kvrewrite.load(checkpoint, rate=0.0, kv_codec=rest)
        return model, model.make_kv_cache
    if kind == "fp32":
        return original, lambda: DynamicCache(config=original.config)
    raise ValueError(spec)


def git_commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, text=True).strip()
    except Exception:  # noqa: BLE001
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="ablation", help="'ablation' or ';'-separated label=spec pairs or specs")
    parser.add_argument("--protocols", default="continuation,window")
    parser.add_argument("--eval-tokens", type=int, default=4096)
    parser.add_argument("--checkpoint", type=Path)
    parser.add_argument("--tag", default="")
    parser.add_argument("--report", action="store_true")
    args = parser.parse_args()
    record = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {"runs": []}
    if args.report:
        report(record)
        return

    from transformers import AutoTokenizer

    from kvrewrite.io.calibration_data import evaluation_token_sequences
    from kvrewrite.compile.passes.load_checkpoint import load_fp32_model
    from kvrewrite.io.sources import resolve_model_source

    path = resolve_model_source("smollm2-135m").path
    tokenizer = AutoTokenizer.from_pretrained(path)
    original = load_fp32_model(path).eval()
    rows = ABLATION if args.rows == "ablation" else [
        tuple(r.split("=", 1)) if "=" in r.split(":")[0] else (r, r) for r in args.rows.split(";")]
    for protocol in args.protocols.split(","):
        seq = 1024 if protocol == "continuation" else 512
        windows = evaluation_token_sequences(tokenizer, args.eval_tokens, seq)
        base, base_logits = evaluate(original, lambda: DynamicCache(config=original.config), windows, protocol, None)
        print(f"[{protocol}] original fp32 DynamicCache ppl {base['ppl']:.3f}", flush=True)
        for label, spec in rows:
            model, factory = make_factory(spec, original, args.checkpoint)
            t0 = time.perf_counter()
            st, _ = evaluate(model, factory, windows, protocol, base_logits)
            row = {"label": label, "spec": spec, "protocol": protocol, "tag": args.tag, "eval_tokens": int(windows.numel()),
                   "baseline_ppl": base["ppl"], **st, "dppl": st["ppl"] / base["ppl"] - 1,
                   "fp16_share": st["bytes_fp16"] / FP16_BYTES, "seconds": round(time.perf_counter() - t0, 1)}
            print(f"[{protocol}] {label:55s} ppl {st['ppl']:8.3f} ({row['dppl']:+8.1%}) KL {st['kl']:.4f} "
                  f"bytes/tok held {st['bytes_held']:7.0f} fp16-equiv {st['bytes_fp16']:7.0f} ({row['fp16_share']:.3f})", flush=True)
            record["runs"] = [r for r in record["runs"] if not (r["spec"] == spec and r["protocol"] == protocol
                                                                  and r.get("tag", "") == args.tag)]
            record["runs"].append(row)
            record.update(command=" ".join(["python", *sys.argv]), commit=git_commit(),
                          machine=f"{platform.node()} {platform.machine()}, {torch.get_num_threads()} threads; torch {torch.__version__} CPU",
                          date=datetime.datetime.now().isoformat(timespec="seconds"), fp16_bytes_per_token=FP16_BYTES)
            RESULTS.parent.mkdir(parents=True, exist_ok=True)
            RESULTS.write_text(json.dumps(record, indent=1))


def report(record: dict) -> None:
    print("| protocol | row | cache | ppl | Δppl | KL | bytes/token (fp16-equiv) | share of fp16 |")
    print("|---|---|---|---|---|---|---|---|")
    for r in record["runs"]:
        print(f"| {r['protocol']} | {r['label']} | `{r['spec']}` | {r['ppl']:.2f} | {r['dppl']:+.1%} | {r['kl']:.4f} | "
              f"{r['bytes_fp16']:.0f} | {r['fp16_share']:.3f} |")


if __name__ == "__main__":
    main()
