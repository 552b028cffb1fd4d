"""The trial pipeline, one for every engine: load -> warm-up -> timed repeats -> determinism -> medians ->
memory, weights, load time -> roofline -> accuracy.

The engine (engine/engines/<name>/) only loads its model and runs what the pipeline plans; the traces
it returns become metrics here, through engine/measure/. No engine is named in this file.
"""
from __future__ import annotations

import logging
import os
import platform
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from . import engines
from .config import EngineError, TrialConfig
from .engines.base import Engine, Runs, ServingPlan, StaticPlan, TrialSession
from .measure.metrics import instability, median_metrics, request_metrics, static_batch_metrics, timing_spread, tokens_equal
from .measure.noise import NoiseMonitor
from .model_facts import facts_or_none

log = logging.getLogger(__name__)


@dataclass
class EngineResult:
    metrics: dict[str, float]
    token_ids: list[list[int]]  # generated ids per sequence (static batch) or per request (serving)
    sample_text: str  # decoded first sequence, for humans
    info: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)  # what the trial *is* (regime.*), not where it ran
    answers: dict[str, list] = field(default_factory=dict)  # eval.tasks: task -> per-example answers


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def device_info(device: torch.device) -> dict[str, str]:
    from .measure.hardware import device_name

    info = {
        "device": str(device),
        "cpu": device_name(torch.device("cpu")) or platform.processor() or platform.machine(),
        "cpu_count": str(os.cpu_count()),
        "torch_threads": str(torch.get_num_threads()),
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "device_name": device_name(device),
    }
    try:
        with open("/proc/meminfo") as f:
            info["ram_bytes"] = str(int(f.readline().split()[1]) * 1024)
    except OSError:
        pass
    return info


def load_trial_model(trial: TrialConfig, progress: Optional[Callable[[str], None]] = None) -> Any:
    """The trial's model as its engine loads it in this process (a warm worker may keep it for the next
    trial with the same model key); None for an engine that loads in its own process."""
    say = progress or (lambda msg: log.info(msg))
    return engines.get(trial.engine.backend).load(trial, say)


def _check_context(trial: TrialConfig, need: int, what: str) -> None:
    facts = facts_or_none(trial.model)
    limit = facts.max_positions if facts else None
    if limit and need > limit:
        raise EngineError(f"{what} = {need} exceeds the model's maximum of {limit} positions")


def _static(trial: TrialConfig, session: TrialSession, say) -> tuple[list[dict], Runs, list[list[int]]]:
    from .prompts import workload_prompts

    wl = trial.workload
    _check_context(trial, wl.context_len + wl.max_new_tokens, "context_len + max_new_tokens")
    plan = StaticPlan(workload_prompts(session.tokenizer, wl), wl.max_new_tokens, wl.warmup, max(1, wl.repeats))
    runs = session.run_static(plan, say)
    # Sampling is seeded per run, so greedy or not, every repeat must produce the same tokens.
    for t in runs.traces[1:]:
        if not tokens_equal(t.tokens, runs.traces[0].tokens):
            raise EngineError("generation is not deterministic: repeats produced different tokens")
    per_run = [dict(static_batch_metrics(t), **x) for t, x in zip(runs.traces, runs.extra)]
    return per_run, runs, runs.traces[0].tokens.tolist()


def _serving(trial: TrialConfig, session: TrialSession, say) -> tuple[list[dict], Runs, list[list[int]]]:
    from .prompts import corpus_ids
    from .serving.requests import make_requests, max_request_tokens, warmup_requests

    wl = trial.workload
    _check_context(trial, max_request_tokens(wl), "the longest request")
    requests = make_requests(wl, corpus_ids(session.tokenizer, wl.text), trial.seed)
    plan = ServingPlan(requests, warmup_requests(requests), wl.warmup, max(1, wl.repeats))
    runs = session.run_serving(plan, say)
    outputs = [[list(r.output) for r in t.requests] for t in runs.traces]
    if any(o != outputs[0] for o in outputs[1:]):  # sampling is seeded per request
        raise EngineError("generation is not deterministic: repeats produced different tokens")
    per_run = [dict(request_metrics(t.requests, t.duration_s, trial.slo), **x) for t, x in zip(runs.traces, runs.extra)]
    return per_run, runs, outputs[0]


def roofline(trial: TrialConfig, engine: Engine, device: torch.device, metrics: dict[str, float]) -> dict[str, str]:
    """Add the cost model's roofline metrics to `metrics`; return its regime labels. A model the cost model
    cannot read (an unusual architecture) costs the trial nothing but these numbers."""
    from .measure.costmodel import assess_trial

    facts = facts_or_none(trial.model)
    if facts is None or facts.shape is None:
        return {"costmodel": "unavailable: the model's shape is unknown"}
    try:
        a = assess_trial(trial, facts.shape, device, metrics, materialize_scores=engine.materializes_scores(trial),
                         kv_elt_bytes=engine.kv_element_bytes(trial))
    except EngineError as e:
        log.warning("cost model skipped: %s", e)
        return {"costmodel": f"unavailable: {e}"}
    metrics.update(a.metrics)
    return a.labels


def _reference(trial: TrialConfig, loaded: Any, windows: torch.Tensor):
    """The fp32 reference's statistics on `windows` (cached on disk per model and windows)."""
    import dataclasses

    from .measure.fidelity import ReferenceCache, compute_reference
    from .models import cache_root

    identity = {k: v for k, v in dataclasses.asdict(trial.model).items() if k != "dtype"}
    cache = ReferenceCache(cache_root() / "fidelity")
    key = cache.key(identity, windows.cpu(), trial.eval.topk)
    return cache.get_or_compute(
        key, lambda: compute_reference(engines.get(engines.REFERENCE).reference(trial, loaded), windows, trial.eval.topk))


def evaluate_tasks(trial: TrialConfig, session: TrialSession, loaded: Any, metrics: dict[str, float], say) -> dict:
    """Task accuracy through lm-evaluation-harness (engine/tasks) into `metrics`; the per-example answers."""
    if not (trial.eval.enabled and trial.eval.tasks):
        return {}
    from .tasks.run import evaluate_tasks as run_tasks

    facts = facts_or_none(trial.model)
    max_length = (facts.max_positions if facts and facts.max_positions else None) or 2048
    res = run_tasks(trial, session, loaded, max_length, say)
    metrics.update(res.metrics)
    return res.answers


def evaluate(trial: TrialConfig, session: TrialSession, loaded: Any, metrics: dict[str, float], say) -> None:
    """Accuracy at `workload.context_len` (perplexity, or fidelity against the reference) into `metrics`."""
    from .measure.fidelity import fidelity_of, perplexity_of
    from .prompts import corpus_ids, windows

    if not (trial.eval.enabled and trial.eval.num_windows > 0):
        return
    evw = windows(corpus_ids(session.tokenizer, trial.eval.text), trial.workload.context_len,
                  trial.eval.num_windows).to(session.device)
    say("evaluating " + ("fidelity against the reference" if trial.eval.fidelity else "perplexity"))
    scores = session.score_windows(evw, trial.eval.topk if trial.eval.fidelity else 1, say)
    if not trial.eval.fidelity:
        metrics.update(perplexity_of(scores, evw))
        return
    ref, cached = _reference(trial, loaded, evw.cpu())
    metrics.update(fidelity_of(scores, evw, ref))
    metrics["fidelity_ref_cached"] = float(cached)


def run_engine_trial(
    trial: TrialConfig,
    loaded: Optional[Any] = None,
    progress: Optional[Callable[[str], None]] = None,
) -> EngineResult:
    """Measure one configuration. `loaded` lets a warm worker reuse a model (from `load_trial_model`)."""
    say = progress or (lambda msg: log.info(msg))
    engine = engines.get(trial.engine.backend)
    if trial.engine.threads > 0:  # the trial's threads, also for the cost model's probe of this node
        torch.set_num_threads(trial.engine.threads)
    seed_everything(trial.seed)
    if loaded is None:
        say(f"loading {trial.model.name}")
        loaded = engine.load(trial, say)
    session = engine.open(trial, loaded, say)
    serving = trial.workload.serving
    with NoiseMonitor() as noise:
        per_run, runs, token_ids = (_serving if serving else _static)(trial, session, say)
    metrics = median_metrics(per_run)
    metrics.update(timing_spread(per_run, runs, serving))
    if engine.in_process:
        metrics.update(noise.result)
    metrics["peak_mem_bytes"] = float(runs.peak_mem_bytes)
    metrics["weights_bytes"] = float(session.weights_bytes())
    metrics["model_load_s"] = float(session.load_s)
    metrics.update(session.metrics())
    labels = {} if serving else roofline(trial, engine, session.device, metrics)
    why = instability(metrics)
    if why:
        labels["unstable"] = why
    evaluate(trial, session, loaded, metrics, say)
    answers = evaluate_tasks(trial, session, loaded, metrics, say)
    info = dict(device_info(session.device), **session.info())
    from .measure.hardware import slow_dtype_note

    note = slow_dtype_note(trial.model.dtype, session.device)
    if note:  # not an error: the user may want to see it, but should know why the numbers look so
        info["dtype_note"] = note
    return EngineResult(metrics=metrics, token_ids=token_ids, sample_text=session.tokenizer.decode(token_ids[0]),
                        info=info, labels=labels, answers=answers)
