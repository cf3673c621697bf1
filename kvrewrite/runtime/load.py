"""Runtime shim: registers kvrewrite model types with transformers and loads compressed checkpoints strictly."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoConfig, AutoModelForCausalLM
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from kvrewrite.errors import CorruptCheckpointError
from kvrewrite.runtime.cache_policy import CachePolicy, requested_policy
from kvrewrite.runtime.checkpoint_files import (
    checkpoint_directory,
    ensure_complete_load,
    refuse_remote_code,
    verify_mla_files,
)
from kvrewrite.runtime.mla.checkpoint import (
    MLA_MARKER,
    RATE_TABLE_KEY,
    absorb_attention,
    check_mla_marker,
    is_mla_checkpoint,
    widths_at_rate,
)
from kvrewrite.runtime.mla.rate_projections import load_rate_o_proj, rates_with_o_proj
from kvrewrite.runtime.modeling.attention import PACKED_ATTENTION, packed_attention_forward
from kvrewrite.runtime.modeling.families import COMPRESSED_FAMILIES
from kvrewrite.spec import rate_key

COMPRESSED_MODEL_CLASSES = {model_type: model_class for model_type, (_, model_class) in COMPRESSED_FAMILIES.items()}


def _packed_attention_mask(*args, **kwargs):
    # Always materialise the mask: the packed attention has no is_causal shortcut, and a skipped mask
    # would silently drop padding.
    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


def register() -> None:
    """Make `AutoModelForCausalLM.from_pretrained(dir)` load kvrewrite checkpoints (idempotent)."""
    AttentionInterface.register(PACKED_ATTENTION, packed_attention_forward)
    AttentionMaskInterface.register(PACKED_ATTENTION, _packed_attention_mask)
    for model_type, (config_class, model_class) in COMPRESSED_FAMILIES.items():
        AutoConfig.register(model_type, config_class, exist_ok=True)
        AutoModelForCausalLM.register(config_class, model_class, exist_ok=True)


def load(name_or_path, rate: float | None = None, *, policy: CachePolicy | None = None, **kwargs):
    """Load a compressed checkpoint with a cache policy: `policy=` (a kvrewrite.CachePolicy), or its fields as
    keywords (rate=, recent_window=, kv_codec=, important=, evict=); neither: the policy `kvrewrite budget` recorded
    in the checkpoint, if any (token_policy=False ignores it), else the compiled rate and codec.

    An MLA export (a stock DeepSeek-V3 checkpoint with the `kvrewrite_mla` marker) loads as the stock model with
    its attention swapped for the absorbed one (runtime.mla).
    """
    keywords = {name: kwargs.pop(name) for name in CACHE_KEYWORDS if name in kwargs}
    requested = requested_policy(policy, rate=rate, **keywords)  # a wrong type named before any file is read
    directory = checkpoint_directory(name_or_path, kwargs.get("revision"))
    config_file = directory / "config.json"
    try:
        config = json.loads(config_file.read_text())
        model_type = config["model_type"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CorruptCheckpointError(f"{config_file}: unreadable or has no model_type ({exc})") from exc
    if is_mla_checkpoint(config):
        return load_mla(directory, config, requested, **kwargs)
    model_class = COMPRESSED_MODEL_CLASSES.get(model_type)
    if model_class is None:
        raise CorruptCheckpointError(
            f"{directory} is not a kvrewrite checkpoint (model_type {model_type!r}); "
            f"known types: {', '.join(COMPRESSED_MODEL_CLASSES)}"
        )
    refuse_remote_code(kwargs)
    return model_class.from_pretrained(directory, policy=requested, trust_remote_code=False, **kwargs)


# CachePolicy's fields besides rate, as load() keywords (rate is load's second positional argument).
CACHE_KEYWORDS = ("recent_window", "kv_codec", "important", "evict")


def load_mla(directory: Path, config: dict, policy: CachePolicy | None = None, **kwargs):
    """A kvrewrite MLA export: stock DeepseekV3ForCausalLM, loaded strictly, with absorbed attention; at a rate of its
    rate table (--layer-widths sensitivity or --refit-rates), every layer narrowed to that rate's latent width and,
    where the export refitted o_proj for that rate (--refit-rates), that rate's o_proj read from its side file."""
    from transformers import DeepseekV3ForCausalLM

    from kvrewrite.runtime.cache_forms import MLA_EXPORT

    policy = policy or CachePolicy()
    # Refused before any file is read, not handed to transformers' from_pretrained; token_policy= (a load flag for
    # the recorded policy, which an export never has) with them.
    MLA_EXPORT.check(policy, str(directory), also=("token_policy",) if "token_policy" in kwargs else ())
    rate = policy.rate
    verify_mla_files(directory)
    check_mla_marker(config, str(directory / "config.json"))
    if rate is not None and not config[MLA_MARKER].get(RATE_TABLE_KEY):
        raise CorruptCheckpointError(
            f"{directory} is an MLA export: its latent width is fixed at export time and it has no rate table "
            f"(got rate={rate}); load it without rate, or export with --layer-widths sensitivity or --refit-rates"
        )
    kwargs.pop("output_loading_info", None)
    refuse_remote_code(kwargs)
    model, info = DeepseekV3ForCausalLM.from_pretrained(
        directory, output_loading_info=True, trust_remote_code=False, **kwargs
    )
    ensure_complete_load(info, directory)
    widths = None if rate is None else widths_at_rate(model.config, rate, str(directory))
    if rate is not None and rate_key(rate) in rates_with_o_proj(config[MLA_MARKER]):  # export-mla --refit-rates
        load_rate_o_proj(model, directory, rate_key(rate))
    return absorb_attention(model, widths)
