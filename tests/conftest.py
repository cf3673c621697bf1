import sys
from pathlib import Path

# Test helpers (tiny_models) live next to the tests.
sys.path.insert(0, str(Path(__file__).parent))

import os

# The Triton kernels are tested on CPU tensors through Triton's interpreter; it must be switched on
# before the kernels are defined (on a CUDA machine the tests compile them for real).
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass
