"""Config hash: sha256 of the canonical JSON of what changes a measurement.

Everything in the resolved trial config counts except the keys in EXCLUDED_TOP (where results go, how
trials are placed), so a new optimization group is part of the hash by default.

Hashes stay stable when the schema grows: a key added after hash_version 1 is listed in ADDED_KEYS with
the value every earlier config implicitly had, and a config holding exactly that value hashes as it did
before the key existed. So runs recorded earlier keep resuming and reproducing by hash, and a config that
sets the new key to anything else gets a hash of its own. (The neutral value is frozen here, not read from
the schema: changing a schema default later must not silently re-hash old runs.)
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


# dotted key -> its value in every config recorded before the key existed
ADDED_KEYS: dict[str, Any] = {
    "kv_cache.dtype": "auto",  # engine=llamacpp / vllm K/V element type
}


def measured_view(config: dict[str, Any], added: dict[str, Any] | None = None) -> dict[str, Any]:
    view = {k: copy.deepcopy(v) for k, v in config.items() if k not in EXCLUDED_TOP}
    for key, neutral in (ADDED_KEYS if added is None else added).items():
        *parents, leaf = key.split(".")
        node: Any = view
        for p in parents:
            node = node.get(p) if isinstance(node, dict) else None
        if isinstance(node, dict) and leaf in node and node[leaf] == neutral:
            del node[leaf]
    return view


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def config_hash(config: dict[str, Any], added: dict[str, Any] | None = None) -> str:
    payload = {"hash_version": HASH_VERSION, "config": measured_view(config, added)}
    return hashlib.sha256(canonical_json(payload).encode()).hexdigest()
