"""Error-compensating least-squares refit of every o_proj at the compiled ranks (zero runtime cost).

The value transforms are the optimum of a per-layer metric measured on the ORIGINAL model: original keys (so the
original attention probabilities), original inputs, and one up-projection shared by the query heads of a group.
At the compiled ranks none of that holds: the compressed keys change the probabilities, the earlier compressed
layers change the inputs, and each query head could read the shared value latent its own way. All three are
fixed by refitting o_proj, which reads the latents of every query head (nothing in the cache changes):

    W_O' = argmin_W  sum over calibration tokens || z W^T - t ||^2 + lam ||W||^2

where z is what the compressed layer feeds its o_proj (the packed attention output in the value latents, at the
compiled ranks) and t, bias removed, either the original MODEL's attention output of that layer (target "model",
`--refit output`: the drift the earlier layers left in the residual stream is absorbed too, as far as this o_proj
can; measured better on SmolLM2) or the original LAYER's attention on the compressed model's own input hidden
states (target "layer", `--refit output-local`: only this layer's error). It runs layer by layer in one forward pass over the calibration windows, GPTQ-style: each layer is refitted before
the next one runs, so later layers are fitted on the activations of the already refitted earlier ones.

The refit depends on the ranks, so a refitted checkpoint serves its compiled rate only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RefitLayerReport:
    relative_error_before: float  # ||z W_O^T - t|| / ||t|| with the folded o_proj
    relative_error_after: float  # the same with the refitted o_proj


def refit_windows(calibration_tokens: torch.Tensor, tokens: int) -> torch.Tensor:
    """The first calibration windows holding `tokens` tokens, rounded up to whole windows (at least one)."""
    return calibration_tokens[: max(1, -(-tokens // calibration_tokens.shape[1]))]


def least_squares_output(z: torch.Tensor, target: torch.Tensor, ridge: float) -> torch.Tensor:
    """argmin_W ||z W^T - target||^2 + lam ||W||^2, lam = ridge * mean diag(z^T z); float64, -> [out, in]."""
    gram = z.T @ z
    lam = ridge * gram.diagonal().mean().clamp_min(1e-30)
    return torch.linalg.solve(
        gram + lam * torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device), z.T @ target
    ).T


def record_attention_outputs(
    model, adapter, tokens: torch.Tensor, with_logits: bool = False
) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """Every layer's attention output (what the output projection returns) of one forward on tokens, and the
    logits when asked for (otherwise only the decoder stack runs: the LM head over a big batch is not needed)."""
    outputs: list[torch.Tensor] = []
    handles = [
        adapter.output_projection(adapter.attention(layer)).register_forward_hook(
            lambda _m, _i, out: outputs.append(out)
        )
        for layer in adapter.decoder_layers(model)
    ]
    tokens = tokens.to(next(model.parameters()).device)
    try:
        with torch.no_grad():
            if with_logits:
                return model(input_ids=tokens, use_cache=False).logits, outputs
            model.get_decoder()(input_ids=tokens, use_cache=False)
            return None, outputs
    finally:
        for handle in handles:
            handle.remove()


def original_attention_outputs(original, adapter, windows: torch.Tensor) -> list[torch.Tensor]:
    """Every layer's attention output (o_proj's output) of the original model on its own hidden states."""
    return record_attention_outputs(original, adapter, windows)[1]


def refit_output_projections(
    compressed,
    original,
    adapter,
    windows: torch.Tensor,
    ridge: float = 1e-4,
    target: str = "model",
    copies: int = 1,
    on_layer=None,
) -> list[RefitLayerReport]:
    """Refit, in place and layer by layer, the o_proj of every compressed attention against the original.

    compressed: the rewritten model at its compiled ranks (modified in place); original: the stock model.
    windows: [n, seq_len] calibration token ids, all run as one batch (memory: one layer's activations of them).
    target: "layer": the original attention on the compressed model's own hidden states (fix this layer's error);
    "model": the original model's attention output on the original hidden states (also absorb the drift the
    earlier layers left in the residual stream, as far as this o_proj can).
    copies: the compressed model runs `copies` stacked copies of the windows (a caller truncating each copy to other
    ranks, probes.truncated_by_rows, fits one o_proj to the rows of every truncation at once). o_proj columns that
    no row reads (all-zero latents) keep their weights.
    on_layer: called once after each layer's fit (a progress bar's advance).
    """
    c_layers = list(adapter.decoder_layers(compressed))
    o_layers = list(adapter.decoder_layers(original))
    call: dict = {}
    reports: list[RefitLayerReport] = []
    model_targets = original_attention_outputs(original, adapter, windows) if target == "model" else None

    def on_attention_call(_module, args, kwargs):
        call["args"], call["kwargs"] = args, kwargs

    def on_output_projection(idx: int):
        def hook(module, inputs):
            if model_targets is not None:
                target = model_targets[idx].repeat(copies, 1, 1)  # every copy's rows have the same target
                model_targets[idx] = None  # free it once used
            else:  # the original attention on exactly the hidden states (and positions, mask) the compressed one got
                target = adapter.attention(o_layers[idx])(*call["args"], **call["kwargs"])[0]
            if module.bias is not None:
                target = target - module.bias
            z = inputs[0].reshape(-1, inputs[0].shape[-1]).double()
            t = target.reshape(-1, target.shape[-1]).double()
            read = z.abs().amax(0) > 0  # columns some row reads; the others stay as they are
            weight = module.weight.detach().double().clone()
            weight[:, read] = least_squares_output(z[:, read], t, ridge)
            norm = t.norm().clamp_min(1e-30)
            reports.append(
                RefitLayerReport(
                    float((z @ module.weight.double().T - t).norm() / norm), float((z @ weight.T - t).norm() / norm)
                )
            )
            module.weight.copy_(weight.to(module.weight.dtype))  # o_proj's forward then uses the refitted weight
            if on_layer is not None:
                on_layer()

        return hook

    handles = []
    for idx, layer in enumerate(c_layers):
        attn = adapter.attention(layer)
        handles.append(attn.register_forward_pre_hook(on_attention_call, with_kwargs=True))
        handles.append(adapter.output_projection(attn).register_forward_pre_hook(on_output_projection(idx)))
    try:
        with torch.no_grad():
            # The decoder stack only: the LM head's logits over the whole batch are not needed.
            compressed.get_decoder()(
                input_ids=windows.to(next(compressed.parameters()).device).repeat(copies, 1), use_cache=False
            )
    finally:
        for handle in handles:
            handle.remove()
    return reports


def scatter_refit_columns(
    full_weight: torch.Tensor, refit_weight: torch.Tensor, value_ranks: list[int], group_size: int, head_dim: int
) -> torch.Tensor:
    """Write a refitted o_proj [out, sum_h r_h] into the prefix columns of each query head's block of the full-rank
    o_proj [out, n_q * d]; the columns beyond each rank (unused at the compiled ranks) are left as they were."""
    out = full_weight.clone()
    start = 0
    for g, rank in enumerate(value_ranks):
        for j in range(group_size):
            h = g * group_size + j
            out[:, h * head_dim : h * head_dim + rank] = refit_weight[:, start : start + rank]
            start += rank
    return out
