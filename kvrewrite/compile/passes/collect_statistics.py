"""Pass 3: the calibration windows streamed through the model one decoder layer at a time, accumulating float64 Grams.

Per layer and KV head: pre- and post-RoPE queries (stacked over the group's query heads) and keys, read
where the adapter's taps say (after any q/k norm), and values; per query head: the attention outputs
O_h = P_h V_g that the output projection sees.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from kvrewrite.compile.layer_streaming import StreamedModel
from kvrewrite.compile.passes.context import CompileContext
from kvrewrite.method.statistics import CalibrationStatistics, GramAccumulator, KMeansGramReducer
from kvrewrite.progress import progress_bar


class CollectStatistics:
    name = "collect_statistics"
    description = "stream calibration windows through the model layer by layer, accumulate d_h x d_h Grams per head"

    produces = ("statistics", "report.statistics")

    def run(self, ctx: CompileContext) -> dict:
        plan = ctx.plan
        statistics = collect_statistics(
            ctx.source.streamed(plan.compute_dtype(ctx.config), plan.device),
            ctx.calibration_tokens,
            batch_size=plan.batch_size,
            reduce=plan.reduce,
            kmeans_clusters=plan.kmeans_clusters,
            kmeans_keep_share=plan.kmeans_keep_share,
            seed=plan.seed,
            progress=plan.progress,
        )
        return {
            "statistics": statistics,
            "report.statistics": {"tokens": statistics.tokens, "reduce": statistics.reduce, **statistics.notes},
        }


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
    if reduce == "kmeans":
        sink = KMeansGramReducer(
            geo.num_layers,
            geo.num_key_value_heads,
            geo.num_attention_heads,
            geo.head_dim,
            clusters=kmeans_clusters,
            keep_share=kmeans_keep_share,
            seed=seed,
        )
    else:
        sink = GramAccumulator(geo.num_layers, geo.num_key_value_heads, geo.num_attention_heads, geo.head_dim)
    with gram_hooks(model, sink):
        same_batches = None
        extra = []
        if isinstance(sink, KMeansGramReducer):
            # The k-means reducer samples whole batches; the same batches must be kept at every layer. (On the
            # attention, not the layer: the stock forward calls the layers' stand-ins while it prepares their inputs.)
            extra = [
                adapter.attention(layer).register_forward_pre_hook(lambda *_: sink.start_batch())
                for layer in model.layers
            ]

            @contextlib.contextmanager
            def same_batches(_idx, _layer):
                state = sink.batch_rng_state()
                yield
                sink.restore_batch_rng_state(state)

        try:
            with torch.inference_mode(), progress_bar("collecting statistics", geo.num_layers, progress) as bar:
                model.forward(list(torch.split(token_windows, batch_size)), on_layer=same_batches, progress=bar.advance)
        finally:
            for handle in extra:
                handle.remove()
    return sink.finish()


@contextlib.contextmanager
def gram_hooks(model: StreamedModel, sink: GramAccumulator) -> Iterator[GramAccumulator]:
    """Inside the block, every decoder layer of `model` that runs adds its activations' Grams to `sink` (at its
    layer index): pre- and post-RoPE queries and keys per KV head, values, attention outputs per query head."""
    adapter = model.adapter
    geo = adapter.geometry(model.skeleton.config)
    d, n_kv, n_q, group = geo.head_dim, geo.num_key_value_heads, geo.num_attention_heads, geo.group_size
    captured: dict[int, dict[str, torch.Tensor]] = {}
    rope: dict[tuple, list | None] = {}  # batch shape -> per layer (cos, sin), as the stock model makes them

    def rope_tables(o_input: torch.Tensor) -> list | None:
        batch, length, _ = o_input.shape
        if (batch, length) not in rope:
            positions = torch.arange(length, device=o_input.device).expand(batch, -1)
            probe = torch.empty(0, dtype=o_input.dtype, device=o_input.device)
            rope[(batch, length)] = adapter.rope_tables(model.skeleton, probe, positions)
        return rope[(batch, length)]

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
            tables = rope_tables(inputs[0])
            if tables is not None:
                cos, sin = tables[layer_idx]
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
        handles += [
            module.register_forward_hook(keep_output(idx, read)) for module, read in adapter.activation_taps(attn)
        ]
        handles.append(adapter.output_projection(attn).register_forward_pre_hook(on_attention_output(idx)))
    try:
        yield sink
    finally:
        for handle in handles:
            handle.remove()
