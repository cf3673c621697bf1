"""Our runtime for the multi-head latent (MLA) cache form: stock DeepSeek-V3 weights, absorbed attention.

- latent_cache: what each layer caches (one row of normed latent c and rotated shared k_pe per token);
- attention: the absorbed attention that scores queries against that row directly;
- checkpoint: how an exported MLA checkpoint is recognised and its attention modules swapped.
"""
