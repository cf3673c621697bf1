import sys
from pathlib import Path

# Test helpers (tiny_models) live next to the tests.
sys.path.insert(0, str(Path(__file__).parent))
