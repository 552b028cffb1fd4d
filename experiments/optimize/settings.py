"""`optimize.*`: the settings of one `infersweep optimize` (conf/optimize/<strategy>.yaml), typed; and every
problem with them and with the space, found at once before anything runs."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from .types import Budget, Rules  # a leaf: the config schema imports this module, not the strategies

STRATEGIES = ("chain", "search")


@dataclass
class GateConf:
    enabled: bool = True  # judge task accuracy (needs eval.tasks)
    max_drop: float = 0.03  # the accuracy drop (share of items) tolerated, vs the incumbent and vs the baseline
    false_holds: float = 0.05  # P(the gate holds | the true drop is max_drop), over all its looks
    max_items: int = 1500  # the gate's looks grow from eval.limit up to this many items, as its plan needs
    prescreen: int = 16  # the fidelity pre-screen's windows (of workload.context_len tokens) per configuration; 0: off


@dataclass
class SearchConf:
    objectives: list[str] = field(default_factory=lambda: ["tpot", "accuracy", "peak_memory"])
    batch: int = 0  # configurations measured at once; 0: the cluster's trial slots
    seed: int = 0
    skip_predicted: bool = True  # skip configurations the cost model predicts to lose
    predicted_loss: float = 0.25  # ... by more than this share of the best predicted decode time


@dataclass
class OptimizeConf:
    strategy: str = "chain"
    objective: str = "tpot"  # tpot | ttft | output_tok_s | max_rate | goodput | peak_memory | 0.7*tpot+0.3*peak_memory | tpot>peak_memory
    min_effect: float = 0.03  # the smallest gain a step must clear (3%), by the lower bound of its interval
    false_accept: float = 0.025  # P(a pair is accepted | its true gain < min_effect), over the whole procedure
    max_trials: int = 24  # trials run now (FINISHED ones reused by hash are free)
    max_minutes: float = 0.0  # 0: no time limit
    remeasure: int = 2  # further measurements of an undecided pair (its rounds pooled; load-flagged ones dropped)
    retries: int = 1  # at the chain's end, while budget remains: more measurements of a still-undecided pair
    rounds: int = 5  # interleaved rounds of a pair (cluster.interleave)
    trust_regime: bool = True  # skip chain steps the measured regime says cannot pay off
    slo: dict[str, float] = field(default_factory=dict)  # metric -> limit, e.g. {ttft_ms_p99: 500}
    max_memory_gb: Optional[float] = None  # None: no limit; judged on the candidate measured alone
    # a final configuration on a served engine: launch the printed deploy command beside the engine's defaults and
    # report their paired goodput (experiments/optimize/verify.py); rounds 0: optimize.rounds as raised for a pair
    verify: bool = True
    verify_rounds: int = 0
    gate: GateConf = field(default_factory=GateConf)
    search: SearchConf = field(default_factory=SearchConf)


def from_dict(d: dict[str, Any]) -> OptimizeConf:
    d = dict(d or {})
    gate = GateConf(**(d.pop("gate", None) or {}))
    search = SearchConf(**(d.pop("search", None) or {}))
    return OptimizeConf(**d, gate=gate, search=search)


def rules_of(o: OptimizeConf, gate: bool, eval_limit: int = 0, model_documents: tuple[str, ...] = ()) -> Rules:
    """The decision rules of `o`; `eval_limit`: the configured item count, from which the gate's looks follow."""
    from .accuracy import gate_looks

    return Rules(min_effect=o.min_effect, false_accept=o.false_accept, attempts=1 + o.remeasure,
                 max_drop=o.gate.max_drop, false_holds=o.gate.false_holds,
                 gate_looks=gate_looks(eval_limit, o.gate.max_items) if eval_limit else 1, gate=gate,
                 slo={str(k): float(v) for k, v in (o.slo or {}).items()},
                 max_memory_bytes=None if o.max_memory_gb is None else o.max_memory_gb * 1e9,
                 model_documents=tuple(model_documents), retries=o.retries)


def budget_of(o: OptimizeConf) -> Budget:
    return Budget(max_trials=o.max_trials, max_s=60 * o.max_minutes, max_items=o.gate.max_items)


def problems(o: OptimizeConf, space: dict[str, list[str]], config: dict[str, Any],
             weights_floor: Optional[tuple[float, str]] = None) -> list[str]:
    """Every problem with the settings, the space and the trial config they apply to, each naming its key.
    `weights_floor`: (the fewest weight bytes any configuration of the space holds, whose they are: predict.py)."""
    from .objective import Objective, ObjectiveError
    from .search import GOALS

    out: list[str] = []
    if o.strategy not in STRATEGIES:
        out.append(f"optimize.strategy: unknown strategy {o.strategy!r}; use {' or '.join(STRATEGIES)} (optimize=search)")
    try:
        Objective.parse(o.objective)
    except ObjectiveError as e:
        out.append(f"optimize.objective: {e}")
    if o.strategy == "search":
        bad = [g for g in o.search.objectives if g not in GOALS]
        if bad or not o.search.objectives:
            out.append(f"optimize.search.objectives: unknown {', '.join(map(repr, bad)) or '(empty list)'}; use a list of "
                       f"{', '.join(GOALS)}")
        if o.search.batch < 0:
            out.append(f"optimize.search.batch: must be >= 0 (0: the cluster's trial slots), got {o.search.batch}")
    if o.max_trials < 1:
        out.append(f"optimize.max_trials: the budget must allow at least one trial (>= 1), got {o.max_trials}; "
                   f"e.g. optimize.max_trials=24")
    if o.max_minutes < 0:
        out.append(f"optimize.max_minutes: must be >= 0 (0: no time limit), got {o.max_minutes}")
    if o.min_effect < 0:
        out.append(f"optimize.min_effect: must be >= 0 (0.03 = a 3% gain), got {o.min_effect}")
    if o.remeasure < 0:
        out.append(f"optimize.remeasure: must be >= 0, got {o.remeasure}")
    if o.retries < 0:
        out.append(f"optimize.retries: must be >= 0, got {o.retries}")
    if o.rounds < 2:
        out.append(f"optimize.rounds: a pair needs >= 2 interleaved rounds for an interval, got {o.rounds}")
    if not 0 < o.false_accept < 0.5:
        out.append(f"optimize.false_accept: must be in (0, 0.5), got {o.false_accept}")
    if not 0 < o.gate.false_holds < 0.5:
        out.append(f"optimize.gate.false_holds: must be in (0, 0.5), got {o.gate.false_holds}")
    if o.gate.max_items < 1:
        out.append(f"optimize.gate.max_items: must be >= 1, got {o.gate.max_items}")
    if o.gate.prescreen < 0:
        out.append(f"optimize.gate.prescreen: windows of fixed text per configuration, >= 0 (0: off), "
                   f"got {o.gate.prescreen}")
    if o.max_memory_gb is not None and not o.max_memory_gb > 0:
        out.append(f"optimize.max_memory_gb: a memory limit must be > 0 GB, got {o.max_memory_gb}; leave it unset "
                   f"(null) for no limit")
    elif o.max_memory_gb is not None and weights_floor and o.max_memory_gb * 1e9 < weights_floor[0]:
        out.append(f"optimize.max_memory_gb: {o.max_memory_gb:g} GB is below {weights_floor[1]}: no configuration "
                   f"of this space can meet it")
    for metric, limit in (o.slo or {}).items():
        try:
            bad = not float(limit) > 0
        except (TypeError, ValueError):
            bad = True
        if bad:
            out.append(f"optimize.slo.{metric}: a limit must be a number > 0, got {limit!r}")
    if not 0 <= o.gate.max_drop < 1:
        out.append(f"optimize.gate.max_drop: must be in [0, 1) (a share of the items), got {o.gate.max_drop}")
    ev = config.get("eval") or {}
    if o.gate.enabled and not (ev.get("enabled", True) and ev.get("tasks")):
        out.append("optimize.gate.enabled: the accuracy gate needs task accuracy, and eval.tasks is empty; choose "
                   "eval=tasks (or eval.tasks=[...]), or turn the gate off with optimize.gate.enabled=false")
    elif o.gate.enabled and 0 < o.gate.max_drop < 1 and 0 < o.gate.false_holds < 0.5 and o.gate.max_items >= 1:
        out += gate_reach_problems(o, ev)
    wl = config.get("workload") or {}
    if o.slo and wl.get("kind", "static") not in ("serving", "multi-turn"):
        out.append(f"optimize.slo: an SLO ({', '.join(o.slo)}) needs a serving workload (requests arriving over "
                   f"time), but workload.kind is {wl.get('kind', 'static')!r}; choose workload=serving-mixed, or drop "
                   f"optimize.slo")
    if not space:
        out.append("the space is empty: give at least one axis with several values to choose from, e.g. "
                   "`infersweep optimize kv_cache=off,contiguous attention=eager,sdpa` (or experiment=optimize-cpu)")
    for k, vs in space.items():
        if len(vs) < 2:
            out.append(f"{k}: an optimize axis needs at least two values to choose from, got [{', '.join(vs)}]; "
                       f"pin it as {k}={vs[0] if vs else 'VALUE'} or list more values ({k}=a,b)")
    return out


def gate_reach_problems(o: OptimizeConf, ev: dict[str, Any]) -> list[str]:
    """A gate that cannot decide anything: the most items it may look at (optimize.gate.max_items, and the tasks'
    pool under eval.order=pooled) cannot rule out a drop of max_drop even when no item differs."""
    from engine.tasks.run import POOLED, pool_size

    from .accuracy import GATE_LOOKS, min_items

    need = min_items(o.gate.max_drop, o.gate.false_holds / GATE_LOOKS)
    tasks = list(ev.get("tasks") or [])
    # eval.order=first takes eval.limit documents of each task: its pool is not known before lm-eval builds it
    pool = pool_size(tasks, list(ev.get("task_files") or [])) if ev.get("order") == POOLED else None
    reach = min(o.gate.max_items, pool) if pool else o.gate.max_items
    if reach >= need:
        return []
    what = (f"the {pool:,} items of {', '.join(tasks)}" if pool is not None and pool <= o.gate.max_items
            else f"optimize.gate.max_items={o.gate.max_items}")
    return [f"optimize.gate: {what} cannot show accuracy within {100 * o.gate.max_drop:g} points even with no item differing "
            f"(that needs >= {need:,} items at the gate's level): raise optimize.gate.max_items, add tasks to "
            f"eval.tasks, or allow a larger optimize.gate.max_drop"]
