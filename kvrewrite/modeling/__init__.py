"""The import path that checkpoints' `modeling_kvrewrite.py` stubs name, kept stable whatever the package layout.

A checkpoint on the Hub carries a stub that imports its classes from `kvrewrite.modeling.families` (and, for
format-1 checkpoints written before the families module, `kvrewrite.modeling.llama`). The classes live in
`kvrewrite.runtime.modeling`; these two modules only re-export them, so moving code inside kvrewrite never breaks
a published checkpoint.
"""
