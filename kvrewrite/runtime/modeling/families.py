"""Compressed model classes for every adapter: the family's stock transformers model with CompressedAttention swapped in.

Each family gets a `kvrewrite_<family>` model type, a config subclass carrying the compression spec and
a ForCausalLM subclass whose only change is the attention module of every decoder layer; embeddings,
MLPs, masks (sliding windows included) and caches are the stock code. `import kvrewrite` registers
them with AutoConfig / AutoModelForCausalLM.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from huggingface_hub.dataclasses import strict

from kvrewrite.adapters import all_adapters
from kvrewrite.adapters.base import ArchitectureAdapter
from kvrewrite.errors import CorruptCheckpointError
from kvrewrite.runtime.codecs.config import CodecConfig, parse_codec
from kvrewrite.runtime.modeling.attention import PACKED_ATTENTION, CompressedAttention
from kvrewrite.spec import CompressionSpec

if TYPE_CHECKING:
    from transformers.cache_utils import Cache

    from kvrewrite.runtime.cache_policy import CachePolicy


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
            # KV codec: the compiled one (spec.kv_codec) unless load() overrides it; trained tables come from
            # kv_codec.safetensors (see kvrewrite.runtime.codecs.checkpoint).
            self.kv_codec: CodecConfig | None = CodecConfig.from_dict(spec.kv_codec) if spec.kv_codec else None
            self.kv_codec_tables: dict = {}
            # Token tiers (kvrewrite.runtime.tiers): set by load(recent_window=...); the model then stays at full rank.
            self.tier_policy = None
            # What load() built the cache with (runtime.cache_policy.CachePolicy); None until from_pretrained sets it.
            self.cache_policy = None
            self.post_init()

        def forward(self, *args, past_key_values=None, **kwargs):
            if self.tier_policy is not None and past_key_values is None:
                # The tiers live in the cache: without one, attention would read every token at full rank.
                past_key_values = self.make_kv_cache()
            return super().forward(*args, past_key_values=past_key_values, **kwargs)

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

        # ---- KV codec -------------------------------------------------------------------------
        def set_kv_codec(self, codec: CodecConfig | str | None, tables: dict | None = None) -> None:
            """Use another codec (or None / "none" for the plain packed cache); trained codecs need their tables."""
            from kvrewrite.runtime.codecs import build_layer_codecs

            codec = parse_codec(codec) if isinstance(codec, str) or codec is None else codec
            tables = dict(tables if tables is not None else self.kv_codec_tables)
            if codec is not None:
                # Build once now so a missing or mis-shaped table fails at load, not at the first generate().
                build_layer_codecs(codec, *self._layer_ranks(), tables)
            self.kv_codec, self.kv_codec_tables = codec, tables
            self.config.kvrewrite = {**self.config.kvrewrite, "kv_codec": codec.to_dict() if codec else None}

        def _layer_ranks(self) -> tuple[list[list[int]], list[list[int]]]:
            attns = self.compressed_attentions()
            return [a.key_ranks for a in attns], [a.value_ranks for a in attns]

        def make_kv_cache(self, capacity: int | None = None):
            """The cache this model generates with: a TieredCache with a tier policy, a CodecCache when a codec is
            set, else a cache that appends in place (runtime.inplace_cache). `capacity`: the longest sequence it
            will hold, where the caller knows it (generate() does); a tiered or evicting cache then allocates its
            stored tiers once, without one they hold exactly what they keep."""
            from kvrewrite.runtime.codecs import make_codec_cache
            from kvrewrite.runtime.inplace_cache import in_place_cache

            if self.tier_policy is not None:
                from kvrewrite.runtime.tiers.build import make_tiered_cache

                return make_tiered_cache(self, self.tier_policy, capacity=capacity)
            if self.kv_codec is None:
                return in_place_cache(self.config, capacity=capacity)
            return make_codec_cache(self.kv_codec, *self._layer_ranks(), self.kv_codec_tables)

        def make_static_kv_cache(self, max_cache_len: int, batch: int | None = None) -> Cache:
            """The cache `generate(..., cache_implementation="static")` uses when a codec is set: a StaticCodecCache of
            `max_cache_len` tokens (runtime.generation_cache.static_kv_cache), allocated now for `batch` if given."""
            from kvrewrite.runtime.generation_cache import static_kv_cache

            return static_kv_cache(self, max_cache_len, batch)

        def generate(self, inputs=None, *args, **kwargs):
            """transformers' generate; with an eviction policy whose prefill_score is "reconstruction", the prompt
            (but its last token) is first prefilled and scored by its reconstruction (runtime.tiers.reconstruction)."""
            policy = self.tier_policy
            if (
                getattr(policy, "prefill_score", "newest") == "reconstruction"
                and kwargs.get("past_key_values") is None
                and inputs is not None
                and inputs.shape[-1] > 1
            ):
                from kvrewrite.runtime.tiers.reconstruction import prefill_for_generate

                kwargs["past_key_values"] = prefill_for_generate(self, inputs, kwargs.get("attention_mask"))
            return super().generate(inputs, *args, **kwargs)

        def _prepare_cache_for_generation(
            self,
            generation_config,
            model_kwargs,
            generation_mode=None,
            batch_size=None,
            max_cache_length=None,
            *args,
            **kwargs,
        ):
            # The model's own cache, or the static form of its codec, unless the caller passed a cache
            # (runtime.generation_cache says which, and refuses what would drop the codec or the tiers).
            if model_kwargs.get("past_key_values") is None and generation_config.use_cache is not False:
                from kvrewrite.runtime.generation_cache import generation_cache

                cache = generation_cache(self, generation_config, batch_size, max_cache_length)
                if cache is not None:
                    model_kwargs["past_key_values"] = cache
                    return
            return super()._prepare_cache_for_generation(
                generation_config, model_kwargs, generation_mode, batch_size, max_cache_length, *args, **kwargs
            )

        @classmethod
        def from_pretrained(
            cls,
            pretrained_model_name_or_path,
            *args,
            rate: float | None = None,
            kv_codec: str | CodecConfig | None = "compiled",
            verify_checksums: bool = True,
            recent_window: int | None = None,
            important: dict | None = None,
            evict: dict | None = None,
            policy: CachePolicy | None = None,
            token_policy: bool = True,
            **kwargs,
        ):
            """Load a kvrewrite checkpoint strictly (a missing or mis-shaped weight raises) and build its cache policy.

            policy: a kvrewrite.CachePolicy (runtime.cache_policy); or its fields as the keywords below, not both.
            rate: another point of the checkpoint's rate table; default: the rate it was compiled for.
            kv_codec: "compiled" (default: the codec recorded in the checkpoint), "none", or a codec such as "int4" or
                "gear:bits=4"; codecs with trained tables (csr, tada's searched bits) use the checkpoint's tables.
            recent_window: keep the model at full rank and cache through kvrewrite.runtime.tiers: each query reads the
                last `recent_window` tokens with all dims and older tokens at `rate`'s ranks (coded by kv_codec,
                if one is given). None (default): every token at `rate`'s ranks.
            important: with recent_window, token-adaptive dims: {"rate": r, "share": g, "score": "attention" or
                "denominator", "pool": 64}: the share g of aged tokens with the highest score keep rate r's ranks.
            evict: with recent_window, re-scored eviction: {"keep": g, "bits": 4}: beyond the window only the share g
                of tokens that the newest queries attend to most stay cached, at `rate`'s ranks, quantized per token
                to `bits` (default: float16); see kvrewrite.runtime.tiers.eviction.
            token_policy: when the checkpoint holds a budget split (token_policy.json, written by `kvrewrite budget`)
                and no policy is asked for (neither policy= nor any of its keywords), load with it. False: ignore it.
            """
            from kvrewrite.runtime.cache_policy import CachePolicy, requested_policy
            from kvrewrite.runtime.checkpoint_files import (
                checkpoint_directory,
                ensure_complete_load,
                refuse_remote_code,
                verify_checkpoint_files,
            )

            requested = requested_policy(  # types and combinations, before any file is read
                policy, rate=rate, kv_codec=kv_codec, recent_window=recent_window, important=important, evict=evict
            )
            directory = checkpoint_directory(pretrained_model_name_or_path, kwargs.get("revision"))
            if verify_checksums:
                verify_checkpoint_files(directory)
            if requested is None and token_policy:
                from kvrewrite.runtime.tiers.token_policy_file import read_cache_policy

                requested = read_cache_policy(directory)  # the budget split `kvrewrite budget` measured and recorded
            policy = requested or CachePolicy()
            want_info = kwargs.pop("output_loading_info", False)
            # A mis-shaped tensor is reported by ensure_complete_load (naming file and tensor), not raised by
            # transformers as a bare RuntimeError; the half-loaded model is discarded either way.
            kwargs.setdefault("ignore_mismatched_sizes", True)
            refuse_remote_code(kwargs)
            model, info = super().from_pretrained(
                directory, *args, output_loading_info=True, trust_remote_code=False, **kwargs
            )
            ensure_complete_load(info, directory)
            model.apply_cache_policy(policy, directory)
            return (model, info) if want_info else model

        def apply_cache_policy(self, policy: CachePolicy, directory: Path) -> None:
            """Build the cache `policy` asks for (refusing, naming field and form, what this checkpoint cannot honour)."""
            from kvrewrite.runtime.codecs.checkpoint import read_codec_tables

            spec = self.compression_spec
            if policy.tiered:
                from kvrewrite.runtime.tiers.build import enable_tiers

                tiers = enable_tiers(self, spec, policy, read_codec_tables(directory), str(directory))
                if getattr(tiers, "prefill_score", "newest") == "reconstruction":
                    from kvrewrite.runtime.tiers.reconstruction import repeat_instruction_ids

                    self.repeat_instruction_ids = repeat_instruction_ids(directory)
            else:
                if policy.rate is not None:
                    key_ranks, value_ranks = spec.ranks_for_rate(policy.rate)
                    spec = spec.with_ranks(key_ranks, value_ranks, policy.rate)
                self.set_ranks([layer.key_ranks for layer in spec.layers], [layer.value_ranks for layer in spec.layers])
                self.config.kvrewrite = spec.to_dict()
                self.set_kv_codec(policy.codec(self.kv_codec), read_codec_tables(directory))
            self.cache_policy = policy

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
