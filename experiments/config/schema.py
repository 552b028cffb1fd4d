"""Typed schema of a trial config, registered once with Hydra's ConfigStore.

What a trial measures is the engine's own `engine.config.TrialConfig` (every default lives there); this
module adds only what the platform needs around it: where the trial runs (`cluster`: the cluster layer's own
`ClusterConfig`, whose defaults live there) and where its result goes (`tracking`). The YAML files in conf/
stay short and only set values; the schema gives them types, so an unknown key or a wrong type is a
composition error. Value ranges are checked in validation.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore

from omegaconf import MISSING

from cluster.config import ClusterConfig
from engine.config import ModelConfig, TrialConfig

from ..optimize.settings import OptimizeConf


@dataclass
class TrackingConf:
    # where runs go: sqlite:///... | postgresql://... (with serve) | http://host:port (a running server)
    uri: str = "sqlite:///mlflow/mlflow.db"
    artifact_root: str = ""  # "": beside a local store (sqlite:////x/mlflow.db -> /x/artifacts), else mlflow/artifacts
    ui_port: int = 5000
    serve: bool = False  # start `mlflow server` on `uri` for the sweep's lifetime and log through it
    host: str = "127.0.0.1"  # bind address of that server; keep loopback unless you mean it
    port: int = 0  # 0 = any free port
    workers: int = 1  # server worker processes (1 for SQLite; more with PostgreSQL)
    spool_dir: str = ""  # results wait here when the store is unreachable (`infersweep sync`); "": beside it, as above
    request_timeout_s: float = 10  # per HTTP request to a tracking server
    request_retries: int = 2  # HTTP retries before the result is spooled instead
    writers: int = 1  # driver threads writing results to a server (>1 wants PostgreSQL behind it)


# mappings whose keys are the user's (`+cluster.resources.accel=1`), not the schema's
OPEN_MAPPINGS = ("cluster.resources", "optimize.slo")


@dataclass
class TrialConf(TrialConfig):
    """The engine's trial config plus placement and tracking (excluded from the config hash)."""

    # a model group file must say which model; its other keys keep the engine's defaults
    model: ModelConfig = field(default_factory=lambda: ModelConfig(name=MISSING, path=MISSING))
    sweep_name: str = "default"
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    tracking: TrackingConf = field(default_factory=TrackingConf)
    # `infersweep optimize`'s settings (conf/optimize/); not part of a trial: `expand` drops them from its config
    optimize: OptimizeConf = field(default_factory=OptimizeConf)


# top-level keys that are not the engine's: where a trial runs and where its result goes
PLATFORM_KEYS = ("sweep_name", "cluster", "tracking", "optimize")


def register() -> None:
    ConfigStore.instance().store(name="trial_schema", node=TrialConf)
