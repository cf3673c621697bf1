"""The original model loaded whole: in fp32 on the CPU (Fisher gradients, refit, evaluation baselines), or in the
compile dtype on the compile device (synthetic calibration text).

Below both the compiler and the evaluation, which each need the original model and must not import each other.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from kvrewrite.errors import CorruptCheckpointError
from kvrewrite.io.checkpoint_io import check_safetensors_files
from kvrewrite.io.source_validation import read_source_config, refuse_custom_code


def load_fp32_model(path):
    """The original model in float32 on the CPU, for what needs it whole (Fisher gradients, evaluation baselines)."""
    return load_whole_model(path)


def load_whole_model(path, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """The original model, whole, in `dtype` on `device` (read straight there, shard by shard): safetensors only, and
    every weight present.

    transformers would fill a missing weight (say a layer's k_proj) with random values and only warn; a compile on
    such a model would be silently wrong, so a missing or mis-shaped weight is an error here.
    """
    check_safetensors_files(path)
    read_source_config(path)
    refuse_custom_code(path)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            path,
            dtype=dtype,
            device_map=device,
            use_safetensors=True,
            output_loading_info=True,
            trust_remote_code=False,
        )
    except (RuntimeError, ValueError) as exc:  # e.g. a tensor whose shape does not match config.json
        raise CorruptCheckpointError(f"could not load the model in {path}: {exc}") from None
    problems = {kind: sorted(str(k) for k in info.get(kind) or []) for kind in ("missing_keys", "mismatched_keys")}
    if any(problems.values()):
        listed = "; ".join(
            f"{kind.replace('_', ' ')}: {', '.join(keys[:6])}{' ...' if len(keys) > 6 else ''}"
            for kind, keys in problems.items()
            if keys
        )
        raise CorruptCheckpointError(
            f"the checkpoint in {path} lacks weights its config needs ({listed}); transformers would fill them with "
            "random values. Re-download the model or fix its shards"
        )
    return model.eval()
