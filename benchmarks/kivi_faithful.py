"""Issue 20's same-protocol table: our codecs against transformers' QuantizedCache, one model, one protocol, one
byte count.

Every row runs a model on held-out wiki text and scores it against the original SmolLM2-135M-Instruct with a
float32 DynamicCache under the *same* protocol:
  - `window`: 512-token windows, chunked prefill in 64-token chunks, every token scored (docs/codecs.md's protocol).
  - `continuation`: 1024-token sequences; the first 512 tokens are prefilled in one forward, the next 512 are fed
    64 tokens at a time and scored (the protocol of QuantizedCache's own numbers in issue 20).
  - `long`: 4096-token sequences; the first 2048 prefilled in one forward, positions 2048-4095 fed 64 tokens at a
    time and scored (the 2K-4K continuation positions of `kvrewrite eval --positions`).

A row is `[pRATE/]KIND:SPEC`. Without a prefix the model is the original (raw post-RoPE K/V); `pRATE/` loads the
compiled checkpoint (`--checkpoint`) at that rate, so the cache holds its packed latents (p0.0 = the full-rank
rewrite, which equals the original model: "codec alone" on the whitened pre-RoPE latents).
  - `ours:SPEC`     kvrewrite's CodecCache on the original model's raw K/V ([B, H, S, D] packed as [B, 1, S, H*D]).
  - `codec:SPEC`    kvrewrite's CodecCache on a compiled model (needs a prefix); trained codecs (tada, csr) are
                    fitted here on 8 calibration windows with the compile pass's own function, as codec_table.py does.
                    `codec:none` is the plain packed cache.
  - `balanced:SPEC` `codec:SPEC` on the compiled model with its value latents balanced for the codec
                    (kvrewrite.runtime.codecs.value_balance, alpha 0.5; untrained codecs only).
  - `latent:SPEC`   old spelling of `p0.0/codec:SPEC`.
  - `quanto:b,ak,av,gs,res`  transformers' QuantizedCache, optimum-quanto backend: nbits, axis_key, axis_value,
                    q_group_size, residual_length (axis 0 = per token groups of gs channels, -1 = per channel groups
                    of gs tokens; KIVI's axes are keys -1, values 0). On a compiled model it quantizes the packed
                    latents, exactly as it would a model's K/V.

Bytes per token: every tensor the cache holds at the end of a sequence (quanto's tensor subclasses unpacked into
their packed data, scales and shifts), divided by the sequence length (512, 1024 or 4096); `fp16 share` counts
float tensors at 2 bytes per element (what a float16 deployment stores: our residual window is float16 already,
quanto keeps the model's float32 residual and float32 scales) against the float16 cache, 23,040 bytes/token.

optimum-quanto is not a project dependency; install it beside the venv and put it on the path:
  pip install --target /tmp/quanto-site optimum-quanto==0.2.7 --no-deps
  PYTHONPATH=/tmp/quanto-site:. python benchmarks/kivi_faithful.py --rows ablation --eval-tokens 4096
  PYTHONPATH=/tmp/quanto-site:. python benchmarks/kivi_faithful.py --checkpoint CKPT --protocols window,long \
      --rows "p0.5/quanto:2,-1,0,64,128;p0.5/codec:int2:group_size=64,residual=128" --tag table
  python benchmarks/kivi_faithful.py --report
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import platform
import subprocess
import sys
import tempfile
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
    cache.layers = [
        layer_cls(codec, config.residual)
        for codec in build_layer_codecs(config, [[dim] * heads] * num_layers, [[dim] * heads] * num_layers)
    ]
    return cache


def quanto_cache(spec: str) -> Cache:
    from transformers.cache_utils import QuantoQuantizedLayer

    nbits, ak, av, gs, res = (int(x) for x in spec.split(","))
    return Cache(
        layers=[
            QuantoQuantizedLayer(nbits=nbits, axis_key=ak, axis_value=av, q_group_size=gs, residual_length=res)
            for _ in range(30)
        ]
    )


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
            items = (
                value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
            )
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
    else:  # continuation / long: prefill half in one forward, then chunks
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
            target = ids[:, 1:] if protocol == "window" else ids[:, -logits.shape[1] :]
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
    stats = {
        "ppl": float(torch.tensor(nll / n).exp()),
        "kl": kl / n,
        "bytes_held": held / len(windows),
        "bytes_fp16": fp16 / len(windows),
    }
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


SEQ_LEN = {"window": 512, "continuation": 1024, "long": 4096}
FIT_WINDOWS = 8
BALANCE_ALPHA = 0.5


def split_row(spec: str) -> tuple[float | None, str, str]:
    """'p0.5/codec:int2' -> (0.5, 'codec', 'int2'); 'quanto:2,-1,0,64,128' -> (None, 'quanto', '2,-1,0,64,128')."""
    rate = None
    if spec.startswith("p") and "/" in spec:
        prefix, spec = spec.split("/", 1)
        rate = float(prefix[1:])
    kind, _, rest = spec.partition(":")
    if kind == "latent":
        rate, kind = 0.0, "codec"
    return rate, kind, rest


class Models:
    """The original model, compiled views per rate (loaded once), and trained codec tables per (rate, codec)."""

    def __init__(self, original, checkpoint: Path | None):
        self.original, self.checkpoint = original, checkpoint
        self._compiled: dict[object, object] = {}
        self._tables: dict[tuple[float, str], dict] = {}

    def compiled(self, rate: float):
        import kvrewrite

        if self.checkpoint is None:
            raise SystemExit("rows with a pRATE/ prefix need --checkpoint")
        if rate not in self._compiled:
            self._compiled[rate] = kvrewrite.load(self.checkpoint, rate=rate, kv_codec="none")
        return self._compiled[rate]

    def balanced(self, rate: float):
        """The compiled model at this rate with its value latents balanced (codecs.value_balance, alpha 0.5)."""
        import kvrewrite
        from kvrewrite.runtime.codecs.value_balance import balance_value_latents

        if ("balanced", rate) not in self._compiled:
            model = kvrewrite.load(self.checkpoint, rate=rate, kv_codec="none")
            balance_value_latents(model, BALANCE_ALPHA)
            self._compiled[("balanced", rate)] = model
        return self._compiled[("balanced", rate)]

    def tables(self, rate: float, codec: str) -> dict:
        """Tables of a trained codec for this rate, fitted as the compile pass fits them (empty for untrained ones)."""
        from transformers import AutoTokenizer

        from kvrewrite.compile.codec_fitting import fit_codec_tables
        from kvrewrite.io.calibration_data import calibration_token_sequences
        from kvrewrite.runtime.codecs import parse_codec

        config = parse_codec(codec)
        if config is None or not getattr(config.codec_class, "fit_description", None):
            return {}
        if (rate, codec) not in self._tables:
            tokenizer = AutoTokenizer.from_pretrained(self.checkpoint)
            tokens = calibration_token_sequences("wiki", tokenizer, 16384, 512, seed=0)[:FIT_WINDOWS]
            budget = 6.0 if config.name == "tada" else None  # codec_table.py's tada budget
            self._tables[(rate, codec)], _ = fit_codec_tables(config, self.compiled(rate), tokens, budget_bits=budget)
        return self._tables[(rate, codec)]

    def factory(self, spec: str):
        rate, kind, rest = split_row(spec)
        if kind == "fp32":
            return self.original, lambda: DynamicCache(config=self.original.config)
        if kind == "ours":
            return self.original, lambda: ours_cache(rest)
        model = self.original if rate is None else self.compiled(rate)
        if kind == "quanto":
            return model, lambda: quanto_cache(rest)
        if kind == "codec" and rate is not None:
            view = copy.copy(model)  # shares every weight; only the codec differs
            view.set_kv_codec(rest, self.tables(rate, rest))
            return view, view.make_kv_cache
        if kind == "balanced" and rate is not None:  # value latents balanced for the codec (alpha 0.5), own weights
            balanced = self.balanced(rate)
            view = copy.copy(balanced)
            view.set_kv_codec(rest, {})
            return view, view.make_kv_cache
        raise ValueError(f"unknown row {spec!r}")


def git_commit() -> str:
    """The commit of the kvrewrite that is imported (a worktree on PYTHONPATH may differ from this script's)."""
    import kvrewrite

    try:
        return subprocess.check_output(
            ["git", "rev-parse", "HEAD"], cwd=Path(kvrewrite.__file__).parent, text=True
        ).strip()
    except Exception:  # noqa: BLE001
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="ablation", help="'ablation' or ';'-separated label=spec pairs or specs")
    parser.add_argument("--protocols", default="continuation,window")
    parser.add_argument(
        "--eval-tokens", type=int, default=4096, help="tokens per protocol (whole sequences of its length)"
    )
    parser.add_argument("--checkpoint", type=Path)
    parser.add_argument("--tag", default="")
    parser.add_argument("--report", action="store_true")
    args = parser.parse_args()
    if args.report:
        report(json.loads(RESULTS.read_text()))
        return

    from transformers import AutoTokenizer

    from kvrewrite.io.calibration_data import evaluation_token_sequences
    from kvrewrite.io.source_model import load_fp32_model
    from kvrewrite.io.sources import resolve_model_source

    path = resolve_model_source("smollm2-135m").path
    tokenizer = AutoTokenizer.from_pretrained(path)
    original = load_fp32_model(path).eval()
    models = Models(original, args.checkpoint)
    rows = (
        ABLATION
        if args.rows == "ablation"
        else [tuple(r.split("=", 1)) if "=" in r.split(":")[0] else (r, r) for r in args.rows.split(";")]
    )
    for protocol in args.protocols.split(","):
        seq = SEQ_LEN[protocol]
        windows = evaluation_token_sequences(tokenizer, args.eval_tokens, seq)
        base, base_logits = evaluate(original, lambda: DynamicCache(config=original.config), windows, protocol, None)
        print(f"[{protocol}] original fp32 DynamicCache ppl {base['ppl']:.3f}", flush=True)
        for label, spec in rows:
            model, factory = models.factory(spec)
            t0 = time.perf_counter()
            st, _ = evaluate(model, factory, windows, protocol, base_logits)
            row = {
                "label": label,
                "spec": spec,
                "protocol": protocol,
                "tag": args.tag,
                "eval_tokens": int(windows.numel()),
                "seq_len": seq,
                "baseline_ppl": base["ppl"],
                **st,
                "dppl": st["ppl"] / base["ppl"] - 1,
                "fp16_share": st["bytes_fp16"] / FP16_BYTES,
                "seconds": round(time.perf_counter() - t0, 1),
                # each row keeps the invocation that measured it (the file accumulates rows of several runs)
                "command": " ".join(["python", *sys.argv]),
                "commit": git_commit(),
                "date": datetime.datetime.now().isoformat(timespec="seconds"),
            }
            print(
                f"[{protocol}] {label:55s} ppl {st['ppl']:8.3f} ({row['dppl']:+8.1%}) KL {st['kl']:.4f} "
                f"bytes/tok held {st['bytes_held']:7.0f} fp16-equiv {st['bytes_fp16']:7.0f} ({row['fp16_share']:.3f})",
                flush=True,
            )
            save_row(row, args.tag)


def save_row(row: dict, tag: str) -> None:
    """Add one row to the results file under a lock, re-reading it first: several invocations (one per protocol)
    may run at once and append to the same file."""
    import fcntl

    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with open(Path(tempfile.gettempdir()) / "kivi_faithful.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        record = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {"runs": []}
        record["runs"] = [
            r
            for r in record["runs"]
            if not (r["spec"] == row["spec"] and r["protocol"] == row["protocol"] and r.get("tag", "") == tag)
        ]
        record["runs"].append(row)
        record.update(
            command=row["command"],
            commit=row["commit"],
            machine=f"{platform.node()} {platform.machine()}, {torch.get_num_threads()} threads; torch {torch.__version__} CPU",
            date=row["date"],
            fp16_bytes_per_token=FP16_BYTES,
        )
        tmp = RESULTS.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1))
        tmp.replace(RESULTS)


def report(record: dict) -> None:
    print("| protocol | row | cache | ppl | Δppl | KL | bytes/token (fp16-equiv) | share of fp16 |")
    print("|---|---|---|---|---|---|---|---|")
    for r in record["runs"]:
        print(
            f"| {r['protocol']} | {r['label']} | `{r['spec']}` | {r['ppl']:.2f} | {r['dppl']:+.1%} | {r['kl']:.4f} | "
            f"{r['bytes_fp16']:.0f} | {r['fp16_share']:.3f} |"
        )


if __name__ == "__main__":
    main()
