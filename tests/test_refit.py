"""Output refit (--refit output): o_proj refitted by least squares at the compiled ranks, layer by layer."""

from __future__ import annotations

import pytest
import torch
from tiny_models import random_windows, save_tiny_llama, tiny_pipeline
from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import kvrewrite
from kvrewrite.compile.passes.pipeline import run_pipeline
from kvrewrite.compile.plan import Plan
from kvrewrite.compile.sweep import parse_config, rate_sliceable
from kvrewrite.errors import InvalidArgumentError
from kvrewrite.publish.evaluation import perplexity_and_agreement

CALIB = random_windows(12, 48, seed=5)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    root = tmp_path_factory.mktemp("refit")
    src = save_tiny_llama(root / "src", seed=7, num_kv_heads=2, num_heads=4, layers=3)
    plans = {
        name: Plan(
            model=str(src),
            output=root / name,
            progress=False,
            target_rate=0.5,
            allocation="uniform",
            refit=name,
            refit_tokens=int(CALIB.numel()),
            refit_ridge=0.0,
        )
        for name in ("none", "output", "output-local")
    }
    contexts = {name: run_pipeline(plan, tiny_pipeline(CALIB)) for name, plan in plans.items()}
    return src, contexts


def dense_attention(attn, rotary, hidden: torch.Tensor) -> torch.Tensor:
    """The stock Llama attention written out in float64 (GQA by repetition, causal softmax, o_proj)."""
    b, t, _ = hidden.shape
    n_q, n_kv = attn.config.num_attention_heads, attn.config.num_key_value_heads
    d = attn.head_dim
    x = hidden.double()
    q = (x @ attn.q_proj.weight.double().T).view(b, t, n_q, d).transpose(1, 2)
    k = (x @ attn.k_proj.weight.double().T).view(b, t, n_kv, d).transpose(1, 2)
    v = (x @ attn.v_proj.weight.double().T).view(b, t, n_kv, d).transpose(1, 2)
    cos, sin = rotary(hidden, torch.arange(t)[None].expand(b, t))
    q, k = apply_rotary_pos_emb(q, k, cos.double(), sin.double())
    k, v = (z.repeat_interleave(n_q // n_kv, dim=1) for z in (k, v))
    scores = (q @ k.transpose(-1, -2)) * d**-0.5
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, n_q * d)
    return out @ attn.o_proj.weight.double().T


def _refit_inputs(model, original):
    """Per layer: the attention's input hidden states and o_proj's input in `model`, and the original model's
    attention input hidden states, on CALIB."""
    seen: dict = {}
    handles = []
    for tag, net in (("c", model), ("o", original)):
        for idx, layer in enumerate(net.model.layers):
            handles.append(
                layer.self_attn.register_forward_pre_hook(
                    lambda _m, args, kwargs, i=idx, t=tag: seen.__setitem__((t, "x", i), kwargs["hidden_states"]),
                    with_kwargs=True,
                )
            )
            handles.append(
                layer.self_attn.o_proj.register_forward_pre_hook(
                    lambda _m, inp, i=idx, t=tag: seen.__setitem__((t, "z", i), inp[0])
                )
            )
    with torch.no_grad():
        model(input_ids=CALIB, use_cache=False)
        original(input_ids=CALIB, use_cache=False)
    for handle in handles:
        handle.remove()
    return seen


@pytest.mark.parametrize("refit", ["output", "output-local"])
def test_every_layer_is_the_least_squares_fit_on_refitted_inputs(compiled, refit):
    """Each refitted o_proj is lstsq(z, t): z = its own latents at the compiled ranks (behind the already refitted
    earlier layers), t = a dense float64 original attention on the original model's hidden states (output) or on
    the refitted model's own hidden states (output-local)."""
    src, contexts = compiled
    original = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    model = kvrewrite.load(contexts[refit].output_dir)
    seen = _refit_inputs(model, original)
    for idx, layer in enumerate(model.model.layers):
        z = seen[("c", "z", idx)].reshape(-1, seen[("c", "z", idx)].shape[-1]).double()
        hidden = seen[("o" if refit == "output" else "c", "x", idx)]
        with torch.no_grad():
            t = dense_attention(original.model.layers[idx].self_attn, original.model.rotary_emb, hidden)
        reference = torch.linalg.lstsq(z, t.reshape(-1, t.shape[-1])).solution.T
        assert torch.allclose(layer.self_attn.o_proj.weight.double(), reference, rtol=1e-4, atol=1e-5), idx


def test_refit_lowers_the_error_on_other_text_and_serves_only_its_rate(compiled):
    src, contexts = compiled
    original = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    held_out = random_windows(8, 48, seed=11)
    kl = {
        name: perplexity_and_agreement(kvrewrite.load(ctx.output_dir), held_out, original, progress=False).kl_mean
        for name, ctx in contexts.items()
    }
    assert kl["output"] < 0.9 * kl["none"], kl
    assert kl["output-local"] < 0.9 * kl["none"], kl
    report = contexts["output"].report["refit"]
    assert all(
        a <= b + 1e-9 for a, b in zip(report["layer_relative_error_after"], report["layer_relative_error_before"])
    )
    assert list(contexts["output"].spec.rate_table) == ["0.50"]
    assert report["verify_kl_after"] < report["verify_kl_before"]
    assert contexts["output"].verification["compiled_rank"]["kl_mean"] == report["verify_kl_after"]
    with pytest.raises(InvalidArgumentError, match="rate table"):
        kvrewrite.load(contexts["output"].output_dir, rate=0.3)
    # Without the refit nothing changes: the full rate table, and every rate loads.
    assert "0.30" in contexts["none"].spec.rate_table


def test_sweep_compiles_refit_configs_at_every_rate():
    assert not rate_sliceable(parse_config("latent-sensitivity-refit").overrides)
    assert not rate_sliceable(parse_config("r:base=latent-sensitivity,refit=output-local").overrides)
    assert rate_sliceable(parse_config("latent-sensitivity").overrides)
    with pytest.raises(InvalidArgumentError, match="refit"):
        Plan(model="x", refit="bogus")


def test_one_refit_over_stacked_truncations_is_the_refit_of_their_rows(compiled):
    """refit_output_projections(copies=2) on a full-rank model truncated by rows: with both copies at the compiled
    ranks the rows are duplicated, which leaves the ridge solution unchanged, so it equals the production refit of
    the sliced model (same logits); o_proj columns beyond the compiled ranks, read by no row, keep their weights."""
    from kvrewrite.adapters import adapter_for
    from kvrewrite.compile.probes import truncated_by_rows, truncated_model
    from kvrewrite.method.output_refit import refit_output_projections

    src, contexts = compiled
    original = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    adapter = adapter_for(original.config)
    directory = contexts["none"].output_dir
    sliced = kvrewrite.load(directory)
    ranks = (
        [l.self_attn.key_ranks for l in sliced.model.layers],
        [l.self_attn.value_ranks for l in sliced.model.layers],
    )
    full = kvrewrite.load(directory, rate=0.0)
    before = [l.self_attn.o_proj.weight.detach().clone() for l in full.model.layers]
    refit_output_projections(sliced, original, adapter, CALIB, ridge=1e-4)
    with truncated_by_rows(full, adapter, [ranks, ranks], rows_per_block=CALIB.shape[0]):
        refit_output_projections(full, original, adapter, CALIB, ridge=1e-4, copies=2)
    held_out = random_windows(4, 48, seed=13)
    with torch.no_grad(), truncated_model(full, adapter, *ranks):
        stacked = full(held_out).logits
    with torch.no_grad():
        assert (stacked - sliced(held_out).logits).abs().max().item() < 1e-4
    n_q = original.config.num_attention_heads
    for layer, old, values in zip(full.model.layers, before, ranks[1]):
        o_proj, d = layer.self_attn.o_proj.weight, layer.self_attn.head_dim
        group = n_q // len(values)  # query heads per KV head; head h reads its KV head's first values[h // group] dims
        for h in range(n_q):
            unread = slice(h * d + values[h // group], (h + 1) * d)
            assert torch.equal(o_proj[:, unread], old[:, unread])
        assert not torch.equal(o_proj, old)  # the read columns were refitted
