"""The production `Measure`: each point becomes a validated TrialSpec (the space's `trial`: the point composed
once on the fixed overrides), runs through the sweep's machinery (`run_specs`: the Ray dispatcher, retries, one MLflow run per
trial nested under the `optimize` run, KILLED on Ctrl-C), and comes back as a `Measurement`.

Resume by config hash: a single point whose hash already has a FINISHED run in the experiment is read back
instead of run. A pair is measured interleaved (`cluster.interleave` rounds on one worker), so its runs share
a deterministic interleave group id (the hashes of its members): attempt k of a pair reuses the k-th FINISHED
run of that group for each member (runs the request `skip`s left out), and runs the pair when there is none.
"""
from __future__ import annotations

import json
from typing import Any, Optional, Sequence

from engine.measure.metrics import TIMINGS
from engine.pipeline import TOP1_ARTIFACT

from ..config.compose import Problem, SweepError
from ..config.spec import TrialSpec
from ..run.trial import FINISHED, identified_correct, interleave_group_id
from ..tracking.store import CORRECT_ARTIFACT, REPEAT_PREFIX, resolve_uri
from .measurement import FAILED, INVALID, Measurement, Point, Request
from .space import Space

INTERLEAVE_TAG = "env.interleave_group"


class TrialMeasure:
    """The production `Measure` (measurement.py): points -> validated trials -> `run_specs` (the cluster's own
    dispatcher, cluster/dispatcher.py, places them) -> Measurements; FINISHED trials reused by config hash."""

    def __init__(self, space: Space, sweep_name: str, tracking: dict[str, Any], parent_run_id: Optional[str],
                 rounds: int, command: str, in_process: bool = False, echo=print):
        self.space, self.sweep_name, self.tracking = space, sweep_name, tracking
        self.parent_run_id, self.rounds, self.command = parent_run_id, rounds, command
        self.in_process, self.echo = in_process, echo
        self._client = None

    # --- points -> specs ---------------------------------------------------------------------------------
    def spec(self, point: Point, interleaved: bool = False) -> TrialSpec:
        """`point`'s validated trial (as one of an interleaved group: `cluster.interleave` rounds); raises InvalidTrial."""
        return self.space.trial(point, self.rounds if interleaved else 0)

    def problems(self, point: Point) -> list[Problem]:
        """The validation's problems with `point` ([] when it can run), each with its config key: never spent as a trial."""
        return self.space.problems(point)

    def validate(self, point: Point) -> list[str]:
        """`problems`, as the user reads them."""
        return [str(p) for p in self.problems(point)]

    def specs(self, req: Request) -> list[TrialSpec]:
        """The trials of a request's points (a pair's as an interleaved group); raises InvalidTrial."""
        return [self.spec(p, req.interleaved and len(req.points) > 1) for p in req.points]

    # --- the store -------------------------------------------------------------------------------------
    @property
    def client(self):
        if self._client is None:
            from mlflow.tracking import MlflowClient

            self._client = MlflowClient(tracking_uri=resolve_uri(self.tracking["uri"]))
        return self._client

    def _finished(self, flt: str) -> list:
        exp = self.client.get_experiment_by_name(self.sweep_name)
        if exp is None:
            return []
        return self.client.search_runs([exp.experiment_id], f"{flt} and attributes.status = '{FINISHED}'",
                                       order_by=["attributes.start_time ASC"], max_results=500)

    def _from_run(self, run, point: Point, interleaved: bool) -> Measurement:
        metrics = dict(run.data.metrics)
        rounds: dict[str, list[float]] = {}
        if interleaved:
            for m in TIMINGS:
                hist = self.client.get_metric_history(run.info.run_id, REPEAT_PREFIX + m)
                if hist:
                    rounds[m] = [float(x.value) for x in sorted(hist, key=lambda x: x.step)]
        correct: dict[str, list] = {}
        from mlflow.artifacts import load_text
        from mlflow.exceptions import MlflowException

        try:
            correct = json.loads(load_text(f"{run.info.artifact_uri}/{CORRECT_ARTIFACT}"))
        except (MlflowException, OSError, ValueError):
            pass  # no eval.tasks, or a run from before per-item results were logged
        top1: dict = {}
        if "top1_agreement" in metrics:  # eval.fidelity: its argmax ids (the pre-screen compares them)
            try:
                top1 = json.loads(load_text(f"{run.info.artifact_uri}/{TOP1_ARTIFACT}"))
            except (MlflowException, OSError, ValueError):
                pass  # a run from before the ids were logged
        return Measurement(point=dict(point), metrics=metrics, rounds=rounds, correct=correct, top1=top1,
                           labels=dict(run.data.tags), config_hash=run.data.tags.get("config_hash", ""), reused=True,
                           run_id=run.info.run_id)

    def _reuse(self, req: Request, specs: list[TrialSpec]) -> Optional[list[Measurement]]:
        if req.interleaved and len(specs) > 1:
            runs = self._finished(f"tags.`{INTERLEAVE_TAG}` = '{interleave_group_id(specs)}'")
            picked = []
            for s in specs:
                mine = [r for r in runs if r.data.tags.get("config_hash") == s.config_hash
                        and r.info.run_id not in req.skip]
                if len(mine) <= req.attempt:
                    return None
                picked.append(mine[req.attempt])
        else:  # attempt 0: the newest FINISHED run of the hash; attempt k > 0 (measured again): the k-th, or run it
            picked = []
            for s in specs:
                # measured alone: a member of an interleaved pair with the same hash is another measurement (its
                # peak is the group's), and which is newer depends on when each was logged: a rerun must find the same
                runs = [r for r in self._finished(f"tags.config_hash = '{s.config_hash}'")
                        if not r.data.tags.get(INTERLEAVE_TAG)]
                if len(runs) <= req.attempt:
                    return None
                picked.append(runs[-1] if req.attempt == 0 else runs[req.attempt])
        return [self._from_run(r, p, req.interleaved) for r, p in zip(picked, req.points)]

    # --- measuring -------------------------------------------------------------------------------------
    def __call__(self, requests: Sequence[Request]) -> list[list[Measurement]]:
        from ..run.sweep import run_specs

        out: list[Optional[list[Measurement]]] = [None] * len(requests)
        todo: list[tuple[int, list[TrialSpec]]] = []
        for i, req in enumerate(requests):
            try:
                specs = self.specs(req)
            except SweepError as e:
                out[i] = [Measurement(dict(p), status=INVALID, error="; ".join(e.problems)) for p in req.points]
                continue
            reused = self._reuse(req, specs)
            if reused is not None:
                out[i] = reused
            else:
                todo.append((i, specs))
        # singles run together (in parallel on the pool); each interleaved pair is one group of its own
        singles = [(i, specs) for i, specs in todo if not (requests[i].interleaved and len(specs) > 1)]
        batches = ([singles] if singles else []) + [[(i, specs)] for i, specs in todo if (i, specs) not in singles]
        for batch in batches:
            flat = [TrialSpec(config=s.config, swept=s.swept, index=j)
                    for j, s in enumerate(s for _, specs in batch for s in specs)]
            res = run_specs(flat, self.command, in_process=self.in_process, echo=self.echo,
                            parent_run_id=self.parent_run_id, extra_tags={"optimize_parent": self.parent_run_id or ""})
            rows = iter(res.rows)
            for i, specs in batch:
                out[i] = [self._from_row(next(rows), p, requests[i].interleaved) for p in requests[i].points]
        return [o or [] for o in out]

    @staticmethod
    def _from_row(row: dict, point: Point, interleaved: bool) -> Measurement:
        o = row["outcome"]
        if o is None or row["status"] != FINISHED:
            return Measurement(dict(point), status=FAILED, error=(o.error if o else row.get("error", "")) or row["status"],
                               config_hash=o.config_hash if o else "", run_id=row.get("run_id"))
        return Measurement(dict(point), metrics=dict(o.metrics), rounds=dict(o.samples) if interleaved else {},
                           correct=identified_correct(getattr(o, "correct", {}), getattr(o, "items", {})),
                           top1=json.loads(getattr(o, "artifacts", {}).get(TOP1_ARTIFACT, "{}")),
                           labels=dict(o.labels), config_hash=o.config_hash, run_id=row.get("run_id"))
