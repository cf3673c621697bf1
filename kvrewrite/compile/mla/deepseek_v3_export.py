"""Write the MLA form as a stock DeepSeek-V3 checkpoint (config and weight names of transformers' DeepseekV3ForCausalLM).

- q_lora_rank null, kv_lora_rank r, qk_rope_head_dim d_r, qk_nope_head_dim = v_head_dim = head_dim,
  rope_interleave true (our k_pe pairs are (2p, 2p + 1)), the source's rope parameters (pair p holds source frequency
  p * head_dim / d_r, so the schedule base^(-2p/d_r) is the source's own).
- Every MLP dense: first_k_dense_replace = number of layers, Llama's gate/up/down under the same names; an integer
  n_routed_experts is still required by the config, no expert weights exist.
- lm_head written explicitly (tie_word_embeddings false), tokenizer files copied.
- kv_a_layernorm neutralised (method/latent_norm.py). transformers builds that norm with eps 1e-6 whatever the config
  says, while llama.cpp and vLLM use config.rms_norm_eps: the config's rms_norm_eps is set to 1e-6 so all three agree;
  that also moves the model's other RMSNorms from the source eps to 1e-6 (its effect is measured by the caller).
- Per-layer latent widths (`export-mla --layer-widths sensitivity`): every layer is zero-padded to the widest one,
  whose width is the config's kv_lora_rank, and the marker lists the true widths (`kv_lora_ranks`). Stock engines run
  the padded form (same outputs, padded cache); kvrewrite's runtime drops the zero rows and caches the true widths.
- `--refit-rates`: every narrower served rate's own o_proj in `kvrewrite_rates/o_proj.safetensors`, which no engine
  reads (runtime/mla/rate_projections.py); the stock weights hold the widest rate's.
- Written atomically: nothing is left at the output if anything fails.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from kvrewrite.errors import InvalidArgumentError
from kvrewrite.io.checkpoint_io import atomic_output_dir, save_safetensors, write_safetensors_shards
from kvrewrite.io.manifest import write_manifest
from kvrewrite.method.latent_norm import LatentNormNeutraliser, dtype_holds_latent, neutralise_latent_norm
from kvrewrite.method.mla import MLALayer
from kvrewrite.runtime.mla.checkpoint import LATENT_RANKS_KEY, MLA_FORMAT_VERSION, MLA_MARKER, RATE_TABLE_KEY
from kvrewrite.runtime.mla.rate_projections import RATE_O_PROJ_FILE, RATE_O_PROJ_KEY, rate_o_proj_name

# transformers' DeepseekV3Attention builds kv_a_layernorm as DeepseekV3RMSNorm(kv_lora_rank): default eps 1e-6.
TRANSFORMERS_LATENT_NORM_EPS = 1e-6
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "generation_config.json",
)
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass(frozen=True)
class ExportSummary:
    output: Path
    neutralisers: list[LatentNormNeutraliser]
    dtype: torch.dtype


def padded_latent_rank(layers: list[MLALayer]) -> int:
    return max(layer.kv_lora_rank for layer in layers)


def latent_width_marker(layers: list[MLALayer], rate_table: dict[str, list[int]] | None = None) -> dict:
    """The marker's record of per-layer widths (nothing when every layer has the config's width) and of the rate
    table, whose widths must be prefixes of the exported ones."""
    ranks = [layer.kv_lora_rank for layer in layers]
    marker = {} if len(set(ranks)) == 1 else {LATENT_RANKS_KEY: ranks}
    for key, widths in (rate_table or {}).items():
        if len(widths) != len(ranks) or any(not 1 <= w <= r for w, r in zip(widths, ranks)):
            raise InvalidArgumentError(f"rate {key}'s latent widths {widths} are not within the exported ones {ranks}")
    if rate_table:
        marker[RATE_TABLE_KEY] = {key: list(widths) for key, widths in sorted(rate_table.items())}
    return marker


def deepseek_v3_config(
    source_config, layer: MLALayer, dtype: torch.dtype, provenance: dict | None = None, kv_lora_rank: int | None = None
) -> dict:
    """kv_lora_rank: the padded width when layers differ (default: layer's own)."""
    rope = dict(
        getattr(source_config, "rope_parameters", None)
        or {"rope_type": "default", "rope_theta": source_config.rope_theta}
    )
    # DeepSeek rotates pair p with base^(-2p/d_r); the source rotated frequency j with base^(-2j/head_dim). They agree
    # iff pair p holds frequency p * head_dim / d_r (one component per kept frequency, every stride-th frequency).
    d_r, d = layer.qk_rope_head_dim, layer.qk_nope_head_dim
    if [int(j) * d_r for j in layer.pair_frequency] != [p * d for p in range(d_r // 2)]:
        raise InvalidArgumentError(
            f"qk_rope_head_dim {d_r} with pairs at source frequencies {layer.pair_frequency.tolist()[:8]}...: DeepSeek's "
            "RoPE schedule would not match the source frequencies (export one RoPE component per kept frequency)"
        )
    n_layers = source_config.num_hidden_layers
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": source_config.vocab_size,
        "hidden_size": source_config.hidden_size,
        "intermediate_size": source_config.intermediate_size,
        "moe_intermediate_size": source_config.intermediate_size,
        "num_hidden_layers": n_layers,
        "num_attention_heads": source_config.num_attention_heads,
        "num_key_value_heads": source_config.num_attention_heads,
        "q_lora_rank": None,
        "kv_lora_rank": layer.kv_lora_rank if kv_lora_rank is None else kv_lora_rank,
        "qk_rope_head_dim": layer.qk_rope_head_dim,
        "qk_nope_head_dim": layer.qk_nope_head_dim,
        "v_head_dim": layer.v_head_dim,
        "rope_interleave": True,
        "rope_theta": rope.get("rope_theta"),
        "rope_parameters": rope,
        "rope_scaling": None if rope.get("rope_type", "default") == "default" else rope,
        # Every layer dense: the MoE fields must still be valid integers. Two routed experts, not one: llama.cpp's
        # loader asserts n_expert_groups (n_group, 1) < n_expert for any model with experts, even all-dense ones.
        "first_k_dense_replace": n_layers,
        "n_routed_experts": 2,
        "n_shared_experts": 1,
        "num_experts_per_tok": 1,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.0,
        "norm_topk_prob": True,
        "num_nextn_predict_layers": 0,
        "hidden_act": source_config.hidden_act,
        "max_position_embeddings": source_config.max_position_embeddings,
        "rms_norm_eps": TRANSFORMERS_LATENT_NORM_EPS,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "initializer_range": getattr(source_config, "initializer_range", 0.02),
        "bos_token_id": source_config.bos_token_id,
        "eos_token_id": source_config.eos_token_id,
        "pad_token_id": getattr(source_config, "pad_token_id", None),
        "torch_dtype": str(dtype).removeprefix("torch."),
        "use_cache": True,
        # kvrewrite.load recognises its own export by this and runs the absorbed runtime (runtime/mla/); stock
        # transformers keeps it as a plain config attribute.
        MLA_MARKER: {
            "format_version": MLA_FORMAT_VERSION,
            "source_model_type": source_config.model_type,
            **(provenance or {}),
        },
    }


def export_deepseek_v3(
    source,
    layers: list[MLALayer],
    max_square_norms: list[float],
    output: Path,
    *,
    dtype: torch.dtype,
    norm_tolerance: float = 1e-6,
    overwrite: bool = False,
    provenance: dict | None = None,
    rate_table: dict[str, list[int]] | None = None,
    rate_o_proj: dict[str, list[torch.Tensor]] | None = None,
) -> ExportSummary:
    """source: compile.layer_streaming.SourceModel of the original; layers: its MLA form; max_square_norms: per layer
    the largest calibration ||x||^2 at the attention input (bounds the latent's mean square for the norm);
    provenance: extra keys for the config's kvrewrite_mla marker (how the form was made, e.g. its distillation);
    rate_o_proj: rate key -> per-layer o_proj for that rate of rate_table (--refit-rates), written to the side file
    runtime/mla/rate_projections.py reads."""
    from kvrewrite.compile.mla.form import latent_max_mean_square

    eps = TRANSFORMERS_LATENT_NORM_EPS
    neutralisers = [
        neutralise_latent_norm(latent_max_mean_square(layer, m), eps, norm_tolerance)
        for layer, m in zip(layers, max_square_norms)
    ]
    bad = [i for i, n in enumerate(neutralisers) if not dtype_holds_latent(n, dtype)]
    if bad:
        raise InvalidArgumentError(
            f"{str(dtype).removeprefix('torch.')} cannot hold the neutralised latent (rms {neutralisers[bad[0]].latent_rms:.1e} "
            f"in layer {bad[0]} is below its smallest normal number {torch.finfo(dtype).tiny:.1e}); export bfloat16 or float32"
        )
    if len({layer.qk_rope_head_dim for layer in layers}) != 1:
        raise InvalidArgumentError("every layer of a DeepSeek-V3 export has the same qk_rope_head_dim")
    unserved = sorted(set(rate_o_proj or {}) - set(rate_table or {}))
    if unserved:
        raise InvalidArgumentError(f"o_proj given for rates {unserved} that the rate table does not serve")
    marker = {**latent_width_marker(layers, rate_table), **(provenance or {})}
    if rate_o_proj:
        marker[RATE_O_PROJ_KEY] = sorted(rate_o_proj)
    config = deepseek_v3_config(source.config, layers[0], dtype, marker, kv_lora_rank=padded_latent_rank(layers))
    state = _weights(source, layers, neutralisers, dtype)
    with atomic_output_dir(Path(output), overwrite=overwrite) as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        write_safetensors_shards(tmp, state, {"kvrewrite_form": "mla-deepseek-v3"}, max_shard_size="2GB")
        if rate_o_proj:  # beside the stock weights, where no engine reads it
            (tmp / RATE_O_PROJ_FILE).parent.mkdir(parents=True)
            save_safetensors(
                {
                    rate_o_proj_name(key, idx): weight.to(dtype).contiguous()
                    for key, weights in rate_o_proj.items()
                    for idx, weight in enumerate(weights)
                },
                tmp / RATE_O_PROJ_FILE,
                metadata={"kvrewrite_form": "mla-rate-o-proj"},
            )
        for name in TOKENIZER_FILES:
            if (source.directory / name).is_file():
                shutil.copyfile(source.directory / name, tmp / name)  # the user's umask, not the source's mode
        write_manifest(tmp)  # every file above: an edited side file, weight or marker is caught on load
    return ExportSummary(Path(output), neutralisers, dtype)


def _weights(
    source, layers: list[MLALayer], neutralisers: list[LatentNormNeutraliser], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    names = list(source.skeleton.state_dict())
    attention_prefixes = [source.attention_prefix(i) for i in range(len(layers))]
    kept = [
        n
        for n in names
        if not any(n.startswith(f"{p}.{proj}.") for p in attention_prefixes for proj in ATTENTION_PROJECTIONS)
    ]
    state = {name: tensor.to(dtype) for name, tensor in source.read(kept).items()}  # embeddings, norms, MLPs, lm_head
    padded = padded_latent_rank(layers)
    for prefix, layer, norm in zip(attention_prefixes, layers, neutralisers):
        r = layer.kv_lora_rank
        # Zero latent rows (and kv_b columns) up to the padded width: those latent dims are 0 for every token. The
        # norm then averages over the padded width, which only lowers its mean square (the bound still holds).
        kv_a = torch.zeros(padded + layer.qk_rope_head_dim, layer.kv_a_proj_with_mqa.shape[1], dtype=torch.float64)
        kv_a[:r] = layer.kv_a_proj_with_mqa[:r] * norm.scale
        kv_a[padded:] = layer.kv_a_proj_with_mqa[r:]
        kv_b = torch.zeros(layer.kv_b_proj.shape[0], padded, dtype=torch.float64)
        kv_b[:, :r] = layer.kv_b_proj
        state[f"{prefix}.q_proj.weight"] = layer.q_proj.to(dtype)
        state[f"{prefix}.kv_a_proj_with_mqa.weight"] = kv_a.to(dtype)
        state[f"{prefix}.kv_a_layernorm.weight"] = torch.full((padded,), norm.norm_weight, dtype=dtype)
        state[f"{prefix}.kv_b_proj.weight"] = kv_b.to(dtype)
        state[f"{prefix}.o_proj.weight"] = layer.o_proj.to(dtype)
    return state
