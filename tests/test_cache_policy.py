"""The cache policy behind load() (kvrewrite.runtime.cache_policy): one frozen, validated object, built from load's
keywords or passed whole, recorded by `kvrewrite budget` and read back; and the forms of cache (runtime.cache_forms)
refusing, by field and form, what they cannot honour."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from test_tiers import RATE, compiled  # noqa: F401  (compiled: the fixture)
from tiny_models import random_windows, save_tiny_llama, tiny_pipeline

import kvrewrite
from kvrewrite import CachePolicy, Eviction, Floor, ImportantTokens
from kvrewrite.compile.passes.pipeline import run_pipeline
from kvrewrite.compile.plan import Plan
from kvrewrite.errors import CorruptCheckpointError, InvalidArgumentError
from kvrewrite.runtime.tiers import EvictionPolicy, TierPolicy
from kvrewrite.runtime.tiers.token_policy_file import TOKEN_POLICY_FILE, policy_record, read_cache_policy

EVICT = {"keep": [0.5, 0.25], "bits": [8, 4], "floor": {"key": 2}, "prefill_score": "reconstruction", "pool_repeats": 3}
IMPORTANT = {"rate": 0.25, "share": 0.25, "pool": 8}


def test_dicts_and_lists_build_the_same_frozen_policy_as_its_parts():
    from_dicts = CachePolicy(rate=0.0, recent_window=16, kv_codec="none", evict=EVICT)
    typed = CachePolicy(
        rate=0.0,
        recent_window=16,
        kv_codec="none",
        evict=Eviction(
            keep=(0.5, 0.25),
            bits=(8, 4),
            floor=Floor(key=2, value=2),
            prefill_score="reconstruction",
            pool_repeats=3,
        ),
    )
    assert from_dicts == typed
    assert from_dicts.evict.floor == Floor(key=2, value=2, bits=4)  # value defaults to key's, bits to 4
    assert CachePolicy(kv_codec=None) == CachePolicy(kv_codec="none")
    important = ImportantTokens(rate=0.25, share=0.25, pool=8)
    assert CachePolicy(recent_window=8, important=IMPORTANT) == CachePolicy(recent_window=8, important=important)
    with pytest.raises(dataclasses.FrozenInstanceError):
        typed.rate = 0.5
    with pytest.raises(dataclasses.FrozenInstanceError):
        typed.evict.keep = 0.1


@pytest.mark.parametrize(
    "policy",
    [
        CachePolicy(),
        CachePolicy(rate=0.3, kv_codec="int4"),
        CachePolicy(rate=0.5, recent_window=8, important=IMPORTANT),
        CachePolicy(rate=0.0, recent_window=16, kv_codec="none", evict=EVICT),
    ],
    ids=["defaults", "rate and codec", "important", "evict"],
)
def test_the_dict_is_the_keywords_that_rebuild_the_policy(policy):
    data = json.loads(json.dumps(policy.to_dict()))  # what token_policy.json holds
    assert set(data) == {"rate", "recent_window", "kv_codec", "important", "evict"}
    assert CachePolicy.from_dict(data) == policy
    assert CachePolicy(**data) == policy


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"rate": 1.5}, r"^rate= must be in \[0, 1\)"),
        ({"rate": "0.5"}, r"^rate= must be a number"),
        ({"recent_window": -1}, r"recent_window=\) must be a whole number"),
        ({"kv_codec": 5}, r"^kv_codec= takes a codec name"),
        ({"kv_codec": "int7"}, r"^kv_codec= must be one of"),
        ({"recent_window": 4, "important": {"rate": 0.3}}, r"^important= takes rate and share"),
        ({"recent_window": 4, "important": {"rate": 0.3, "share": 0.2, "score": "x"}}, r"^important= score"),
        ({"recent_window": 4, "important": {"rate": 0.3, "share": 0.2, "pool": 0}}, r"^important= pool"),
        ({"recent_window": 4, "evict": {"keep": 0.5, "bits": 3}}, r"^evict= bits"),
        ({"recent_window": 4, "evict": {"keep": [0.5, 1.2]}}, r"^evict= keep"),
        ({"recent_window": 4, "evict": {"keep": 0.5, "group_size": 0}}, r"^evict= group_size"),
        ({"recent_window": 4, "evict": {"keep": 0.5, "floor": {"key": 2, "bits": 5}}}, r"^evict= floor bits"),
        ({"evict": {"keep": 0.5}}, r"^evict= \(re-scored eviction\) needs recent_window="),
        ({"recent_window": 4, "evict": {"keep": 0.5}, "important": IMPORTANT}, "choose one"),
        ({"recent_window": 4, "important": {**IMPORTANT, "evict_rest": True}}, r"replaced by re-scored eviction"),
    ],
)
def test_a_bad_field_is_named(fields, message):
    with pytest.raises(InvalidArgumentError, match=message):
        CachePolicy(**fields)


def test_unknown_fields_of_a_recorded_policy_are_named():
    with pytest.raises(InvalidArgumentError, match=r"^window=: not a cache policy field"):
        CachePolicy.from_dict({"window": 4})


def test_policy_and_keywords_are_one_or_the_other(compiled):
    policy = CachePolicy(rate=RATE, recent_window=4)
    with pytest.raises(InvalidArgumentError, match=r"^rate=, recent_window=: policy= already holds"):
        kvrewrite.load(compiled["latent"], RATE, policy=policy, recent_window=4)
    with pytest.raises(InvalidArgumentError, match=r"^policy= takes a kvrewrite.CachePolicy"):
        kvrewrite.load(compiled["latent"], policy={"rate": RATE})


@pytest.mark.parametrize("mode", ["latent", "freq", "post-rope"])
@pytest.mark.parametrize(
    "policy",
    [
        CachePolicy(rate=RATE),
        CachePolicy(rate=RATE, kv_codec="int4"),
        CachePolicy(rate=RATE, recent_window=4, kv_codec="int4"),
        CachePolicy(rate=RATE, recent_window=4, important=IMPORTANT),
        CachePolicy(rate=RATE, recent_window=4, evict=EVICT),
    ],
    ids=["rate", "codec", "window and codec", "important", "evict"],
)
def test_per_head_checkpoints_honour_every_field(compiled, mode, policy):
    """latent, freq and post-rope keys honour each field; the policy given is the one the model keeps, and keywords
    build the same one."""
    model = kvrewrite.load(compiled[mode], policy=policy)
    assert model.cache_policy == policy
    assert kvrewrite.load(compiled[mode], **policy.to_dict()).cache_policy == policy
    if policy.important is not None:
        assert isinstance(model.tier_policy, TierPolicy) and model.tier_policy.adaptive
    if policy.evict is not None:
        assert isinstance(model.tier_policy, EvictionPolicy) and model.tier_policy.keep == (0.5, 0.25)
        assert model.tier_policy.floor is not None and model.tier_policy.prefill_score == "reconstruction"
        assert model.tier_policy.pool_repeats == 3
        assert all(layer.pool_repeats == 3 for layer in model.make_kv_cache().layers)


@pytest.mark.parametrize(
    "fields, named",
    [({"evict": {"keep": 0.5}}, "evict="), ({"important": IMPORTANT}, "important=")],
)
def test_a_block_codec_refuses_important_tokens_and_eviction(fields, named):
    with pytest.raises(InvalidArgumentError, match=r"the cache is coded by int4, which cannot honour it") as refused:
        CachePolicy(rate=RATE, recent_window=4, kv_codec="int4", **fields)
    assert str(refused.value).startswith(named + ":") and "kv_codec='none'" in str(refused.value)


@pytest.fixture(scope="module")
def other_forms(tmp_path_factory):
    """A crosshead compile, a checkpoint compiled with an int4 codec, and a family with sliding-window layers."""
    from tiny_families import save_tiny_family

    root = tmp_path_factory.mktemp("forms")
    src = save_tiny_llama(root / "src", seed=5, num_kv_heads=2, num_heads=4)
    out = {}
    for name, options in (("crosshead", {"rope_mode": "crosshead"}), ("int4", {"kv_codec": "int4"})):
        run_pipeline(
            Plan(model=str(src), output=root / name, progress=False, target_rate=RATE, **options), tiny_pipeline()
        )
        out[name] = root / name
    gemma = save_tiny_family(root / "gemma3-src", "gemma3", seed=2)
    run_pipeline(Plan(model=str(gemma), output=root / "gemma3", progress=False, target_rate=RATE), tiny_pipeline())
    out["gemma3"] = root / "gemma3"
    return out


@pytest.mark.parametrize(
    "form, fields, named, described",
    [
        ("crosshead", {"recent_window": 4}, "recent_window=", "has crosshead keys"),
        ("crosshead", {"recent_window": 4, "evict": {"keep": 0.5}}, "recent_window=, evict=", "has crosshead keys"),
        ("gemma3", {"recent_window": 4}, "recent_window=", "checkpoint with sliding-window layers"),
        ("gemma3", {"recent_window": 4, "important": IMPORTANT}, "recent_window=, important=", "sliding-window"),
        ("int4", {"recent_window": 4, "evict": {"keep": 0.5}}, "evict=", "is coded by its compiled codec int4"),
        ("int4", {"recent_window": 4, "important": IMPORTANT}, "important=", "is coded by its compiled codec int4"),
    ],
)
def test_a_form_refuses_the_fields_it_cannot_honour_naming_them_and_itself(other_forms, form, fields, named, described):
    directory = other_forms[form]
    for load in (
        lambda: kvrewrite.load(directory, rate=RATE, **fields),
        lambda: kvrewrite.load(directory, policy=CachePolicy(rate=RATE, **fields)),
    ):
        with pytest.raises(InvalidArgumentError, match=described) as refused:
            load()
        assert str(refused.value).startswith(f"{named}: {directory} ")


def test_the_other_forms_honour_rate_and_codec(other_forms):
    for form in ("crosshead", "gemma3"):
        policy = CachePolicy(rate=RATE, kv_codec="int4")
        assert kvrewrite.load(other_forms[form], policy=policy).cache_policy == policy
    coded = kvrewrite.load(other_forms["int4"], rate=RATE, recent_window=4)  # the compiled codec on the aged tier
    assert coded.tier_policy.codec is not None and coded.tier_policy.codec.name == "int4"
    plain = kvrewrite.load(other_forms["int4"], rate=RATE, recent_window=4, kv_codec="none", evict={"keep": 0.5})
    assert isinstance(plain.tier_policy, EvictionPolicy)


def test_budget_records_a_policy_and_older_records_still_read(tmp_path):
    policy = CachePolicy(rate=0.0, recent_window=16, kv_codec="none", evict={"keep": 0.263, "bits": [8, 4]})
    (tmp_path / TOKEN_POLICY_FILE).write_text(json.dumps({"kv_budget": 0.125, **policy_record(policy)}))
    assert read_cache_policy(tmp_path) == policy
    # What `kvrewrite budget` wrote before the policy object: the load() keywords under "load".
    older = {"rate": 0.0, "recent_window": 16, "kv_codec": "none", "evict": {"keep": 0.263, "bits": [8, 4]}}
    (tmp_path / TOKEN_POLICY_FILE).write_text(json.dumps({"kv_budget": 0.125, "load": older}))
    assert read_cache_policy(tmp_path) == policy
    (tmp_path / TOKEN_POLICY_FILE).write_text(json.dumps({"policy": {"rate": 0.0, "recent_window": 16}}))
    with pytest.raises(CorruptCheckpointError, match=r"token policy lacks \['evict', 'important', 'kv_codec'\]"):
        read_cache_policy(tmp_path)


def test_logits_equal_for_a_policy_passed_whole_or_as_keywords(compiled):
    keywords = {"rate": RATE, "recent_window": 4, "kv_codec": "none", "evict": {"keep": 0.5, "bits": (8, 4)}}
    tokens = random_windows(n=1, length=24, seed=3)
    logits = []
    for model in (
        kvrewrite.load(compiled["latent"], **keywords),
        kvrewrite.load(compiled["latent"], policy=CachePolicy(**keywords)),
    ):
        with torch.no_grad():
            logits.append(model.eval()(tokens).logits)
    assert torch.equal(logits[0], logits[1])
