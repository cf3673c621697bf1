"""kvrewrite's recipes on the frontier: one compressed checkpoint, read through token tiers and codecs.

    KVREWRITE_FRONTIER_CHECKPOINT=DIR python benchmarks/frontier/run.py eval \
        --method-module benchmarks.frontier.kvrewrite_recipes:recipes -o PARTIAL.json

DIR is a kvrewrite checkpoint of the benchmark's model (the default compile: `kvrewrite compress smollm2-135m
-p 0.5 --calib-tokens 16384 -o DIR`); every recipe below is a load() of that one checkpoint (docs/tiers.md).
Set KVREWRITE_FRONTIER_RECIPES to a comma-separated subset of names to run only those.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from .methods import Method


def _moved_inward(
    outer: float, inner: float, whole: Iterable[int] = (), chosen: float = 0.225, **evict: Any
) -> dict[str, Any]:
    """The pooled eighth at 8 bits with keep `outer` in SmolLM2's layers 0-4 and 25-29 (chosen by the prompt's last
    queries) and `inner` in layers 5-24, where the reconstruction chooses the share `chosen` of the tokens, or every
    kept token in the layers `whole`; `evict`: more eviction options (group_size, sinks)."""
    whole = set(whole)
    shares = [1.0 if i in whole else round(chosen / inner, 4) if 5 <= i < 25 else 0.0 for i in range(30)]
    return {
        "rate": 0.0,
        "recent_window": 16,
        "kv_codec": "none",
        "evict": {
            "keep": [outer] * 5 + [inner] * 20 + [outer] * 5,
            "bits": 8,
            "prefill_score": "reconstruction",
            "reconstruction_share": shares,
            "pool_repeats": 3,
            **evict,
        },
        "prefill": "reconstruction",
    }


# The reconstruction's 0.225 of the tokens in 192-channel groups: a side codes in 196 bytes instead of 204.
_G192_CHOSEN = round(0.225 * 204 / 196, 5)

# name -> load() keyword arguments; rates are points of the checkpoint's rate table.
RECIPES: dict[str, dict[str, Any]] = {
    "kvrewrite-p0.5": {"rate": 0.5},
    "kvrewrite-p0.6-W64-imp0.3x0.25": {
        "rate": 0.6,
        "recent_window": 64,
        "important": {"rate": 0.3, "share": 0.25, "score": "attention"},
    },
    "kvrewrite-p0.3-W64-int4": {"rate": 0.3, "recent_window": 64, "kv_codec": "int4"},
    "kvrewrite-p0.6-W64-int4": {"rate": 0.6, "recent_window": 64, "kv_codec": "int4"},
    "kvrewrite-p0.3-W64-int2": {"rate": 0.3, "recent_window": 64, "kv_codec": "int2"},
    # Rate 0 keeps every dim: our int4 / int2 codecs on the full-rank latents behind a 64-token window, to set
    # beside transformers' QuantizedCache.
    "kvrewrite-p0-W64-int4": {"rate": 0.0, "recent_window": 64, "kv_codec": "int4"},
    "kvrewrite-p0-W64-int2": {"rate": 0.0, "recent_window": 64, "kv_codec": "int2"},
    # The frozen-score eviction recipes (kvrewrite-W64-keep0.2, -keep0.1, -keep0.4-p0.5; parts kvrewrite5-7) left
    # with their option, important={..., "evict_rest": True}: re-scored eviction below replaced it.
    # Re-scored eviction (kvrewrite.runtime.tiers.eviction): beyond a full-rank window of W tokens only the share g that the
    # newest queries attend to most stays, re-scored at every forward, quantized per token to 4 bits (centred,
    # scaled and turned) at full dims, or at p = 0.3's.
    "kvrewrite-W64-evict0.7-int4": {
        "rate": 0.0,
        "recent_window": 64,
        "kv_codec": "none",
        "evict": {"keep": 0.7, "bits": 4},
    },
    "kvrewrite-W16-evict0.8-int4": {
        "rate": 0.0,
        "recent_window": 16,
        "kv_codec": "none",
        "evict": {"keep": 0.8, "bits": 4},
    },
    "kvrewrite-W16-evict0.4-int4": {
        "rate": 0.0,
        "recent_window": 16,
        "kv_codec": "none",
        "evict": {"keep": 0.4, "bits": 4},
    },
    "kvrewrite-W16-evict0.55-p0.3-int4": {
        "rate": 0.3,
        "recent_window": 16,
        "kv_codec": "none",
        "evict": {"keep": 0.55, "bits": 4},
    },
    # Keys at 8 bits, values at 4 (per-token keys lose more at 4 bits than values do).
    "kvrewrite-W16-evict0.57-k8v4": {
        "rate": 0.0,
        "recent_window": 16,
        "kv_codec": "none",
        "evict": {"keep": 0.57, "bits": (8, 4)},
    },
    "kvrewrite-W16-evict0.26-k8v4": {
        "rate": 0.0,
        "recent_window": 16,
        "kv_codec": "none",
        "evict": {"keep": 0.26, "bits": (8, 4)},
    },
    "kvrewrite-W16-evict0.125-k8v4": {
        "rate": 0.0,
        "recent_window": 16,
        "kv_codec": "none",
        "evict": {"keep": 0.125, "bits": (8, 4)},
    },
    # The same re-scored eviction, with the context's kept tokens chosen by its reconstruction
    # (kvrewrite.runtime.tiers.reconstruction) instead of by the newest queries at each prefill chunk.
    **{
        f"kvrewrite-W16-evict{keep:g}-k8v4-rec": {
            "rate": 0.0,
            "recent_window": 16,
            "kv_codec": "none",
            "evict": {"keep": keep, "bits": (8, 4)},
            "prefill": "reconstruction",
        }
        for keep in (0.57, 0.26, 0.125)
    },
    # A share of the context's kept budget chosen by its reconstruction, the rest by the context's newest queries.
    **{
        f"kvrewrite-W16-evict{keep:g}-k8v4-rec{share:g}": {
            "rate": 0.0,
            "recent_window": 16,
            "kv_codec": "none",
            "evict": {"keep": keep, "bits": (8, 4), "reconstruction_share": share},
            "prefill": "reconstruction",
        }
        for keep in (0.57, 0.26, 0.125)
        for share in (0.25, 0.5)
    },
    # No token ever leaves: every token beyond the window at 4 bits per number (keep 1), the bytes brought to a
    # quarter by the rate's ranks (p = 0.2) or by evicting the least-read 20% of the tokens.
    "kvrewrite-W16-p0.2-all-k4v4": {
        "rate": 0.2,
        "recent_window": 16,
        "kv_codec": "none",
        "evict": {"keep": 1.0, "bits": 4},
    },
    "kvrewrite-W16-evict0.8-k4v4": {
        "rate": 0.0,
        "recent_window": 16,
        "kv_codec": "none",
        "evict": {"keep": 0.8, "bits": 4},
    },
    # Reconstruction-chosen tokens at more bits per number and fewer tokens, at a quarter of the bytes: whether
    # the 2K prompts' misses come from the 4-bit values or from the tokens evicted.
    "kvrewrite-W16-evict0.44-k8v8-rec": {
        "rate": 0.0,
        "recent_window": 16,
        "kv_codec": "none",
        "evict": {"keep": 0.44, "bits": 8},
        "prefill": "reconstruction",
    },
    "kvrewrite-W16-evict0.23-fp16-rec": {
        "rate": 0.0,
        "recent_window": 16,
        "kv_codec": "none",
        "evict": {"keep": 0.23, "bits": None},
        "prefill": "reconstruction",
    },
    # What `kvrewrite compress smollm2-135m --kv-budget 0.125` chose (recipes_smollm2_eighth.json): 8-bit keys and
    # values, a quarter of the prompt's kept budget chosen by its reconstruction.
    "kvrewrite-W16-evict0.225-k8v8-rec0.25": {
        "rate": 0.0,
        "recent_window": 16,
        "kv_codec": "none",
        "evict": {"keep": 0.225, "bits": 8, "reconstruction_share": 0.25},
        "prefill": "reconstruction",
    },
    # The quarter's and the eighth's budgets with a share of them chosen by the reconstruction: where several keys
    # compete for it.
    **{
        f"kvrewrite-W16-evict{keep:g}-k8v8-rec{share:g}": {
            "rate": 0.0,
            "recent_window": 16,
            "kv_codec": "none",
            "evict": {"keep": keep, "bits": 8, "reconstruction_share": share},
            "prefill": "reconstruction",
        }
        for keep in (0.44, 0.225)
        for share in (0.5, 0.75)
    },
    "kvrewrite-W16-evict0.225-k8v8-rec": {
        "rate": 0.0,
        "recent_window": 16,
        "kv_codec": "none",
        "evict": {"keep": 0.225, "bits": 8},
        "prefill": "reconstruction",
    },
    # What `kvrewrite budget --kv-budget 0.25` chose with its planted-key probes (budget_smollm2_0.25.json): 4-bit
    # keys and values on 82% of the tokens, half of the prompt's kept budget chosen by its reconstruction.
    "kvrewrite-W16-evict0.821-k4v4-rec0.5": {
        "rate": 0.0,
        "recent_window": 16,
        "kv_codec": "none",
        "evict": {"keep": 0.821, "bits": 4, "reconstruction_share": 0.5},
        "prefill": "reconstruction",
    },
    # An eighth of the bytes spent on more tokens at fewer bits: 4-bit keys, 2-bit values on 52% of the tokens, every
    # kept token chosen by the reconstruction (the wiki-filler screen, answer_nll_eighth_wiki.json).
    "kvrewrite-W16-evict0.52-k4v2-rec": {
        "rate": 0.0,
        "recent_window": 16,
        "kv_codec": "none",
        "evict": {"keep": 0.52, "bits": (4, 2)},
        "prefill": "reconstruction",
    },
    # The same with one (scale, minimum) pair per token and side (192 channels: SmolLM2's 3 KV heads x 64) instead
    # of one per 64 channels: the bytes saved keep 57.5% of the tokens at the same eighth.
    "kvrewrite-W16-evict0.575-k4v2-g192-rec": {
        "rate": 0.0,
        "recent_window": 16,
        "kv_codec": "none",
        "evict": {"keep": 0.575, "bits": (4, 2), "group_size": 192},
        "prefill": "reconstruction",
    },
    # The quarter's 8-bit recipe (-evict0.44-k8v8-rec) with one (scale, minimum) pair per token and side instead of
    # three: at the same bytes, 45.5% of the tokens kept instead of 44%.
    "kvrewrite-W16-evict0.455-k8v8-g192-rec": {
        "rate": 0.0,
        "recent_window": 16,
        "kv_codec": "none",
        "evict": {"keep": 0.455, "bits": 8, "group_size": 192},
        "prefill": "reconstruction",
    },
    # Evicted tokens keep 8 key and 8 value dims per head at 4 bits instead of leaving (kvrewrite.runtime.tiers.floor).
    "kvrewrite-W16-evict0.2-k8v4-floor8-rec": {
        "rate": 0.0,
        "recent_window": 16,
        "kv_codec": "none",
        "evict": {"keep": 0.2, "bits": (8, 4), "floor": {"key": 8, "value": 8, "bits": 4}},
        "prefill": "reconstruction",
    },
    # The same floor, with a quarter of the prompt's kept budget chosen by its reconstruction and the rest by the
    # context's own last queries (reconstruction_share).
    "kvrewrite-W16-evict0.2-k8v4-floor8-rec0.25": {
        "rate": 0.0,
        "recent_window": 16,
        "kv_codec": "none",
        "evict": {
            "keep": 0.2,
            "bits": (8, 4),
            "floor": {"key": 8, "value": 8, "bits": 4},
            "reconstruction_share": 0.25,
        },
        "prefill": "reconstruction",
    },
    # The eighth's recipes with repeated trigrams of the context pooling their reconstruction scores into their
    # best copy (pool_repeats, kvrewrite.runtime.tiers.repeated_evidence): a key said twice competes as a word said
    # once (needle_survival_eighth_wiki.json: the score dropped the wiki key line).
    **{
        f"kvrewrite-W16-evict{keep:g}-{label}-rec{share_label}-pool3": {
            "rate": 0.0,
            "recent_window": 16,
            "kv_codec": "none",
            "evict": {
                "keep": keep,
                "bits": bits,
                "prefill_score": "reconstruction",
                "reconstruction_share": share,
                "pool_repeats": 3,
            },
            "prefill": "reconstruction",
        }
        for keep, label, bits in ((0.225, "k8v8", 8), (0.26, "k8v4", (8, 4)))
        for share, share_label in ((1.0, ""), (0.75, "0.75"), (0.5, "0.5"), (0.25, "0.25"))
    },
    # The eighth's pooled recipe with the reconstruction choosing the whole budget only in SmolLM2's layers 5-24 and
    # the prompt's last queries choosing it in the other ten (a per-layer reconstruction_share). On the five 1K wiki
    # prompts (answer_nll_eighth_wiki_layer_share.json, in docs/results/frontier.md) the outer layers could leave the
    # reconstruction without losing the key; layers 5-9 at half, or 5-24 at three quarters, lost it.
    "kvrewrite-W16-evict0.225-k8v8-recL5-24-pool3": {
        "rate": 0.0,
        "recent_window": 16,
        "kv_codec": "none",
        "evict": {
            "keep": 0.225,
            "bits": 8,
            "prefill_score": "reconstruction",
            "reconstruction_share": [0.0] * 5 + [1.0] * 20 + [0.0] * 5,
            "pool_repeats": 3,
        },
        "prefill": "reconstruction",
    },
    # The same with the outer ten layers' budget moved into layers 5-24 (per-layer keep: `outer` outside, `inner` in
    # them, 0.225 on average), the extra tokens there chosen by the prompt's last queries (the reconstruction still
    # chooses 0.225 of the tokens there: a share of 0.225 / inner).
    **{
        f"kvrewrite-W16-evict{inner:g}x20-{outer:g}-k8v8-recL5-24-pool3": _moved_inward(outer, inner)
        for outer, inner in ((0.15, 0.2625), (0.1875, 0.24375), (0.2, 0.2375))
    },
    # The same with the reconstruction choosing every kept token in some of layers 5-24 (`rec1L...`).
    **{
        f"kvrewrite-W16-evict{inner:g}x20-{outer:g}-k8v8-rec1L{label}-pool3": _moved_inward(outer, inner, layers)
        for outer, inner, label, layers in (
            (0.15, 0.2625, "5-24", range(5, 25)),
            (0.1875, 0.24375, "5-24", range(5, 25)),
            (0.15, 0.2625, "5-14", range(5, 15)),
            (0.15, 0.2625, "5-9+20-24", [*range(5, 10), *range(20, 25)]),
            (0.15, 0.2625, "7", [7]),
            (0.15, 0.2625, "7-9", [7, 8, 9]),
        )
    },
    # The layer-7 split with the sequence's first 16 tokens always kept (`sinks`), and one (scale, minimum) pair per
    # token and side (192 channels): a side codes in 196 bytes instead of 204 (and a token's int32 position 4), so
    # every share above grows by about 204/196 (412/396 with the position) at the same bytes.
    "kvrewrite-W16-evict0.273x20-0.156-k8v8-g192-rec1L7-sink16-pool3": _moved_inward(
        0.156, 0.273, [7], chosen=_G192_CHOSEN, group_size=192, sinks=16
    ),
    # The same with the sinks in layer 7 only, where the reconstruction chooses every kept token.
    "kvrewrite-W16-evict0.273x20-0.156-k8v8-g192-rec1L7-sink16L7-pool3": _moved_inward(
        0.156, 0.273, [7], chosen=_G192_CHOSEN, group_size=192, sinks=[16 if i == 7 else 0 for i in range(30)]
    ),
    # Each of the two changes alone, to tell them apart.
    "kvrewrite-W16-evict0.2625x20-0.15-k8v8-rec1L7-sink16-pool3": _moved_inward(0.15, 0.2625, [7], sinks=16),
    "kvrewrite-W16-evict0.273x20-0.156-k8v8-g192-rec1L7-pool3": _moved_inward(
        0.156, 0.273, [7], chosen=_G192_CHOSEN, group_size=192
    ),
}


def _reconstruction_prefill(directory: str):
    """The context prefilled and scored by its reconstruction (kvrewrite.runtime.tiers.reconstruction)."""
    import torch
    from transformers import AutoTokenizer

    from kvrewrite.runtime.tiers.reconstruction import REPEAT_INSTRUCTION, prefill_scored_by_reconstruction

    tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=False)
    repeat = torch.tensor(tokenizer(REPEAT_INSTRUCTION, add_special_tokens=False)["input_ids"])

    def prefill(model: Any, ids: Any, cache: Any) -> tuple[Any, Any]:
        return prefill_scored_by_reconstruction(model, cache, ids, repeat), cache

    return prefill


def _method(name: str, directory: str, options: dict[str, Any]) -> Method:
    load_options = {k: v for k, v in options.items() if k != "prefill"}

    def load(_original_path: str) -> Any:
        import kvrewrite

        return kvrewrite.load(directory, **load_options).eval()

    return Method(
        name,
        "kvrewrite",
        new_cache=lambda model: model.make_kv_cache(),
        load=load,
        prefill=_reconstruction_prefill(directory) if options.get("prefill") == "reconstruction" else None,
        settings={"checkpoint": directory, **{k: v for k, v in options.items()}},
    )


def recipes() -> list[Method]:
    directory = os.environ.get("KVREWRITE_FRONTIER_CHECKPOINT")
    if not directory:
        raise SystemExit("set KVREWRITE_FRONTIER_CHECKPOINT to a kvrewrite checkpoint of the benchmark's model")
    chosen = [n.strip() for n in os.environ.get("KVREWRITE_FRONTIER_RECIPES", "").split(",") if n.strip()]
    unknown = set(chosen) - set(RECIPES)
    if unknown:
        raise SystemExit(f"unknown recipes {sorted(unknown)}; known: {', '.join(RECIPES)}")
    return [_method(name, directory, RECIPES[name]) for name in (chosen or RECIPES)]
