"""Config hash: sha256 of the canonical JSON of what changes a measurement.

Everything in the resolved trial config counts except the keys in EXCLUDED (where results go, how trials
are placed), so a new optimization group is part of the hash by default.
"""
from __future__ import annotations

import copy
import hashlib
import json
from typing import Any

HASH_VERSION = 1
# top-level keys that never change what is measured
EXCLUDED_TOP = ("cluster", "tracking", "sweep_name", "hydra")
SHORT = 12


def measured_view(config: dict[str, Any]) -> dict[str, Any]:
    return {k: copy.deepcopy(v) for k, v in config.items() if k not in EXCLUDED_TOP}


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def config_hash(config: dict[str, Any]) -> str:
    payload = {"hash_version": HASH_VERSION, "config": measured_view(config)}
    return hashlib.sha256(canonical_json(payload).encode()).hexdigest()
