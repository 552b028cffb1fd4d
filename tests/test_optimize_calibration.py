"""The chain's verdicts keep the error they state: simulations over many seeds of the chain's own pair loop
(`Chain.measure_pair` -> decide.judge_timing / judge_accuracy -> the exact bounds), with the engine's round
extensions and the chain's re-measurements on, and mutations of the rules that these checks must catch."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from engine.measure.spread import signed_rank_bounds, signed_rank_k
from experiments.optimize import accuracy, decide
from experiments.optimize.calibration import GATE, TIMING, Noise, gate_rates, timing_rates, violations
from experiments.optimize.decide import min_rounds
from experiments.optimize.settings import OptimizeConf, rules_of

RULES = rules_of(OptimizeConf(), True, 50)  # the shipped settings: conf/optimize/chain.yaml's values
ROUNDS = max(OptimizeConf().rounds, min_rounds(RULES))


def test_signed_rank_bound_covers_at_its_level_with_stalls():
    rng = np.random.default_rng(0)
    for n, alpha in ((9, 0.0028), (12, 0.025), (30, 0.01)):
        x = rng.normal(0, 0.14, (20000, n)) + np.where(rng.random((20000, n)) < 0.05, rng.choice([-0.69, 0.69], (20000, n)), 0)
        c, lo, hi = signed_rank_bounds(x, alpha)
        assert np.mean(lo > 0) <= alpha * 1.15 + 0.001  # exact under symmetry: the bound misses at most alpha
        assert np.mean(hi < 0) <= alpha * 1.15 + 0.001
        assert np.mean(lo > 0) >= alpha * 0.5  # and not far more conservative than stated
    assert signed_rank_k(5, 0.025) == 0 and signed_rank_k(6, 0.025) == 1  # 2^-5 > 2.5%: no bound from 5 rounds


def test_tango_interval_matches_the_exact_bound_with_no_item_lost_and_covers():
    lo, _ = accuracy.tango_bounds(0, 0, 50, 0.025)
    assert lo == pytest.approx(-(1 - 0.025 ** (1 / 50)), abs=0.002)  # 0/50 lost: a drop up to 7.1% not ruled out
    rng = np.random.default_rng(1)
    for n, p10, p01 in ((50, 0.03, 0.0), (200, 0.05, 0.02), (100, 0.01, 0.01)):
        b = rng.binomial(n, p10, 20000)
        c = rng.binomial(n - b, p01 / (1 - p10))
        lo, hi = accuracy.tango_bounds(b, c, n, 0.025)
        assert np.mean(lo > p01 - p10) <= 0.035 and np.mean(hi < p01 - p10) <= 0.035


def test_the_shipped_rules_keep_their_false_acceptance_and_false_holds():
    # the timing level's spending over every look, and false acceptance at x1.00 and at x1.03 (10% lognormal noise,
    # x2 stalls in 5% of rounds, 20% of the measurements flagged for load and biased: independent, AR(1) and offset
    # noise are tests/test_optimize_timing_calibration.py's); false holds at a true drop of max_drop
    assert violations(RULES, seeds=1000, rounds=ROUNDS, noises=(Noise(load=0.2),)) == []
    # ... and the simulation exercised what inflated the old rule's error: pairs measured again (mean > 1
    # measurement of 2 trials) and rounds added by the engine (mean rounds above the measurements' minimum)
    r = timing_rates(1.0, RULES, Noise(), 300, ROUNDS)
    assert r.trials / 2 > 2.5 and r.rounds > ROUNDS * r.trials / 2 * 1.2
    # the whole procedure includes the chain's end: a pair undecided after the walk's measurements (here: every
    # one flagged for load) is measured optimize.retries more times, and the per-look level counts those too
    always_loaded = timing_rates(1.0, RULES, Noise(load=1.0), 50, ROUNDS)
    assert RULES.retries == 1 and always_loaded.trials == 2 * RULES.looks == 2 * (RULES.attempts + 1)
    assert always_loaded.undecided == 1.0


def test_power_the_docs_state():
    # (the timing rule's power: tests/test_optimize_timing_calibration.py)
    # the gate holds a candidate that loses nothing once the items can show it (200 items)
    assert gate_rates(0.0, RULES, 0.0, 200).holds >= 0.95


def test_mutation_accept_on_the_point_estimate_is_caught(monkeypatch):
    # the bound at level 0.5 is the point estimate itself: "faster" on the median, as the old rule did for min_effect
    monkeypatch.setattr(decide.Rules, "timing_alpha", property(lambda self: 0.5))
    found = violations(RULES, seeds=300, rounds=ROUNDS, checks=(TIMING,), noises=(Noise(),))
    assert any("false acceptance at x1.00" in v for v in found), found


def test_mutation_one_level_for_every_look_is_caught(monkeypatch):
    # each look at the full false_accept (no spending over the looks): optional stopping shows at the boundary
    monkeypatch.setattr(decide.Rules, "timing_alpha", property(lambda self: 2 * self.false_accept))
    found = violations(RULES, seeds=1200, rounds=ROUNDS, checks=(TIMING,), noises=(Noise(),))
    assert any("false acceptance at x1.03" in v for v in found), found


def test_mutation_gate_holds_at_zero_width_is_caught(monkeypatch):
    # the old gate: an interval of the observed differences only ([0, 0] when no item differs)
    def wald(b, c, n, alpha):
        b, c, n = (np.asarray(v, dtype=float) for v in (b, c, n))
        d = (c - b) / n
        se = np.sqrt(np.maximum((b + c) / n - d ** 2, 0) / n)
        return d - 2.13 * se, d + 2.13 * se

    monkeypatch.setattr(accuracy, "tango_bounds", wald)
    found = violations(dataclasses.replace(RULES), seeds=300, checks=(GATE,))
    assert any("false holds" in v for v in found), found
