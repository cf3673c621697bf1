"""Loading a model directory's tokenizer with built-in transformers classes only: no code shipped with a model runs.

transformers asks "Do you wish to run the custom code? [y/N]" when a tokenizer_config.json (or config.json) carries
an `auto_map` and trust_remote_code is not given, and a `y` on stdin then imports the shipped code. Every tokenizer
kvrewrite loads goes through here: trust_remote_code=False, a custom tokenizer class refused up front naming the file,
and transformers' own refusal (which advises allowing the shipped code to run) replaced by one that does not.
"""

from __future__ import annotations

from pathlib import Path

from kvrewrite.errors import ModelSourceError


def load_tokenizer(directory: Path, **kwargs):
    """AutoTokenizer.from_pretrained(directory) with built-in classes only; ModelSourceError naming the directory."""
    from transformers import AutoTokenizer

    from kvrewrite.io.source_validation import refuse_custom_code

    refuse_custom_code(Path(directory))
    kwargs.pop("trust_remote_code", None)
    try:
        return AutoTokenizer.from_pretrained(directory, trust_remote_code=False, **kwargs)
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        if "trust_remote_code" in str(exc) or "custom code" in str(exc):
            raise ModelSourceError(
                f"{directory} asks for code shipped with the model to load its tokenizer; kvrewrite never runs code "
                "shipped with a model. Use a revision with a built-in tokenizer class, or save the tokenizer as "
                "tokenizer.json"
            ) from None
        raise ModelSourceError(
            f"the tokenizer in {directory} cannot be loaded ({exc}); re-download the model or fix its tokenizer files"
        ) from None
