"""CPU linears on oneDNN-packed weights: the outputs of torch's row-major linear (or of float32 products, where the
plan widens bfloat16 weights), and the model back intact."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvrewrite.io.calibration_data import packed_linears
from kvrewrite.io.calibration_data.packed_linears import PackingPlan, can_pack, choose_packing, packed_cpu_linears
from kvrewrite.io.calibration_data.static_decoding import SamplingSettings, decode_batch

pytestmark = pytest.mark.skipif(not can_pack(), reason="this torch/CPU has no oneDNN bfloat16 linear")


def _model(tied: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=320,
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    return LlamaForCausalLM(config).eval().to(torch.bfloat16)


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("tied", [False, True])
def test_packed_logits_equal_row_major_and_weights_come_back(tied: bool) -> None:
    model = _model(tied)
    before = _snapshot(model)
    ids = torch.randint(3, 320, (5, 11))
    with torch.no_grad():
        reference = model(ids).logits.float()
    with packed_cpu_linears(model, rows=5, plan=choose_packing(model, widen=False)) as packed:
        # q, k, v, o, gate, up, down per layer, and the lm_head unless it is the embedding's matrix.
        assert packed == 2 * 7 + (0 if tied else 1)
        released = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m.weight.numel() == 0]
        assert len(released) == packed, "row-major weights are released while packed copies are used"
        with torch.no_grad():
            logits = model(ids).logits.float()
    # Both are oneDNN's bfloat16 products; the packed layout changes how the weight is read, not the sums.
    assert torch.equal(logits, reference)
    after = _snapshot(model)
    assert before.keys() == after.keys()
    for name in before:
        assert torch.equal(before[name], after[name]), name
    assert not any("forward" in m.__dict__ for m in model.modules())
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight


def test_restored_after_an_error_and_usable_by_autograd() -> None:
    model = _model(tied=False)
    before = _snapshot(model)
    with pytest.raises(KeyboardInterrupt):
        with packed_cpu_linears(model, rows=3):
            raise KeyboardInterrupt
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    # The rebuilt weights are ordinary leaves: a backward pass reaches them.
    model.model.layers[0].self_attn.q_proj.weight.requires_grad_(True)
    model(torch.randint(3, 320, (1, 6))).logits.float().sum().backward()
    assert model.model.layers[0].self_attn.q_proj.weight.grad is not None


def test_refused_inside_inference_mode() -> None:
    model = _model(tied=False)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="inference_mode"):
        with packed_cpu_linears(model, rows=3):
            pass


def _float32_products(model: torch.nn.Module) -> None:
    """The reference for widened packing, computed apart from oneDNN: each linear multiplies in float32 (torch's own
    row-major product) and rounds its output to the weight's dtype."""

    def forward(module: torch.nn.Linear):
        def run(x: torch.Tensor) -> torch.Tensor:
            bias = None if module.bias is None else module.bias.float()
            return torch.nn.functional.linear(x.float(), module.weight.float(), bias).to(x.dtype)

        return run

    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.forward = forward(module)


def test_widened_bfloat16_computes_float32_products_and_weights_come_back() -> None:
    model = _model(tied=False)
    before = _snapshot(model)
    ids = torch.randint(3, 320, (5, 11))
    plan = choose_packing(model, widen=True)
    assert plan.widen and plan.arithmetic == "onednn-float32"
    with packed_cpu_linears(model, rows=5, plan=plan) as packed:
        assert packed == 2 * 7 + 1
        with torch.no_grad():
            logits = model(ids).logits.float()
    after = _snapshot(model)
    for name in before:  # bfloat16 -> float32 -> bfloat16 is exact
        assert after[name].dtype == torch.bfloat16 and torch.equal(before[name], after[name]), name
    with torch.no_grad():
        row_major = model(ids).logits.float()
        _float32_products(model)
        reference = model(ids).logits.float()
    # Same products as the float32 reference up to the order of the sums (within 2% of the largest logit), and
    # nearer to it than bfloat16 products are.
    widened_error = (logits - reference).abs().max().item()
    assert widened_error <= 0.02 * reference.abs().max().item()
    assert widened_error <= (row_major - reference).abs().max().item()


def test_float32_weights_are_packed_too() -> None:
    model = _model(tied=False).float()
    before = _snapshot(model)
    ids = torch.randint(3, 320, (4, 9))
    with torch.no_grad():
        reference = model(ids).logits
    plan = choose_packing(model)
    assert plan.dtypes == (torch.float32,) and not plan.widen and plan.arithmetic == "onednn-float32"
    with packed_cpu_linears(model, rows=4, plan=plan) as packed:
        assert packed == 2 * 7 + 1
        with torch.no_grad():
            logits = model(ids).logits
    torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-5)
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name


def test_widening_is_chosen_only_without_bfloat16_instructions_and_with_memory(monkeypatch) -> None:
    model = _model(tied=False)
    # The packable bfloat16 weights: widening adds 2 bytes for each of their numbers.
    extra = 2 * sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    monkeypatch.setattr(packed_linears, "native_bfloat16", lambda: False)
    monkeypatch.setattr(packed_linears, "_available_memory_bytes", lambda: 8 << 30)
    assert choose_packing(model).widen
    monkeypatch.setattr(packed_linears, "_available_memory_bytes", lambda: extra)  # no headroom left
    assert not choose_packing(model).widen
    monkeypatch.setattr(packed_linears, "_available_memory_bytes", lambda: None)  # unknown: not risked
    assert not choose_packing(model).widen
    monkeypatch.setattr(packed_linears, "_available_memory_bytes", lambda: 8 << 30)
    monkeypatch.setattr(packed_linears, "native_bfloat16", lambda: True)
    plan = choose_packing(model)
    assert not plan.widen and plan.arithmetic is None  # bfloat16 products, as the row-major linear computes them


def test_nothing_to_pack_gives_an_empty_plan() -> None:
    with torch.device("meta"):
        model = LlamaForCausalLM(_model(tied=False).config)
    assert choose_packing(model) == PackingPlan()
    assert choose_packing(object()) == PackingPlan()


def test_sampled_tokens_match_row_major_decoding() -> None:
    model = _model(tied=False)
    settings = SamplingSettings(temperature=0.8, top_p=0.95, top_k=50, repetition_penalty=1.1)
    prompts = [[1, 5, 9, 11], [1, 7], [1, 30, 31, 32, 33, 34]]

    def decode() -> list[list[int]]:
        with torch.inference_mode():
            rows = decode_batch(
                model, prompts, [0, 1, 2], seed=7, settings=settings, max_new_tokens=12, eos_ids=[2], pad_id=2
            )
        return [r.tokens for r in rows]

    reference = decode()
    with packed_cpu_linears(model, rows=len(prompts), plan=choose_packing(model, widen=False)):
        packed = decode()
    assert packed == reference
