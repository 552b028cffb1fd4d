"""MLflow records: one experiment per sweep name, a parent run per sweep, a child run per trial.

The sweep driver is the only writer (workers return plain outcomes), so a local SQLite store works for any
number of workers and no node needs a shared filesystem.
"""
from __future__ import annotations

import functools
import json
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable, Optional

import yaml

from .compose import PROJECT_ROOT
from .hashing import HASH_VERSION
from .spec import TrialSpec
from .trial import TrialOutcome

PARENT_TAG = "mlflow.parentRunId"
CONFIG_ARTIFACT = "config.yaml"
TOKENS_ARTIFACT = "token_ids.json"
PACKAGES = ("torch", "transformers", "ray", "mlflow", "hydra-core", "bitsandbytes", "infersweep")


def resolve_uri(uri: str) -> str:
    """A relative sqlite path is relative to the project root, not to wherever the CLI was started."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri.startswith(prefix + "/"):
        path = (PROJECT_ROOT / uri[len(prefix):]).resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        return prefix + str(path)
    return uri


def resolve_artifact_root(root: str) -> str:
    if "://" in root:
        return root
    path = Path(root) if Path(root).is_absolute() else PROJECT_ROOT / root
    path.mkdir(parents=True, exist_ok=True)
    return path.resolve().as_uri()


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = "null" if v is None else str(v)
    return out


@functools.lru_cache(maxsize=1)
def environment_tags() -> dict[str, str]:
    tags = {"python": platform.python_version(), "hash_version": str(HASH_VERSION)}
    for pkg in PACKAGES:
        try:
            tags[f"version.{pkg}"] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    try:
        commit = subprocess.run(
            ["git", "-C", str(PROJECT_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(PROJECT_ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=5,
        ).stdout.strip()
        if commit:
            tags["git_commit"] = commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return tags


class Tracker:
    def __init__(self, tracking: dict[str, Any]):
        from mlflow.tracking import MlflowClient

        self.uri = resolve_uri(tracking["uri"])
        self.artifact_root = resolve_artifact_root(tracking["artifact_root"])
        self.client = MlflowClient(tracking_uri=self.uri)

    # --- writing -------------------------------------------------------------------------------------
    def experiment_id(self, name: str) -> str:
        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            return exp.experiment_id
        return self.client.create_experiment(name, artifact_location=f"{self.artifact_root}/{name}")

    def start_sweep(self, sweep_name: str, sweep_id: str, specs: list[TrialSpec], command: str) -> str:
        exp_id = self.experiment_id(sweep_name)
        axes = sorted({k for s in specs for k in s.swept})
        run = self.client.create_run(
            exp_id,
            run_name=f"sweep-{sweep_id}",
            tags={"sweep_id": sweep_id, "kind": "sweep", "command": command, **environment_tags()},
        )
        rid = run.info.run_id
        self.client.log_batch(rid, params=_params({"trials": str(len(specs)), "axes": ",".join(axes) or "-"}))
        self.client.log_text(rid, "\n".join(f"{s.short_hash} {s.label}" for s in specs), "trials.txt")
        return rid

    def end_run(self, run_id: str, status: str) -> None:
        self.client.set_terminated(run_id, status=status)

    def log_trial(
        self,
        exp_name: str,
        spec: TrialSpec,
        outcome: TrialOutcome,
        parent_run_id: Optional[str] = None,
        sweep_id: Optional[str] = None,
        extra_tags: Optional[dict[str, str]] = None,
    ) -> str:
        from mlflow.entities import Metric

        exp_id = self.experiment_id(exp_name)
        tags = {
            "config_hash": spec.config_hash,
            "trial_index": str(spec.index),
            "kind": "trial",
            **environment_tags(),
            **{f"env.{k}": v for k, v in outcome.info.items()},
            **(extra_tags or {}),
        }
        if parent_run_id:
            tags[PARENT_TAG] = parent_run_id
        if sweep_id:
            tags["sweep_id"] = sweep_id
        if outcome.error:
            tags["error"] = outcome.error.splitlines()[0][:4000]
        run = self.client.create_run(exp_id, start_time=outcome.start_ms or None, tags=tags, run_name=spec.label[:250])
        rid = run.info.run_id
        params = flatten({k: v for k, v in spec.config.items() if k != "tracking"})
        metrics = [Metric(k, float(v), outcome.end_ms, 0) for k, v in sorted(outcome.metrics.items())]
        self.client.log_batch(rid, metrics=metrics, params=_params(params))
        self.client.log_text(rid, yaml.safe_dump(spec.config, sort_keys=True), CONFIG_ARTIFACT)
        if outcome.token_ids:
            self.client.log_text(rid, json.dumps(outcome.token_ids), TOKENS_ARTIFACT)
            self.client.log_text(rid, outcome.sample_text, "sample.txt")
        if outcome.error:
            self.client.log_text(rid, outcome.error, "error.txt")
        self.client.set_terminated(rid, status=outcome.status, end_time=outcome.end_ms or None)
        return rid

    # --- reading -------------------------------------------------------------------------------------
    def find_by_hash(self, prefix: str, statuses: Iterable[str] = ("FINISHED",)) -> list:
        from mlflow.entities import ViewType

        exps = [e.experiment_id for e in self.client.search_experiments(view_type=ViewType.ACTIVE_ONLY)]
        if not exps:
            return []
        safe = prefix.replace("'", "")
        runs = self.client.search_runs(
            exps, filter_string=f"tags.config_hash LIKE '{safe}%'", order_by=["attributes.start_time ASC"], max_results=1000
        )
        return [r for r in runs if r.info.status in set(statuses)]

    def load_text(self, run_id: str, path: str) -> str:
        import tempfile

        import mlflow.artifacts

        with tempfile.TemporaryDirectory() as tmp:
            local = mlflow.artifacts.download_artifacts(
                run_id=run_id, artifact_path=path, dst_path=tmp, tracking_uri=self.uri
            )
            return Path(local).read_text()


def _params(d: dict[str, str]):
    from mlflow.entities import Param

    return [Param(k, v[:6000]) for k, v in sorted(d.items())]
