"""Frontier benchmark: quality against KV bytes held per token, kvrewrite and peer methods on the same tokens.

Modules: inputs (token windows and passkey prompts, saved once), methods (the method interface), peers (peer
methods), cache_bytes (bytes held by a cache), protocols (continuation ppl, passkey), run (the driver), plot.
"""
