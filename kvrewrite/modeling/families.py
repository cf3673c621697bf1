"""Compressed model classes for every adapter: the family's stock transformers model with CompressedAttention swapped in.

Each family gets a `kvrewrite_<family>` model type, a config subclass carrying the compression spec and
a ForCausalLM subclass whose only change is the attention module of every decoder layer; embeddings,
MLPs, masks (sliding windows included) and caches are the stock code. `import kvrewrite` registers
them with AutoConfig / AutoModelForCausalLM.
"""

from __future__ import annotations

from huggingface_hub.dataclasses import strict

from kvrewrite.adapters import all_adapters
from kvrewrite.adapters.base import ArchitectureAdapter
from kvrewrite.errors import CorruptCheckpointError
from kvrewrite.modeling.attention import PACKED_ATTENTION, CompressedAttention
from kvrewrite.spec import CompressionSpec


def compressed_family(adapter: ArchitectureAdapter) -> tuple[type, type]:
    """(KVRewrite<Family>Config, KVRewrite<Family>ForCausalLM) built on the adapter's stock classes."""

    @strict
    class Config(adapter.config_class):
        model_type = adapter.compressed_model_type
        # The compression spec (kvrewrite.spec.CompressionSpec.to_dict()).
        kvrewrite: dict | None = None

    class ForCausalLM(adapter.model_class):
        config_class = Config
        kvrewrite_adapter = adapter

        def __init__(self, config):
            if config.kvrewrite is None:
                raise CorruptCheckpointError(f"{config.model_type} config has no 'kvrewrite' compression spec")
            config._attn_implementation = PACKED_ATTENTION
            super().__init__(config)
            spec = CompressionSpec.from_dict(config.kvrewrite)
            rotary = adapter.rotary_embedding(self)
            for i, layer in enumerate(adapter.decoder_layers(self)):
                setattr(layer, adapter.attention_attr, CompressedAttention(config, i, spec.layers[i], rotary, adapter))
            self.post_init()

        def compressed_attentions(self) -> list[CompressedAttention]:
            return [adapter.attention(layer) for layer in adapter.decoder_layers(self)]

        @property
        def compression_spec(self) -> CompressionSpec:
            return CompressionSpec.from_dict(self.config.kvrewrite)

        def set_ranks(self, key_ranks: list[list[int]], value_ranks: list[list[int]]) -> None:
            for attn, k, v in zip(self.compressed_attentions(), key_ranks, value_ranks):
                attn.set_ranks(k, v)

        def kv_elements_per_token(self) -> int:
            return sum(attn.kv_elements_per_token() for attn in self.compressed_attentions())

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

    for cls, suffix in ((Config, "Config"), (ForCausalLM, "ForCausalLM")):
        cls.__name__ = cls.__qualname__ = f"KVRewrite{adapter.family}{suffix}"
        cls.__module__ = __name__
    return Config, ForCausalLM


# model_type -> (config class, model class); module attributes too, so checkpoints' auto_map stubs can import them.
COMPRESSED_FAMILIES: dict[str, tuple[type, type]] = {}
for _adapter in all_adapters():
    _config_cls, _model_cls = compressed_family(_adapter)
    COMPRESSED_FAMILIES[_adapter.compressed_model_type] = (_config_cls, _model_cls)
    globals()[_config_cls.__name__] = _config_cls
    globals()[_model_cls.__name__] = _model_cls

