"""Synthetic calibration text from the static-cache batched decoder: the same tokens as transformers' own
generate() running one text at a time, texts independent of the batch size, and a sampler that draws from the
distribution it claims."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvrewrite.io.calibration_data import static_decoding
from kvrewrite.io.calibration_data.static_decoding import (
    SamplingSettings,
    decode_batch,
    sample_next_tokens,
    text_uniforms,
)
from kvrewrite.io.calibration_data.synthetic import DEFAULT_SETTINGS, _prompt_ids, seed_prompts, synthetic_texts

SAMPLING = SamplingSettings(
    DEFAULT_SETTINGS.temperature, DEFAULT_SETTINGS.top_p, DEFAULT_SETTINGS.top_k, DEFAULT_SETTINGS.repetition_penalty
)


@pytest.fixture(scope="module")
def smollm2_tokenizer() -> Any:
    from transformers import AutoTokenizer

    from kvrewrite.io.sources import bundled_smollm2_path

    return AutoTokenizer.from_pretrained(bundled_smollm2_path())


def _tiny_llama(dtype: torch.dtype) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    return LlamaForCausalLM(config).eval().to(dtype)


def _generate_alone(model: Any, prompt: list[int], text_id: int, seed: int, max_new: int, eos: int) -> list[int]:
    """The reference: transformers' generate() on one unpadded prompt with its dynamic cache and its own
    repetition penalty; only the draw from the penalised logits is ours (the definition of the text)."""
    from transformers import GenerationConfig, LogitsProcessor

    class Draw(LogitsProcessor):
        def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
            step = torch.tensor([input_ids.shape[1] - len(prompt)])
            token = sample_next_tokens(scores, SAMPLING, seed, torch.tensor([text_id]), step)
            return torch.full_like(scores, float("-inf")).scatter_(-1, token[:, None], 0.0)

    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new,
        repetition_penalty=SAMPLING.repetition_penalty,
        pad_token_id=eos,
        eos_token_id=[eos],
    )
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config, logits_processor=[Draw()]
        )
    row = out[0, len(prompt) :].tolist()
    return row[: row.index(eos)] if eos in row else row


@pytest.mark.real_model
def test_batched_static_cache_decoding_matches_generate_one_text_at_a_time(
    smollm2_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # float64 so that padding and batching cannot flip a draw through rounding: the comparison is token for token.
    model = _tiny_llama(torch.float64)
    prompts = [_prompt_ids(smollm2_tokenizer, p) for p in seed_prompts()[:5]]
    assert len({len(p) for p in prompts}) > 1, "left padding must be exercised"
    text_ids, seed, max_new = [7, 8, 9, 10, 11], 5, 24
    # An end-of-sequence token that text 9 produces halfway, so one row stops early while the others go on.
    free_run = _generate_alone(model, prompts[2], 9, seed, max_new, eos=-1 % 49152)
    eos = free_run[max_new // 2]
    first = free_run.index(eos)
    reference = [_generate_alone(model, p, t, seed, max_new, eos) for p, t in zip(prompts, text_ids, strict=True)]
    assert len(reference[2]) == first < max_new

    compactions = _count_calls(monkeypatch, static_decoding, "_keep_rows")
    with torch.inference_mode():
        batched = decode_batch(
            model, prompts, text_ids, seed=seed, settings=SAMPLING, max_new_tokens=max_new, eos_ids=[eos], pad_id=0
        )
    assert compactions, "the row that ended must have left the batch"
    assert [row.tokens for row in batched] == reference
    assert [row.ended for row in batched] == [len(r) < max_new for r in reference]
    # The same texts in another order and batch: each row depends on its own text id only.
    with torch.inference_mode():
        alone = decode_batch(
            model,
            prompts[3:4],
            text_ids[3:4],
            seed=seed,
            settings=SAMPLING,
            max_new_tokens=max_new,
            eos_ids=[eos],
            pad_id=0,
        )
    assert alone[0].tokens == reference[3]


def _count_calls(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[int]:
    """Wraps ``module.name`` so that each call appends to the returned list (the function still runs)."""
    calls: list[int] = []
    real = getattr(module, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


@pytest.mark.real_model
def test_rows_past_the_wanted_tokens_stop_once_the_rows_before_them_have_ended(smollm2_tokenizer: Any) -> None:
    model = _tiny_llama(torch.float64)
    prompts = [_prompt_ids(smollm2_tokenizer, p) for p in seed_prompts()[:3]]
    seed, max_new = 5, 24
    free_run = _generate_alone(model, prompts[0], 7, seed, max_new, eos=-1 % 49152)
    eos = free_run[max_new // 3]
    first = free_run.index(eos)  # text 7 ends here; texts 8 and 9 would go on
    reference = [_generate_alone(model, p, t, seed, max_new, eos) for p, t in zip(prompts, [7, 8, 9], strict=True)]
    assert len(reference[0]) == first and min(len(r) for r in reference[1:]) > first

    def run(wanted: int) -> tuple[list[Any], int]:
        steps: list[int] = []
        with torch.inference_mode():
            rows = decode_batch(
                model,
                prompts,
                [7, 8, 9],
                seed=seed,
                settings=SAMPLING,
                max_new_tokens=max_new,
                eos_ids=[eos],
                pad_id=0,
                on_step=steps.append,
                kept_tokens=len,
                tokens_wanted=wanted,
            )
        return rows, len(steps)

    # Text 7 alone holds the tokens wanted: the other rows stop when it ends, and only it is returned.
    rows, steps = run(first)
    assert [row.tokens for row in rows] == reference[:1] and rows[0].ended
    assert steps == first + 1
    # One token more than text 7 holds: every row is needed, and each is what it would be alone.
    rows, steps = run(first + 1)
    assert [row.tokens for row in rows] == reference
    assert steps == max(len(r) + 1 if len(r) < max_new else max_new for r in reference)


@pytest.mark.real_model
def test_synthetic_texts_do_not_depend_on_the_batch_size(
    smollm2_tokenizer: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    model = _tiny_llama(torch.float64)
    monkeypatch.setenv("KVREWRITE_CACHE", str(tmp_path / "a"))
    wide = synthetic_texts(model, smollm2_tokenizer, 600, seed=2, batch_size=64)
    monkeypatch.setenv("KVREWRITE_CACHE", str(tmp_path / "b"))
    narrow = synthetic_texts(model, smollm2_tokenizer, 600, seed=2, batch_size=2)
    assert narrow == wide and len(wide) >= 3


@pytest.mark.real_model
def test_the_generation_dtype_is_part_of_the_cache_key(
    smollm2_tokenizer: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("KVREWRITE_CACHE", str(tmp_path))
    synthetic_texts(_tiny_llama(torch.float32), smollm2_tokenizer, 200, seed=0)
    synthetic_texts(_tiny_llama(torch.bfloat16), smollm2_tokenizer, 200, seed=0)
    assert len(list((tmp_path / "calibration").glob("synthetic-*.json"))) == 2


def test_uniforms_are_uniform_and_keyed_by_seed_text_and_step() -> None:
    ids = torch.arange(4000)
    u = text_uniforms(3, ids, torch.zeros_like(ids), 50)
    assert u.shape == (4000, 50) and 0 < float(u.min()) and float(u.max()) < 1
    # Deciles of 200,000 draws: each holds 10% within 5 standard deviations (0.07%).
    counts = torch.histc(u.float(), bins=10, min=0.0, max=1.0) / u.numel()
    assert torch.allclose(counts, torch.full((10,), 0.1), atol=0.0035)
    # Neighbouring columns, rows and steps are uncorrelated.
    centred = u - 0.5
    for a, b in (
        (centred[:, 1:], centred[:, :-1]),
        (centred[1:], centred[:-1]),
        (centred, text_uniforms(3, ids, torch.ones_like(ids), 50) - 0.5),
    ):
        assert abs(float((a * b).mean()) / float((a * a).mean())) < 0.02
    assert not torch.equal(u, text_uniforms(4, ids, torch.zeros_like(ids), 50))
    # One row's numbers do not depend on the rows beside it.
    assert torch.equal(text_uniforms(3, ids[17:18], torch.zeros(1, dtype=torch.long), 50), u[17:18])


def test_the_draw_follows_the_nucleus_distribution() -> None:
    # Five candidates; temperature 0.8 and top_p 0.95 as by default. The reference is computed here densely.
    logits = torch.tensor([2.0, 1.5, 1.0, 0.0, -3.0])
    probs = torch.softmax(logits / SAMPLING.temperature, -1)
    keep = (probs.cumsum(-1) - probs) <= SAMPLING.top_p
    expected = torch.where(keep, probs, torch.zeros_like(probs))
    expected = expected / expected.sum()
    n = 40_000
    tokens = sample_next_tokens(logits.expand(n, -1), SAMPLING, 11, torch.arange(n), torch.full((n,), 3))
    frequencies = torch.bincount(tokens, minlength=5).double() / n
    sigma = (expected * (1 - expected) / n).sqrt()
    assert bool(((frequencies - expected).abs() <= 5 * sigma + 1e-12).all()), (frequencies, expected)
    assert expected[-1] == 0 and frequencies[-1] == 0  # outside the nucleus: never drawn


def test_the_shared_prefix_leaves_every_prompt_a_token_of_its_own() -> None:
    from kvrewrite.io.calibration_data.static_decoding import _shared_prefix_length

    assert _shared_prefix_length([[5, 6, 7, 8], [5, 6, 9]]) == 2
    assert _shared_prefix_length([[5, 6, 7], [5, 6, 7]]) == 2  # identical prompts: the last token is prefilled per row
    assert _shared_prefix_length([[5, 6, 7]]) == 2
    assert _shared_prefix_length([[5], [5, 6]]) == 0
    assert _shared_prefix_length([[4, 6], [5, 6]]) == 0
