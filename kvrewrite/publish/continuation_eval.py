"""Quality at long context: score tokens at chosen positions with the cache of everything before them.

Independent 512-token windows say nothing about position 3,000. Here every window is fed through each model's own
cache in chunks (chunked prefill, as a serving engine prefills a long prompt), and only the tokens whose positions
fall in the requested ranges are scored, each predicted from the cache of all the tokens before it. The baseline
runs in lockstep on the same chunks, so KL and top-1 agreement compare the two models token by token while only one
chunk of logits per model is alive at a time: memory stays bounded at 8K positions and beyond.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from kvrewrite.errors import InvalidArgumentError
from kvrewrite.publish.evaluation import (
    QualityStats,
    _eval_mode,
    _model_device,
    _progress,
    _validate_tokens,
    new_kv_cache,
)
from kvrewrite.runtime.cache_bytes import cache_tensor_bytes

# Chunk of the chunked prefill when none is asked for: small enough for bounded logits, large enough to be quick.
DEFAULT_CONTINUATION_CHUNK = 512


@dataclass(frozen=True)
class PositionRange:
    """Token positions [start, end) to score; the token at position t is predicted from tokens 0..t-1."""

    start: int
    end: int

    @property
    def label(self) -> str:
        return f"{self.start}-{self.end}"


def parse_positions(text: str) -> tuple[PositionRange, ...]:
    """'512-1024,2048-4096' (K suffixes allowed: '2K-4K') -> ranges, checked: start >= 1, start < end, no overlap."""

    def number(part: str) -> int:
        match = re.fullmatch(r"\s*(\d+)\s*([kK]?)\s*", part)
        if match is None:
            raise InvalidArgumentError(
                f"`positions` {text!r}: {part!r} is not a whole number of tokens (e.g. 2048 or 2K)"
            )
        return int(match.group(1)) * (1024 if match.group(2) else 1)

    ranges = []
    for item in text.split(","):
        bounds = item.split("-")
        if len(bounds) != 2:
            raise InvalidArgumentError(f"`positions` {text!r}: expected ranges like 512-1024,2K-4K, got {item!r}")
        start, end = number(bounds[0]), number(bounds[1])
        if start < 1 or end <= start:
            raise InvalidArgumentError(
                f"`positions` {text!r}: {item!r} must satisfy 1 <= start < end (position 0 has no context to predict it)"
            )
        ranges.append(PositionRange(start, end))
    ranges.sort(key=lambda r: r.start)
    for left, right in zip(ranges, ranges[1:]):
        if right.start < left.end:
            raise InvalidArgumentError(f"`positions` {text!r}: ranges {left.label} and {right.label} overlap")
    return tuple(ranges)


@dataclass(frozen=True)
class ContinuationResult:
    """One model's quality per position range, and the cache bytes per token it held at the end of the windows."""

    by_range: dict[str, QualityStats]
    kv_bytes_per_token: float


class _Sums:
    """Float64 running sums for one model and one range."""

    def __init__(self) -> None:
        self.nll = 0.0
        self.kl = 0.0
        self.agree = 0
        self.count = 0


def continuation_quality(
    models: dict[str, torch.nn.Module],
    windows: torch.Tensor,
    ranges: tuple[PositionRange, ...],
    baseline: torch.nn.Module | None = None,
    *,
    chunk: int | None = None,
    progress: bool = True,
) -> dict[str, ContinuationResult]:
    """Perplexity (and KL/top-1 against `baseline`) of each model on the tokens of each range, every token predicted
    through the model's own cache of all the tokens before it; the baseline's own figures are returned under the
    key "baseline" when one is given.

    windows: [n_windows, length] token ids, length >= the largest range end. Each window starts with a fresh cache.
    chunk: tokens per forward of the chunked prefill (default DEFAULT_CONTINUATION_CHUNK).
    """
    if not models:
        raise InvalidArgumentError("no models to evaluate")
    if not ranges:
        raise InvalidArgumentError("no position ranges to score")
    chunk = DEFAULT_CONTINUATION_CHUNK if chunk is None else chunk
    if chunk < 1:
        raise InvalidArgumentError(f"chunk must be >= 1, got {chunk}")
    _validate_tokens(windows, (*models.values(), baseline))
    length = int(windows.shape[1])
    if ranges[-1].end > length:
        raise InvalidArgumentError(
            f"position range {ranges[-1].label} ends beyond the {length}-token evaluation windows; use windows of at "
            f"least {ranges[-1].end} tokens"
        )
    runners = dict(models)
    if baseline is not None:
        if "baseline" in runners:
            raise InvalidArgumentError("'baseline' is reserved for the baseline model's own figures; rename that model")
        runners["baseline"] = baseline
    sums = {name: {r.label: _Sums() for r in ranges} for name in runners}
    held: dict[str, list[float]] = {name: [] for name in runners}
    last = ranges[-1].end  # nothing after the last scored token needs to be fed
    n_chunks = math.ceil((last - 1) / chunk)
    with torch.inference_mode(), _eval_mode(*runners.values()), _progress(progress) as bar:
        task = bar.add_task("continuation", total=windows.shape[0] * n_chunks)
        for window in windows.long():
            caches = {name: new_kv_cache(model) for name, model in runners.items()}
            # Logits at positions [s, s + chunk) predict the tokens at [s + 1, s + chunk + 1).
            for s in range(0, last - 1, chunk):
                e = min(s + chunk, last - 1)
                logits = {}
                for name, model in runners.items():
                    ids = window[s:e][None].to(_model_device(model))
                    logits[name] = model(input_ids=ids, past_key_values=caches[name], use_cache=True).logits[0]
                for r in ranges:
                    lo, hi = max(r.start - 1, s), min(r.end - 1, e)  # logit positions of this chunk in the range
                    if lo >= hi:
                        continue  # context only: its logits are never normalised
                    targets = window[lo + 1 : hi + 1]
                    logp = {
                        name: torch.log_softmax(out[lo - s : hi - s].float().cpu(), dim=-1)
                        for name, out in logits.items()
                    }
                    ref = logp["baseline"] if baseline is not None else None
                    for name in runners:
                        lp = logp[name]
                        acc = sums[name][r.label]
                        acc.nll -= lp.gather(-1, targets[:, None]).double().sum().item()
                        acc.count += hi - lo
                        if ref is not None and name != "baseline":
                            p = ref.exp()
                            acc.kl += (
                                torch.where(p > 0, p * (ref - lp), torch.zeros_like(p)).sum(-1).double().sum().item()
                            )
                            acc.agree += int((ref.argmax(-1) == lp.argmax(-1)).sum())
                bar.advance(task)
            for name, cache in caches.items():
                held[name].append(cache_tensor_bytes(cache) / (last - 1))
    results = {}
    for name in runners:
        by_range = {}
        for r in ranges:
            acc, base = sums[name][r.label], sums["baseline"][r.label] if baseline is not None else None
            compared = base is not None and name != "baseline"
            by_range[r.label] = QualityStats(
                perplexity=math.exp(acc.nll / acc.count),
                baseline_perplexity=math.exp(base.nll / base.count) if base is not None else None,
                kl_mean=acc.kl / acc.count if compared else None,
                top1_agreement=acc.agree / acc.count if compared else None,
                n_tokens=acc.count,
            )
        results[name] = ContinuationResult(by_range, sum(held[name]) / len(held[name]))
    return results
