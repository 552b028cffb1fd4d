"""Spread of timings (engine/measure/spread.py), noise capture (engine/measure/noise.py) and the
`unstable` label: checked on synthetic samples with known answers and against a process the test starts."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from engine.measure.metrics import instability
from engine.measure.noise import NoiseMonitor
from engine.measure.spread import spread, spread_metrics


def test_one_sample_has_no_spread():
    s = spread([3.0])
    assert (s.median, s.ci_lo, s.ci_hi, s.cv, s.n) == (3.0, 3.0, 3.0, 0.0, 1)


def test_interval_of_the_median_covers_the_true_median_at_its_confidence():
    """Coverage on samples from a known distribution (exponential, skewed like stalled timings): the 95%
    interval of the median contains the true median (ln 2 for rate 1) in about 95% of 400 experiments."""
    import random

    rng, hits = random.Random(7), 0
    true_median = 0.6931471805599453  # ln 2
    for i in range(400):
        xs = [rng.expovariate(1.0) for _ in range(25)]
        s = spread(xs, resamples=400, seed=i)
        hits += s.ci_lo <= true_median <= s.ci_hi
    assert 0.88 <= hits / 400 <= 0.995  # percentile bootstrap of the median: near-nominal at n = 25


def test_interval_narrows_with_more_samples_and_cv_is_exact():
    import random

    rng = random.Random(1)
    few = spread([rng.gauss(100, 5) for _ in range(10)])
    many = spread([rng.gauss(100, 5) for _ in range(400)])
    assert (many.ci_hi - many.ci_lo) < (few.ci_hi - few.ci_lo) / 3  # width ~ 1/sqrt(n): 40x samples -> ~1/6.3
    assert many.ci_lo < 100 < many.ci_hi
    s = spread([90.0, 100.0, 110.0])
    assert s.cv == pytest.approx(10.0 / 100.0) and s.median == 100.0
    assert spread([90.0, 100.0, 110.0]) == s  # seeded: the same samples give the same interval


def test_spread_metrics_names():
    m = spread_metrics("tpot_ms_p50", [1.0, 2.0, 3.0])
    assert set(m) == {"tpot_ms_p50_ci_lo", "tpot_ms_p50_ci_hi", "tpot_ms_p50_cv", "tpot_ms_p50_n"}
    assert m["tpot_ms_p50_n"] == 3 and 1.0 <= m["tpot_ms_p50_ci_lo"] <= 2.0 <= m["tpot_ms_p50_ci_hi"] <= 3.0


def test_instability_names_each_reason():
    assert instability({"tpot_ms_p50_cv": 0.05, "tpot_ms_p50_n": 3, "noise_other_cpu_frac": 0.1}) == ""
    why = instability({"tpot_ms_p50_cv": 0.14, "tpot_ms_p50_n": 3, "noise_other_cpu_frac": 0.4})
    assert "tpot_ms_p50 CV 14% > 10%" in why and "other processes used 40% of the CPUs" in why
    assert instability({"tpot_ms_p50_cv": 0.5, "tpot_ms_p50_n": 1}) == ""  # one repeat has no CV to judge


def _other_cpu(busy: bool) -> float:
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        time.sleep(0.3 if busy else 0)  # let it start
        with NoiseMonitor() as n:
            time.sleep(1.5)  # this process idles: everything busy is someone else
    finally:
        if burner is not None:
            burner.kill()
            burner.wait()
    return n.result["noise_other_cpu_frac"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")
def test_noise_monitor_sees_a_process_the_test_starts():
    import os

    quiet, loaded = _other_cpu(False), _other_cpu(True)
    # one busy process is one core's worth of other CPU time: 1/ncpu of the machine, above the quiet level
    assert loaded - quiet > 0.6 / (os.cpu_count() or 1)
    assert 0.0 <= quiet <= 1.0 and loaded <= 1.0


def test_a_trial_records_spread_noise_and_its_stability():
    from engine import EvalConfig, ModelConfig, TrialConfig, WorkloadConfig, run_engine_trial

    r = run_engine_trial(TrialConfig(model=ModelConfig(name="tiny", path="tiny://llama"),
                                     workload=WorkloadConfig(context_len=16, max_new_tokens=5, repeats=3, warmup=1),
                                     eval=EvalConfig(enabled=False)))
    m = r.metrics
    for k in ("ttft_ms_p50", "tpot_ms_p50", "output_tok_s"):
        assert m[f"{k}_n"] == 3 and m[f"{k}_ci_lo"] <= m[k] <= m[f"{k}_ci_hi"], k
    assert m["itl_ms_p50_n"] == 3 * 4  # every gap of every repeat
    assert 0.0 <= m["noise_other_cpu_frac"] <= 1.0 and "noise_steal_frac" in m
    assert ("unstable" in r.labels) == bool(instability(m))


def test_reproduce_judges_a_timing_by_both_intervals():
    from experiments.run.reproduce import timing_verdict

    orig = {"tpot_ms_p50": 10.0, "tpot_ms_p50_ci_lo": 9.5, "tpot_ms_p50_ci_hi": 10.6}
    near = {"tpot_ms_p50": 10.9, "tpot_ms_p50_ci_lo": 10.4, "tpot_ms_p50_ci_hi": 11.5}  # overlaps [9.5, 10.6]
    far = {"tpot_ms_p50": 13.0, "tpot_ms_p50_ci_lo": 12.5, "tpot_ms_p50_ci_hi": 13.4}
    assert timing_verdict("tpot_ms_p50", orig, near) == "x1.09 consistent"
    assert timing_verdict("tpot_ms_p50", orig, far) == "x1.30 differs beyond noise"
    assert timing_verdict("tpot_ms_p50", {"tpot_ms_p50": 10.0}, far) == "x1.30 no interval recorded"
