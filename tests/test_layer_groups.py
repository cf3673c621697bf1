"""benchmarks/attention_evidence.py (the layer-groups benchmark's measurements): attention evidence equals a dense
reference, and the set / group / mass-share helpers."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from benchmarks.attention_evidence import (
    greedy_layer_groups,
    group_ratio,
    important_mask,
    linear_ramp,
    mass_share,
    record_attention_evidence,
    repetition_matrix,
    scale_to_mean,
)
from kvrewrite.errors import InvalidArgumentError
from tests.tiny_models import VOCAB, tiny_llama_config


def _tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(layers=3)).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # sharpen attention so the scores differ between tokens
            layer.self_attn.q_proj.weight.mul_(4.0)
            layer.self_attn.k_proj.weight.mul_(4.0)
    model.config._attn_implementation = "eager"
    return model


def test_evidence_equals_dense_reference():
    model = _tiny_model()
    torch.manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, 24))
    window = 5
    captured = {}

    def grab(module, args, kwargs):
        captured[module.layer_idx] = (kwargs["hidden_states"], kwargs["position_embeddings"])

    hooks = [layer.self_attn.register_forward_pre_hook(grab, with_kwargs=True) for layer in model.model.layers]
    with torch.no_grad():
        ref = model(ids, output_attentions=True)
    for h in hooks:
        h.remove()
    evidence = record_attention_evidence(model, ids, window)
    assert model.config._attn_implementation == "eager"  # restored
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, ref.logits, atol=1e-5)

    t = torch.arange(ids.shape[1])
    aged = (t[:, None] - t[None, :]) > window
    for i, attn in enumerate(ref.attentions):  # [B, H, T, T]
        p = attn.double()
        assert torch.allclose(evidence.received[i], p.sum(dim=(1, 2)), atol=1e-6)
        assert torch.allclose(evidence.aged_received[i], (p * aged).sum(dim=(1, 2)), atol=1e-6)
        # ZDC's score: log sum_h sum_{k<=t} exp(q_t k_k / sqrt(d)), from the layer's own q and k
        attn_module = model.model.layers[i].self_attn
        hidden, (cos, sin) = captured[i]
        shape = (*hidden.shape[:-1], -1, attn_module.head_dim)
        with torch.no_grad():
            q = attn_module.q_proj(hidden).view(shape).transpose(1, 2)
            k = attn_module.k_proj(hidden).view(shape).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        logits = (q @ k.transpose(-1, -2)).double() * attn_module.scaling
        logits = logits.masked_fill(t[None, :] > t[:, None], float("-inf"))
        denominator = logits.exp().sum(dim=-1).sum(dim=1)  # the paper's sum, no log
        assert torch.allclose(evidence.log_denominator[i].exp(), denominator, rtol=1e-4)

    readers = torch.arange(ids.shape[1], 0, -1).double()
    assert torch.allclose(evidence.mean_received(), evidence.received / readers)
    aged_readers = (readers - 1 - window).clamp(min=0)
    expected = torch.where(aged_readers > 0, evidence.aged_received / aged_readers.clamp(min=1), 0.0)
    assert torch.allclose(evidence.mean_aged_received(), expected)
    assert (evidence.mean_aged_received()[..., -window - 1 :] == 0).all()


def test_important_mask_global_and_per_pool():
    scores = torch.tensor([[5.0, 1, 2, 9, 0, 3, 8, 4]])
    glob = important_mask(scores, 0.25)
    assert glob.tolist() == [[False, False, False, True, False, False, True, False]]
    pooled = important_mask(scores, 0.25, pool=4)  # one per pool of 4
    assert pooled.tolist() == [[False, False, False, True, False, False, True, False]]
    pooled = important_mask(scores, 0.5, pool=4)
    assert pooled.tolist() == [[True, False, False, True, False, False, True, True]]
    assert not important_mask(scores, 0.0).any()
    with pytest.raises(InvalidArgumentError):
        important_mask(scores, 0.25, pool=3)
    with pytest.raises(InvalidArgumentError):
        important_mask(scores, 1.5)


def test_repetition_matrix_and_groups():
    # 2 samples, 4 layers, 4 tokens; sets of 2 tokens each
    a = torch.tensor([1, 1, 0, 0], dtype=torch.bool)
    b = torch.tensor([1, 0, 1, 0], dtype=torch.bool)
    c = torch.tensor([0, 0, 1, 1], dtype=torch.bool)
    masks = torch.stack([torch.stack([a, a, b, c]), torch.stack([a, a, a, c])])
    r = repetition_matrix(masks)
    assert r.shape == (4, 4)
    assert torch.allclose(r.diagonal(), torch.ones(4, dtype=torch.float64))
    assert r[0, 1] == 1.0
    assert r[0, 2] == pytest.approx((1 + 2) / 4)  # sample 1: |a∩b| = 1, sample 2: 2; sizes 2 + 2
    assert r[0, 3] == pytest.approx(0.0)
    assert greedy_layer_groups([r], 0.95) == [[0, 1], [2], [3]]
    assert greedy_layer_groups([r], 0.7) == [[0, 1, 2], [3]]
    # a second matrix (say the unimportant sets) can veto a join
    veto = r.clone()
    veto[0, 2] = 0.5
    assert greedy_layer_groups([r, veto], 0.7) == [[0, 1], [2], [3]]
    assert group_ratio(r, [0, 1, 2]) == pytest.approx((1.0 + 0.75) / 2)
    assert group_ratio(r, [3]) is None


def test_mass_share():
    mass = torch.tensor([[0.5, 0.3, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25]], dtype=torch.float64)
    assert mass_share(mass, 0.8).tolist() == [0.5, 1.0]
    assert mass_share(mass, 0.5).tolist() == [0.25, 0.5]
    # per pool of 2: pools (0.5, 0.3) -> 1 token of 2 holds 0.5/0.8 < 0.8 -> 2; (0.1, 0.1) -> 2 of 2
    assert mass_share(mass[:1], 0.6, pool=2).tolist() == [pytest.approx((0.5 + 1.0) / 2)]
    with pytest.raises(InvalidArgumentError):
        mass_share(mass, 0.0)


def test_linear_ramp():
    ramp = linear_ramp([0.1, 0.2, 0.3, 0.4], mean=0.25)
    assert sum(ramp) / 4 == pytest.approx(0.25)
    assert ramp == sorted(ramp)
    assert ramp[0] == pytest.approx(0.1)
    flat = linear_ramp([0.3, 0.3, 0.3], mean=0.2)
    assert flat == [pytest.approx(0.2)] * 3
    clipped = linear_ramp([0.0, 1.0], mean=0.6, high=0.8)
    assert max(clipped) <= 0.8 and min(clipped) >= 0.0


def test_scale_to_mean():
    assert scale_to_mean([1.0, 2.0, 3.0], 0.2) == [pytest.approx(0.1), pytest.approx(0.2), pytest.approx(0.3)]
    clipped = scale_to_mean([0.1, 0.1, 1.0], 0.4, high=0.6)
    assert max(clipped) == pytest.approx(0.6)
    assert sum(clipped) / 3 == pytest.approx(0.4)
