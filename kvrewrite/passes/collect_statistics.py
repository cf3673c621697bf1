"""Pass 3: the calibration windows streamed through the model one decoder layer at a time, accumulating float64 Grams.

Per layer and KV head: pre- and post-RoPE queries (stacked over the group's query heads) and keys,
values; per query head: the attention outputs O_h = P_h V_g that o_proj sees.
"""

from __future__ import annotations

import torch

from kvrewrite.layer_streaming import StreamedModel
from kvrewrite.passes.context import CompileContext
from kvrewrite.progress import progress_bar
from kvrewrite.statistics import CalibrationStatistics, GramAccumulator, KMeansGramReducer


class CollectStatistics:
    name = "collect_statistics"
    description = "stream calibration windows through the model layer by layer, accumulate d_h x d_h Grams per head"

    def run(self, ctx: CompileContext) -> None:
        plan = ctx.plan
        ctx.statistics = collect_statistics(
            ctx.source.streamed(plan.compute_dtype(), plan.device),
            ctx.calibration_tokens,
            batch_size=plan.batch_size,
            reduce=plan.reduce,
            kmeans_clusters=plan.kmeans_clusters,
            kmeans_keep_share=plan.kmeans_keep_share,
            seed=plan.seed,
            progress=plan.progress,
        )
        ctx.report["statistics"] = {"tokens": ctx.statistics.tokens, "reduce": ctx.statistics.reduce, **ctx.statistics.notes}


def collect_statistics(
    model: StreamedModel,
    token_windows: torch.Tensor,
    *,
    batch_size: int = 4,
    reduce: str = "none",
    kmeans_clusters: int = 256,
    kmeans_keep_share: float = 0.5,
    seed: int = 0,
    progress: bool = True,
) -> CalibrationStatistics:
    """Layer by layer: every calibration batch goes through layer i (the only one holding weights), then i + 1.

    The hidden states of all windows are carried between layers (windows x seq_len x hidden in the
    compute dtype); the Grams are summed in float64 whatever the compute dtype.
    """
    adapter = model.adapter
    geo = adapter.geometry(model.skeleton.config)
    d, n_kv, n_q, group = geo.head_dim, geo.num_key_value_heads, geo.num_attention_heads, geo.group_size
    if reduce == "kmeans":
        sink = KMeansGramReducer(geo.num_layers, n_kv, n_q, d, clusters=kmeans_clusters, keep_share=kmeans_keep_share, seed=seed)
    else:
        sink = GramAccumulator(geo.num_layers, n_kv, n_q, d)

    captured: dict[str, torch.Tensor] = {}
    rope: dict[str, torch.Tensor] = {}

    def keep_output(kind: str):
        def hook(_module, _inputs, output):
            captured[kind] = output.detach()

        return hook

    def on_attention_output(layer_idx: int):
        # o_proj's input is the last thing a layer's attention computes: all its activations are known.
        def hook(_module, inputs):
            batch, length, _ = inputs[0].shape
            q = captured.pop("q").view(batch, length, n_q, d).transpose(1, 2)
            k_flat = captured.pop("k")  # [B, L, n_kv * d]: all KV heads side by side (key_pre_layer)
            k = k_flat.view(batch, length, n_kv, d).transpose(1, 2)
            v = captured.pop("v").view(batch, length, n_kv, d).transpose(1, 2)
            o = inputs[0].detach().view(batch, length, n_q, d).transpose(1, 2)
            q_post = adapter.apply_rope(q, rope["cos"], rope["sin"])
            k_post = adapter.apply_rope(k, rope["cos"], rope["sin"])
            for g in range(n_kv):
                heads = slice(g * group, (g + 1) * group)
                sink.add(layer_idx, "query_pre", g, q[:, heads])
                sink.add(layer_idx, "query_post", g, q_post[:, heads])
                sink.add(layer_idx, "key_pre", g, k[:, g])
                sink.add(layer_idx, "key_post", g, k_post[:, g])
                sink.add(layer_idx, "value", g, v[:, g])
            sink.add(layer_idx, "key_pre_layer", 0, k_flat)
            for h in range(n_q):
                sink.add(layer_idx, "output", h, o[:, h])
            sink.count(layer_idx, batch * length)

        return hook

    batches = torch.split(token_windows, batch_size)
    with torch.inference_mode(), progress_bar("collecting statistics", geo.num_layers + 1, progress) as bar:
        hidden = model.embed_batches(list(batches))
        inputs = [model.layer_inputs(h) for h in hidden]
        bar.advance()
        for idx in range(geo.num_layers):
            # The k-means reducer samples whole batches; the same batches must be kept at every layer.
            rng_state = sink.batch_rng_state() if isinstance(sink, KMeansGramReducer) else None
            with model.layer(idx) as layer:
                attn = adapter.attention(layer)
                handles = [
                    attn.q_proj.register_forward_hook(keep_output("q")),
                    attn.k_proj.register_forward_hook(keep_output("k")),
                    attn.v_proj.register_forward_hook(keep_output("v")),
                    attn.o_proj.register_forward_pre_hook(on_attention_output(idx)),
                ]
                try:
                    for b, (h, extra) in enumerate(zip(hidden, inputs)):
                        if rng_state is not None:
                            sink.start_batch()
                        rope["cos"], rope["sin"] = extra["position_embeddings"]
                        hidden[b] = model.run_layer(layer, h, extra)
                finally:
                    for handle in handles:
                        handle.remove()
            if rng_state is not None:
                sink.restore_batch_rng_state(rng_state)
            bar.advance()
    return sink.finish()
