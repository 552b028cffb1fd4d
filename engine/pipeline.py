"""The trial pipeline, one for every engine: load -> warm-up -> timed repeats -> determinism -> medians ->
memory, weights, load time -> roofline -> accuracy.

The engine (engine/engines/<name>/) only loads its model and runs what the pipeline plans; the traces
it returns become metrics here, through engine/measure/. No engine is named in this file.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from . import engines
from .config import EngineError, TrialConfig, replace
from .engines.base import Engine, Runs, ServingPlan, StaticPlan, TrialSession
from .measure.metrics import STABILITY_KEYS, TIMINGS, UNSTABLE, instability, median_metrics, paired_instability, undecided_pairs, UNSTABLE_HALF_WIDTH, request_metrics, static_batch_metrics, timing_spread, tokens_equal
from .measure.noise import NoiseMonitor
from .model_facts import facts_or_none
from .quant import kernel_info

log = logging.getLogger(__name__)


@dataclass
class EngineResult:
    metrics: dict[str, float]
    token_ids: list[list[int]]  # generated ids per sequence (static batch) or per request (serving)
    sample_text: str  # decoded first sequence, for humans
    info: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)  # what the trial *is* (regime.*), not where it ran
    samples: dict[str, list[float]] = field(default_factory=dict)  # each timed repeat's whole-run timings, in order
    # metric -> values by step (a capacity search's probe curve, in rate order), logged with steps
    series: dict[str, list[float]] = field(default_factory=dict)
    answers: dict[str, list] = field(default_factory=dict)  # eval.tasks: task -> per-example answers
    correct: dict[str, list] = field(default_factory=dict)  # eval.tasks: task -> per-example 0/1 (paired tests)
    # eval.tasks: task -> each example's identity (`<doc_id>:<document digest>`, in the order of `correct`): what
    # pairs two trials' examples (optimize's paired gate) and tells when the documents behind an index differ
    items: dict[str, list] = field(default_factory=dict)
    artifacts: dict[str, str] = field(default_factory=dict)  # file name -> text for the run's record (a server's log)


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


def precise_enough(per_run: list[dict[str, float]]) -> float:
    """The widest relative half-width of the 95% interval of a judged timing's median over the repeats so
    far (0 when none is judged; infinite from one repeat, which has no interval)."""
    from .measure.spread import spread

    if len(per_run) < 2:
        return float("inf")
    widths = [spread([r[k] for r in per_run]).half_width for k in STABILITY_KEYS if per_run and k in per_run[0]]
    return max(widths, default=0.0)


def _more(n: int, width: float, target: float, max_n: int, budget_left_s: float, per_one_s: float) -> int:
    """How many more repeats (or rounds) bring an interval of relative half-width `width` after `n` to
    `target`: it narrows as 1/sqrt(n) (one repeat has none yet: what the limits allow), within `max_n` in all
    and `budget_left_s` seconds at `per_one_s` each."""
    want = math.ceil(n * (width / target) ** 2) - n if math.isfinite(width) else max_n - n
    by_time = int(budget_left_s / max(per_one_s, 1e-9)) if math.isfinite(budget_left_s) else max_n - n
    return min(want, max_n - n, by_time)


# An interleaved group adds rounds at most this often, so the rounds a judge reads stop at one of 1 + EXTENSIONS
# sizes (experiments/optimize counts each as a look: types.ENGINE_LOOKS)
EXTENSIONS = 2


def more_rounds(samples: list[dict[str, list[float]]], n: int, max_rounds: int, budget_left_s: float = math.inf,
                per_round_s: float = 1.0) -> tuple[int, float]:
    """The extension rule of an interleaved group, one pure function (`run_interleaved` runs it; the optimize
    calibration's simulated machine runs the same): after `n` rounds whose per-round values each variant holds
    in `samples` (timing -> values), how many rounds to add (0: stop) and the widest undecided paired
    half-width that asks for them. Rounds follow while a paired comparison is undecided -- its interval holds
    x1 and is wider than +-UNSTABLE_HALF_WIDTH (metrics.undecided_pairs) -- as many as 1/sqrt(n) narrowing
    predicts, within `max_rounds` in all and `budget_left_s` seconds at `per_round_s` a round."""
    if n >= max_rounds:
        return 0, 0.0
    worst = max((hw for i, own in enumerate(samples)
                 for hw, _, _ in undecided_pairs(own, [o for j, o in enumerate(samples) if j != i])[0]), default=0.0)
    if worst <= 0:
        return 0, 0.0
    return max(0, _more(n, worst, UNSTABLE_HALF_WIDTH, max_rounds, budget_left_s, per_round_s)), worst


def _repeat_until_precise(trial: TrialConfig, run: Callable[[int, int], Runs], metrics_of: Callable[[Any, dict], dict],
                          adaptive: bool, say) -> tuple[Runs, str]:
    """`run(warmup, repeats)` once with the workload's warm-up and repeats, then -- `adaptive` -- again
    with as many more repeats as the interval's 1/sqrt(n) narrowing needs to reach `timing.target_ci`,
    within `timing.max_repeats` and `timing.budget_s` (at most two more calls: each may pay a setup).
    Returns the runs and why repeating stopped."""
    import time

    wl, tm = trial.workload, trial.timing
    t0 = time.perf_counter()
    runs = run(wl.warmup, max(1, wl.repeats))
    if not adaptive or tm.max_repeats <= len(runs.traces):
        return runs, "fixed count"
    per_repeat_s = (time.perf_counter() - t0) / (len(runs.traces) + wl.warmup)
    spent = 0.0
    for _ in range(2):
        per_run = [metrics_of(t, x) for t, x in zip(runs.traces, runs.extra)]
        width, n = precise_enough(per_run), len(runs.traces)
        if width <= tm.target_ci:
            return runs, f"interval within +-{tm.target_ci:.0%}"
        k = _more(n, width, tm.target_ci, tm.max_repeats, tm.budget_s - spent, per_repeat_s)
        if k <= 0:
            break
        say(f"interval +-{width:.0%} > +-{tm.target_ci:.0%} after {n} repeats: {k} more")
        t1 = time.perf_counter()
        more = run(0, k)
        spent += time.perf_counter() - t1
        per_repeat_s = (time.perf_counter() - t1) / max(1, len(more.traces))
        runs = Runs(runs.traces + list(more.traces), runs.extra + list(more.extra),
                    max(runs.peak_mem_bytes, more.peak_mem_bytes))
    per_run = [metrics_of(t, x) for t, x in zip(runs.traces, runs.extra)]
    if precise_enough(per_run) <= tm.target_ci:
        return runs, f"interval within +-{tm.target_ci:.0%}"
    return runs, ("repeat limit" if len(runs.traces) >= tm.max_repeats else "time budget")


@dataclass
class Workload:
    """One trial's workload on an open session: `run(warmup, repeats)` measures, `outcome(runs)` checks the
    repeats (same tokens) and turns their traces into per-repeat metrics and the generated ids."""

    run: Callable[[int, int], Runs]
    metrics_of: Callable[[Any, dict], dict]
    outputs_of: Callable[[Any], list[list[int]]]
    batch_variant: bool = False  # Engine.batch_variant_outputs: differing repeats are counted, not refused

    def outcome(self, runs: Runs) -> tuple[list[dict], list[list[int]]]:
        outputs = [self.outputs_of(t) for t in runs.traces]
        per_run = [self.metrics_of(t, x) for t, x in zip(runs.traces, runs.extra)]
        if self.batch_variant:
            for m, out in zip(per_run, outputs):
                m["outputs_changed"] = sum(a != b for a, b in zip(out, outputs[0])) / max(1, len(out))
        elif any(o != outputs[0] for o in outputs[1:]):  # sampling is seeded per run / per request
            raise EngineError("generation is not deterministic: repeats produced different tokens")
        return per_run, outputs[0]


def _static(trial: TrialConfig, session: TrialSession, say) -> Workload:
    from .prompts import workload_prompts

    wl = trial.workload
    _check_context(trial, wl.context_len + wl.max_new_tokens, "context_len + max_new_tokens")
    prompts = workload_prompts(session.tokenizer, wl)
    return Workload(lambda warmup, repeats: session.run_static(StaticPlan(prompts, wl.max_new_tokens, warmup, repeats), say),
                    lambda t, x: dict(static_batch_metrics(t), **x), lambda t: t.tokens.tolist())


def serving_plan(wl, corpus: torch.Tensor, seed: int, warmup: int, repeats: int) -> ServingPlan:
    """The plan of a serving workload: its requests (multi-turn: the first turns, and the follow-up that
    builds each next turn from the answer before it)."""
    from .serving.requests import make_requests, warmup_requests

    follow_up = None
    if wl.multi_turn:
        from .serving.conversations import make_conversations

        convs = make_conversations(wl, corpus, seed)
        requests, follow_up = convs.first_turns(), convs.next_turn
    else:
        requests = make_requests(wl, corpus, seed)
    return ServingPlan(requests, warmup_requests(requests), warmup, repeats, follow_up, wl.max_concurrency)


def _serving_workload(trial: TrialConfig, session: TrialSession, wl, corpus: torch.Tensor, say) -> Workload:
    """The serving workload `wl` (the trial's, or a capacity probe's arrivals of it) on `session`."""
    def metrics_of(t, x):
        m = dict(request_metrics(t.requests, t.duration_s, trial.slo), **x)
        if wl.multi_turn:
            from .measure.metrics import turn_metrics

            m.update(turn_metrics([t.requests], wl.turns)[0])
        return m

    return Workload(lambda warmup, repeats: session.run_serving(serving_plan(wl, corpus, trial.seed, warmup, repeats), say),
                    metrics_of, lambda t: [list(r.output) for r in t.requests],
                    engines.get(trial.engine.backend).batch_variant_outputs)


def _serving(trial: TrialConfig, session: TrialSession, say) -> Workload:
    from .prompts import corpus_ids
    from .serving.requests import max_request_tokens

    wl = trial.workload
    _check_context(trial, max_request_tokens(wl), "the longest request")
    return _serving_workload(trial, session, wl, corpus_ids(session.tokenizer, wl.text), say)


def _capacity(m: "Measurement"):
    """A capacity search (engine/serving/capacity.py): the same requests probed at several arrival rates,
    each probe the workload's warm-up (first probe only) and repeats. Returns the runs of the probe at the
    found rate (the trial's metrics), the scalars and curve of the search, its verdict, and the synchronous
    probe's outputs (one request at a time: the reference tokens)."""
    import dataclasses

    from .measure.metrics import capacity_metrics, percentile
    from .prompts import corpus_ids
    from .serving.capacity import RATE, SATURATE, SYNC, ProbeStats, SearchBudget, meets, search_capacity

    trial, session, say = m.trial, m.session, m.say
    wl, cap = trial.workload, trial.capacity
    corpus = corpus_ids(session.tokenizer, wl.text)
    done: list[tuple[Runs, list[list[int]]]] = []  # per probe: its runs, its outputs

    def probe(kind: str, rate: float) -> ProbeStats:
        spec = {SYNC: dataclasses.replace(wl, arrival="all-at-once", max_concurrency=1),
                SATURATE: dataclasses.replace(wl, arrival="all-at-once"),
                RATE: dataclasses.replace(wl, arrival="poisson", rate=rate)}[kind]
        w = _serving_workload(trial, session, spec, corpus, say)
        runs = w.run(wl.warmup if not done else 0, max(1, wl.repeats))
        per_run, outputs = w.outcome(runs)
        done.append((runs, outputs))
        reqs = [r for t in runs.traces for r in t.requests]
        tpot = [(r.e2e_s - r.ttft_s) / (len(r.output) - 1) * 1e3 for r in reqs if len(r.output) > 1] or [0.0]
        med = median_metrics(per_run)
        return ProbeStats(ttft_ms=percentile([r.ttft_s * 1e3 for r in reqs], cap.percentile),
                          tpot_ms=percentile(tpot, cap.percentile), request_s=med["request_s"], metrics=med)

    budget = SearchBudget(cap.max_probes, cap.tolerance, cap.max_s)
    result = search_capacity(probe, lambda s: meets(s, trial.slo.ttft_ms, trial.slo.tpot_ms), budget, say=say)
    say(f"capacity: {result.verdict}")
    runs = done[result.probes.index(result.best)][0]
    reference = done[0][1]
    mismatched = {i for _, out in done for i, (a, b) in enumerate(zip(out, reference)) if a != b}
    scalars, series = capacity_metrics(result, cap.tolerance)
    scalars["capacity_token_mismatches"] = float(len(mismatched))
    return runs, scalars, series, result.verdict, reference


def roofline(trial: TrialConfig, engine: Engine, device: torch.device, metrics: dict[str, float]) -> dict[str, str]:
    """Add the cost model's roofline metrics to `metrics`; return its regime labels. A model the cost model
    cannot read (an unusual architecture) costs the trial nothing but these numbers."""
    from .measure.costmodel import assess_trial

    facts = facts_or_none(trial.model)
    if facts is None or facts.shape is None:
        return {"costmodel": "unavailable: the model's shape is unknown"}
    try:
        # the weight format the matmuls read (llama.cpp's gguf-shipped names a file, not a format)
        costed = replace(replace(trial, "quant.level", engine.weight_level(trial)), "quant.skip_modules",
                         engine.skip_modules(trial))
        a = assess_trial(costed, facts.shape, device, metrics, materialize_scores=engine.materializes_scores(trial),
                         kv_elt_bytes=engine.kv_element_bytes(trial), compute_dtype=engine.compute_dtype(trial, device))
    except EngineError as e:
        log.warning("cost model skipped: %s", e)
        return {"costmodel": f"unavailable: {e}"}
    metrics.update(a.metrics)
    return a.labels


def dtype_note(trial: TrialConfig, engine: Engine, device: torch.device) -> Optional[str]:
    """The hardware note for the dtype `engine` computes the trial in on `device` (its own fast paths: llama.cpp
    widens f16 weights to f32, torch runs them in fp16), or None."""
    from .measure.hardware import slow_dtype_note

    return slow_dtype_note(engine.compute_dtype(trial, device), device)


def _reference(trial: TrialConfig, loaded: Any, windows: torch.Tensor):
    """The fp32 reference's statistics on `windows` (cached on disk per model and windows)."""
    import dataclasses

    from .measure.fidelity import ReferenceCache, compute_reference
    from .cachedir import cache_root

    identity = {k: v for k, v in dataclasses.asdict(trial.model).items() if k != "dtype"}
    cache = ReferenceCache(cache_root() / "fidelity")
    key = cache.key(identity, windows.cpu(), trial.eval.topk)
    return cache.get_or_compute(
        key, lambda: compute_reference(engines.get(engines.REFERENCE).reference(trial, loaded), windows, trial.eval.topk))


def evaluate_tasks(trial: TrialConfig, session: TrialSession, loaded: Any, metrics: dict[str, float],
                   say) -> tuple[dict, dict, dict]:
    """Task accuracy through lm-evaluation-harness (engine/tasks) into `metrics`; the per-example answers, their
    correctness (0/1 by the task's primary metric: what a paired comparison of two trials needs) and identities."""
    if not (trial.eval.enabled and trial.eval.tasks):
        return {}, {}, {}
    from .tasks.run import evaluate_tasks as run_tasks

    facts = facts_or_none(trial.model)
    max_length = (facts.max_positions if facts and facts.max_positions else None) or 2048
    res = run_tasks(trial, session, loaded, max_length, say)
    metrics.update(res.metrics)
    return res.answers, res.correct, res.items


# eval.fidelity: {"windows": a digest of the windows' token ids, "top1": the argmax at each scored position, per window}
TOP1_ARTIFACT = "fidelity_top1.json"


def evaluate(trial: TrialConfig, session: TrialSession, loaded: Any, metrics: dict[str, float], say) -> dict[str, str]:
    """Accuracy at `workload.context_len` (perplexity, or fidelity against the reference) into `metrics`; with
    fidelity, the candidate's argmax at every scored position as an artifact (`TOP1_ARTIFACT`: a list per
    window), so that two trials' predictions compare position by position (optimize's fidelity pre-screen)."""
    from .measure.fidelity import fidelity_of, perplexity_of
    from .prompts import corpus_ids, windows

    if not (trial.eval.enabled and trial.eval.num_windows > 0):
        return {}
    evw = windows(corpus_ids(session.tokenizer, trial.eval.text), trial.workload.context_len,
                  trial.eval.num_windows).to(session.device)
    say("evaluating " + ("fidelity against the reference" if trial.eval.fidelity else "perplexity"))
    scores = session.score_windows(evw, trial.eval.topk if trial.eval.fidelity else 1, say)
    if not trial.eval.fidelity:
        metrics.update(perplexity_of(scores, evw))
        return {}
    cpu = evw.cpu()
    ref, cached = _reference(trial, loaded, cpu)
    top1: list = []
    metrics.update(fidelity_of(scores, evw, ref, top1))
    metrics["fidelity_ref_cached"] = float(cached)
    text = hashlib.sha256(cpu.numpy().tobytes()).hexdigest()[:16]  # which windows: equal ids, same text
    return {TOP1_ARTIFACT: json.dumps({"windows": text, "top1": [t.tolist() for t in top1]})}


@dataclass
class Measurement:
    """One trial between its phases: loaded and open (`open_trial`), measured (`Workload.run`, by
    `run_engine_trial` alone or round-robin with others by `run_interleaved`), then finished (`finish`)."""

    trial: TrialConfig
    engine: Engine
    loaded: Any
    session: TrialSession
    workload: Workload
    say: Callable[[str], None]

    @property
    def gpu(self) -> Optional[int]:
        return (self.session.device.index or 0) if self.session.device.type == "cuda" else None

    def finish(self, runs: Runs, stop: str, noise: dict[str, float], grouped: bool = False,
               own_mem_bytes: Optional[int] = None) -> EngineResult:
        """Medians, spread, noise, memory, weights, load time, roofline, accuracy and labels of `runs`.
        `grouped`: measured in a process shared with other trials (`run_interleaved`), whose peak
        (`runs.peak_mem_bytes`) is the group's: logged as group_peak_mem_bytes, and the trial's own
        footprint `own_mem_bytes` (None: not measurable here) as peak_mem_bytes."""
        trial, engine, session = self.trial, self.engine, self.session
        serving = trial.workload.serving
        per_run, token_ids = self.workload.outcome(runs)
        metrics = median_metrics(per_run)
        metrics["timed_repeats"] = float(len(runs.traces))
        metrics.update(timing_spread(per_run, runs, serving))
        if engine.in_process:
            metrics.update(noise)
        if grouped:  # the process held other trials' models too: its peak is the group's
            metrics["group_peak_mem_bytes"] = float(runs.peak_mem_bytes)
            if own_mem_bytes is not None:
                metrics["peak_mem_bytes"] = float(own_mem_bytes)
        else:
            metrics["peak_mem_bytes"] = float(runs.peak_mem_bytes)
        metrics["weights_bytes"] = float(session.weights_bytes())
        metrics["model_load_s"] = float(session.load_s)
        metrics.update(session.metrics())
        labels = {} if serving else roofline(trial, engine, session.device, metrics)
        why = instability(metrics, own_spread=not grouped)
        if why:
            labels[UNSTABLE] = why
        produced = evaluate(trial, session, self.loaded, metrics, self.say)
        answers, correct, items = evaluate_tasks(trial, session, self.loaded, metrics, self.say)
        info = dict(device_info(session.device), **session.info(), repeats_stop=stop)
        model = getattr(self.loaded, "model", None)
        if isinstance(model, torch.nn.Module):  # which weight-only kernels ran (quant.kernel=auto resolves per shape)
            info.update(kernel_info(model))
        note = dtype_note(trial, engine, session.device)
        if note:  # not an error: the user may want to see it, but should know why the numbers look so
            info["dtype_note"] = note
        samples = {k: [float(r[k]) for r in per_run] for k in TIMINGS if k in per_run[0]}
        return EngineResult(metrics=metrics, token_ids=token_ids, sample_text=session.tokenizer.decode(token_ids[0]),
                            info=info, labels=labels, samples=samples, answers=answers,
                            correct=correct, items=items, artifacts={**session.artifacts(), **produced})


def close_session(session: TrialSession) -> None:
    """End what a session holds outside this process (an engine's server; `TrialSession.close`)."""
    session.close()


def open_trial(trial: TrialConfig, loaded: Optional[Any] = None,
               progress: Optional[Callable[[str], None]] = None) -> Measurement:
    """Load (unless `loaded`) and open `trial`'s model, ready to measure its workload."""
    say = progress or (lambda msg: log.info(msg))
    engine = engines.get(trial.engine.backend)
    if trial.engine.threads > 0:  # the trial's threads, also for the cost model's probe of this node
        torch.set_num_threads(trial.engine.threads)
    seed_everything(trial.seed)
    if loaded is None:
        say(f"loading {trial.model.name}")
        loaded = engine.load(trial, say)
    if trial.workload.serving and trial.capacity.search and not engine.searches_capacity:
        raise EngineError(f"engine {engine.name} cannot run a capacity search: {engine.searches_capacity_why}")
    if trial.workload.multi_turn and not engine.serves_conversations:
        raise EngineError(f"engine {engine.name} cannot serve multi-turn conversations: {engine.serves_conversations_why}")
    session = engine.open(trial, loaded, say)
    workload = (_serving if trial.workload.serving else _static)(trial, session, say)
    return Measurement(trial, engine, loaded, session, workload, say)


def run_engine_trial(
    trial: TrialConfig,
    loaded: Optional[Any] = None,
    progress: Optional[Callable[[str], None]] = None,
) -> EngineResult:
    """Measure one configuration. `loaded` lets a warm worker reuse a model (from `load_trial_model`)."""
    m = open_trial(trial, loaded, progress)
    searched = trial.workload.serving and trial.capacity.search
    try:
        with NoiseMonitor(m.gpu) as noise:
            if searched:  # each probe runs the workload's fixed warm-up and repeats
                runs, found, series, verdict, reference = _capacity(m)
                stop = "capacity search"
            else:
                runs, stop = _repeat_until_precise(trial, m.workload.run, m.workload.metrics_of, m.engine.in_process, m.say)
        result = m.finish(runs, stop, noise.result)
    finally:
        close_session(m.session)
    if searched:
        result.metrics.update(found)
        result.series.update(series)
        result.labels["capacity"] = verdict
        result.token_ids, result.sample_text = reference, m.session.tokenizer.decode(reference[0])
    if trial.workload.multi_turn:
        from .measure.metrics import turn_metrics

        result.series.update(turn_metrics([t.requests for t in runs.traces], trial.workload.turns)[1])
    return result


def run_interleaved(trials: list[TrialConfig], rounds: int, progress: Optional[Callable[[str], None]] = None,
                    on_round: Optional[Callable[[int], None]] = None) -> list[EngineResult]:
    """Measure several configurations round-robin on this worker: each warms up, then every round runs one
    timed repeat of each, in ABBA order (reversed every other round), so drift on a shared machine (another
    process starting, a thermal or frequency change) hits every variant alike. Repeat i of every variant ran
    in round i: their per-round ratios are paired samples (`engine.measure.spread.paired_ratio`). `rounds`
    is the minimum: more follow while a paired comparison is undecided, within `timing.*`. Each
    configuration keeps its own model in memory for the whole run."""
    if rounds < 1:
        raise EngineError(f"rounds must be >= 1, got {rounds}")
    if any(t.workload.serving and t.capacity.search for t in trials):
        raise EngineError("a capacity search runs its own probes; it cannot be interleaved with other trials")
    apart = sorted({t.engine.backend for t in trials
                    if not (engines.get(t.engine.backend).in_process or engines.get(t.engine.backend).interleaves)})
    if apart:  # each call would start the engine's process again: one repeat per call measures the start-up
        raise EngineError(f"interleaving needs engines that run in this process; {', '.join(apart)} runs in its own")
    from .measure.memory import PeakMemory

    ms: list[Measurement] = []
    try:  # every session opened is closed (a served variant's server ends), whatever happens
        for t in trials:
            ms.append(open_trial(t, progress=progress))
        collected: list[list[Runs]] = [[] for _ in ms]
        grown: list[Optional[int]] = [0 for _ in ms]  # the most each variant's own calls grew the process
        for m in ms:
            m.workload.run(m.trial.workload.warmup, 0)
        if any(m.trial.workload.warmup for m in ms):
            # One untimed round in the timed rounds' order: each variant's own warm-up ran before the others'
            # (which evict its caches and reshape the allocator's free lists), so its first round was still
            # warming (hf's first-round TTFT at twice its median, a TTFT CV of 102%). Its results are discarded.
            (progress or log.info)("interleaved: one untimed warm-up round")
            for m in ms:
                m.workload.run(0, 1)
        gpus = {m.gpu for m in ms} - {None}

        def one_round(r: int) -> None:
            if on_round is not None:  # round r is about to start (progress, or a benchmark's own events)
                on_round(r)
            order = list(range(len(ms))) if r % 2 == 0 else list(reversed(range(len(ms))))
            for i in order:
                # the process holds every variant's model, so its peak is the group's: each variant's own
                # footprint is its weights plus what its own calls allocate on top (KV cache, scratch)
                with PeakMemory(ms[i].session.device, release=True) as mem:
                    collected[i].append(ms[i].workload.run(0, 1))
                grown[i] = max(grown[i], mem.growth_bytes) if mem.scoped and grown[i] is not None else None

        def per_round() -> list[dict[str, list[float]]]:
            per = []
            for m, parts in zip(ms, collected):
                rows = [m.workload.metrics_of(t, x) for p in parts for t, x in zip(p.traces, p.extra)]
                per.append({k: [row[k] for row in rows] for k in STABILITY_KEYS if rows and k in rows[0]})
            return per

        import time

        # `rounds` is the minimum: like a solo trial's repeats, more follow while a paired comparison is
        # undecided (more_rounds), within the group's timing.max_repeats and timing.budget_s (max_repeats <= rounds
        # pins the count)
        max_rounds = min(t.timing.max_repeats for t in trials)
        budget_s = min(t.timing.budget_s for t in trials)
        with NoiseMonitor(min(gpus) if gpus else None) as noise:
            t0 = time.perf_counter()
            for r in range(rounds):
                one_round(r)
            per_round_s, spent, n = (time.perf_counter() - t0) / rounds, 0.0, rounds
            for _ in range(EXTENSIONS):
                k, worst = more_rounds(per_round(), n, max_rounds, budget_s - spent, per_round_s)
                if k <= 0:
                    break
                (progress or log.info)(f"interleaved: a paired comparison is undecided (+-{worst:.0%}) after {n} rounds: {k} more")
                t1 = time.perf_counter()
                for r in range(n, n + k):
                    one_round(r)
                spent += time.perf_counter() - t1
                n += k
        rounds = n
        out = []
        group_peak = max(p.peak_mem_bytes for parts in collected for p in parts)
        for m, parts, grew in zip(ms, collected, grown):
            runs = Runs([t for p in parts for t in p.traces], [x for p in parts for x in p.extra], group_peak)
            if not m.engine.in_process:  # its own process (a server): that process's peak is the variant's own
                own = max(p.peak_mem_bytes for p in parts)
            else:
                own = None if grew is None else int(m.session.weights_bytes()) + grew
            out.append(m.finish(runs, f"interleaved: {rounds} round(s)", noise.result, grouped=True, own_mem_bytes=own))
        for i, res in enumerate(out):  # spread of a group's variant: judged on the paired ratios its verdicts read
            why = paired_instability(res.samples, [o.samples for j, o in enumerate(out) if j != i])
            if why:
                res.labels[UNSTABLE] = "; ".join(filter(None, (res.labels.get(UNSTABLE), why)))
        return out
    finally:
        for m in ms:
            close_session(m.session)
