"""`kvrewrite_llama`: a Llama-family model whose attention runs on the compressed, packed KV cache."""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers import LlamaConfig, LlamaForCausalLM

from kvrewrite.adapters.llama import LlamaAdapter
from kvrewrite.errors import CorruptCheckpointError
from kvrewrite.modeling.attention import PACKED_ATTENTION, CompressedAttention
from kvrewrite.spec import CompressionSpec


@strict
class KVRewriteLlamaConfig(LlamaConfig):
    model_type = "kvrewrite_llama"
    # The compression spec (kvrewrite.spec.CompressionSpec.to_dict()).
    kvrewrite: dict | None = None


class KVRewriteLlamaForCausalLM(LlamaForCausalLM):
    config_class = KVRewriteLlamaConfig

    def __init__(self, config: KVRewriteLlamaConfig):
        if config.kvrewrite is None:
            raise CorruptCheckpointError("kvrewrite_llama config has no 'kvrewrite' compression spec")
        config._attn_implementation = PACKED_ATTENTION
        super().__init__(config)
        spec = CompressionSpec.from_dict(config.kvrewrite)
        adapter = LlamaAdapter()
        rotary = self.model.rotary_emb
        for i, layer in enumerate(self.model.layers):
            layer.self_attn = CompressedAttention(config, i, spec.layers[i], rotary, adapter.apply_rope)
        self.post_init()

    @property
    def compression_spec(self) -> CompressionSpec:
        return CompressionSpec.from_dict(self.config.kvrewrite)

    def set_ranks(self, key_ranks: list[list[int]], value_ranks: list[list[int]]) -> None:
        for layer, k, v in zip(self.model.layers, key_ranks, value_ranks):
            layer.self_attn.set_ranks(k, v)

    def kv_elements_per_token(self) -> int:
        return sum(layer.self_attn.kv_elements_per_token() for layer in self.model.layers)

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path,
        *args,
        rate: float | None = None,
        verify_checksums: bool = True,
        **kwargs,
    ):
        """Load a kvrewrite checkpoint strictly (a missing or mis-shaped weight raises) and slice its ranks.

        rate: another point of the checkpoint's rate table; default: the rate it was compiled for.
        """
        from kvrewrite.runtime import checkpoint_directory, ensure_complete_load, verify_checkpoint_files

        directory = checkpoint_directory(pretrained_model_name_or_path, kwargs.get("revision"))
        if verify_checksums:
            verify_checkpoint_files(directory)
        want_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(directory, *args, output_loading_info=True, **kwargs)
        ensure_complete_load(info, directory)
        spec = model.compression_spec
        if rate is not None:
            key_ranks, value_ranks = spec.ranks_for_rate(rate)
            spec = spec.with_ranks(key_ranks, value_ranks, rate)
        model.set_ranks([layer.key_ranks for layer in spec.layers], [layer.value_ranks for layer in spec.layers])
        model.config.kvrewrite = spec.to_dict()
        return (model, info) if want_info else model
