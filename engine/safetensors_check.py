"""Whether a checkpoint's safetensors files are whole: each file's 8-byte header length and header JSON
against its size, never the weights themselves. A leaf (no engine imports): model_facts (validation) and
models (prepare) both ask it."""
from __future__ import annotations

import functools
import json
import os
from typing import Optional


def checkpoint_problem(d: str) -> Optional[str]:
    """'<file>: <why>' for the first damaged *.safetensors file in folder `d`, or None."""
    for f in sorted(_listdir(d)):
        if f.endswith(".safetensors"):
            path = os.path.join(d, f)
            try:
                st = os.stat(path)
            except OSError:
                continue
            why = _safetensors_problem(path, st.st_size, st.st_mtime_ns)
            if why:
                return f"{path}: {why}"
    return None


def _listdir(d) -> list[str]:
    try:
        return os.listdir(d)
    except OSError:
        return []


@functools.lru_cache(maxsize=256)
def _safetensors_problem(path: str, size: int, mtime_ns: int) -> Optional[str]:
    """Cached by (path, size, mtime): a sweep's thousand trials read each header once."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"the file is truncated ({size} bytes, not even the 8-byte header length)"
            n = int.from_bytes(head, "little")
            if 8 + n > size:
                return f"the file is truncated: its header alone needs {8 + n} bytes, the file has {size}"
            header = json.loads(f.read(n))
    except (OSError, ValueError) as e:
        return f"the safetensors header cannot be read ({e})"
    try:
        end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
    except (TypeError, KeyError, IndexError, ValueError, AttributeError):
        return "the safetensors header has no valid data_offsets"
    if 8 + n + end != size:
        what = "truncated" if 8 + n + end > size else "longer than its header says"
        return f"the file is {what}: its header says {8 + n + end} bytes, the file has {size}"
    return None
