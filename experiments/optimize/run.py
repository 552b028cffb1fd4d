"""`infersweep optimize`: validate everything, open one `optimize` run, let the strategy decide through the
dispatcher, and leave the chain table (or the Pareto front), the final configuration with its hash and a plot
of the path in that run."""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Optional

import yaml

from ..config.compose import Problem, SweepError
from ..errors import UserError
from .chain import BASELINE_FAILED, MODEL_KEYS, Chain, ChainResult, baseline_of
from .dispatch import TrialMeasure
from .measurement import describe
from .objective import Objective
from .search import ACCURACY, Search, SearchResult, summary
from .settings import OptimizeConf, budget_of, from_dict, problems, rules_of
from .space import Space, read_space
from .table import order_notes, plot_path, to_markdown
from .types import Row

KIND = "optimize"
TABLE_ARTIFACT, ROWS_ARTIFACT, PLOT_ARTIFACT = "optimize/chain.md", "optimize/chain.json", "optimize/path.png"
FRONT_ARTIFACT, FINAL_ARTIFACT = "optimize/front.md", "optimize/final_config.yaml"
DEPLOY_ARTIFACT = "optimize/deploy.sh"


class OptimizeError(UserError):
    heading = "invalid optimize"


@dataclass(frozen=True)
class Decided:
    """What a strategy decided (the run around it adds where and how long: OptimizeResult)."""
    strategy: str
    final: dict[str, str]
    stop: str
    trials: int
    reused: int
    measured: dict[str, str] = field(default_factory=dict)  # the final point as its trial ran (eval.enabled=false ...)
    table: str = ""  # chain: the markdown table
    rows: tuple[Row, ...] = ()  # chain: the table's rows (chain.json)
    notes: tuple[str, ...] = ()
    summary: tuple[str, ...] = ()  # search: the front, best, races, pruned, refused, ... each in its section


@dataclass(frozen=True)
class OptimizeResult(Decided):
    experiment: str = ""
    run_id: Optional[str] = None
    wall_s: float = 0.0
    final_hash: str = ""  # the config hash of the final configuration's trial (`infersweep reproduce` finds it)
    deploy: str = ""  # the final configuration as the command that deploys it (deploy.py)
    verified: dict[str, float] = field(default_factory=dict)  # the printed command launched and measured (verify.py)


def prepare(overrides: list[str]) -> tuple[Space, OptimizeConf, TrialMeasure]:
    """Everything checked before any trial: the settings, the space, and the baseline trial's config."""
    try:
        space = read_space(overrides)
    except SweepError as e:  # the overrides' own problems: refused as what was asked (`invalid optimize:`)
        raise OptimizeError(e.problems) from None
    o = from_dict(space.config.get("optimize") or {})
    tracking = space.config["tracking"]
    disp = TrialMeasure(space, space.config["sweep_name"], tracking, None, rounds_of(o),
                      "infersweep optimize " + " ".join(overrides))
    floor = None  # a memory limit below every configuration's weights is refused now, not after the trials
    if space.axes and (o.max_memory_gb or 0) > 0:
        from .predict import weights_floor

        floor = weights_floor(disp, space.axes, baseline_of(space.axes))
    found = problems(o, space.axes, space.config, floor)
    if o.strategy == "search" and ACCURACY in o.search.objectives and not (space.config.get("eval") or {}).get("tasks"):
        found.append("optimize.search.objectives: 'accuracy' needs task accuracy (eval=tasks); drop it from the list "
                     "or choose eval=tasks")
    if space.axes and not found:
        base = baseline_of(space.axes)
        found += [f"baseline ({describe(base)}): {p}" for p in space.problems(base)]
        if not found:  # every value of every axis, each on the baseline: an unknown model is refused now, not at step 5
            for k, values in space.axes.items():
                for v in values:
                    if v != base[k]:
                        found += [f"{k}={v}: {p}" for p in own_problems(k, space.problems({**base, k: v}), space.axes)]
    if found:
        raise OptimizeError(found)
    return space, o, disp


def own_problems(key: str, problems: list[Problem], axes: dict[str, list[str]]) -> list[Problem]:
    """The problems of one axis value on the baseline that are its own: one keyed on another axis of the space is
    an interaction with that axis' baseline value (engine=native-cpp needs kv_cache=contiguous, which the baseline
    has off) -- the value runs once that axis is applied, and a candidate that combines them badly is refused at
    its step without a trial."""
    group = key.split(".", 1)[0]
    others = {k.split(".", 1)[0] for k in axes} - {group}
    return [p for p in problems if p.key.split(".", 1)[0] not in others]


def rounds_of(o: OptimizeConf) -> int:
    """The interleaved rounds of a pair: optimize.rounds, raised to the fewest that can give a bound at the timing
    rule's per-look level (decide.min_rounds: 9 at the shipped settings)."""
    from .decide import min_rounds

    return max(o.rounds, min_rounds(rules_of(o, False)))


def study_storage(tracking: dict[str, Any]) -> str:
    """The Optuna study's RDB storage: a sqlite file beside a local tracking store (mlflow/optuna.db)."""
    uri = str(tracking["uri"])
    if uri.startswith("sqlite:///"):
        return f"sqlite:///{Path(uri[len('sqlite:///'):]).parent / 'optuna.db'}"
    return "sqlite:///mlflow/optuna.db"


def _study_name(experiment: str, space: Space, o: OptimizeConf) -> str:
    """Same overrides and settings -> same study (a rerun resumes it); anything else -> a new one."""
    key = json.dumps({"fixed": sorted(space.fixed), "axes": space.axes, "optimize": o.__dict__ | {
        "gate": o.gate.__dict__, "search": o.search.__dict__}}, sort_keys=True, default=str)
    return f"{experiment}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"


def run_optimize(overrides: list[str], in_process: bool = False, echo=print) -> OptimizeResult:
    from ..tracking.store import Tracker, driver_id, held_interrupts

    t0 = time.perf_counter()
    space, o, disp = prepare(overrides)
    experiment = space.config["sweep_name"]
    objective = Objective.parse(o.objective)
    ev = space.config.get("eval") or {}
    gate = bool(o.gate.enabled and ev.get("tasks"))
    tracker = Tracker(space.config["tracking"])
    tracker.reap_stale_sweeps(experiment)
    exp_id = tracker.experiment_id(experiment)
    with held_interrupts():  # the run's id is in hand before an interrupt can land: the `finally` ends it
        rid = tracker.client.create_run(exp_id, run_name=f"optimize ({o.strategy})", tags={
            "kind": KIND, "optimize.strategy": o.strategy, "optimize.objective": o.objective,
            "driver": driver_id(), "command": disp.command[:4000]}).info.run_id
    status = "FAILED"
    try:
        tracker.client.log_text(rid, yaml.safe_dump({"space": space.axes, "fixed": space.fixed, "optimize": o.__dict__ | {
            "gate": o.gate.__dict__, "search": o.search.__dict__}}, sort_keys=False, default_flow_style=None),
            "optimize/settings.yaml")
        disp.parent_run_id, disp.in_process, disp.echo = rid, in_process, echo
        if disp.rounds > o.rounds:
            echo(f"optimize.rounds={o.rounds} raised to {disp.rounds}: fewer rounds cannot show a gain at the timing "
                 f"rule's per-look level ({rules_of(o, False).timing_alpha:.4f})")
        echo(f"optimize ({o.strategy}, objective {objective.label}) over {len(space.axes)} axes: "
             + ", ".join(f"{k}={','.join(v)}" for k, v in space.axes.items()) + f"; experiment '{experiment}', run {rid}")
        if o.strategy == "chain":
            decided = _chain(space, o, objective, gate, disp, echo)
        else:
            decided = _search(space, o, gate, disp, echo, study_storage(space.config["tracking"]),
                              _study_name(experiment, space, o))
        spec, problem = _final_spec(disp, decided)
        res = OptimizeResult(**{f.name: getattr(decided, f.name) for f in fields(Decided)},
                             experiment=experiment, run_id=rid, wall_s=time.perf_counter() - t0,
                             final_hash=spec.config_hash if spec else "", deploy=_deployment(spec.trial) if spec else "")
        if problem:
            res = replace(res, notes=res.notes + (problem,))
        if o.verify and spec is not None and decided.stop == BASELINE_FAILED:
            res = replace(res, notes=res.notes + ("the deploy command was not verified: the baseline's trial failed "
                                                  "(its reason is in the table), so no configuration was measured",))
        elif o.verify and spec is not None:
            res = _verified(res, spec, decided, o, objective, disp, echo)
        _log(tracker.client, rid, res, spec)
        status = "FINISHED"
        return res
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        tracker.client.set_terminated(rid, status=status)


def _verified(res: OptimizeResult, spec, decided: Decided, o: OptimizeConf, objective: Objective, disp: TrialMeasure,
              echo) -> OptimizeResult:
    """The printed command launched beside the engine's defaults and measured (verify.py); where the final runs
    in-process, first its served counterpart measured (counterpart.py), whose command is the one launched."""
    from engine import engines
    from engine.served.session import ServedEngine

    from .verify import verify_deploy

    trial, deploy, notes, metrics = spec.trial, res.deploy, res.notes, dict(res.verified)
    if not isinstance(engines.get(trial.engine.backend), ServedEngine):
        from .counterpart import served_counterpart

        c = served_counterpart(disp, decided.measured or decided.final, spec, objective, echo)
        notes, metrics = notes + c.notes, metrics | c.metrics
        deploy += "".join(f"# {n}\n" for n in c.notes)
        if c.measurement is None or not c.measurement.ok:
            return replace(res, notes=notes, verified=metrics, deploy=deploy)
        trial = c.spec.trial
        deploy += "\n" + _deployment(trial).replace("# deploy the final configuration",
                                                      "# deploy its served counterpart", 1)
    note, verified = verify_deploy(trial, max(2, o.verify_rounds or disp.rounds), echo)
    if note:
        notes, metrics, deploy = notes + (note,), metrics | verified, deploy + f"# {note}\n"
    return replace(res, notes=notes, verified=metrics, deploy=deploy)


def group_backend(option: str) -> str:
    """The backend an `engine=` config group option runs (`native-cpp` -> `native`); the option itself where the
    group has no such file (validation names it)."""
    from omegaconf import OmegaConf

    from ..config.compose import conf_dir

    path = conf_dir() / "engine" / f"{option}.yaml"
    return str(OmegaConf.load(path).get("backend", option)) if path.is_file() else option


def score_neutral(space: Space) -> tuple[str, ...]:
    """The axes that cannot change this space's task scores: those that touch only generation (engine/axes.py
    `generation_only`: the KV cache, batching, speculation), where an in-process logits engine (hf, native) scores a
    log-likelihood task teacher-forced with no cache (engine/engines/logits.py `Backend.score`). Nothing when a task
    generates or an engine scores otherwise."""
    from engine import axes
    from engine.tasks.run import needs_generation

    tasks = list((space.config.get("eval") or {}).get("tasks") or [])
    if not tasks or any(needs_generation(t) for t in tasks) or not logits_engines(space):
        return ()
    return tuple(a.key for a in axes.AXES if a.generation_only)


def backends_of(space: Space) -> list[str]:
    """The engines the space's trials run on: the engine axis's (config group options such as `native-cpp`, each
    naming its backend), else the config's one."""
    from engine.config import EngineConfig

    if "engine" in space.axes:
        return [group_backend(v) for v in space.axes["engine"]]
    return [str((space.config.get("engine") or {}).get("backend", EngineConfig().backend))]


def logits_engines(space: Space) -> bool:
    """Whether every engine of the space scores from its own logits (hf, native, llamacpp: a `LogitsEngine`)."""
    from engine import engines
    from engine.config import EngineError
    from engine.engines.logits import LogitsEngine

    try:
        return all(isinstance(engines.get(b), LogitsEngine) for b in backends_of(space))
    except EngineError:  # an unknown engine: validation says so
        return False


def prescreen_of(space: Space, o: OptimizeConf) -> int:
    """The gate's fidelity pre-screen windows (prescreen.py) where every engine of the space runs in this process;
    0 (off) where one is served: each pre-screen trial would start a server, costing more than the look it sizes."""
    from engine import engines
    from engine.config import EngineError

    try:
        return o.gate.prescreen if all(engines.get(b).in_process for b in backends_of(space)) else 0
    except EngineError:
        return 0


def model_documents(space: Space) -> tuple[str, ...]:
    """The tasks whose documents each model builds with its own tokenizer (the needle tasks: a haystack cut to
    the context in tokens), so that a position is no item identity across models."""
    from engine.tasks.run import needs_generation

    return tuple(t for t in (space.config.get("eval") or {}).get("tasks") or [] if needs_generation(t))


def gate_pool(config: dict[str, Any]) -> int:
    """The items the gate can draw from (eval.order=pooled: every task's prepared documents together; else the
    first eval.limit... of each task, so the pool is not known): 0 where unknown."""
    from engine.tasks.run import POOLED, pool_size

    ev = config.get("eval") or {}
    if ev.get("order") != POOLED:
        return 0
    return pool_size(list(ev.get("tasks") or []), list(ev.get("task_files") or [])) or 0


def _chain(space: Space, o: OptimizeConf, objective: Objective, gate: bool, disp: TrialMeasure, echo) -> Decided:
    from .predict import WeightBytes

    limit = int((space.config.get("eval") or {}).get("limit") or 0)
    predict = None
    if any(k in MODEL_KEYS for k in space.axes):  # right-size: a larger model predicted slower is not measured
        from .predict import CostModelSkip

        predict = CostModelSkip(disp, space.axes).predicted
    neutral = score_neutral(space) if gate else ()
    c = Chain(space.axes, objective, rules_of(o, gate, limit, model_documents(space)), budget_of(o), disp, eval_limit=limit,
              trust_regime=o.trust_regime, echo=echo, predict=predict, score_neutral=neutral,
              eval_baseline=not neutral,  # log-likelihood tasks only: the pairs measure every accuracy that decides
              item_pool=gate_pool(space.config) if gate else 0,
              weights=WeightBytes(disp) if o.max_memory_gb else None,  # a candidate whose weights exceed it: skipped
              prescreen=prescreen_of(space, o))  # the gate's fidelity pre-screen (prescreen.py)
    r: ChainResult = c.run()
    notes = order_notes(r.rows)
    if r.total is not None:
        notes.append(f"total gain of the chain: {objective.label} {r.total.cell()} (final vs baseline, one "
                     f"interleaved pair, 95%)")
    return Decided("chain", r.incumbent, r.stop, r.trials, r.reused,
                   measured=dict(r.incumbent_measurement.point) if r.incumbent_measurement else {},
                   table=to_markdown(r.rows), rows=tuple(r.rows), notes=tuple(notes))


def _search(space: Space, o: OptimizeConf, gate: bool, disp: TrialMeasure, echo, storage: str, name: str) -> Decided:
    from cluster import ClusterConfig

    cl = ClusterConfig.from_dict(space.config["cluster"])
    batch = o.search.batch or max(1, int((os.cpu_count() or 1) // max(1.0, float(cl.num_cpus_per_trial))))
    predict = None
    if o.search.skip_predicted:
        from .predict import CostModelSkip

        predict = CostModelSkip(disp, space.axes, o.search.predicted_loss, memory="peak_memory" in o.search.objectives)
    goals = [g for g in o.search.objectives if g != ACCURACY or gate or (space.config.get("eval") or {}).get("tasks")]
    limit = int((space.config.get("eval") or {}).get("limit") or 0)
    s = Search(space.axes, goals, rules_of(o, gate, limit), budget_of(o), disp, batch=batch, validate=disp.validate,
               predict=predict or (lambda p, done: ""), storage=storage, study_name=name, seed=o.search.seed,
               eval_limit=limit, echo=echo)
    r: SearchResult = s.run()
    best = r.best
    return Decided("search", dict(best.point) if best else {}, r.stop, r.trials, r.reused,
                   measured=dict(best.measurement.point) if best and best.measurement else {}, summary=tuple(summary(r)),
                   notes=(f"objectives: {', '.join(goals)}; {len(r.evaluated)} configuration(s) measured, "
                          f"{r.duplicates} repeated proposal(s) of decided configurations (nothing measured)",)
                   + ((f"resumed: {r.earlier} trial(s) run by earlier runs of this study count toward "
                       f"optimize.max_trials; their verdicts on the best were kept",) if r.earlier else ()))


def _final_spec(disp: TrialMeasure, decided: Decided):
    """(the final configuration's trial spec -- as its trial ran, so its hash is one `reproduce` finds -- or None,
    and a note when it no longer validates)."""
    if not decided.final:
        return None, ""
    try:
        return disp.spec(decided.measured or decided.final), ""
    except SweepError as e:  # it ran, so it validated: say so rather than hide it
        return None, f"the final configuration no longer validates: {'; '.join(e.problems)}"


def _log(client, rid: str, res: OptimizeResult, spec) -> None:
    """The run's artifacts and tags: the table / front, the final configuration, its hash and deploy command, the plot."""
    tags = {"optimize.stop": res.stop[:250], "optimize.trials": str(res.trials), "optimize.reused": str(res.reused)}
    if res.final_hash:
        tags["final_config_hash"] = res.final_hash
    for k, v in tags.items():
        client.set_tag(rid, k, v)
    if spec is not None:
        client.log_text(rid, yaml.safe_dump(spec.config, sort_keys=True), FINAL_ARTIFACT)
        client.log_text(rid, res.deploy, DEPLOY_ARTIFACT)
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    client.log_batch(rid, metrics=[Metric(k, float(v), now, 0) for k, v in (
        ("optimize_trials", res.trials), ("optimize_reused", res.reused), ("optimize_wall_s", res.wall_s),
        *res.verified.items())])
    if res.strategy == "chain":
        client.log_text(rid, res.table + "\n\n" + "\n".join(f"- {n}" for n in res.notes) + "\n", TABLE_ARTIFACT)
        client.log_text(rid, json.dumps([row.as_dict() for row in res.rows], indent=1), ROWS_ARTIFACT)
        with tempfile.TemporaryDirectory() as d:
            path = plot_path(res.rows, Path(d) / "path.png", f"optimize ({res.experiment}): final {describe(res.final)}")
            if path is not None:
                client.log_artifact(rid, str(path), "optimize")
    else:
        client.log_text(rid, "\n".join(res.summary + ("",) + res.notes) + "\n", FRONT_ARTIFACT)
    from ..tracking.dashboard import show_optimize

    show_optimize(client, rid, res)  # the run's description (table, final hash); trials named by step, candidate


def _deployment(trial) -> str:
    from engine.config import EngineError

    from .deploy import deployment, gguf_of

    def gguf(t):
        try:
            return gguf_of(t)
        except (EngineError, OSError) as e:  # not in this machine's cache: named by what it holds
            return f"<GGUF of {t.model.name}, weights {t.quant.level}: {e}>"

    return deployment(trial, gguf).text()


def print_result(res: OptimizeResult, echo=print) -> None:
    echo("")
    if res.strategy == "chain":
        echo(res.table)
        for n in res.notes:
            echo(f"note: {n}")
    else:
        for line in res.summary:
            echo(line)
        for n in res.notes:
            echo(f"note: {n}")
    echo(f"\nstopped: {res.stop}; {res.trials} trial(s) run, {res.reused} reused from the store; "
         f"{res.wall_s / 60:.1f} min")
    echo(f"final: {describe(res.final) if res.final else '(none)'}  config_hash {res.final_hash[:12] or '?'}"
         + (f"  (infersweep reproduce {res.final_hash[:12]})" if res.final_hash else ""))
    if res.deploy:
        echo("\n" + res.deploy.rstrip())
    echo(f"MLflow: experiment '{res.experiment}', optimize run {res.run_id} (artifacts optimize/); `infersweep ui` "
         "prints the URL of its page")
