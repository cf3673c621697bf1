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
    # Under pytest-xdist (`make test`) every worker would size torch's thread pool to all the cores; give each its
    # share.
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if _workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))
except ImportError:  # pragma: no cover
    pass


def pytest_collection_modifyitems(config, items):
    """The modules that use the real SmolLM2 hold the longest fixtures: put them first, so that xdist (which hands
    out modules in collection order) starts them first instead of last. The order within a module is kept."""
    real = {item.module.__name__ for item in items if item.get_closest_marker("real_model")}
    items.sort(key=lambda item: item.module.__name__ not in real)  # stable: collection order otherwise
