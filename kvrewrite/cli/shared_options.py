"""The meaning of the flags `kvrewrite compress` and `kvrewrite export-mla` share, worded once for both help texts.

Both commands' defaults come from their plans (compile/plan.py Plan, compile/mla/plan.py MLAPlan), which agree on every
shared flag (tests/test_cli_and_errors.py holds that); each command adds what its own checks or outputs are.
"""

from __future__ import annotations

# --dtype auto (compile/plan.py source_dtype).
AUTO_DTYPE_MEANING = "the default: the source checkpoint's dtype when it is float32 or bfloat16, else float32"
# --verify-tokens, followed by what the command's checks compare.
VERIFY_TOKENS_MEANING = "Calibration tokens the checks at the end run on"
# --distill-tokens.
DISTILL_TOKENS_MEANING = (
    "calibration tokens the distillation trains on, 1/16 of them held back for validation (default: every "
    "calibration token)"
)
