"""Task accuracy of one trial: lm-evaluation-harness (`simple_evaluate`) on the trial's session through
`SessionLM`, the same tasks on the fp32 reference of the model (cached on disk like the fidelity reference),
and per task: lm-eval's metrics (acc, acc_norm, exact_match) with its stderr, n, the task's score (its primary
metric), the delta against the reference's score with its paired stderr, the recovery (score / reference
score) and the gate (recovery >= eval.gate).

A task is a shipped one (engine/tasks/yaml over the prepared data, or a needle task) or the user's own, defined by
a file in `eval.task_files` (engine/tasks/user.py) and named in `eval.tasks` like a shipped one.

Metric keys are `<metric>.<task>` (engine/measure/metrics.py defines each <metric>); per needle depth
`task_score.<task>.d<percent>`. The per-example answers (chosen choice index, or the generated text) come
back for reproduce, and per item its correctness and identity (`<doc_id>:<sha256 of the document>`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from ..config import EngineError, TrialConfig
from .user import LM_EVAL_METRICS

log = logging.getLogger(__name__)
Say = Callable[[str], None]
TASKS_VERSION = 2  # 2: items identified by doc_id and document digest; user task files


def available_tasks() -> list[str]:
    """The shipped tasks `eval.tasks` accepts: the YAMLs of engine/tasks/yaml and the needle tasks (a trial's own
    task files add theirs)."""
    from .data import NEEDLE_TASKS, YAML_DIR

    return sorted(p.stem for p in YAML_DIR.glob("*.yaml")) + list(NEEDLE_TASKS)


def user_tasks(trial: TrialConfig) -> dict:
    """{task name: UserTask} of the trial's `eval.task_files` (the readable ones; `task_problems` reports the rest)."""
    from .user import load_all

    files = list(getattr(trial.eval, "task_files", None) or [])
    return load_all(files, available_tasks())[0] if files else {}


def needs_generation(task: str, user: Optional[dict] = None) -> bool:
    """Whether `task` generates (generate_until) rather than scores choices. `user`: the trial's task files
    (`user_tasks`); without them a task that is not shipped (a user's) may generate: True, the safe answer."""
    from .data import NEEDLE_TASKS

    if user and task in user:
        return user[task].request == "generate_until"
    if task in NEEDLE_TASKS:
        return True
    return task not in available_tasks()


def is_needle(task: str) -> bool:
    from .data import NEEDLE_TASKS

    return task in NEEDLE_TASKS


FIRST, POOLED = "first", "pooled"  # eval.order
ORDERS = (FIRST, POOLED)


def task_sizes(tasks: list[str], task_manager: Any) -> dict[str, int]:
    """{task: documents it evaluates} as lm-eval builds them (shipped and user tasks alike)."""
    from lm_eval.tasks import get_task_dict

    got = get_task_dict(tasks, task_manager)
    return {t: len(got[t].eval_docs) for t in tasks}


def pooled_items(sizes: dict[str, int], n: int, seed: int) -> dict[str, list[int]]:
    """The first `n` of one seeded shuffle of every (task, document index) together -> {task: sorted indices}.
    The shuffle depends only on the sizes and the seed, so a larger `n` keeps a smaller one's items (nested looks),
    and each task comes in about in proportion to its size."""
    import numpy as np

    pairs = [(t, i) for t in sorted(sizes) for i in range(sizes[t])]
    order = np.random.default_rng([seed, 0x9A7E]).permutation(len(pairs))[:max(0, n)]
    out: dict[str, list[int]] = {t: [] for t in sizes}
    for j in order:
        t, i = pairs[int(j)]
        out[t].append(i)
    return {t: sorted(v) for t, v in out.items() if v}


def pool_size(tasks: list[str], task_files: list[str]) -> Optional[int]:
    """How many items `eval.order=pooled` can draw from over `tasks` (needle tasks are not pooled): the prepared
    documents of the shipped tasks and the items of the user's JSONL files; None where a task's count is not known
    before lm-eval builds it (data not prepared, a user YAML task)."""
    from .data import MC_TASKS, mc_dir
    from .user import load_all

    user = load_all(list(task_files), available_tasks())[0] if task_files else {}
    total = 0
    for t in tasks:
        if is_needle(t):
            continue
        if t in user and user[t].n:
            total += user[t].n
        elif t in MC_TASKS and (mc_dir() / f"{t}.jsonl").is_file():
            with open(mc_dir() / f"{t}.jsonl", "rb") as f:
                total += sum(1 for line in f if line.strip())
        else:
            return None
    return total


@dataclass
class TaskResult:
    metrics: dict[str, float] = field(default_factory=dict)
    answers: dict[str, list] = field(default_factory=dict)  # task -> per-example answers, in document order
    correct: dict[str, list] = field(default_factory=dict)  # task -> per-example 0/1 (the primary metric)
    # task -> per-example identity "<doc_id>:<first 16 hex of sha256 of the document's canonical JSON>", in the
    # order of `correct`: pairs items across trials and tells when the documents behind an index changed
    items: dict[str, list] = field(default_factory=dict)
    chance: dict[str, float] = field(default_factory=dict)  # multiple choice: mean of 1 / choices over the items


def item_id(doc_id: int, doc: Any) -> str:
    text = json.dumps(doc, sort_keys=True, ensure_ascii=False, default=str)
    return f"{doc_id}:{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def _shipped_yaml(task: str) -> dict:
    from .data import YAML_DIR
    from .user import yaml_load

    try:
        return yaml_load((YAML_DIR / f"{task}.yaml").read_text()) or {}
    except OSError:
        return {}


def primary_metric(task: str, user: Optional[dict] = None) -> str:
    """The lm-eval metric a task is judged by (its score): a user task's own (engine/tasks/user.py), exact_match
    for a needle task, else the YAML's `metadata.primary_metric` (acc_norm where the choices' lengths differ so
    much that raw log-likelihood mostly measures length), else acc."""
    if user and task in user:
        return user[task].primary
    if is_needle(task):
        return "exact_match"
    meta = _shipped_yaml(task).get("metadata") or {}
    return str(meta.get("primary_metric", "acc"))


def run_lmeval(session: Any, trial: TrialConfig, tasks: list[str], max_length: int, say: Say) -> TaskResult:
    """simple_evaluate over `tasks` on `session`; per-task metrics, per-example answers, correctness and identity."""
    from .data import data_problems, render_yamls, yaml_dir
    from .lmeval import SessionLM, offline_env
    from .needle import needle_depth_of, render_needle_tasks
    from .user import render as render_user

    offline_env()
    import lm_eval
    from lm_eval.tasks import TaskManager

    user = user_tasks(trial)
    shipped = [t for t in tasks if t not in user]
    problem = data_problems(shipped)
    if problem:
        raise EngineError(problem)
    unknown = [t for t in tasks if t not in user and t not in available_tasks()]
    if unknown:
        raise EngineError(f"unknown task(s) {', '.join(unknown)} (not shipped, and no eval.task_files defines them)")
    render_yamls()
    with tempfile.TemporaryDirectory(prefix="infersweep-tasks-") as tmp:
        includes = [str(yaml_dir())]
        needle = [t for t in tasks if is_needle(t)]
        if needle:
            render_needle_tasks(needle, session.tokenizer, trial, Path(tmp) / "needle", say)
            includes.append(str(Path(tmp) / "needle"))
        pooled = getattr(trial.eval, "order", FIRST) == POOLED
        every = [t for t in trial.eval.tasks if not is_needle(t)] if pooled else []
        for t in dict.fromkeys(list(tasks) + every):  # pooled: the pool is every task's, whichever run now
            if t in user:
                render_user(user[t], Path(tmp) / "user" / t)  # each in a folder of its own: its modules too
                includes.append(str(Path(tmp) / "user" / t))
        lm = SessionLM(session, max_length, say)
        tm = TaskManager(include_path=includes, include_defaults=False)
        out = {"results": {}, "samples": {}}
        # the first eval.limit documents of a task (or eval.limit pooled items); needle: all generated (eval.limit
        # per depth)
        for group, limit in (([t for t in tasks if not is_needle(t)], trial.eval.limit), (needle, None)):
            if not group:
                continue
            picks = None
            if limit and pooled:
                drawn = pooled_items(task_sizes(every, tm), trial.eval.limit, trial.seed)
                picks, limit = {t: v for t, v in drawn.items() if t in group}, None
                group = [t for t in group if t in picks]  # a task the draw left out has no items here
                if not group:
                    continue
                say(f"lm-eval: {', '.join(group)} ({sum(map(len, picks.values()))} pooled items: "
                    + ", ".join(f"{t} {len(v)}" for t, v in picks.items()) + ")")
            else:
                say(f"lm-eval: {', '.join(group)}" + (f" (limit {limit})" if limit else ""))
            got = lm_eval.simple_evaluate(model=lm, tasks=group, limit=limit, samples=picks, task_manager=tm,
                                          log_samples=True, bootstrap_iters=1000,
                                          random_seed=trial.seed, numpy_random_seed=trial.seed,
                                          torch_random_seed=trial.seed, fewshot_random_seed=trial.seed)
            out["results"].update(got["results"])
            out["samples"].update(got["samples"])
    res = TaskResult()
    for task in tasks:
        if task not in out["results"]:  # pooled: the draw gave it no items
            continue
        r = out["results"][task]
        samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
        prim = primary_metric(task, user)
        for key, value in r.items():  # lm-eval's own metrics: "<metric>,<filter>" and "<metric>_stderr,<filter>"
            name = key.split(",", 1)[0]
            if "," in key and isinstance(value, (int, float)) and name.removesuffix("_stderr") in LM_EVAL_METRICS:
                res.metrics[f"{name}.{task}"] = float(value)
        res.metrics[f"task_n.{task}"] = float(len(samples))
        if f"{prim}.{task}" not in res.metrics:
            raise EngineError(f"task {task}: lm-eval reported no {prim} (its metrics: "
                              f"{', '.join(sorted(k.split(',')[0] for k in r if ',' in k)) or 'none'})")
        res.metrics[f"task_score.{task}"] = res.metrics[f"{prim}.{task}"]
        if f"{prim}_stderr.{task}" in res.metrics:
            res.metrics[f"task_score_stderr.{task}"] = res.metrics[f"{prim}_stderr.{task}"]
        res.correct[task] = [float(s[prim]) for s in samples]
        res.items[task] = [item_id(s["doc_id"], s["doc"]) for s in samples]
        if needs_generation(task, user):
            res.answers[task] = [s["filtered_resps"][0] for s in samples]
            if is_needle(task):
                by_depth: dict[int, list[float]] = {}
                for s in samples:
                    by_depth.setdefault(needle_depth_of(s["doc"]), []).append(float(s[prim]))
                for d, vals in sorted(by_depth.items()):
                    res.metrics[f"task_score.{task}.d{d}"] = sum(vals) / len(vals)
        else:  # the chosen choice: highest log-likelihood (acc), or per character of the continuation (acc_norm)
            def pick(s):
                lls = [x[0] for x in s["filtered_resps"]]
                if prim == "acc_norm":
                    lls = [ll / max(1, len(args[1].lstrip(" "))) for ll, args in zip(lls, s["arguments"])]
                return max(range(len(lls)), key=lambda i: lls[i])

            res.answers[task] = [pick(s) for s in samples]
            res.chance[task] = sum(1 / len(s["arguments"]) for s in samples) / max(1, len(samples))
    return res


def _reference_key(trial: TrialConfig, task: str, user: Optional[dict] = None) -> str:
    """What the reference's result on `task` depends on: the model, the task's documents, limit, and for
    needle tasks the context length, depths and seed."""
    from .data import YAML_DIR, _read_manifest, source_of

    ident = {k: v for k, v in dataclasses.asdict(trial.model).items() if k != "dtype"}
    ident.update(v=TASKS_VERSION, task=task, limit=trial.eval.limit)
    if getattr(trial.eval, "order", FIRST) != FIRST and not is_needle(task):  # which items the limit takes
        ident.update(order=trial.eval.order, tasks=sorted(t for t in trial.eval.tasks if not is_needle(t)),
                     seed=trial.seed)
    if user and task in user:
        from .user import RENDER_VERSION

        ident.update(user=user[task].digest, kind=user[task].kind, render=RENDER_VERSION)
    elif is_needle(task):
        ident.update(context_len=trial.workload.context_len, depths=list(trial.eval.depths), seed=trial.seed)
    else:
        src = (_read_manifest().get("sources") or {}).get(source_of(task) or "", {})
        text = (YAML_DIR / f"{task}.yaml").read_text()
        ident.update(yaml=text, data={k: v for k, v in (src.get("files") or {}).items() if Path(k).stem == task})
        if "!function" in text:  # lm-eval's own functions the YAML names (their version is lm-eval's)
            ident.update(functions=(YAML_DIR / "lmeval_functions.py").read_text())
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


def is_reference(trial: TrialConfig) -> bool:
    """Whether `trial` runs exactly the fp32 reference's configuration (the reference engine's defaults at float32:
    same engine, attention, KV cache, quantization, precision, no speculation): its own results are the reference."""
    from .. import engines

    ref = TrialConfig(model=dataclasses.replace(trial.model, dtype="float32"))
    return trial.engine.backend == engines.REFERENCE and all(
        getattr(trial, f) == getattr(ref, f) for f in ("model", "attention", "kv_cache", "quant", "speculative"))


def _reference(trial: TrialConfig, loaded: Any, max_length: int, say: Say,
               own: Optional[TaskResult] = None) -> tuple[dict[str, dict], bool]:
    """task -> {"metrics", "correct"} of the fp32 reference (cached under <cache>/tasks-reference). `own`: the
    trial's results when the trial is the reference configuration (then nothing is computed twice)."""
    from .. import engines
    from ..engines.logits import LogitsSession
    from ..models import cache_root

    root = cache_root() / "tasks-reference"
    user = user_tasks(trial)
    out, missing = {}, []
    for task in trial.eval.tasks:
        path = root / f"{_reference_key(trial, task, user)}.json"
        try:
            out[task] = json.loads(path.read_text())
        except (OSError, ValueError):
            missing.append(task)
    if missing and own is not None:
        say(f"this trial is the fp32 reference: its results on {', '.join(missing)} are cached as the reference")
        got = own
    elif missing:
        say(f"computing the fp32 reference on {', '.join(missing)}")
        ref_engine = engines.get(engines.REFERENCE)
        backend = ref_engine.reference(trial, loaded)
        ref_session = LogitsSession(ref_engine, backend.trial, backend.loaded, backend)
        got = run_lmeval(ref_session, trial, missing, max_length, lambda m: say("reference: " + m))
    if missing:
        root.mkdir(parents=True, exist_ok=True)
        for task in [t for t in missing if t in got.correct]:
            entry = {"metrics": {k: v for k, v in got.metrics.items() if k.split(".")[1] == task},
                     "correct": got.correct[task], "items": got.items.get(task, [])}
            path = root / f"{_reference_key(trial, task, user)}.json"
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(entry))
            tmp.replace(path)
            out[task] = entry
    return out, not missing


def evaluate_tasks(trial: TrialConfig, session: Any, loaded: Any, max_length: int, say: Say) -> TaskResult:
    """The trial's task metrics, with the reference's and the comparison (delta, recovery, gate)."""
    res = run_lmeval(session, trial, list(trial.eval.tasks), max_length, say)
    ref, cached = _reference(trial, loaded, max_length, say, own=res if is_reference(trial) else None)
    res.metrics["task_ref_cached"] = float(cached)
    present = [t for t in trial.eval.tasks if t in res.correct and t in ref and ref[t].get("correct") is not None]
    for task in present:  # (pooled items: a task the draw gave no item is absent)
        score, racc = res.metrics[f"task_score.{task}"], ref[task]["metrics"][f"task_score.{task}"]
        res.metrics[f"task_ref.{task}"] = racc
        for k, v in ref[task]["metrics"].items():  # the reference's score by needle depth
            if k.startswith(f"task_score.{task}.d"):
                res.metrics["task_ref" + k[len("task_score"):]] = v
        a, b = res.correct[task], ref[task]["correct"]
        n = min(len(a), len(b))
        d = [x - y for x, y in zip(a[:n], b[:n])]
        mean = sum(d) / n if n else 0.0
        var = sum((x - mean) ** 2 for x in d) / (n - 1) if n > 1 else 0.0
        res.metrics[f"task_delta.{task}"] = score - racc
        res.metrics[f"task_delta_stderr.{task}"] = math.sqrt(var / n) if n else 0.0
        recovery = score / racc if racc > 0 else (1.0 if score >= racc else 0.0)
        res.metrics[f"task_recovery.{task}"] = recovery
        res.metrics[f"task_gate.{task}"] = float(recovery >= trial.eval.gate)
    if present:
        res.metrics["task_gate"] = float(all(res.metrics[f"task_gate.{t}"] == 1.0 for t in present))
    return res


def task_problems(trial: TrialConfig, max_positions: Optional[int]) -> list[tuple[str, str]]:
    """What makes `eval.tasks` impossible before anything loads: unknown tasks, data not prepared, task files that
    are unreadable or malformed (every problem of every file), a limit below 1, a needle longer than the model's
    positions, a request type the engine does not serve."""
    from .. import engines
    from .data import data_problems
    from .needle import overhead_tokens
    from .user import load_all, meant_task

    ev = trial.eval
    files = list(getattr(ev, "task_files", None) or [])
    if not (ev.enabled and (ev.tasks or files)):
        return []
    p: list[tuple[str, str]] = []
    shipped = available_tasks()
    user, file_problems = load_all(files, shipped)
    p += [("eval.task_files", m) for m in file_problems]
    known = shipped + sorted(user)
    # a task its (refused) file means to define is that file's problem, said above: not also an unknown task
    meant = {meant_task(f) for f in files} if file_problems else set()
    unknown = [t for t in ev.tasks if t not in known and t not in meant]
    if unknown:
        p.append(("eval.tasks", f"unknown task(s) {', '.join(map(repr, unknown))}; available: {', '.join(known)}"
                                + ("" if files else " (or your own: eval.task_files=[path/to/items.jsonl])")))
    unnamed = [t for t in user if t not in ev.tasks]
    if unnamed:
        wanted = ",".join(list(ev.tasks) + unnamed)
        p.append(("eval.task_files", f"{', '.join(f'{user[t].path.name} defines task {t!r}' for t in unnamed)}, which "
                                     f"eval.tasks does not name: name it to run it (eval.tasks=[{wanted}])"))
    if ev.limit < 1:
        p.append(("eval.limit", f"must be >= 1 (examples per task; needle: per depth), got {ev.limit}"))
    if getattr(ev, "order", FIRST) not in ORDERS:
        p.append(("eval.order", f"unknown order {ev.order!r}; use first (the first eval.limit documents of each task) "
                                f"or pooled (eval.limit items drawn over all the tasks, seeded)"))
    if not ev.depths or any(not 0.0 <= d <= 1.0 for d in ev.depths):
        p.append(("eval.depths", f"needs fractions in [0, 1], got {list(ev.depths)}"))
    if not 0.0 < ev.gate <= 1.0:
        p.append(("eval.gate", f"must be in (0, 1] (a share of the reference's accuracy), got {ev.gate}"))
    problem = data_problems([t for t in ev.tasks if t in shipped])
    if problem:
        p.append(("eval.tasks", problem))
    needle = [t for t in ev.tasks if is_needle(t)]
    if needle and max_positions and trial.workload.context_len > max_positions:
        p.append(("workload.context_len", f"{', '.join(needle)} at context_len {trial.workload.context_len} "
                                          f"exceeds the model's maximum of {max_positions} positions"))
    if needle:
        from ..models import local_tokenizer

        tok = local_tokenizer(trial.model)
        least = overhead_tokens(tok) + 16 if tok is not None else 64
        if trial.workload.context_len < least:
            p.append(("workload.context_len", f"{', '.join(needle)} needs context_len >= {least} for this model's "
                                              f"tokenizer (intro, needles, question, answer and some haystack)"))
    if trial.engine.backend in engines.NAMES:
        eng = engines.get(trial.engine.backend)
        runnable = [t for t in ev.tasks if t in known]
        for need, which in (("loglikelihood", [t for t in runnable if not needs_generation(t, user)]),
                            ("generate_until", [t for t in runnable if needs_generation(t, user)])):
            if which and need not in eng.task_requests:
                why = f": {eng.task_why}" if eng.task_why else ""
                able = [e.name for e in engines.all_engines() if need in e.task_requests]
                p.append(("eval.tasks", f"{', '.join(which)} need {need}, which engine={eng.name} does not serve"
                                        f"{why}; engines that do: {', '.join(able)}"))
    return p
