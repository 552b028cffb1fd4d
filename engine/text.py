"""Text sources for prompts and evaluation; the default ships with every CPython (offline)."""
from __future__ import annotations

import functools

from .config import EngineError, TextConfig


@functools.lru_cache(maxsize=8)
def load_text(src: TextConfig) -> str:
    if src.kind == "pydoc":
        from pydoc_data.topics import topics

        return "\n\n".join(topics[k] for k in sorted(topics))
    if src.kind == "file":
        if not src.path:
            raise EngineError("text.kind=file needs text.path")
        try:
            with open(src.path, encoding="utf-8") as f:
                return f.read()
        except OSError as e:
            raise EngineError(f"cannot read text file {src.path!r}: {e}") from e
    if src.kind == "datasets":
        try:
            import datasets
        except ImportError as e:
            raise EngineError("text.kind=datasets needs `pip install datasets`") from e
        ds = datasets.load_dataset(src.name, src.config, split=src.split)
        return "\n\n".join(str(x) for x in ds[src.column] if x)
    raise EngineError(f"unknown text kind {src.kind!r}; choose pydoc, file or datasets")
