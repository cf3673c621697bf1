"""Runs methods over the saved inputs and returns their results as plain dicts (one process, one env)."""

from __future__ import annotations

import gc
import time
from typing import Any

import torch

from .cache_bytes import fp16_bytes_per_token
from .inputs import REGIMES, PasskeyPrompt
from .methods import Method
from .protocols import continuation_window, passkey, passkey_correct, perplexity


def _work(protocols: list[str], windows: dict[str, torch.Tensor], prompts: list[PasskeyPrompt]) -> int:
    """Tokens one method processes, for the progress bar."""
    total = sum(int(w.numel()) for r, w in windows.items() if "continuation" in protocols)
    return total + (sum(len(p.context_ids) + len(p.question_ids) for p in prompts) if "passkey" in protocols else 0)


def run_method(
    method: Method,
    model: Any,
    tokenizer: Any,
    protocols: list[str],
    windows: dict[str, torch.Tensor],
    prompts: list[PasskeyPrompt],
    chunk: int,
    advance: Any,
) -> dict[str, Any]:
    per_token_fp16 = fp16_bytes_per_token(model.config)
    result: dict[str, Any] = {
        "name": method.name,
        "family": method.family,
        "settings": method.settings,
        "prefill_chunk": method.prefill_chunk,
        "nominal_share": method.nominal_share,
    }
    started = time.perf_counter()
    if "continuation" in protocols:
        result["continuation"] = {}
        for regime, rows in windows.items():
            n_ctx = REGIMES[regime][0]
            scores = []
            for row in rows:
                scores.append(continuation_window(model, method, row, n_ctx, chunk))
                advance(int(row.numel()))
            shares = [s.bytes_held / s.tokens / per_token_fp16 for s in scores]
            result["continuation"][regime] = {
                "ppl": perplexity(scores),
                "n_windows": len(scores),
                "n_scored": sum(s.n_scored for s in scores),
                "bytes_share": sum(shares) / len(shares),
                "window_nll": [s.nll_sum / s.n_scored for s in scores],
            }
    if "passkey" in protocols:
        items, shares = [], []
        for p in prompts:
            answer, held, fed = passkey(model, tokenizer, method, p)
            ok = passkey_correct(answer, p.key)
            items.append(
                {
                    "length": p.length,
                    "depth": p.depth,
                    "key": p.key,
                    "variant": p.variant,
                    "answer": answer,
                    "correct": ok,
                }
            )
            shares.append(held / fed / per_token_fp16)
            advance(len(p.context_ids) + len(p.question_ids))
        result["passkey"] = {
            "accuracy": sum(i["correct"] for i in items) / len(items),
            "n": len(items),
            "bytes_share": sum(shares) / len(shares),
            "items": items,
        }
    result["seconds"] = time.perf_counter() - started
    return result


def add_deltas(results: list[dict[str, Any]]) -> None:
    """Δppl% of each method against the original run in the same process on the same windows."""
    reference = next(r for r in results if r["family"] == "original")
    for r in results:
        for regime, c in r.get("continuation", {}).items():
            base = reference["continuation"][regime]["ppl"]
            c["delta_ppl_pct"] = 100.0 * (c["ppl"] / base - 1.0)


def add_retrieval_summary(results: list[dict[str, Any]]) -> None:
    """Per method: passkey accuracy per prompt length and variant ("1024", "2048/multi", ...), and its accuracy as a
    share of the original's on the same prompts (`of_original`)."""
    reference = next((r for r in results if r["family"] == "original" and "passkey" in r), None)
    prompt = lambda i: (i["length"], i["depth"], i["key"], i.get("variant", "single"))  # noqa: E731
    original = {prompt(i): i["correct"] for i in reference["passkey"]["items"]} if reference else {}
    for r in results:
        pk = r.get("passkey")
        if pk is None:
            continue
        groups: dict[str, list[bool]] = {}
        for item in pk["items"]:
            variant = item.get("variant", "single")
            groups.setdefault(str(item["length"]) + ("" if variant == "single" else f"/{variant}"), []).append(
                item["correct"]
            )
        pk["by_length"] = {k: sum(v) / len(v) for k, v in sorted(groups.items())}
        # Against the original on the same prompts (a method may have run on a subset of them).
        same = [original[prompt(i)] for i in pk["items"] if prompt(i) in original]
        base = sum(same) / len(same) if len(same) == len(pk["items"]) else None
        pk["of_original"] = pk["accuracy"] / base if base else None


def free(model: Any) -> None:
    del model
    gc.collect()
