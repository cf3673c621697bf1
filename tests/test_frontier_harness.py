"""The frontier benchmark's harness pieces that run in the project env (no kvpress/quanto needed): byte counting on
real cache tensors, the FP8 cache, the continuation protocol and the passkey prompt builder."""

import math
import re
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tiny_models import random_windows, tiny_llama_config, word_tokenizer  # noqa: E402

from benchmarks.frontier.cache_bytes import fp16_bytes_per_token  # noqa: E402
from benchmarks.frontier.fp8_cache import FP8Cache  # noqa: E402
from benchmarks.frontier.inputs import passkey_prompts  # noqa: E402
from benchmarks.frontier.methods import Method, original  # noqa: E402
from benchmarks.frontier.protocols import continuation_window, passkey_correct, perplexity  # noqa: E402


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config()).eval()


def test_bytes_are_fp16_share_for_the_original_and_half_for_fp8():
    model = _model()
    window = random_windows(1, 48)[0]
    per_token = fp16_bytes_per_token(model.config)
    assert per_token == 2 * 2 * 2 * 2 * 16  # fp16 x (K, V) x layers x kv heads x head dim
    full = continuation_window(model, original(), window, n_ctx=16, chunk=8)
    assert full.bytes_held == per_token * 48 and full.tokens == 48  # float32 tensors counted at 2 bytes
    fp8 = Method("fp8", "peer", new_cache=lambda m: FP8Cache(m.config))
    low = continuation_window(model, fp8, window, n_ctx=16, chunk=8)
    assert low.bytes_held == per_token * 48 // 2
    assert full.n_scored == low.n_scored == 32
    assert math.isfinite(perplexity([low])) and abs(low.nll_sum - full.nll_sum) / full.nll_sum < 0.05


def test_chunked_continuation_scores_like_one_forward():
    model = _model()
    window = random_windows(1, 40)[0]
    score = continuation_window(model, Method("o", "original", prefill_chunk=7), window, n_ctx=20, chunk=6)
    logits = model(input_ids=window[None]).logits[0, 19:-1]
    expected = torch.nn.functional.cross_entropy(logits, window[20:], reduction="sum").item()
    assert abs(score.nll_sum - expected) < 1e-3 * expected


def test_passkey_prompts_have_the_asked_length_and_the_key():
    tok = word_tokenizer()
    prompts = passkey_prompts(tok, [256], [0.1, 0.9], 1, seed=0, filler="classic")
    assert [len(p.context_ids) + len(p.question_ids) for p in prompts] == [256, 256]
    assert passkey_correct(" 12345. The", "12345") and not passkey_correct(" 1234", "12345")


def test_retrieval_summary_is_per_length_and_against_the_original_on_the_same_prompts():
    from benchmarks.frontier.evaluate import add_retrieval_summary

    def items(correct, lengths):
        return [
            {"length": n, "depth": 0.5, "key": str(k), "correct": c} for k, (c, n) in enumerate(zip(correct, lengths))
        ]

    lengths = [1024, 1024, 2048, 2048]
    original = {"family": "original", "passkey": {"accuracy": 0.75, "items": items([1, 1, 1, 0], lengths)}}
    full = {"family": "kvrewrite", "passkey": {"accuracy": 0.5, "items": items([1, 0, 1, 0], lengths)}}
    subset = {"family": "kvrewrite", "passkey": {"accuracy": 0.5, "items": items([1, 0], lengths[:2])}}
    add_retrieval_summary([original, full, subset])
    assert full["passkey"]["by_length"] == {"1024": 0.5, "2048": 0.5}
    assert full["passkey"]["of_original"] == pytest.approx(0.5 / 0.75)
    assert subset["passkey"]["by_length"] == {"1024": 0.5}
    assert subset["passkey"]["of_original"] == pytest.approx(0.5)  # the original got both 1K prompts


class _Characters:
    """One token per character: prompts decode back to their exact text."""

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": [ord(c) for c in text]}


def test_multi_key_prompts_plant_four_coloured_keys_and_ask_for_one():
    prompts = passkey_prompts(_Characters(), [2048], [0.1, 0.5, 0.9], 1, seed=3, filler="classic", variant="multi")
    for p in prompts:
        context, question = "".join(map(chr, p.context_ids)), "".join(map(chr, p.question_ids))
        assert len(p.context_ids) + len(p.question_ids) == 2048 and p.variant == "multi"
        planted = re.findall(r"The (\w+) pass key is (\d{5})\.", context)
        assert sorted(c for c, _ in planted) == ["blue", "gold", "green", "red"]
        asked = re.search(r"What is the (\w+) pass key\?", question).group(1)
        assert dict(planted)[asked] == p.key and len({k for _, k in planted}) == 4
        where = context.index(f"The {asked} pass key is") / len(context)
        assert abs(where - p.depth) < 0.1  # the asked key sits at the asked depth


def test_merge_adds_a_lengths_only_partial_to_the_row_and_replaces_a_full_rerun(tmp_path):
    import json

    from benchmarks.frontier.run import main

    def item(length, correct):
        return {"length": length, "depth": 0.5, "key": str(length), "variant": "single", "correct": correct}

    def row(name, items, share, continuation=True):
        r = {
            "name": name,
            "family": "original" if name == "original" else "kvrewrite",
            "settings": {"keep": 0.2},
            "passkey": {
                "accuracy": sum(i["correct"] for i in items) / len(items),
                "n": len(items),
                "bytes_share": share,
                "items": items,
            },
            "seconds": 10.0,
        }
        if continuation:
            r["continuation"] = {"512-1K": {"ppl": 20.0, "bytes_share": share, "delta_ppl_pct": 0.0}}
        return r

    def partial(name, rows, selection):
        path = tmp_path / name
        meta = {"provenance": {"versions": {}, "command": name}, "inputs": {}, "chunk": 64, "selection": selection}
        path.write_text(json.dumps({**meta, "results": rows}))
        return str(path)

    everything = [item(1024, True), item(2048, True), item(4096, False)]
    short = partial(
        "a.json",
        [row("original", everything, 1.0), row("m", [item(1024, True), item(2048, False)], 0.2)],
        {"windows": 0},
    )
    long = partial(
        "b.json",
        [row("original", [item(4096, False)], 1.0, False), row("m", [item(4096, True)], 0.1, False)],
        {"windows": 0, "passkey_lengths": [4096]},
    )
    out = tmp_path / "merged.json"
    merge = ["merge", "-o", str(out), "--plot", str(tmp_path / "p.png"), "--markdown", str(tmp_path / "t.md")]
    main([*merge[:1], short, long, *merge[1:]])
    merged = json.loads(out.read_text())
    m = next(r for r in merged["results"] if r["name"] == "m")
    assert m["passkey"]["n"] == 3 and m["passkey"]["accuracy"] == pytest.approx(2 / 3)
    assert m["passkey"]["bytes_share"] == pytest.approx((0.2 * 2 + 0.1) / 3)
    assert m["passkey"]["by_length"] == {"1024": 1.0, "2048": 0.0, "4096": 1.0}
    assert m["passkey"]["of_original"] == pytest.approx((2 / 3) / (2 / 3))
    assert m["continuation"]["512-1K"]["bytes_share"] == 0.2 and m["passkey_added_from"] == [long]
    assert merged["superseded"] == []
    # The same method run again on the same prompts replaces the row.
    again = partial("c.json", [row("m", [item(1024, False)], 0.3)], {"windows": 0})
    main([*merge[:1], short, again, *merge[1:]])
    merged = json.loads(out.read_text())
    assert next(r for r in merged["results"] if r["name"] == "m")["passkey"]["n"] == 1
    assert [r["name"] for r in merged["superseded"]] == ["m"]


@pytest.mark.parametrize("saved", ["frontier_inputs.safetensors", "frontier_inputs_multi.safetensors"])
def test_prompts_rebuilt_with_the_budget_searchs_wording_equal_the_saved_inputs(saved):
    """The passkey lines, question and intro now come from kvrewrite.compile.key_probes: the committed input sets,
    built before that, are rebuilt token for token (so every committed passkey result stays comparable)."""
    from transformers import AutoTokenizer

    from benchmarks.frontier.inputs import load_inputs
    from kvrewrite.io.sources import bundled_smollm2_path

    _, prompts, meta = load_inputs(Path(__file__).resolve().parents[1] / "benchmarks" / "results" / saved)
    spec = meta["passkey"]
    tokenizer = AutoTokenizer.from_pretrained(bundled_smollm2_path())
    rebuilt = passkey_prompts(
        tokenizer, spec["lengths"], spec["depths"], spec["keys"], meta["seed"], meta["filler"], spec["variant"]
    )
    assert [(p.context_ids, p.question_ids, p.key, p.variant) for p in rebuilt] == [
        (p.context_ids, p.question_ids, p.key, p.variant) for p in prompts
    ]


def test_a_reference_serves_a_run_of_fewer_protocols_and_names_what_differs():
    from benchmarks.frontier.run import reference_original

    original = {"name": "original", "family": "original", "passkey": {"accuracy": 0.9}, "continuation": {"x": 1}}
    earlier = {
        "inputs": {"seed": 0},
        "chunk": 64,
        "protocols": ["continuation", "passkey"],
        "selection": {"windows": 0},
        "results": [{"name": "m", "family": "peer"}, original],
    }
    run = {"inputs": {"seed": 0}, "chunk": 64, "protocols": ["passkey"], "selection": {"windows": 0}}
    row = reference_original(earlier, run)
    assert row == {"name": "original", "family": "original", "passkey": {"accuracy": 0.9}}
    assert reference_original(earlier, {**run, "protocols": ["continuation", "passkey"]}) == original
    with pytest.raises(ValueError, match=r"other chunk, protocols \(it has no needle\)"):
        reference_original(earlier, {**run, "chunk": 32, "protocols": ["needle"]})
    with pytest.raises(ValueError, match="other inputs, selection"):
        reference_original(earlier, {**run, "inputs": {"seed": 1}, "selection": {"windows": 2}})
