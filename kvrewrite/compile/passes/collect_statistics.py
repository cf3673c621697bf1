"""Pass 3: the calibration windows streamed through the model one decoder layer at a time, accumulating float64 Grams.

Per layer and KV head: pre- and post-RoPE queries (stacked over the group's query heads) and keys, read
where the adapter's taps say (after any q/k norm), and values; per query head: the attention outputs
O_h = P_h V_g that the output projection sees.
"""

from __future__ import annotations

import torch

from kvrewrite.compile.layer_streaming import StreamedModel
from kvrewrite.compile.passes.context import CompileContext
from kvrewrite.progress import progress_bar
from kvrewrite.method.statistics import CalibrationStatistics, GramAccumulator, KMeansGramReducer


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

    captured: dict[int, dict[str, torch.Tensor]] = {}
    rope: dict[str, list | None] = {}  # "tables": per layer (cos, sin) of the current batch

    def keep_output(layer_idx: int, read):
        def hook(_module, _inputs, output):
            for kind, tensor in read(output).items():
                captured.setdefault(layer_idx, {})[kind] = tensor.detach()

        return hook

    def on_attention_output(layer_idx: int):
        # The output projection's input is the last thing a layer's attention computes: all its activations are known.
        def hook(_module, inputs):
            acts = captured.pop(layer_idx)
            batch, length, _ = inputs[0].shape
            q = acts["q"].reshape(batch, length, n_q, d).transpose(1, 2)
            k = acts["k"].reshape(batch, length, n_kv, d).transpose(1, 2)
            v = acts["v"].reshape(batch, length, n_kv, d).transpose(1, 2)
            o = inputs[0].detach().view(batch, length, n_q, d).transpose(1, 2)
            if rope["tables"] is not None:
                cos, sin = rope["tables"][layer_idx]
                q_post = adapter.apply_rope(q, cos, sin)
                k_post = adapter.apply_rope(k, cos, sin)
            else:  # no RoPE: post-RoPE statistics are the pre-RoPE ones
                q_post, k_post = q, k
            for g in range(n_kv):
                heads = slice(g * group, (g + 1) * group)
                sink.add(layer_idx, "query_pre", g, q[:, heads])
                sink.add(layer_idx, "query_post", g, q_post[:, heads])
                sink.add(layer_idx, "key_pre", g, k[:, g])
                sink.add(layer_idx, "key_post", g, k_post[:, g])
                sink.add(layer_idx, "value", g, v[:, g])
            sink.add(layer_idx, "key_pre_layer", 0, acts["k"])  # [B, L, n_kv * d]: all KV heads side by side
            for h in range(n_q):
                sink.add(layer_idx, "output", h, o[:, h])
            sink.count(layer_idx, batch * length)

        return hook

    # Hooks on the skeleton's modules: they stay the same objects while their weights come and go.
    handles = []
    for idx, layer in enumerate(model.layers):
        attn = adapter.attention(layer)
        handles += [module.register_forward_hook(keep_output(idx, read)) for module, read in adapter.activation_taps(attn)]
        handles.append(adapter.output_projection(attn).register_forward_pre_hook(on_attention_output(idx)))
    batches = torch.split(token_windows, batch_size)
    try:
        with torch.inference_mode(), progress_bar("collecting statistics", geo.num_layers + 1, progress) as bar:
            hidden = model.embed_batches(list(batches))
            inputs = [model.layer_inputs(h) for h in hidden]
            # Per batch, the (cos, sin) each layer is rotated with (None without RoPE), as the stock model makes them.
            tables = []
            for h in hidden:
                positions = torch.arange(h.shape[1], device=h.device).expand(h.shape[0], -1)
                tables.append(adapter.rope_tables(model.skeleton, torch.empty(0, dtype=h.dtype, device=h.device), positions))
            bar.advance()
            for idx in range(geo.num_layers):
                # The k-means reducer samples whole batches; the same batches must be kept at every layer.
                rng_state = sink.batch_rng_state() if isinstance(sink, KMeansGramReducer) else None
                with model.layer(idx) as layer:
                    for b, (h, extra) in enumerate(zip(hidden, inputs)):
                        if rng_state is not None:
                            sink.start_batch()
                        rope["tables"] = tables[b]
                        hidden[b] = model.run_layer(layer, h, extra)
                if rng_state is not None:
                    sink.restore_batch_rng_state(rng_state)
                bar.advance()
    finally:
        for handle in handles:
            handle.remove()
    return sink.finish()
