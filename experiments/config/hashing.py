"""Config hash: sha256 of the canonical JSON of what changes a measurement.

Everything in the resolved trial config counts except the keys in EXCLUDED_TOP (where results go, how
trials are placed, how precisely timings are measured), so a new optimization group is part of the hash by default.

Hashes stay stable when the schema grows: a key added after hash_version 1 is declared with
`engine.config.added(value)`, the value every earlier config implicitly had, and a config holding exactly
that value hashes as it did before the key existed (a section left empty by that is dropped too). So runs
recorded earlier keep resuming and reproducing by hash, and a config that sets the new key to anything else
gets a hash of its own. (The implicit value is declared beside the field, not read from its default:
changing a default later must not silently re-hash old runs.)
"""
from __future__ import annotations

import copy
import hashlib
import json
from typing import Any

HASH_VERSION = 1
# top-level keys that never change what is measured
# (timing: how many repeats a timing gets, i.e. its precision, not what it measures)
EXCLUDED_TOP = ("cluster", "tracking", "sweep_name", "hydra", "timing", "optimize")
SHORT = 12


def _added() -> dict[str, Any]:
    from engine.config import added_keys

    return added_keys()


def measured_view(config: dict[str, Any], added: dict[str, Any] | None = None) -> dict[str, Any]:
    view = {k: copy.deepcopy(v) for k, v in config.items() if k not in EXCLUDED_TOP}
    for key, neutral in {**_added(), **(added or {})}.items():  # `added`: more, as a test declares them
        *parents, leaf = key.split(".")
        chain: list[dict] = [view]
        for p in parents:
            nxt = chain[-1].get(p) if isinstance(chain[-1], dict) else None
            if not isinstance(nxt, dict):
                break
            chain.append(nxt)
        else:
            if leaf in chain[-1] and chain[-1][leaf] == neutral:
                del chain[-1][leaf]
                for parent, name in zip(reversed(chain[:-1]), reversed(parents)):  # a new section, now empty
                    if parent[name]:
                        break
                    del parent[name]
    ev = view.get("eval")
    if isinstance(ev, dict) and ev.get("task_files"):  # the user's task files count by content, not by path
        from engine.tasks.user import identity

        ev["task_files"] = identity(ev["task_files"])
    return view


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def config_hash(config: dict[str, Any], added: dict[str, Any] | None = None) -> str:
    payload = {"hash_version": HASH_VERSION, "config": measured_view(config, added)}
    return hashlib.sha256(canonical_json(payload).encode()).hexdigest()
