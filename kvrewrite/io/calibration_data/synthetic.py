"""Synthetic calibration text: prose the model writes itself from a fixed set of diverse seed prompts.

Calibrating on the model's own output needs no dataset and matches the distribution the model will actually see
at inference. Generation runs on the model's device, in its dtype, many texts per forward with a static KV cache
(static_decoding.py; on a CPU the linear layers read oneDNN-packed weights, and a bfloat16 model's products run in
float32 where the CPU has no bfloat16 instructions: packed_linears.py). Each text is seeded on its own, so the batch
size changes the speed, never the text. The texts are cached as JSON under ``cache_dir()/calibration/`` keyed by a
fingerprint of the model, the dtype it generated in (and the linears' products where they are not torch's own), the
tokenizer, seed, size, prompts and sampling settings.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
import time
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from rich.progress import ProgressColumn
from rich.text import Text

from kvrewrite.errors import CalibrationError, InvalidArgumentError
from kvrewrite.io.atomic_files import atomic_write_text
from kvrewrite.io.calibration_data.packed_linears import PackingPlan, choose_packing, packed_cpu_linears
from kvrewrite.io.calibration_data.static_decoding import SamplingSettings, decode_batch
from kvrewrite.io.sources import cache_dir

__all__ = ["GenerationSettings", "DEFAULT_SETTINGS", "seed_prompts", "synthetic_texts", "synthetic_cache_path"]

# 2: texts sampled per text (random numbers keyed by seed, text and step; the batch size left the key) by the
# static-cache decoder on the compile device, and the generation dtype in the key. Format-1 files (transformers'
# generate, one RNG stream per batch) are not reused: their texts differ.
_CACHE_FORMAT = 2
_PROMPT_FILE = "seed_prompts.txt"


@dataclass(frozen=True)
class GenerationSettings:
    """Sampling settings; all of them are part of the cache fingerprint (the batch size is not: it changes no text)."""

    temperature: float = 0.8
    top_p: float = 0.95
    # The nucleus is searched inside the top-k candidates only: sorting the full vocabulary (49K for SmolLM2) for
    # top-p at every step would cost as much as the forward pass of a 135M model on CPU.
    top_k: int = 50
    # A mild penalty keeps a 135M model from looping on one sentence.
    repetition_penalty: float = 1.1
    max_new_tokens: int = 256


DEFAULT_SETTINGS = GenerationSettings()


def _prompt_bytes() -> bytes:
    return resources.files("kvrewrite.io.calibration_data").joinpath(_PROMPT_FILE).read_bytes()


def seed_prompts() -> list[str]:
    """The seed prompts shipped with kvrewrite, one per non-empty line of ``seed_prompts.txt``."""
    lines = _prompt_bytes().decode("utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


# ---------------------------------------------------------------------------------------------------------------------
# Fingerprint and cache
# ---------------------------------------------------------------------------------------------------------------------


def _tensor_sample_bytes(tensor: torch.Tensor, max_elems: int = 65536) -> bytes:
    """A strided sample spanning the whole tensor: cheap even for an 8B model's embedding, yet changes if weights do."""
    flat = tensor.detach().reshape(-1)
    step = max(1, flat.numel() // max_elems)
    return flat[::step][:max_elems].to(device="cpu", dtype=torch.float32).contiguous().numpy().tobytes()


def _model_fingerprint(model: Any) -> str:
    h = hashlib.sha256()
    config = model.config.to_dict() if hasattr(model, "config") else {}
    # Paths and library versions say nothing about the weights; leaving them out keeps the cache valid when a
    # checkpoint is moved or transformers is upgraded.
    config = {k: v for k, v in config.items() if not k.startswith("_") and k != "transformers_version"}
    h.update(json.dumps(config, sort_keys=True, default=str).encode())
    params = list(model.named_parameters())
    if params:
        picks = {0, len(params) // 2, len(params) - 1}
        for i in sorted(picks):
            name, tensor = params[i]
            h.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
            try:
                h.update(_tensor_sample_bytes(tensor))
            except (RuntimeError, NotImplementedError):  # meta / offloaded tensors: shapes only
                pass
    return h.hexdigest()


def _tokenizer_fingerprint(tokenizer: Any) -> str:
    h = hashlib.sha256()
    h.update(f"{type(tokenizer).__name__}:{len(tokenizer)}:{tokenizer.eos_token_id}".encode())
    h.update((getattr(tokenizer, "chat_template", None) or "").encode())
    probe = "Calibration fingerprint probe: 12 apples, naïve café, def f(x): return x**2\n"
    h.update(json.dumps(tokenizer(probe, add_special_tokens=False)["input_ids"]).encode())
    return h.hexdigest()


def _fingerprint(
    model: Any, tokenizer: Any, n_tokens: int, seed: int, settings: GenerationSettings, linears: str | None = None
) -> str:
    parts = {
        "format": _CACHE_FORMAT,
        "model": _model_fingerprint(model),
        "dtype": str(next(model.parameters()).dtype),  # bf16 logits sample other tokens than fp32 ones
        "tokenizer": _tokenizer_fingerprint(tokenizer),
        "n_tokens": n_tokens,
        "seed": seed,
        "prompts": hashlib.sha256(_prompt_bytes()).hexdigest(),
        "settings": asdict(settings),
    }
    if linears is not None:  # products other than torch's own (packed_linears.PackingPlan.arithmetic)
        parts["linears"] = linears
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def synthetic_cache_path(fingerprint: str) -> Path:
    return cache_dir() / "calibration" / f"synthetic-{fingerprint[:32]}.json"


def _read_cache(path: Path, fingerprint: str) -> list[str] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    texts = data.get("texts") if isinstance(data, dict) else None
    if data.get("fingerprint") != fingerprint or not isinstance(texts, list):
        return None
    if not all(isinstance(t, str) for t in texts):
        return None
    return texts


# ---------------------------------------------------------------------------------------------------------------------
# Generation
# ---------------------------------------------------------------------------------------------------------------------


def _count_tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _prompt_ids(tokenizer: Any, prompt: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        chat = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        return tokenizer(chat, add_special_tokens=False)["input_ids"]
    # Base models: the prompt as plain text, then a paragraph break for the continuation.
    return tokenizer(prompt + "\n\n", add_special_tokens=True)["input_ids"]


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    ids: set[int] = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (gen_eos, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return sorted(ids)


_SENTENCE_END_RE = re.compile(r"[.!?][\"')\]]*(?=\s|$)")


def _trim_unfinished(text: str) -> str:
    """Drop a sentence cut off by max_new_tokens, unless that would throw away more than a third of the text."""
    text = re.sub(r"\n\s*(?:\d+[.)]|[-*])?\s*$", "", text)  # a dangling "10." or "-" list item
    ends = [m.end() for m in _SENTENCE_END_RE.finditer(text)]
    if ends and ends[-1] >= 2 * len(text) / 3:
        return text[: ends[-1]]
    return text


class _TokensPerSecond(ProgressColumn):
    """Generated tokens per second (every row still generating counts, whether or not its text is kept)."""

    def render(self, task: Any) -> Text:
        speed = task.fields.get("tokens_per_s")
        return Text(f"{speed:,.0f} tokens/s" if speed else "... tokens/s")


def _default_batch_size(device: torch.device) -> int:
    # Many rows per forward is what makes generation fast; a GPU has the memory for four times a CPU's rows (an
    # 8B model's static cache for 256 rows x ~320 positions is ~11 GB in bf16).
    return 256 if device.type == "cuda" else 64


def _row_text(tokenizer: Any, tokens: list[int], ended: bool) -> str:
    """The text one generated row contributes (a sentence cut off by max_new_tokens trimmed)."""
    text = tokenizer.decode(tokens, skip_special_tokens=True).strip()
    return text if ended else _trim_unfinished(text)


def _kept_count(tokenizer: Any, tokens: list[int]) -> int:
    """How many tokens the text of a row that ended with these tokens adds to the total."""
    text = _row_text(tokenizer, tokens, ended=True)
    return _count_tokens(tokenizer, text) if text else 0


def _generate(
    model: Any,
    tokenizer: Any,
    n_tokens: int,
    seed: int,
    settings: GenerationSettings,
    batch_size: int | None = None,
    packing: PackingPlan | None = None,
) -> list[str]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    prompts = seed_prompts()
    if not prompts:
        raise CalibrationError("seed_prompts.txt is empty; reinstall kvrewrite.")
    order = list(range(len(prompts)))
    random.Random(seed).shuffle(order)  # the seed also decides which prompts come first

    eos_ids = _eos_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        pad_id = eos_ids[0] if eos_ids else 0
    device = next(model.parameters()).device
    rows_per_batch = batch_size or _default_batch_size(device)
    sampling = SamplingSettings(settings.temperature, settings.top_p, settings.top_k, settings.repetition_penalty)

    texts: list[str] = []
    total = 0
    next_text = 0  # text i is written from prompt order[i % len(prompts)] with random numbers keyed by (seed, i)
    tokens_per_text = settings.max_new_tokens * 0.9  # refined with the real average after the first batch
    empty_batches = 0
    generated = 0
    was_training = getattr(model, "training", False)
    model.eval()
    progress = Progress(
        TextColumn("[bold]synthetic calibration text"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("tokens"),
        _TokensPerSecond(),
        TimeElapsedColumn(),
        transient=True,
    )
    start = time.perf_counter()
    try:
        with progress, packed_cpu_linears(model, rows_per_batch, packing), torch.inference_mode():
            task = progress.add_task("generate", total=n_tokens, tokens_per_s=0.0)

            def on_step(live_rows: int) -> None:
                nonlocal generated
                generated += live_rows
                progress.update(task, tokens_per_s=generated / max(time.perf_counter() - start, 1e-9))

            while total < n_tokens:
                # Size the last batches to what is still missing: texts past the target are dropped. Only the
                # speed depends on this; every text is the same in any batch.
                # 15% spare rows: a batch that falls short costs another batch of max_new_tokens steps, each of
                # which reads every weight however few rows it runs.
                wanted = math.ceil((n_tokens - total) / max(tokens_per_text, 1.0) * 1.15)
                rows = max(1, min(rows_per_batch, wanted))
                text_ids = list(range(next_text, next_text + rows))
                next_text += rows
                batch = [_prompt_ids(tokenizer, prompts[order[i % len(order)]]) for i in text_ids]
                decoded = decode_batch(
                    model,
                    batch,
                    text_ids,
                    seed=seed,
                    settings=sampling,
                    max_new_tokens=settings.max_new_tokens,
                    eos_ids=eos_ids,
                    pad_id=pad_id,
                    on_step=on_step,
                    kept_tokens=lambda tokens: _kept_count(tokenizer, tokens),
                    tokens_wanted=n_tokens - total,
                )
                batch_tokens = 0
                for row in decoded:
                    text = _row_text(tokenizer, row.tokens, row.ended)
                    if not text:
                        continue
                    count = _count_tokens(tokenizer, text)
                    batch_tokens += count
                    if total < n_tokens:  # texts past the target are dropped, so the output is ~n_tokens
                        texts.append(text)
                        total += count
                tokens_per_text = max(batch_tokens / rows, 8.0)
                progress.update(task, completed=min(total, n_tokens))
                empty_batches = empty_batches + 1 if batch_tokens == 0 else 0
                if empty_batches >= 3:
                    raise CalibrationError(
                        "The model produced no text for synthetic calibration in three batches (it ends every "
                        "answer immediately). Use `calibration=wiki` or a text file instead."
                    )
    finally:
        if was_training:
            model.train()
    return texts


def synthetic_texts(
    model: Any,
    tokenizer: Any,
    n_tokens: int,
    *,
    seed: int = 0,
    settings: GenerationSettings = DEFAULT_SETTINGS,
    batch_size: int | None = None,
) -> list[str]:
    """Texts generated by ``model`` from the shipped seed prompts, holding at least ``n_tokens`` tokens in total.

    Tokens are counted by re-tokenizing each text with ``tokenizer`` (no special tokens); generation stops as soon
    as the total reaches ``n_tokens``, so it overshoots by less than one text. The result is cached on disk and
    reused on later calls with the same model (and dtype), tokenizer, ``n_tokens``, ``seed``, prompts and settings.
    Generation runs where the model is, in its dtype; ``batch_size`` texts per forward (default 64 on a CPU, 256
    on a GPU) changes the speed and memory only.
    """
    if model is None:
        raise InvalidArgumentError(
            "Synthetic calibration text is generated by the model itself, so a model is needed: pass model=..., "
            "or use the 'wiki' source or a text file."
        )
    if not isinstance(n_tokens, int) or n_tokens <= 0:
        raise InvalidArgumentError(f"n_tokens must be a positive integer, got {n_tokens!r}.")

    packing = choose_packing(model)
    fingerprint = _fingerprint(model, tokenizer, n_tokens, seed, settings, packing.arithmetic)
    path = synthetic_cache_path(fingerprint)
    cached = _read_cache(path, fingerprint)
    if cached is not None:
        return cached

    start = time.perf_counter()
    texts = _generate(model, tokenizer, n_tokens, seed, settings, batch_size, packing)
    payload = {
        "format": _CACHE_FORMAT,
        "fingerprint": fingerprint,
        "n_tokens": n_tokens,
        "seed": seed,
        "settings": asdict(settings),
        "token_count": sum(_count_tokens(tokenizer, t) for t in texts),
        "seconds": round(time.perf_counter() - start, 1),
        "texts": texts,
    }
    atomic_write_text(path, json.dumps(payload, ensure_ascii=False, indent=1))
    return texts
