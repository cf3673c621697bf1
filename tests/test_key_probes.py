"""Planted-key probes (kvrewrite.compile.key_probes): the prompts hold what they claim, and the recall measure equals
one dense forward over the whole probe."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tiny_models import VOCAB, tiny_llama_config
from transformers import DynamicCache, LlamaForCausalLM

from kvrewrite.compile.key_probes import ASKED_DEPTHS, LABELS, KeyProbe, key_probes, key_recall
from kvrewrite.errors import InvalidArgumentError


@pytest.fixture(scope="module")
def smollm2_tokenizer() -> Any:
    from transformers import AutoTokenizer

    from kvrewrite.io.sources import bundled_smollm2_path

    return AutoTokenizer.from_pretrained(bundled_smollm2_path())


def _windows(tokenizer: Any, n: int, length: int) -> torch.Tensor:
    text = " ".join(f"Sentence number {i} says nothing in particular about the weather." for i in range(400))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return torch.tensor([ids[i * length : (i + 1) * length] for i in range(n)])


def test_each_probe_plants_four_labelled_keys_and_asks_one(smollm2_tokenizer):
    windows = _windows(smollm2_tokenizer, 5, 512)
    probes = key_probes(smollm2_tokenizer, windows, seed=3)
    assert len(probes) == 5
    asked_keys = set()
    for i, probe in enumerate(probes):
        assert len(probe.context_ids) + len(probe.question_ids) == 512
        context = smollm2_tokenizer.decode(list(probe.context_ids))
        question = smollm2_tokenizer.decode(list(probe.question_ids))
        answer = smollm2_tokenizer.decode(list(probe.answer_ids))
        lines = re.findall(r"The (\w+) pass key is (\d{5})\. Remember it\. (\d{5}) is the (\w+) pass key\.", context)
        assert sorted(label for label, *_ in lines) == sorted(LABELS)
        assert all(first == second and label == again for label, first, second, again in lines)
        asked = re.search(r"What is the (\w+) pass key\? The \1 pass key is$", question).group(1)
        assert answer == " " + dict((label, key) for label, key, *_ in lines)[asked]
        assert probe.depth == ASKED_DEPTHS[i % len(ASKED_DEPTHS)]
        # The asked line sits at its depth of the filler (within a key line's length).
        where = context.index(f"The {asked} pass key is") / len(context)
        assert abs(where - probe.depth) < 0.1
        asked_keys.add(answer)
    assert len(asked_keys) == 5
    assert key_probes(smollm2_tokenizer, windows, seed=3) == probes
    assert key_probes(smollm2_tokenizer, windows, seed=4) != probes


def test_windows_too_short_for_the_key_lines_are_refused(smollm2_tokenizer):
    with pytest.raises(InvalidArgumentError, match="at least"):
        key_probes(smollm2_tokenizer, _windows(smollm2_tokenizer, 1, 96), seed=0)
    with pytest.raises(InvalidArgumentError, match=r"\[n, length\]"):
        key_probes(smollm2_tokenizer, torch.zeros(10, dtype=torch.long), seed=0)


@pytest.mark.parametrize("chunk,with_prefill", [(5, False), (64, False), (7, True)])
def test_recall_equals_one_dense_forward_over_the_probe(chunk, with_prefill):
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config()).eval()
    generator = torch.Generator().manual_seed(1)
    probes = []
    for n in (23, 40):
        ids = torch.randint(3, VOCAB, (n + 9,), generator=generator).tolist()
        probes.append(KeyProbe(tuple(ids[:n]), tuple(ids[n : n + 4]), tuple(ids[n + 4 :]), 0.5))
    # One probe whose answer is what the model writes greedily: it must count as answered.
    context, question = probes[0].context_ids, probes[0].question_ids
    sequence = list(context + question)
    for _ in range(3):
        with torch.no_grad():
            sequence.append(int(model(torch.tensor([sequence])).logits[0, -1].argmax()))
    probes.append(KeyProbe(context, question, tuple(sequence[-3:]), 0.5))

    expected_nll, expected_answered, answer_tokens = 0.0, 0, 0
    for probe in probes:
        whole = torch.tensor([probe.context_ids + probe.question_ids + probe.answer_ids])
        with torch.no_grad():
            logits = model(whole).logits[0].double()
        first = len(probe.context_ids) + len(probe.question_ids) - 1
        scored = logits[first : first + len(probe.answer_ids)]
        targets = torch.tensor(probe.answer_ids)
        expected_nll += F.cross_entropy(scored, targets, reduction="sum").item()
        expected_answered += int(bool((scored.argmax(-1) == targets).all()))
        answer_tokens += len(probe.answer_ids)
    assert expected_answered >= 1

    calls = []

    def prefill(model, cache, ids):
        calls.append(ids.shape[1])
        return model(ids, past_key_values=cache, use_cache=True).logits[:, -1]

    recall = key_recall(model, probes, DynamicCache, chunk, prefill if with_prefill else None)
    assert recall.probes == 3 and recall.answered == expected_answered
    assert recall.answer_nll == pytest.approx(expected_nll / answer_tokens, rel=1e-5)
    assert calls == ([23, 40, 23] if with_prefill else [])


def test_recall_needs_probes():
    model = LlamaForCausalLM(tiny_llama_config()).eval()
    with pytest.raises(InvalidArgumentError, match="at least one probe"):
        key_recall(model, [], DynamicCache, 8)
