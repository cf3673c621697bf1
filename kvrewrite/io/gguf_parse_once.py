"""Read a GGUF file once while transformers converts it.

transformers' GGUF loading opens the file once for the config, once for the tokenizer and once for the weights
(`GGUFReader` parses every metadata field, among them the 49K-entry vocabulary), and rebuilds gguf's tensor-name
map once per module of the model (about 400 times for SmolLM2-135M): 20 of the bundled model's 29 s of conversion
on a 2-core CPU. Within `gguf_parsed_once()` both are built once. Neither is changed by transformers: the reader is
opened read-only and only read, the map is a pure function of (architecture, layer count).
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Iterator


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """Within the block, gguf.GGUFReader(path) returns one reader per (path, mode) and gguf.get_tensor_name_map
    one map per argument; both are gguf's own again on exit. transformers imports them from gguf at each call, so
    the block reaches it. Not for concurrent threads (the patch is process-wide while the block runs)."""
    import gguf

    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], object] = {}

    def shared_reader(path: os.PathLike[str] | str, mode: str = "r"):
        key = (os.path.realpath(os.fspath(path)), mode)
        if key not in readers:
            readers[key] = reader_class(path, mode)
        return readers[key]

    gguf.GGUFReader = shared_reader
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map
        readers.clear()
