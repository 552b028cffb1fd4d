"""Where infersweep keeps what it prepares once per machine: converted checkpoints, evaluation caches, the
kernel choices (`INFERSWEEP_CACHE`, default ~/.cache/infersweep). A leaf module, so that any engine module can
ask without importing engine.models."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """Where prepared checkpoints and evaluation caches live (`INFERSWEEP_CACHE`, default ~/.cache)."""
    root = os.environ.get("INFERSWEEP_CACHE") or os.path.join(Path.home(), ".cache", "infersweep")
    return Path(root)
