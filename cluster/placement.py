"""What one item asks of the cluster (`Placement`) and how many such workers a set of nodes holds (a trial's
`Placement` comes from its typed cluster section: `cluster.config.ClusterConfig.placement`).

Pure arithmetic over node descriptions shaped like `ray.nodes()` entries ({"NodeID", "Alive",
"Resources"}), so the dispatcher and its tests need no Ray.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

SHARED, EXCLUSIVE_NODE = "shared", "exclusive-node"
ISOLATIONS = (SHARED, EXCLUSIVE_NODE)


@dataclass(frozen=True)
class Placement:
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    memory_bytes: int = 0
    resources: tuple[tuple[str, float], ...] = ()  # custom resources, sorted (hashable)
    isolation: str = SHARED
    max_retries: int = 1

    def demand(self) -> dict[str, float]:
        d = {"CPU": self.num_cpus, "GPU": self.num_gpus, "memory": float(self.memory_bytes), **dict(self.resources)}
        return {k: v for k, v in d.items() if v > 0}

    def actor_options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus, "max_restarts": 0}
        if self.memory_bytes > 0:
            opts["memory"] = self.memory_bytes
        if self.resources:
            opts["resources"] = dict(self.resources)
        return opts

    def shape(self) -> tuple:
        """Actors are interchangeable between items of the same shape (retries do not matter)."""
        return (self.num_cpus, self.num_gpus, self.memory_bytes, self.resources, self.isolation)


def fits(node_resources: dict[str, float], p: Placement) -> int:
    """How many actors of placement `p` one node holds (by its total resources)."""
    n = math.inf
    for k, need in p.demand().items():
        n = min(n, math.floor(node_resources.get(k, 0.0) / need + 1e-9))
    return 0 if n is math.inf else int(n)


def capacity(p: Placement, nodes: list[dict[str, Any]]) -> int:
    """How many items of placement `p` the given (alive) nodes run at once."""
    per = [fits(n.get("Resources", {}), p) for n in nodes]
    if p.isolation == EXCLUSIVE_NODE:
        return sum(1 for k in per if k > 0)
    return sum(per)
