"""Spread of timings (engine/measure/spread.py), noise capture (engine/measure/noise.py) and the
`unstable` label: checked on synthetic samples with known answers and against a process the test starts."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from engine.measure.metrics import instability
from engine.measure.noise import NoiseMonitor, unstable_causes
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


def _logged(name: str, samples: list[float]) -> dict[str, float]:
    """A timing as a trial logs it: its median and spread."""
    return {name: spread(samples).median, **spread_metrics(name, samples)}


def test_instability_names_each_cause_with_the_figures_that_triggered_it():
    quiet = _logged("tpot_ms_p50", [10.0, 10.2, 9.9, 10.1, 10.0])
    assert instability({**quiet, "noise_other_cpu_frac": 0.1}) == ""
    wide = {"tpot_ms_p50": 10.0, "tpot_ms_p50_ci_lo": 8.54, "tpot_ms_p50_ci_hi": 11.0, "tpot_ms_p50_cv": 0.14,
            "tpot_ms_p50_n": 3}
    why = instability({**wide, "noise_other_cpu_frac": 0.4031})
    # one decimal, each reason led by its cause: "CV 10% > 10%" could not say why it flagged
    assert why == ("load: other processes used 40.3% of the CPUs (> 25.0%); "
                   "spread: tpot_ms_p50 CI half-width 12.3% > 10.0%")
    assert unstable_causes(why) == {"load", "spread"}
    assert instability({**wide, "tpot_ms_p50_n": 1}) == ""  # one repeat has no interval to judge
    # a half-width that prints as the limit is not over it
    assert instability({**wide, "tpot_ms_p50_ci_lo": 9.0, "tpot_ms_p50_ci_hi": 11.0004}) == ""


def test_unstable_causes_of_labels_old_and_new():
    assert unstable_causes("") == set()
    assert unstable_causes("spread: output_tok_s CI half-width 12.5% > 10.0%") == {"spread"}
    assert unstable_causes("load: 2 other process(es) on the GPU") == {"load"}
    # labels written before causes led each reason
    assert unstable_causes("tpot_ms_p50 CV 14% > 10%") == {"spread"}
    assert unstable_causes("output_tok_s CV 12% > 10%; other processes used 40% of the CPUs (> 25%)") == {"spread", "load"}


def test_spread_is_judged_by_the_interval_not_the_cv_so_a_quiet_machine_is_seldom_flagged():
    """Synthetic quiet-machine trials: 10 repeats (what the adaptive repeats reach when the interval is wide)
    of a timing with 8% run-to-run noise. The old rule (CV > 10%) flags a trial whenever one stalled run
    lifts the sample's CV; the interval of the median, which is what a comparison reads, stays within +-10%
    for all but ~1 trial in 16. A truly noisy timing (30%) is still flagged, and so is a wide interval from
    few repeats."""
    import random

    rng = random.Random(11)
    trials = [[100 * rng.lognormvariate(0, 0.08) for _ in range(10)] for _ in range(160)]
    new = sum(bool(instability(_logged("output_tok_s", xs))) for xs in trials)
    old = sum(spread(xs).cv > 0.10 for xs in trials)
    assert new <= 160 / 16 < old
    noisy = [[100 * rng.lognormvariate(0, 0.3) for _ in range(10)] for _ in range(16)]
    assert sum(bool(instability(_logged("output_tok_s", xs))) for xs in noisy) >= 15
    assert instability(_logged("output_tok_s", [80.0, 100.0, 125.0])).startswith("spread: output_tok_s CI half-width ")


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

    quiet = _other_cpu(False)
    if quiet > 1 - 0.7 / (os.cpu_count() or 1):  # every core already busy: one more process cannot show
        pytest.skip(f"the machine is saturated by other work ({quiet:.0%} of the CPUs busy): no room to see a burner")
    loaded = _other_cpu(True)
    # one busy process is one core's worth of other CPU time: 1/ncpu of the machine, above the quiet level
    assert loaded - quiet > 0.6 / (os.cpu_count() or 1)
    assert 0.0 <= quiet <= 1.0 and loaded <= 1.0


def test_a_trial_records_spread_noise_and_its_stability():
    from engine import EvalConfig, ModelConfig, TrialConfig, WorkloadConfig, run_engine_trial

    from engine.config import TimingConfig

    r = run_engine_trial(TrialConfig(model=ModelConfig(name="tiny", path="tiny://llama"),
                                     workload=WorkloadConfig(context_len=16, max_new_tokens=5, repeats=3, warmup=1),
                                     eval=EvalConfig(enabled=False), timing=TimingConfig(max_repeats=0)))
    m = r.metrics
    for k in ("ttft_ms_p50", "tpot_ms_p50", "output_tok_s"):
        assert m[f"{k}_n"] == 3 and m[f"{k}_ci_lo"] <= m[k] <= m[f"{k}_ci_hi"], k
        assert len(r.samples[k]) == 3 and sorted(r.samples[k])[1] == pytest.approx(m[k])  # the median of its repeats
    assert m["itl_ms_p50_n"] == 3 * 4  # every gap of every repeat
    assert m["timed_repeats"] == 3 and r.info["repeats_stop"] == "fixed count"  # timing.max_repeats=0 pins it
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


# --- ratios of two trials: interval and verdict ---------------------------------------------------------
def _ratio_trials(true_ratio: float, n: int, cv: float, experiments: int, seed: int):
    """`experiments` pairs of trials with lognormal noise (CV ~ `cv`) whose true medians differ by `true_ratio`."""
    import random

    from engine.measure.spread import ratio

    rng = random.Random(seed)
    out = []
    for i in range(experiments):
        a = [100 * rng.lognormvariate(0, cv) for _ in range(n)]
        b = [100 * true_ratio * rng.lognormvariate(0, cv) for _ in range(n)]
        out.append(ratio(spread(a, resamples=400, seed=i), spread(b, resamples=400, seed=i + 1)))
    return out


@pytest.mark.parametrize("n", [5, 10])
def test_ratio_interval_covers_the_true_ratio_at_its_confidence(n):
    rs = _ratio_trials(1.0, n, 0.05, 300, seed=n)
    coverage = sum(r.lo <= 1.0 <= r.hi for r in rs) / len(rs)
    assert 0.90 <= coverage <= 0.995, coverage
    # equal trials: "within noise" is the verdict of (about) the covering share, the rest split both ways
    assert sum(r.verdict == "within noise" for r in rs) / len(rs) == pytest.approx(coverage)


def test_ratio_with_three_repeats_is_widened_by_students_t():
    """3 repeats: the bootstrap interval of each median is about the samples' range; the t factor
    (4 degrees of freedom) keeps the ratio's coverage near 90% instead of ~80% with z."""
    rs = _ratio_trials(1.0, 3, 0.05, 400, seed=3)
    assert 0.85 <= sum(r.lo <= 1.0 <= r.hi for r in rs) / len(rs) <= 0.97


def test_ratio_verdicts_on_a_real_difference():
    faster = _ratio_trials(1.15, 5, 0.05, 200, seed=11)  # 15% better, 5% noise: mostly resolved (power ~80%)
    assert sum(r.verdict == "faster" for r in faster) / 200 >= 0.7 and not any(r.verdict == "slower" for r in faster)
    slower = _ratio_trials(1 / 1.15, 5, 0.05, 200, seed=12)
    assert sum(r.verdict == "slower" for r in slower) / 200 >= 0.7 and not any(r.verdict == "faster" for r in slower)
    noisy = _ratio_trials(1.15, 5, 0.30, 200, seed=13)  # the same 15% under 30% noise: mostly unresolved
    assert sum(r.verdict == "within noise" for r in noisy) / 200 >= 0.6


def test_ratio_direction_and_missing_intervals():
    from engine.measure.spread import Spread, ratio, spread_of

    fast, slow = Spread(10.0, 9.0, 11.0, 0.05, 5), Spread(20.0, 18.0, 22.0, 0.05, 5)
    assert ratio(fast, slow).value == pytest.approx(2.0)  # a rate: new / base
    assert ratio(fast, slow, higher_is_better=False).value == pytest.approx(0.5)  # a time: base / new
    assert ratio(fast, Spread(20.0, 20.0, 20.0, 0.0, 1)) is None  # one sample: no interval to judge with
    m = {"tpot_ms_p50": 5.0, "tpot_ms_p50_ci_lo": 4.0, "tpot_ms_p50_ci_hi": 6.0, "tpot_ms_p50_cv": 0.1, "tpot_ms_p50_n": 3.0}
    assert spread_of(m, "tpot_ms_p50") == Spread(5.0, 4.0, 6.0, 0.1, 3)
    assert spread_of({"tpot_ms_p50": 5.0}, "tpot_ms_p50") is None  # recorded before intervals existed


def test_t_quantile():
    from engine.measure.spread import t95

    for df, exact in ((3, 3.182), (4, 2.776), (10, 2.228), (30, 2.042)):
        assert t95(df) == pytest.approx(exact, rel=0.01)


# --- adaptive repeats (engine/pipeline.py) ----------------------------------------------------------------
def _policy_trial(repeats=3, **timing):
    from engine.config import ModelConfig, TimingConfig, TrialConfig, WorkloadConfig

    return TrialConfig(model=ModelConfig(name="m", path="tiny://llama"), workload=WorkloadConfig(repeats=repeats, warmup=0),
                       timing=TimingConfig(**timing))


def _runner(cv: float, seed: int = 0):
    """A stand-in engine whose repeats give output_tok_s with lognormal noise of ~`cv`; counts its calls."""
    import random

    from engine.engines.base import Runs

    rng, calls = random.Random(seed), []

    def run(warmup: int, repeats: int) -> Runs:
        calls.append((warmup, repeats))
        return Runs([100 * rng.lognormvariate(0, cv) for _ in range(repeats)], [{} for _ in range(repeats)], 1)

    return run, calls


def _adapt(trial, run, adaptive=True):
    from engine.pipeline import _repeat_until_precise

    return _repeat_until_precise(trial, run, lambda t, x: {"output_tok_s": t}, adaptive, lambda _m: None)


def test_quiet_timings_stop_at_the_minimum_and_noisy_ones_repeat_until_the_interval_is_narrow():
    run, calls = _runner(cv=0.002)
    runs, why = _adapt(_policy_trial(), run)
    assert len(runs.traces) == 3 and calls == [(0, 3)] and why == "interval within +-5%"
    run, calls = _runner(cv=0.15, seed=1)  # 3 samples at 15% CV: an interval far wider than +-5%
    runs, why = _adapt(_policy_trial(max_repeats=40, budget_s=1e9), run)
    from engine.pipeline import precise_enough

    width = precise_enough([{"output_tok_s": t} for t in runs.traces])
    assert why == "interval within +-5%" and width <= 0.05 and 3 < len(runs.traces) <= 40
    assert calls[0] == (0, 3) and all(w == 0 for w, _ in calls[1:]) and len(calls) <= 3  # no second warm-up


def test_repeats_stop_at_their_limits_and_a_pinned_count_is_exact():
    run, calls = _runner(cv=0.5, seed=2)  # far too noisy for +-5% within 6 repeats
    runs, why = _adapt(_policy_trial(max_repeats=6, budget_s=1e9), run)
    assert len(runs.traces) == 6 and why == "repeat limit"
    run, calls = _runner(cv=0.5, seed=3)
    runs, why = _adapt(_policy_trial(max_repeats=50, budget_s=0), run)
    assert len(runs.traces) == 3 and why == "time budget"
    for trial, adaptive in ((_policy_trial(max_repeats=3), True), (_policy_trial(max_repeats=50), False)):
        run, calls = _runner(cv=0.5, seed=4)
        runs, why = _adapt(trial, run, adaptive)
        assert len(runs.traces) == 3 and calls == [(0, 3)] and why == "fixed count"


def test_timing_policy_is_validated_and_outside_the_hash():
    from engine.validation import check_trial
    from experiments.config.hashing import config_hash

    bad = _policy_trial(target_ci=0, budget_s=-1)
    found = dict(check_trial(bad, gpu_available=False))
    assert "must be > 0" in found["timing.target_ci"] and "must be >= 0" in found["timing.budget_s"]
    import dataclasses

    a, b = (dataclasses.asdict(_policy_trial(max_repeats=m)) for m in (3, 30))
    assert config_hash(a) == config_hash(b)  # precision, not what is measured


def test_instability_names_other_gpu_processes():
    assert instability({"noise_gpu_other_procs": 0.0}) == ""
    assert instability({"noise_gpu_other_procs": 2.0}) == "load: 2 other process(es) on the GPU"


@pytest.mark.gpu
def test_noise_monitor_sees_a_gpu_process_the_test_starts():
    """A second process holding the GPU (started here) is counted; needs CUDA and NVML (nvidia-ml-py)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    pytest.importorskip("pynvml", reason="NVML bindings: pip install nvidia-ml-py")
    holder = subprocess.Popen([sys.executable, "-c", "import torch, time; x = torch.ones(1 << 26, device='cuda'); "
                               "print('ready', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        with NoiseMonitor(gpu=0) as n:
            time.sleep(0.2)
    finally:
        holder.kill()
        holder.wait()
    assert n.result["noise_gpu_other_procs"] >= 1 and n.result["noise_gpu_other_mem_bytes"] > 0


def test_noise_monitor_without_a_gpu_records_only_the_cpu():
    with NoiseMonitor() as n:
        time.sleep(0.05)
    assert not any(k.startswith("noise_gpu") for k in n.result)


def test_a_single_repeat_is_always_followed_by_more():
    """One repeat has no interval: the policy asks for more (as many as its limits allow) instead of stopping."""
    run, calls = _runner(cv=0.002)
    runs, why = _adapt(_policy_trial(repeats=1, max_repeats=4, budget_s=1e9), run)
    assert calls[:2] == [(0, 1), (0, 3)] and len(runs.traces) >= 2 and why == "interval within +-5%"


# --- interleaved (ABBA) measurement and paired ratios ------------------------------------------------------
def test_paired_ratios_cancel_a_drift_that_unpaired_intervals_cannot():
    """A drift shared by the round (the machine slowing down 1x -> 3x over the run) widens each variant's
    own interval, so the unpaired ratio cannot resolve a 10% difference; the per-round ratios of an
    interleaved run cancel the drift and resolve it, with an interval that covers the truth at about its
    confidence. 200 simulated runs of 10 rounds, 2% noise per measurement."""
    import random

    from engine.measure.spread import paired_ratio, ratio

    rng = random.Random(5)
    drift = [1 + 2 * i / 9 for i in range(10)]
    found, covered, unresolved, narrower = 0, 0, 0, 0
    for k in range(200):
        a = [100 / d * rng.lognormvariate(0, 0.02) for d in drift]
        b = [110 / d * rng.lognormvariate(0, 0.02) for d in drift]
        unpaired, paired = ratio(spread(a, seed=k), spread(b, seed=k + 1)), paired_ratio(a, b, seed=k)
        found += paired.verdict == "faster"
        covered += paired.lo <= 1.10 <= paired.hi
        unresolved += unpaired.verdict == "within noise"
        narrower += (paired.hi - paired.lo) < (unpaired.hi - unpaired.lo) / 5
    assert found >= 190 and unresolved >= 190 and narrower >= 190
    assert 0.85 <= covered / 200 <= 1.0
    assert paired_ratio([1.0], [1.1]) is None
    with pytest.raises(ValueError, match="equal counts"):
        paired_ratio([1.0, 2.0], [1.0])


def test_run_interleaved_gives_each_variant_its_rounds_and_the_same_tokens():
    import dataclasses

    from engine import EvalConfig, ModelConfig, TrialConfig, WorkloadConfig, run_engine_trial, run_interleaved
    from engine.config import EngineConfig, EngineError, KVCacheConfig, TimingConfig

    base = TrialConfig(model=ModelConfig(name="tiny", path="tiny://llama"),
                       workload=WorkloadConfig(context_len=24, max_new_tokens=6, warmup=1, repeats=2),
                       eval=EvalConfig(enabled=False))
    variants = [base, dataclasses.replace(base, kv_cache=KVCacheConfig(mode="off")),
                dataclasses.replace(base, engine=EngineConfig(backend="native"))]
    alone = run_engine_trial(base)
    pinned = [dataclasses.replace(v, timing=TimingConfig(max_repeats=0)) for v in variants]
    for group, exact in ((pinned, True), (variants, False)):
        # `rounds` is the minimum; more follow (every variant alike) while a pair is undecided, unless pinned
        results = run_interleaved(group, rounds=3)
        n = results[0].metrics["timed_repeats"]
        assert (n == 3) if exact else (3 <= n <= TimingConfig().max_repeats)
        for r in results:
            assert r.metrics["timed_repeats"] == n and r.info["repeats_stop"] == f"interleaved: {n:.0f} round(s)"
            assert r.metrics["output_tok_s_n"] == n and "noise_other_cpu_frac" in r.metrics
            assert r.token_ids == alone.token_ids  # greedy, fp32: every variant generates the same tokens
    with pytest.raises(EngineError, match="rounds must be >= 1"):
        run_interleaved(variants, rounds=0)
    with pytest.raises(EngineError, match="vllm runs in its own"):
        run_interleaved([dataclasses.replace(base, engine=EngineConfig(backend="vllm"))], rounds=2)


def test_each_interleaved_variant_logs_its_own_memory_not_the_groups():
    """An interleaved group's process holds every variant's model, so its peak is the group's (8 engine
    variants all logged `peak MB 4335`). Three tiny models of different sizes in one group: each logs its
    own footprint as peak_mem_bytes -- its weights plus what its own calls allocated, ordered as the weights
    are -- and the one process peak as group_peak_mem_bytes. The first timed round follows an untimed one."""
    from engine import EvalConfig, ModelConfig, TrialConfig, WorkloadConfig, run_interleaved
    from engine.config import TinyModelConfig

    def tiny(hidden: int) -> TrialConfig:
        return TrialConfig(model=ModelConfig(name=f"tiny-{hidden}", path="tiny://llama",
                                             tiny=TinyModelConfig(hidden_size=hidden, intermediate_size=2 * hidden)),
                           workload=WorkloadConfig(context_len=24, max_new_tokens=6, warmup=1, repeats=2),
                           eval=EvalConfig(enabled=False))

    said: list[str] = []
    results = run_interleaved([tiny(64), tiny(768), tiny(384)], rounds=2, progress=said.append)
    weights = [r.metrics["weights_bytes"] for r in results]
    own = [r.metrics["peak_mem_bytes"] for r in results]
    groups = {r.metrics["group_peak_mem_bytes"] for r in results}
    assert len(groups) == 1 and len(set(own)) == 3  # one process peak; three footprints
    assert sorted(range(3), key=own.__getitem__) == sorted(range(3), key=weights.__getitem__) == [0, 2, 1]
    for w, o in zip(weights, own):  # weights plus a 30-token generation's KV cache and scratch: MBs, not the group
        assert w <= o < w + 32e6, (w, o)
    assert max(own) < groups.pop()  # the process also holds the other variants and the runtime
    assert "interleaved: one untimed warm-up round" in said


def test_an_interleaved_variant_is_judged_on_its_paired_ratios_not_its_own_interval():
    """Drift shared by every variant widens each one's own interval (+-20% here) but cancels in the per-round
    ratios, so neither variant is flagged; a pair whose ratio interval holds x1 and is wider than +-10%
    is (hand-made rounds: the second variant's rounds scatter +-30% around the first's)."""
    from engine.measure.metrics import instability, paired_instability

    drift = [10.0, 14.0, 9.0, 16.0, 11.0, 8.0]
    a = {"tpot_ms_p50": drift}
    b = {"tpot_ms_p50": [x * 0.8 for x in drift]}  # x1.25 faster in every round
    own = _logged("tpot_ms_p50", drift)
    assert instability(own).startswith("spread: tpot_ms_p50 CI half-width ")  # alone: too wide
    assert instability(own, own_spread=False) == ""  # in a group its own interval is not the measure
    assert paired_instability(a, [b]) == paired_instability(b, [a]) == ""  # the pair decides: x1.25
    same = {"tpot_ms_p50": [x * 1.001 for x in drift]}
    assert paired_instability(a, [same]) == ""  # within noise, and narrowly: a verdict too
    scattered = {"tpot_ms_p50": [x * f for x, f in zip(drift, (0.7, 1.3, 0.75, 1.3, 0.7, 1.25))]}
    why = paired_instability(a, [b, scattered])
    assert why.startswith("spread: 1 of 2 paired comparisons undecided, widest tpot_ms_p50 x")
    assert why.endswith("> 10.0%") and "~" in why
    assert paired_instability({"tpot_ms_p50": [10.0]}, [{"tpot_ms_p50": [11.0]}]) == ""  # one round: no interval


@pytest.mark.parametrize("rounds", [3, 4, 5])
def test_paired_ratio_covers_at_its_confidence_with_few_rounds(rounds):
    """The chain decides on 3-5 interleaved rounds: there the bootstrap of the median alone covered a true
    x1.02 in 75% (3 rounds) / 87% (4) / 92% (5) of 400 simulated pairs at 10% noise; with Student's t interval
    of the log ratios beside it the interval covers at ~95%, so a chance gain is not a verdict."""
    import random

    from engine.measure.spread import paired_ratio

    rng = random.Random(1)
    hits = false_gain = 0
    for k in range(400):
        a = [100 * rng.lognormvariate(0, 0.1) for _ in range(rounds)]
        b = [102 * rng.lognormvariate(0, 0.1) for _ in range(rounds)]
        r = paired_ratio(a, b, seed=k)
        hits += r.lo <= 1.02 <= r.hi
        false_gain += r.lo > 1.10  # "faster by 10% or more": the decision a chance result must not reach
    assert hits / 400 >= 0.93 and false_gain <= 4


def test_a_zero_sample_gives_no_paired_ratio_instead_of_a_crash():
    """An interleaved group at max_new_tokens=1 has TPOT 0 in every round (no token after the first): there is
    no ratio of those, and the group's undecided-pair check skips the metric (it divided by zero before)."""
    from engine.measure.metrics import undecided_pairs
    from engine.measure.spread import paired_ratio

    assert paired_ratio([0.0, 0.0, 0.0], [0.0, 0.0, 0.0], higher_is_better=False) is None
    assert paired_ratio([1.0, 2.0], [1.0, float("nan")]) is None
    a = {"tpot_ms_p50": [0.0, 0.0, 0.0], "ttft_ms_p50": [100.0, 101.0, 99.0]}
    b = {"tpot_ms_p50": [0.0, 0.0, 0.0], "ttft_ms_p50": [50.0, 51.0, 49.5]}
    undecided, pairs = undecided_pairs(a, [b])
    assert undecided == [] and pairs == 1  # TTFT judged (clearly x2), TPOT skipped
