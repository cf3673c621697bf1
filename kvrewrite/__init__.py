"""kvrewrite: an offline compiler that rewrites a Hugging Face causal LM so its KV cache is smaller.

`import kvrewrite` registers the compressed model types with transformers, so
`AutoModelForCausalLM.from_pretrained(compressed_dir)` just works. It loads only the runtime (torch and
transformers); the compiler (`compress`, `compress_variants`, `Plan`, `CompileResult`; the MLA export `export_mla`, `MLAPlan`,
`MLAExport`) is imported on first use, so a user who only loads compressed checkpoints needs none of the `compile`
extra (gensim, scikit-learn, matplotlib).
See docs/architecture.md, "Runtime vs compiler imports".
"""

from __future__ import annotations

from typing import Any

from kvrewrite import interrupts as _interrupts

if _interrupts.started_as_console_script():  # a Ctrl-C during the imports below is one line, not a traceback
    _interrupts.exit_while_importing()

from kvrewrite.runtime.load import register as _register  # noqa: E402

_register()

from kvrewrite.runtime.cache_policy import CachePolicy, Eviction, Floor, ImportantTokens  # noqa: E402
from kvrewrite.runtime.load import load  # noqa: E402
from kvrewrite.spec import CompressionSpec  # noqa: E402

__version__ = "0.1.0"
__all__ = [
    "CachePolicy",
    "CompileResult",
    "CompiledVariants",
    "CompressionSpec",
    "Eviction",
    "Floor",
    "ImportantTokens",
    "MLAExport",
    "MLAPlan",
    "Plan",
    "compress",
    "compress_variants",
    "export_mla",
    "load",
    "__version__",
]

# Compiler names, resolved on first access (PEP 562) so that `import kvrewrite` never imports the compiler.
_LAZY = {
    "compress": "kvrewrite.compile.api",
    "CompileResult": "kvrewrite.compile.api",
    "compress_variants": "kvrewrite.compile.api",
    "CompiledVariants": "kvrewrite.compile.api",
    "Plan": "kvrewrite.compile.plan",
    "export_mla": "kvrewrite.compile.mla.api",
    "MLAExport": "kvrewrite.compile.mla.api",
    "MLAPlan": "kvrewrite.compile.mla.plan",
}


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'kvrewrite' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value  # cache: later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
