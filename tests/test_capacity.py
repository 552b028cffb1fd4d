"""Capacity search (capacity.search): the highest request rate within the SLO.

The search itself (engine/serving/capacity.py) is tested on a synthetic latency model whose knee is known
in closed form; the real pipeline on the tiny random model (native engine), end to end through Ray and
MLflow (steps, the curve artifact, reproduce).
"""
from __future__ import annotations

import dataclasses
import math

import pytest

from support import make_trial
from engine.config import BatchingConfig, CapacityConfig, EvalConfig, LengthConfig, ModelConfig, SLOConfig, WorkloadConfig
from engine.pipeline import run_engine_trial
from engine.serving.capacity import RATE, SATURATE, SYNC, ProbeStats, SearchBudget, meets, search_capacity

# --------------------------------------------------------------------------- a synthetic latency model


@dataclasses.dataclass
class Queue:
    """p99 TTFT grows like an M/M/1 queue's wait: base + a * r / (C - r) ms at Poisson rate r < C (and
    without bound at r >= C); TPOT is flat. One request at a time gives `base`, all at once serves C req/s
    with a TTFT far above any SLO. The SLO on TTFT is met exactly up to knee()."""

    base: float = 50.0
    a: float = 100.0
    capacity: float = 10.0
    tpot: float = 20.0
    calls: list = dataclasses.field(default_factory=list)

    def ttft(self, r: float) -> float:
        return self.base + self.a * r / (self.capacity - r) if r < self.capacity else math.inf

    def __call__(self, kind: str, rate: float) -> ProbeStats:
        self.calls.append((kind, rate))
        if kind == SYNC:
            return ProbeStats(self.base, self.tpot, request_s=1.5)
        if kind == SATURATE:
            return ProbeStats(1e9, self.tpot, request_s=self.capacity)
        assert kind == RATE
        return ProbeStats(self.ttft(rate), self.tpot, request_s=min(rate, self.capacity))

    def knee(self, slo: float) -> float:
        """The rate at which ttft(r) == slo."""
        d = slo - self.base
        return self.capacity * d / (self.a + d)


@pytest.mark.parametrize("slo", [60.0, 150.0, 400.0, 2000.0])
@pytest.mark.parametrize("tol", [0.2, 0.05])
def test_bisection_finds_the_known_knee_within_tolerance_and_budget(slo, tol):
    q = Queue()
    budget = SearchBudget(max_probes=12, tolerance=tol)
    r = search_capacity(q, lambda s: meets(s, slo, 100.0), budget)
    knee = q.knee(slo)
    assert r.meets_slo and r.hi is not None
    assert r.lo <= knee < r.hi  # the true knee is bracketed by measured rates
    assert r.hi - r.lo <= tol * r.hi  # ... within the tolerance
    assert r.max_rate == r.lo and r.best.rate == r.lo and r.best.passed
    assert len(q.calls) == len(r.probes) <= budget.max_probes
    assert [k for k, _ in q.calls[:3]] == [SYNC, SATURATE, RATE] and q.calls[2][1] == q.capacity  # the bracket first
    # bisection: each probe after the third halves the bracket, so the count is the bound log2(C / (tol * hi))
    assert len(r.probes) <= 3 + math.ceil(math.log2(q.capacity / (tol * r.hi)))


def test_probe_budget_stops_the_search_with_an_honest_bracket():
    q = Queue()
    r = search_capacity(q, lambda s: meets(s, 150.0, 100.0), SearchBudget(max_probes=4, tolerance=0.001))
    assert len(r.probes) == 4 and "probe budget (4) spent" in r.verdict
    assert r.lo <= q.knee(150.0) < r.hi


def test_time_budget_stops_the_search():
    ticks = iter(range(1000))
    q = Queue()
    r = search_capacity(q, lambda s: meets(s, 150.0, 100.0), SearchBudget(max_probes=50, tolerance=1e-6, max_s=10),
                        clock=lambda: next(ticks) * 1.0)
    assert "time budget" in r.verdict and len(r.probes) < 50
    assert r.lo <= q.knee(150.0) < r.hi


def test_no_rate_meets_the_slo_is_a_result_not_a_crash():
    q = Queue(base=500.0)
    r = search_capacity(q, lambda s: meets(s, 100.0, 100.0), SearchBudget())
    assert r.max_rate == 0.0 and not r.meets_slo and len(q.calls) == 1  # nothing after the synchronous probe
    assert "no rate meets the SLO" in r.verdict


def test_tpot_counts_too_and_an_slo_met_at_saturation_is_the_saturating_throughput():
    assert search_capacity(Queue(tpot=300.0), lambda s: meets(s, 1e12, 100.0), SearchBudget()).max_rate == 0.0
    r = search_capacity(Queue(), lambda s: meets(s, 1e12, 100.0), SearchBudget())
    assert r.max_rate == 10.0 and r.hi is None and len(r.probes) == 2


def test_a_poisson_probe_at_saturation_that_passes_is_the_capacity():
    class Flat(Queue):  # no queueing up to C (a deterministic server); only the all-at-once probe misses
        def ttft(self, r):
            return self.base

    q = Flat(capacity=5.0)
    r = search_capacity(q, lambda s: meets(s, 60.0, 100.0), SearchBudget())
    assert r.max_rate == 5.0 and r.hi is None and len(r.probes) == 3


# --------------------------------------------------------------------------- the real pipeline (tiny model)

TINY = ModelConfig(name="tiny", path="tiny://llama")


def _trial(slo: SLOConfig, **capacity):
    spec = WorkloadConfig(num_requests=5, input_len=LengthConfig("uniform", 0, 4, 20),
                          output_len=LengthConfig("uniform", 0, 2, 8), prefix_len=8, arrival="poisson", rate=20.0)
    return make_trial(TINY, backend="native", kv_cache="paged", kv_block_size=4, prefix_caching=True,
                      workload=WorkloadConfig(warmup=1, repeats=1), eval=EvalConfig(enabled=False), serving=spec,
                      batching=BatchingConfig("continuous", max_batch_size=4), slo=slo,
                      capacity=CapacityConfig(search=True, **capacity))


def test_search_through_the_pipeline_logs_the_found_rate_its_curve_and_reference_tokens():
    trial = _trial(SLOConfig(ttft_ms=1e7, tpot_ms=1e7), max_probes=4)  # an SLO every load meets
    r = run_engine_trial(trial)
    m = r.metrics
    plain = run_engine_trial(dataclasses.replace(trial, capacity=CapacityConfig()))  # one run at workload.rate
    assert r.token_ids == plain.token_ids  # the same requests, the same greedy tokens, whatever the arrivals
    assert m["capacity_token_mismatches"] == 0
    assert m["capacity_meets_slo"] == 1 and m["capacity_probes"] == 2  # all at once met it: no bisection needed
    assert m["max_rate_at_slo"] == m["capacity_saturation_request_s"] > 0
    assert m["goodput_at_slo"] == pytest.approx(m["request_s"])  # the trial's metrics are the found probe's
    assert "saturating throughput" in r.labels["capacity"]
    assert set(r.series) >= {"probe_rate", "probe_ttft_ms_p99", "probe_tpot_ms_p50", "probe_goodput"}
    assert all(len(v) == 2 for v in r.series.values())
    assert r.series["probe_rate"] == sorted(r.series["probe_rate"])  # steps in rate order
    assert r.series["probe_kind"] == [0.0, 2.0]  # synchronous, then saturating (a higher rate)
    assert "max_rate_at_slo" not in plain.metrics and not plain.series
    from engine.measure.metrics import METRICS, LABELS, base_metric

    assert {base_metric(k) for k in m} | set(r.series) <= set(METRICS) and set(r.labels) <= set(LABELS)


def test_search_with_an_slo_no_probe_meets_finishes_and_says_so():
    r = run_engine_trial(_trial(SLOConfig(ttft_ms=1e-3, tpot_ms=1e-3)))
    assert r.metrics["max_rate_at_slo"] == 0 and r.metrics["capacity_meets_slo"] == 0
    assert r.metrics["capacity_probes"] == 1 and r.metrics["goodput_at_slo"] == 0
    assert "no rate meets the SLO" in r.labels["capacity"]
    assert len(r.token_ids) == 5


# --------------------------------------------------------------------------- bad input, before launch


def test_validation_reports_every_capacity_problem_at_once():
    from experiments.config.compose import SweepError, expand

    base = ["model=tiny-llama", "workload=serving-mixed", "engine=native", "kv_cache=paged", "capacity.search=true"]
    assert len(expand(base)) == 1
    with pytest.raises(SweepError) as ei:
        expand(base + ["capacity.max_probes=2", "capacity.percentile=0", "capacity.tolerance=1", "capacity.max_s=0"])
    text = "\n".join(ei.value.problems)
    for key in ("capacity.max_probes: must be >= 3", "capacity.percentile: must be in (0, 100]",
                "capacity.tolerance: must be in (0, 1)", "capacity.max_s: must be > 0"):
        assert key in text, (key, text)
    with pytest.raises(SweepError) as ei:
        expand(["model=tiny-llama", "capacity.search=true"])  # a static workload
    assert any(p.startswith("capacity.search: a capacity search probes requests arriving over time")
               for p in ei.value.problems), ei.value.problems
    with pytest.raises(SweepError) as ei:
        expand(["model=tiny-llama", "workload=serving-mixed", "engine=hf", "capacity.search=true"])
    assert any("capacity.search: engine hf cannot serve" in p and "engine=native kv_cache=paged" in p
               for p in ei.value.problems), ei.value.problems


def test_capacity_search_on_an_engine_that_serves_but_cannot_search_is_refused():
    from engine import engines
    from engine.validation import check_trial

    trial = _trial(SLOConfig())
    for e in engines.all_engines():
        if e.serves and not e.searches_capacity:
            p = check_trial(dataclasses.replace(trial, engine=dataclasses.replace(trial.engine, backend=e.name)), False)
            assert any(k == "capacity.search" and e.searches_capacity_why in m for k, m in p), p


# --------------------------------------------------------------------------- end to end: Ray, MLflow, reproduce


def test_capacity_sweep_trial_logs_steps_and_a_curve_and_reproduces(ray_local, tiny_overrides, tracking, mlflow_client):
    from experiments.run.reproduce import format_comparison, reproduce
    from experiments.run.sweep import run_sweep
    from experiments.tracking.store import CURVE_ARTIFACT

    over = tiny_overrides + ["sweep_name=t-capacity", "seed=777", "engine=native", "kv_cache=paged", "workload=serving-mixed",
                             "workload.num_requests=4", "workload.prefix_len=8", "workload.input_len.min=4",
                             "workload.input_len.max=16", "workload.output_len.min=2", "workload.output_len.max=6",
                             "batching=continuous", "eval=none", "capacity.search=true", "capacity.max_probes=4",
                             "slo.ttft_ms=1e7", "slo.tpot_ms=1e7", "kv_cache.prefix_caching=false,true"]
    res = run_sweep(over, echo=lambda *_: None)
    assert len(res.rows) == 2 and len({r["hash"] for r in res.rows}) == 2  # one hash per configuration
    run = mlflow_client.get_run(res.rows[0]["run_id"])
    assert run.info.status == "FINISHED" and run.data.metrics["max_rate_at_slo"] > 0
    history = mlflow_client.get_metric_history(run.info.run_id, "probe_rate")
    assert sorted(h.step for h in history) == list(range(int(run.data.metrics["capacity_probes"])))
    assert CURVE_ARTIFACT in [a.path for a in mlflow_client.list_artifacts(run.info.run_id)]
    cmp = reproduce(res.rows[0]["hash"][:12], tracking)
    assert cmp.tokens_match and cmp.deterministic_match
    verdicts = {m: v for m, _, _, v in cmp.rows}
    assert verdicts["max_rate_at_slo"].startswith("x")  # judged as a timing, by the search's brackets
    assert "max_rate_at_slo" in format_comparison(cmp)


def test_the_synchronous_probe_sends_one_request_at_a_time_and_the_saturating_all_at_once():
    from engine import engines
    from engine.pipeline import serving_plan
    from engine.prompts import corpus_ids

    trial = _trial(SLOConfig())
    native = engines.get(trial.engine.backend)
    session = native.open(trial, native.load(trial, lambda _m: None), lambda _m: None)
    corpus = corpus_ids(session.tokenizer, trial.workload.text)
    sync = serving_plan(dataclasses.replace(trial.workload, arrival="all-at-once", max_concurrency=1), corpus, 0, 0, 1)
    recs = sorted(session.run_serving(sync, lambda _m: None).traces[0].requests, key=lambda r: r.sent_s)
    assert len(recs) == 5 and all(b.sent_s >= a.token_times_s[-1] for a, b in zip(recs, recs[1:]))  # no overlap
    sat = serving_plan(dataclasses.replace(trial.workload, arrival="all-at-once"), corpus, 0, 0, 1)
    assert all(r.sent_s == 0.0 for r in session.run_serving(sat, lambda _m: None).traces[0].requests)


def test_the_found_rates_interval_is_the_bracket_widened_by_the_searchs_resolution():
    from engine.measure.metrics import capacity_metrics

    q = Queue()
    r = search_capacity(q, lambda s: meets(s, 150.0, 100.0), SearchBudget(max_probes=12, tolerance=0.1))
    m, _ = capacity_metrics(r, 0.1)
    assert m["capacity_bracket_hi"] == r.hi and m["max_rate_at_slo"] == r.lo
    assert m["max_rate_at_slo_ci_lo"] == pytest.approx(0.9 * r.lo) and m["max_rate_at_slo_ci_hi"] == pytest.approx(1.1 * r.hi)
    # a capacity at the saturating throughput: nothing failed above it, its interval is the rate +- the tolerance
    sat = search_capacity(Queue(), lambda s: meets(s, 1e12, 100.0), SearchBudget(tolerance=0.15))
    m, _ = capacity_metrics(sat, 0.15)
    assert "capacity_bracket_hi" not in m
    assert (m["max_rate_at_slo_ci_lo"], m["max_rate_at_slo_ci_hi"]) == (pytest.approx(8.5), pytest.approx(11.5))
    # reproduce: a rerun within the search's resolution is consistent, one beyond it differs
    from experiments.run.reproduce import CONSISTENT, DIFFERS_BEYOND_NOISE, timing_verdict

    near = {k: v * 0.97 for k, v in m.items() if k.startswith("max_rate_at_slo")}
    far = {k: v * 0.6 for k, v in m.items() if k.startswith("max_rate_at_slo")}
    assert timing_verdict("max_rate_at_slo", m, near).endswith(CONSISTENT)
    assert timing_verdict("max_rate_at_slo", m, far).endswith(DIFFERS_BEYOND_NOISE)
