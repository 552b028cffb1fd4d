"""Where a trial runs: the `cluster` section of a trial config, typed, with every default in this one place.

`conf/cluster/*.yaml` set only what a profile changes; `experiments/config/schema.py` registers this class as
the section's schema (so Hydra checks keys and types); the driver turns a trial's resolved section back into
it with `ClusterConfig.from_dict` and asks it for the trial's `Placement`. No Hydra here: a plain dataclass.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional

from .placement import ISOLATIONS, SHARED, Placement


@dataclass
class ClusterConfig:
    name: str = "local"
    address: Optional[str] = None  # None: start an embedded local Ray; "auto" or ray://host:port: connect
    num_cpus_per_trial: float = 2
    num_gpus_per_trial: float = 0
    memory_per_trial_gb: float = 0
    max_retries: int = 1  # retries after a worker/node crash (application errors are never retried)
    resources: Dict[str, float] = field(default_factory=dict)  # custom Ray resources per trial
    isolation: str = SHARED  # shared | exclusive-node (never two trials on one node: clean timings)
    warm_workers: bool = True  # trials with the same model/attention/backend reuse a loaded model
    placement_timeout_s: float = 600  # fail queued trials when no worker can be placed for this long
    local_num_cpus: Optional[int] = None  # embedded Ray only; None = all cores
    local_num_gpus: Optional[int] = None  # embedded Ray only; None = detected
    # > 0: the variants of each workload run on one worker, round-robin, this many rounds of one timed repeat
    # each (ABBA), so drift hits them alike and their ratios pair by round (0: one trial per task)
    interleave: int = 0

    @classmethod
    def from_dict(cls, section: Mapping[str, Any] | "ClusterConfig") -> "ClusterConfig":
        """The typed section of a resolved config (a stored one may predate a key: it gets the default)."""
        if isinstance(section, ClusterConfig):
            return section
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(section) - known)
        if unknown:
            raise ValueError(f"cluster.{unknown[0]}: unknown key; keys in cluster: {', '.join(sorted(known))}")
        return cls(**{k: v for k, v in section.items() if k in known})

    def placement(self) -> Placement:
        """What one trial asks of the cluster."""
        return Placement(
            num_cpus=float(self.num_cpus_per_trial),
            num_gpus=float(self.num_gpus_per_trial),
            memory_bytes=int(float(self.memory_per_trial_gb or 0) * 1024**3),
            resources=tuple(sorted((str(k), float(v)) for k, v in (self.resources or {}).items())),
            isolation=str(self.isolation or SHARED),
            max_retries=int(self.max_retries),
        )

    def problems(self) -> list[str]:
        """Value checks; each message names its key (`cluster.<key>: ...`)."""
        out = []
        if self.num_cpus_per_trial <= 0:
            out.append(f"cluster.num_cpus_per_trial: must be > 0, got {self.num_cpus_per_trial}")
        if self.num_gpus_per_trial < 0:
            out.append(f"cluster.num_gpus_per_trial: must be >= 0, got {self.num_gpus_per_trial}")
        if self.max_retries < 0:
            out.append(f"cluster.max_retries: must be >= 0, got {self.max_retries}")
        if self.isolation not in ISOLATIONS:
            out.append(f"cluster.isolation: unknown {self.isolation!r}; choose one of {', '.join(ISOLATIONS)}")
        for k, v in (self.resources or {}).items():
            if v <= 0:
                out.append(f"cluster.resources.{k}: must be > 0, got {v}")
        if self.interleave < 0 or self.interleave == 1:
            out.append(f"cluster.interleave: rounds must be 0 (off) or >= 2 (a ratio needs two rounds), got {self.interleave}")
        if self.memory_per_trial_gb < 0:
            out.append(f"cluster.memory_per_trial_gb: must be >= 0, got {self.memory_per_trial_gb}")
        return out


def placement(section: Mapping[str, Any] | ClusterConfig) -> Placement:
    """The `Placement` of a trial's `cluster` section."""
    return ClusterConfig.from_dict(section).placement()
