"""Pass (only with --value-metric fisher): how much each direction of every layer's attention output matters downstream.

The output-aware value objective minimises E||O (I - A_r B_r) W_O||^2: every hidden direction of the
attention output counts the same. But the residual stream is read very unevenly downstream (a few
directions carry most of what changes the loss). To first order the loss moves by g . Δ, where g is
the gradient of the next-token loss with respect to the layer's attention output, so the expected
squared change is Δ F Δ^T with F = E[g^T g] (the empirical Fisher of that output). The objective
becomes ||C^{1/2} (I - A_r B_r) W_O F^{1/2}||^2: the same closed-form solver with W_O right-multiplied
by F^{1/2}, still optimal for every rank at once, still folded exactly (zero runtime cost).

F is shrunk towards the identity (`Plan.fisher_shrink`) at matched trace, since an empirical Fisher from
a few thousand tokens is noisy in its small directions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvrewrite.compile.on_device import whole_model_on
from kvrewrite.compile.passes.context import CompileContext
from kvrewrite.method.linalg import psd_sqrt
from kvrewrite.progress import progress_bar

FISHER_BATCH = 2


def output_fisher(model, out_projections, windows: torch.Tensor, show_progress: bool = False) -> list[torch.Tensor]:
    """Per layer, the float64 sum over tokens of g^T g for g = d(next-token NLL)/d(attention output).

    out_projections: each layer's output projection (o_proj, OPT's out_proj, ...); its output is hooked."""
    hidden = model.config.hidden_size
    device = next(model.parameters()).device  # the sums stay where the gradients are
    sums = [torch.zeros(hidden, hidden, dtype=torch.float64, device=device) for _ in out_projections]

    def hook_for(idx):
        def forward_hook(_module, _inputs, output):
            def grad_hook(grad):
                g = grad.reshape(-1, grad.shape[-1]).double()
                sums[idx].add_(g.T @ g)

            output.register_hook(grad_hook)

        return forward_hook

    handles = [module.register_forward_hook(hook_for(i)) for i, module in enumerate(out_projections)]
    flags = [p.requires_grad for p in model.parameters()]
    for p in model.parameters():
        p.requires_grad_(False)
    try:
        batches = windows.split(FISHER_BATCH)
        with progress_bar("collecting output Fisher", len(batches), show_progress) as bar:
            for tokens in batches:
                tokens = tokens.to(device)
                embeds = model.get_input_embeddings()(tokens).detach().requires_grad_(True)
                logits = model(inputs_embeds=embeds, use_cache=False).logits.float()
                loss = F.cross_entropy(
                    logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1), reduction="sum"
                )
                loss.backward()
                bar.advance()
    finally:
        for handle in handles:
            handle.remove()
        for p, flag in zip(model.parameters(), flags):
            p.requires_grad_(flag)
    return [s.cpu() for s in sums]


def shrunk_sqrt(fisher: torch.Tensor, shrink: float) -> torch.Tensor:
    """((1 - s) F + s tr(F)/n I)^{1/2}, F scaled to trace n (only its shape matters to the objective)."""
    n = fisher.shape[0]
    scaled = fisher * (n / fisher.trace().clamp_min(1e-300))
    return psd_sqrt((1 - shrink) * scaled + shrink * torch.eye(n, dtype=fisher.dtype))


class CollectFisher:
    name = "collect_fisher"
    description = "(--value-metric fisher) gradient second moments of every attention output, for the value objective"

    produces = ("output_metric", "report.fisher")

    def run(self, ctx: CompileContext) -> dict:
        plan = ctx.plan
        if plan.value_metric != "fisher" or plan.objective != "optimal":
            return {"output_metric": None}
        n_windows = max(1, -(-plan.fisher_tokens // ctx.calibration_tokens.shape[1]))
        windows = ctx.calibration_tokens[:n_windows]
        # Gradients need the whole model: loaded here (fp32) only for --value-metric fisher, not layer-streamed; run on
        # the compile device, then back to the host copy the other whole-model passes share.
        adapter = ctx.adapter
        with whole_model_on(ctx.original_model(), plan.device) as model, torch.enable_grad():
            out_projections = [
                adapter.output_projection(adapter.attention(layer)) for layer in adapter.decoder_layers(model)
            ]
            sums = output_fisher(model, out_projections, windows, plan.progress)
        return {
            "output_metric": [shrunk_sqrt(s, plan.fisher_shrink) for s in sums],
            "report.fisher": {"tokens": int(windows.numel()), "shrink": plan.fisher_shrink},
        }
