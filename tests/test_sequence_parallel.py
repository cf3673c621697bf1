"""Sequence-parallel prefill (kvrewrite.runtime.sequence_parallel): N gloo processes on CPU give the single-process
compressed model's logits and cache, move exactly the packed latents, and refuse an impossible N up front."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from sequence_parallel_worker import prefill_jobs
from tiny_families import save_tiny_family
from tiny_models import random_windows, save_tiny_llama, tiny_pipeline
from transformers import DynamicCache

import kvrewrite
from kvrewrite.compile.passes.base import run_pass
from kvrewrite.compile.passes.compute_transforms import LayerTransforms
from kvrewrite.compile.passes.context import CompileContext
from kvrewrite.compile.passes.pipeline import run_pipeline
from kvrewrite.compile.plan import Plan
from kvrewrite.errors import InvalidArgumentError
from kvrewrite.key_modes import key_transform
from kvrewrite.runtime.kernels.cache_layout import packed_view
from kvrewrite.runtime.sequence_parallel import (
    check_world_size,
    head_runs,
    layer_shares,
    prefill,
    run_processes,
    token_runs,
)

# One layer per RoPE key mode: shared key block, folded pairs, rebuilt latent keys, post-RoPE maps.
MODES = ["crosshead", "freq", "latent", "post-rope"]
RATES = [None, 0.0]  # the compiled rate (0.5) and the full-rank rewrite (the original attention)
LENGTH, NEW_TOKENS = 29, 4  # 29 tokens: uneven slices for 2 and 4 ranks


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("sp")
    source = save_tiny_llama(root / "src", seed=2, num_kv_heads=2, num_heads=4, layers=len(MODES))
    ctx = CompileContext(
        plan=Plan(model=str(source), output=root / "out", progress=False, target_rate=0.5, allocation="greedy")
    )
    pipeline = tiny_pipeline()
    split = [step.name for step in pipeline].index("compute_transforms") + 1
    for step in pipeline[:split]:
        ctx = run_pass(ctx, step)
    ctx = dataclasses.replace(
        ctx,
        transforms=[
            LayerTransforms(key=key_transform(mode, "optimal", stats, ctx.geometry), value=t.value)
            for mode, stats, t in zip(MODES, ctx.statistics.layers, ctx.transforms)
        ],
    )
    for step in pipeline[split:]:
        ctx = run_pass(ctx, step)
    assert [layer.key_mode for layer in ctx.spec.layers] == MODES
    return root / "out"


# Other layouts, each in its family's default key mode: q/k norms (Qwen3, post-rope), q/k/v biases (Qwen2), no RoPE
# (OPT and GPT-2, folded; GPT-2's fused c_attn). Run with N=2 only, in the same processes.
FAMILIES = ["qwen3", "qwen2", "opt", "gpt2"]


@pytest.fixture(scope="module")
def family_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("sp_families")
    out = {}
    for i, family in enumerate(FAMILIES):
        source = save_tiny_family(root / f"{family}-src", family, seed=i)
        run_pipeline(
            Plan(model=str(source), output=root / family, progress=False, target_rate=0.5, allocation="greedy"),
            tiny_pipeline(),
        )
        out[family] = root / family
    return out


def single_process(directory, tokens, rate):
    model = kvrewrite.load(directory, rate=rate).eval()
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        logits = model(tokens, past_key_values=cache, use_cache=True).logits
        generated = model.generate(tokens, max_new_tokens=NEW_TOKENS, do_sample=False)[:, tokens.shape[1] :]
    return model, logits, [(packed_view(layer.keys), packed_view(layer.values)) for layer in cache.layers], generated


@pytest.mark.parametrize("world", [2, 4])
def test_n_process_prefill_equals_single_process_and_ships_the_packed_latents(checkpoint, family_checkpoints, world):
    tokens = random_windows(world // 2, LENGTH, seed=5)  # a batch of one (N=2) and of two (N=4)
    jobs = [(str(checkpoint), rate) for rate in RATES]
    families = [(str(directory), None) for directory in family_checkpoints.values()] if world == 2 else []
    ranks = run_processes(prefill_jobs, world, jobs + families, tokens, NEW_TOKENS)
    for directory, rate in families:  # other layouts: logits, cache and continuation
        model, logits, cache, generated = single_process(directory, tokens, rate)
        for result in ranks:
            got = result[(directory, rate)]
            start, stop = got["tokens"]
            assert (got["logits"] - logits[:, start:stop]).abs().max().item() < 1e-5, directory
            for (k, v), (k_ref, v_ref) in zip(got["cache"], cache):
                assert (k - k_ref).abs().max().item() < 1e-5 and (v - v_ref).abs().max().item() < 1e-5, directory
            assert torch.equal(got["continuation"], generated), directory
    for job in jobs:
        rate = job[1]
        model, logits, cache, generated = single_process(checkpoint, tokens, rate)
        for rank, result in enumerate(ranks):
            got = result[job]
            start, stop = got["tokens"]
            assert (start, stop) == token_runs(LENGTH, world)[rank]
            assert (got["logits"] - logits[:, start:stop]).abs().max().item() < 1e-5
            for (k, v), (k_ref, v_ref) in zip(got["cache"], cache):
                assert k.shape == k_ref.shape and v.shape == v_ref.shape
                assert (k - k_ref).abs().max().item() < 1e-5 and (v - v_ref).abs().max().item() < 1e-5
            assert torch.equal(got["continuation"], generated)  # decoding from the gathered cache goes on as usual

        # Bytes: the wrapper's count of every all-to-all equals the packed column ranges of the ranks' shares.
        attentions = model.compressed_attentions()
        for rank, result in enumerate(ranks):
            calls = result[job]["calls"]
            mine = token_runs(LENGTH, world)[rank]
            for attn in attentions:
                shares = layer_shares(attn, world)
                qkv = [c for c in calls if c["name"] == "qkv" and c["layer"] == attn.layer_idx]
                out = [c for c in calls if c["name"] == "output" and c["layer"] == attn.layer_idx]
                assert len(qkv) == len(out) == 1
                to_others = sum(sum(s.widths) for r, s in enumerate(shares) if r != rank)
                assert qkv[0]["sent"] == 4 * tokens.shape[0] * (mine[1] - mine[0]) * to_others
                back = sum(stop - start for r, (start, stop) in enumerate(token_runs(LENGTH, world)) if r != rank)
                assert out[0]["sent"] == 4 * tokens.shape[0] * back * shares[rank].output_width
    # Compressed latents are narrower than the full-rank ones they replace, on every layer's first all-to-all.
    sent = {rate: sum(c["sent"] for c in ranks[0][(d, rate)]["calls"] if c["name"] == "qkv") for d, rate in jobs}
    assert sent[None] < sent[0.0]


def test_head_and_token_runs_are_contiguous_and_balanced():
    assert head_runs(9, 4) == [(0, 3), (3, 5), (5, 7), (7, 9)]
    assert token_runs(29, 2) == [(0, 15), (15, 29)]


def test_shares_slice_the_packed_columns_without_padding(checkpoint):
    model = kvrewrite.load(checkpoint).eval()
    for attn in model.compressed_attentions():
        for world in (1, 2, 3, 4):
            shares = layer_shares(attn, world)
            # Output columns tile o_proj's packed input exactly once, in head order.
            assert [s.output_columns for s in shares][0][0] == 0 and shares[-1].output_columns[
                1
            ] == attn.layout.output_offsets[-1]
            assert all(a.output_columns[1] == b.output_columns[0] for a, b in zip(shares, shares[1:]))
        if not attn.mode.shared_key_block and not attn.mode.rebuilds_keys:
            # With whole KV groups per rank, the shares tile the packed query, key and value too.
            two = layer_shares(attn, 2)
            assert two[0].key_columns == (0, attn.key_ranks[0]) and two[1].key_columns[1] == sum(attn.key_ranks)
            assert two[1].query_columns[1] == attn.layout.query_offsets[-1]


def test_an_impossible_process_count_fails_before_any_work(checkpoint):
    model = kvrewrite.load(checkpoint).eval()
    with pytest.raises(InvalidArgumentError, match="only 4 query heads"):
        check_world_size(model, 5, LENGTH)
    with pytest.raises(InvalidArgumentError, match="cannot be split over 3 processes"):
        check_world_size(model, 3, 2)
    original = dict(model.named_parameters())
    with pytest.raises(InvalidArgumentError, match="cache_on"):
        prefill(model, random_windows(1, LENGTH), cache_on="rank 3")
    assert dict(model.named_parameters()).keys() == original.keys()


def test_cli_refuses_an_impossible_process_count_before_starting_any(checkpoint, tmp_path):
    from typer.testing import CliRunner

    from kvrewrite.cli.app import app

    prompt = tmp_path / "prompt.txt"
    prompt.write_text("w5 w6 w7 w8 w9 w10")
    result = CliRunner().invoke(
        app, ["prefill-parallel", str(checkpoint), "--prompt-file", str(prompt), "--nproc", "5"]
    )
    assert result.exit_code == 2
    assert "--nproc 5: the model has 4 query heads" in result.output
    result = CliRunner().invoke(
        app,
        [
            "prefill-parallel",
            str(checkpoint),
            "--prompt-file",
            str(prompt),
            "--nproc",
            "2",
            "--rate",
            "0.5",
            "--new-tokens",
            "3",
            "--json",
            str(tmp_path / "run.json"),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "cache gathered to rank 0" in result.output and "next 3 tokens (greedy, rank 0)" in result.output
    written = json.loads((tmp_path / "run.json").read_text())
    assert written["processes"] == 2 and [r["tokens"] for r in written["results"]] == [[0, 3], [3, 6]]
    assert written["results"][1]["sent_bytes"]["qkv"] > 0 and len(written["results"][0]["generated"]) == 3
