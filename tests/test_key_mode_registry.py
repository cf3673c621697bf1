"""A key mode is one class plus a registration: a mode defined in this file alone compiles, loads and runs exactly.

`rotated-prefix` keeps each head's first r dims of the query and key AFTER RoPE (no basis, no fold): q_proj and
k_proj stay whole and the runtime rotates, then cuts. Exact at full rank; any rank is a valid (if crude) truncation.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from tiny_models import one_shot_and_cached_logits, random_windows, save_tiny_llama, tiny_pipeline
from transformers import AutoModelForCausalLM

import kvrewrite
from kvrewrite.compile.passes.pipeline import run_pipeline
from kvrewrite.compile.plan import Plan
from kvrewrite.errors import CorruptCheckpointError
from kvrewrite.key_modes import KeyMode, KeyTransform, key_mode_names, register_key_mode, unregister_key_mode


@dataclass(frozen=True, eq=False)
class RotatedPrefixTransform(KeyTransform):
    pass


class RotatedPrefixMode(KeyMode):
    name = "rotated-prefix"
    run_time_cost = 0.1
    run_time_sentence = "`rotated-prefix` layers rotate whole queries and keys, then keep each head's first dims"

    def allowed_for(self, features) -> bool:
        return features.has_rope

    def transform(self, objective, stats, geometry) -> RotatedPrefixTransform:
        # Energy of each post-RoPE dim in stored (natural) order: what truncating to r removes is spectrum[r:].
        spectra = [
            (torch.diagonal(stats.gram("query_post", g)) * torch.diagonal(stats.gram("key_post", g)))
            .clamp_min(0)
            .sqrt()
            for g in range(geometry.num_key_value_heads)
        ]
        return RotatedPrefixTransform(self.name, torch.stack(spectra))

    def slice_query_key(self, attn, key_ranks) -> None:
        """q_proj/k_proj stay whole: RoPE needs every dim; `project` cuts after rotating."""

    def project(self, attn, query, key, cos, sin):
        q = attn._apply_rope(attn._heads(query, attn.num_heads), cos, sin)  # [B, H, T, d]
        k = attn._apply_rope(attn._heads(key, attn.num_kv_heads), cos, sin)
        ranks = attn.key_ranks
        packed_q = torch.cat([q[:, h, :, : ranks[h // attn.group_size]] for h in range(attn.num_heads)], dim=-1)
        packed_k = torch.cat([k[:, g, :, : ranks[g]] for g in range(attn.num_kv_heads)], dim=-1)
        return packed_q, packed_k


@pytest.fixture
def rotated_prefix():
    register_key_mode(RotatedPrefixMode)  # the one registration line
    yield RotatedPrefixMode.name
    unregister_key_mode(RotatedPrefixMode.name)  # later tests see only the built-in modes


def test_a_mode_from_one_file_compiles_and_loads_exactly(rotated_prefix, tmp_path):
    source = save_tiny_llama(tmp_path / "src", seed=3, num_kv_heads=2, num_heads=4, layers=2)
    plan = Plan(
        model=str(source),
        output=tmp_path / "out",
        progress=False,
        rope_mode=rotated_prefix,
        target_rate=0.0,
        allocation="greedy",
    )
    ctx = run_pipeline(plan, tiny_pipeline())
    assert [layer.key_mode for layer in ctx.spec.layers] == [rotated_prefix] * 2
    assert rotated_prefix in key_mode_names()

    tokens = random_windows(2, 30, seed=7)
    original = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    full = kvrewrite.load(tmp_path / "out", rate=0.0)
    with torch.no_grad():
        diff = (full(tokens).logits - original(tokens).logits).abs().max().item()
    print(
        f"\n{rotated_prefix}: full-rank max |logit diff| vs the original = {diff:.2e}; "
        f"verify pass: {ctx.verification['full_rank_max_abs_logit_diff']:.2e}"
    )
    assert diff < 1e-4
    assert ctx.verification["full_rank_max_abs_logit_diff"] < 1e-4

    # At a lower rate of the table the mode slices at run time: prefill + decode equals one forward.
    model = kvrewrite.load(tmp_path / "out", rate=0.5)
    assert model.compression_spec.kept_elements_per_token < full.compression_spec.kept_elements_per_token
    one_shot, cached, _ = one_shot_and_cached_logits(model, tokens)
    assert (one_shot - cached).abs().max().item() < 1e-4

    # The checkpoint names its mode: without the registration it is refused, not misread.
    unregister_key_mode(rotated_prefix)
    with pytest.raises(CorruptCheckpointError, match="unknown key mode 'rotated-prefix'"):
        kvrewrite.load(tmp_path / "out")
