"""kvrewrite: an offline compiler that rewrites a Hugging Face causal LM so its KV cache is smaller.

`import kvrewrite` registers the compressed model types with transformers, so
`AutoModelForCausalLM.from_pretrained(compressed_dir)` just works.
"""

from kvrewrite.runtime import register as _register

_register()

from kvrewrite.api import CompileResult, compress  # noqa: E402
from kvrewrite.plan import Plan  # noqa: E402
from kvrewrite.runtime import load  # noqa: E402
from kvrewrite.spec import CompressionSpec  # noqa: E402

__version__ = "0.1.0"
__all__ = ["CompileResult", "CompressionSpec", "Plan", "compress", "load", "__version__"]
