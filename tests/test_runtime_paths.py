"""The runtime picks its attention path by device; every path gives the reference model's outputs."""

from __future__ import annotations

import pytest
import torch

import kvrewrite
from kvrewrite.errors import InvalidArgumentError
from kvrewrite.kernels.buckets import BucketedAttention
from kvrewrite.kernels.dispatch import resolve_backend
from kvrewrite.passes.pipeline import run_pipeline
from kvrewrite.plan import Plan
from tiny_models import save_tiny_llama, tiny_pipeline


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    root = tmp_path_factory.mktemp("paths")
    src = save_tiny_llama(root / "src", seed=3, num_kv_heads=2, num_heads=4)
    out = {}
    for mode in ("freq", "post-rope"):
        plan = Plan(model=str(src), output=root / mode, progress=False, target_rate=0.5, rope_mode=mode)
        run_pipeline(plan, tiny_pipeline())
        out[mode] = root / mode
    return out


def _generate_logits(directory, monkeypatch, backend: str) -> torch.Tensor:
    monkeypatch.setenv("KVREWRITE_ATTENTION", backend)
    model = kvrewrite.load(directory).eval()
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return torch.stack(out.logits, dim=1)  # [B, new tokens, vocab]; prefill then 2 decode steps


def test_cpu_runs_rank_buckets_by_default(compiled, monkeypatch):
    monkeypatch.delenv("KVREWRITE_ATTENTION", raising=False)
    assert resolve_backend(torch.device("cpu")) == "torch"
    model = kvrewrite.load(compiled["freq"])
    with torch.no_grad():
        model(torch.tensor([[5, 6, 7]]))
    assert isinstance(model.model.layers[0].self_attn.packed_attention_runner(torch.device("cpu")), BucketedAttention)


def test_unknown_backend_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("KVREWRITE_ATTENTION", "cudnn")
    with pytest.raises(InvalidArgumentError, match="KVREWRITE_ATTENTION"):
        resolve_backend(torch.device("cpu"))


@pytest.mark.parametrize("mode", ["freq", "post-rope"])
def test_bucketed_and_triton_generation_match_reference(compiled, monkeypatch, mode):
    pytest.importorskip("triton")
    reference = _generate_logits(compiled[mode], monkeypatch, "reference")
    for backend in ("torch", "triton"):
        logits = _generate_logits(compiled[mode], monkeypatch, backend)
        assert (logits - reference).abs().max().item() < 1e-4, backend
