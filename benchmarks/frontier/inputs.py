"""The shared inputs: held-out wiki windows and passkey prompts, built once and saved as token ids.

Built in the project env (it needs kvrewrite.io.calibration_data); every process then reads the same ids from the
saved file, so peers run in the benchmark env score exactly the tokens kvrewrite methods score.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

# (context, continuation) token counts of the two continuation regimes.
REGIMES: dict[str, tuple[int, int]] = {"512-1K": (512, 512), "2K-4K": (2048, 2048)}

# The classic filler of the passkey test (Mohtashami & Jaggi 2023, LongLoRA).
CLASSIC_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


@dataclass(frozen=True)
class PasskeyPrompt:
    length: int  # target prompt length in tokens
    depth: float  # where the key line sits, as a fraction of the filler
    key: str
    context_ids: list[int]  # intro + filler with the key line (prefilled like a context)
    question_ids: list[int]  # the question, fed after the context
    variant: str = "single"  # "single": one key; "multi": four labelled keys planted, the one at `depth` asked


def wiki_windows(tokenizer: Any, n_windows: int, length: int) -> torch.LongTensor:
    """``n_windows`` windows of ``length`` tokens from the held-out wiki articles.

    The held-out articles are tokenized and concatenated in dump order with EOS between articles (the project's
    evaluation stream), so a window longer than one article spans consecutive articles; windows are spread evenly
    over the stream (kvrewrite.io.calibration_data.evaluation_token_sequences).
    """
    from kvrewrite.io.calibration_data import evaluation_token_sequences

    return evaluation_token_sequences(tokenizer, n_windows * length, length)


def _wiki_sentences() -> list[str]:
    from kvrewrite.io.calibration_data.wiki import wiki_split

    text = " ".join(a.text.replace("\n", " ") for a in wiki_split()[1])
    return [s.strip() + "." for s in text.split(". ") if 40 < len(s) < 300]


def passkey_prompts(
    tokenizer: Any,
    lengths: list[int],
    depths: list[float],
    n_keys: int,
    seed: int,
    filler: str,
    variant: str = "single",
) -> list[PasskeyPrompt]:
    """One prompt per (length, depth, key); keys are random 5-digit numbers from a fixed seed.

    variant "multi": one key per label of key_probes.LABELS, the asked one at `depth` and the others at depths
    spread over the filler away from it; the question names the asked colour. The lines, question and intro are
    the budget search's (kvrewrite.compile.key_probes), so both measure the same test."""
    from kvrewrite.compile.key_probes import INTRO, LABELS, key_line, key_question

    rng = random.Random(seed)
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    sentences = _wiki_sentences() if filler == "wiki" else None
    prompts = []
    for length in lengths:
        for depth in depths:
            for _ in range(n_keys):
                key = str(rng.randrange(10000, 100000))
                planted = [(depth, key_line(key))]
                asked = None
                if variant == "multi":
                    colours = list(LABELS)
                    rng.shuffle(colours)
                    asked = colours[0]
                    others = [d for d in (0.05, 0.3, 0.55, 0.8, 0.95) if abs(d - depth) > 0.12][: len(colours) - 1]
                    planted = [(depth, key_line(key, asked))] + [
                        (d, key_line(str(rng.randrange(10000, 100000)), c)) for d, c in zip(others, colours[1:])
                    ]
                question = enc(key_question(asked))
                fixed = len(enc(INTRO)) + sum(len(enc(n)) for _, n in planted) + len(question)
                budget = length - fixed
                if sentences is None:
                    pieces = [CLASSIC_FILLER] * (budget // len(enc(CLASSIC_FILLER)) + 1)
                else:
                    start = rng.randrange(len(sentences))
                    pieces = [sentences[(start + i) % len(sentences)] + " " for i in range(budget // 4 + 50)]
                # Whole filler pieces up to the budget, then cut to exactly the budget: every prompt is exactly
                # ``length`` tokens (a multiple of 64, which quanto's per-channel groups of 64 tokens need).
                filler_ids: list[int] = []
                bounds = [0]
                for piece in pieces:
                    if len(filler_ids) >= budget:
                        break
                    filler_ids.extend(enc(piece))
                    bounds.append(len(filler_ids))
                filler_ids = filler_ids[:budget]
                # Each key line goes at a piece boundary near its depth.
                cuts = sorted((min(bounds, key=lambda b, d=d: abs(b - d * budget)), n) for d, n in planted)
                context, start = enc(INTRO), 0
                for cut, needle in cuts:
                    context += filler_ids[start:cut] + enc(needle)
                    start = cut
                context += filler_ids[start:]
                prompts.append(PasskeyPrompt(length, depth, key, context, question, variant))
    return prompts


def save_inputs(path: Path, windows: dict[str, torch.Tensor], prompts: list[PasskeyPrompt], meta: dict) -> None:
    tensors = {f"window/{name}": w.to(torch.int32).contiguous() for name, w in windows.items()}
    for i, p in enumerate(prompts):
        tensors[f"passkey/{i}/context"] = torch.tensor(p.context_ids, dtype=torch.int32)
        tensors[f"passkey/{i}/question"] = torch.tensor(p.question_ids, dtype=torch.int32)
    info = [{"length": p.length, "depth": p.depth, "key": p.key, "variant": p.variant} for p in prompts]
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"meta": json.dumps(meta), "passkey": json.dumps(info)})


def load_inputs(path: Path) -> tuple[dict[str, torch.Tensor], list[PasskeyPrompt], dict]:
    with safe_open(str(path), framework="pt") as f:
        header = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    windows = {k.split("/", 1)[1]: v.long() for k, v in tensors.items() if k.startswith("window/")}
    prompts = [
        PasskeyPrompt(
            d["length"],
            d["depth"],
            d["key"],
            tensors[f"passkey/{i}/context"].tolist(),
            tensors[f"passkey/{i}/question"].tolist(),
            d.get("variant", "single"),
        )
        for i, d in enumerate(json.loads(header["passkey"]))
    ]
    return windows, prompts, json.loads(header["meta"])
