"""The accuracy gate's fidelity pre-screen (experiments/optimize/prescreen.py): each configuration's argmax on fixed
text, compared position by position, orders a step's candidates, sizes a candidate's first look, and leaves a
hopeless one undecided before any task item -- and it never refuses a candidate the gate's own plan would take
at the cap."""
from __future__ import annotations

import math

import pytest

from experiments.optimize import accuracy
from experiments.optimize.accuracy import (FLOOR, PLAN_POWER, PairedAccuracy, Prescreen, items_needed, ladder,
                                           prescreen)
from experiments.optimize.calibration import gate_rates
from experiments.optimize.chain import Chain
from experiments.optimize.decide import UNDECIDED_PAIR
from experiments.optimize.measurement import EVAL_LIMIT
from experiments.optimize.objective import Objective
from experiments.optimize.settings import OptimizeConf, rules_of
from experiments.optimize.types import Budget
from optimize_synthetic import Synthetic, tpot_of

SHIPPED = OptimizeConf()
FIRST = 150
RULES = rules_of(SHIPPED, True, FIRST)
POSITIONS = 1008  # 16 windows of 64 tokens: 63 scored positions each


def ids(flips: int, windows: int = 16, length: int = 63, digest: str = "w") -> dict:
    """Argmax ids as TOP1_ARTIFACT holds them, the first `flips` positions changed from the reference's."""
    flat = [i % 50 for i in range(windows * length)]
    flat = [x + 1000 if i < flips else x for i, x in enumerate(flat)]
    return {"windows": digest, "top1": [flat[w * length:(w + 1) * length] for w in range(windows)]}


# --- the comparison ----------------------------------------------------------------------------------------
def test_two_trials_compare_position_by_position_on_the_same_windows_only():
    got = prescreen(ids(0), ids(37))
    assert (got.differ, got.positions) == (37, POSITIONS)
    assert prescreen(ids(0), ids(0)).differ == 0
    assert prescreen(ids(0), ids(5, digest="other text")) is None  # another text or tokenizer: no comparison
    assert prescreen(ids(0), ids(5, windows=8)) is None
    assert prescreen({}, ids(5)) is None and prescreen(ids(0), {}) is None  # a trial that logged nothing


def test_the_prediction_is_the_plans_own_model_at_the_predicted_discordance():
    """need() is what items_needed asks of a look that saw the predicted share of items differ (one rule)."""
    ps = Prescreen(60, POSITIONS)
    disc = ps.discordance
    assert disc == pytest.approx(accuracy.DISCORDANCE_PER_FLIP * 61 / (POSITIONS + 1))
    n = 100_000
    look = PairedAccuracy("t", n, round(disc * (n + 1) / 2), round(disc * (n + 1)) - round(disc * (n + 1) / 2) - 1,
                          0.0, -1, 1, 0.9, "undecided")
    alpha = RULES.gate_alpha
    assert ps.need(0.03, alpha) == pytest.approx(items_needed(look, 0.03, alpha), rel=1e-3)
    assert ps.power_at(math.ceil(ps.need(0.03, alpha)), 0.03, alpha) == pytest.approx(PLAN_POWER, abs=0.01)
    assert Prescreen(10, POSITIONS).need(0.03, alpha) < ps.need(0.03, alpha) < Prescreen(200, POSITIONS).need(0.03, alpha)


# --- in the chain --------------------------------------------------------------------------------------------
class Screened(Synthetic):
    """The synthetic objective, with each configuration's argmax on the pre-screen's windows (`flips` positions
    differing from the baseline's) for trials that ask for fidelity."""

    def __init__(self, *a, flips, **k):
        super().__init__(*a, **k)
        self.flips = flips
        self.screened: list[str] = []

    def __call__(self, requests):
        out = super().__call__(requests)
        for req, ms in zip(requests, out):
            for p, m in zip(req.points, ms):
                if p.get("eval.fidelity") == "true":
                    m.top1 = ids(self.flips.get(p.get("quant", "none"), 0))
                    m.correct = {}
                    self.screened.append(p.get("quant", "none"))
        return out


SPACE = {"quant": ["none", "int8-weight", "int4-weight", "int8-dynamic"]}
FAST = tpot_of({("quant", "int8-weight"): 0.7, ("quant", "int4-weight"): 0.6, ("quant", "int8-dynamic"): 0.5})


def run_chain(flips: dict, prescreen: int = 16, pool: int = 3000, max_items: int = 1500, space=SPACE):
    m = Screened(FAST, flips=flips, items=FIRST)
    c = Chain(space, Objective.parse("tpot"), RULES, Budget(max_trials=200, max_s=0, max_items=max_items), m,
              eval_limit=FIRST, trust_regime=False, total_pair=False, item_pool=pool, prescreen=prescreen)
    return c.run(), m


def pairs(m: Synthetic) -> list[str]:
    """The candidates of the interleaved pairs, in the order they were measured (first time each)."""
    out: list[str] = []
    for r in m.requests:
        if r.interleaved and (q := r.points[1].get("quant")) not in out:
            out.append(q)
    return out


def looks(m: Synthetic, quant: str) -> list[int]:
    """The item counts of the gate's looks at `quant` (its solo task trials)."""
    return [int(p.get(EVAL_LIMIT, FIRST)) for r in m.requests if not r.interleaved for p in r.points
            if p.get("quant") == quant and p.get("eval.fidelity") != "true" and p.get("eval.enabled") != "false"]


def test_a_steps_candidates_are_measured_most_faithful_first():
    r, m = run_chain({"int8-weight": 8, "int4-weight": 90, "int8-dynamic": 40})
    assert pairs(m) == ["int8-weight", "int8-dynamic", "int4-weight"]
    assert sorted(m.screened) == ["int4-weight", "int8-dynamic", "int8-weight", "none"]  # each once, before any item
    first_screen = next(i for i, q in enumerate(m.requests) if q.points[0].get("eval.fidelity") == "true")
    assert first_screen < next(i for i, q in enumerate(m.requests) if q.interleaved)


def test_without_the_pre_screen_the_seeds_order_holds_and_no_fidelity_trial_runs():
    r, m = run_chain({"int8-weight": 8, "int4-weight": 90, "int8-dynamic": 40}, prescreen=0)
    assert pairs(m) == ["int8-weight", "int4-weight", "int8-dynamic"]
    assert m.screened == []


def test_a_hopeless_candidate_is_left_undecided_before_any_item_or_timing():
    r, m = run_chain({"int8-weight": 4, "int4-weight": 700, "int8-dynamic": 4}, max_items=600)
    row = next(x for x in r.rows if "int4-weight" in x.candidate)
    assert row.decision == UNDECIDED_PAIR and "pre-screen" in row.reason and "not spent" in row.reason
    assert "int4-weight" not in pairs(m) and looks(m, "int4-weight") == []


def test_the_first_look_takes_the_items_the_prediction_needs_on_the_shared_ladder():
    r, m = run_chain({"int8-weight": 60}, space={"quant": ["none", "int8-weight"]})
    need = Prescreen(60, POSITIONS).need(RULES.max_drop, RULES.gate_alpha)
    got = looks(m, "int8-weight")
    assert got and got[0] > FIRST and got[0] >= need and got[0] in ladder(FIRST, 1500)
    assert got[0] < next(n for n in ladder(FIRST, 1500) if n >= need) * 1.5  # the ladder's first size past the need
    # a faithful candidate keeps the configured first look
    r, m = run_chain({"int8-weight": 1}, space={"quant": ["none", "int8-weight"]})
    assert looks(m, "int8-weight")[0] == FIRST


def test_the_stop_never_refuses_what_the_gate_decides_at_the_cap():
    """Power: the smallest share of differing positions the pre-screen stops at, at a true discordance no lower
    than the prediction (DISCORDANCE_PER_FLIP is the lowest ratio measured), is a pair the chain's own gate, over
    simulated items up to the cap, decides less than FLOOR + a Monte Carlo margin of the time. A constant twice
    too high stops candidates the gate decides most of the time."""
    cap, seeds = 600, 120

    def threshold() -> int:
        return next(k for k in range(POSITIONS) if Prescreen(k, POSITIONS).need(RULES.max_drop, RULES.gate_alpha) > cap
                    and Prescreen(k, POSITIONS).power_at(cap, RULES.max_drop, RULES.gate_alpha) < FLOOR)

    k = threshold()
    true_disc = accuracy.DISCORDANCE_PER_FLIP * (k + 1) / (POSITIONS + 1)
    g = gate_rates(0.0, RULES, true_disc, seeds=seeds, limit=FIRST, max_items=cap)
    margin = 2.33 * math.sqrt(0.25 / seeds)
    assert 1 - g.undecided <= FLOOR + margin, f"decided {1 - g.undecided:.1%} at the stop's threshold"

    mp = pytest.MonkeyPatch()
    mp.setattr(accuracy, "DISCORDANCE_PER_FLIP", 2 * accuracy.DISCORDANCE_PER_FLIP)
    try:
        k2 = threshold()
    finally:
        mp.undo()
    g2 = gate_rates(0.0, RULES, accuracy.DISCORDANCE_PER_FLIP * (k2 + 1) / (POSITIONS + 1), seeds=seeds, limit=FIRST,
                    max_items=cap)
    assert 1 - g2.undecided > FLOOR + margin, "the mutation (prediction x2) should stop decidable candidates"


def test_a_negative_pre_screen_is_refused_with_its_key():
    import dataclasses

    from experiments.optimize.settings import problems
    bad = dataclasses.replace(SHIPPED, gate=dataclasses.replace(SHIPPED.gate, prescreen=-1))
    cfg = {"eval": {"tasks": ["arc_easy", "sciq", "piqa"], "limit": 150, "order": "pooled"}}
    assert [x for x in problems(bad, SPACE, cfg) if x.startswith("optimize.gate.prescreen")] == [
        "optimize.gate.prescreen: windows of fixed text per configuration, >= 0 (0: off), got -1"]
    assert problems(SHIPPED, SPACE, cfg) == []


def test_the_pre_screen_runs_where_every_engine_is_in_process_only():
    """A served engine would start a server for every pre-screen trial: more than the look it sizes saves."""
    from types import SimpleNamespace

    from experiments.optimize.run import prescreen_of

    def space(axes, backend="hf"):
        return SimpleNamespace(axes=axes, config={"engine": {"backend": backend}})

    assert prescreen_of(space({"quant": ["none", "int8-weight"], "engine": ["hf", "native-cpp"]}), SHIPPED) == 16
    assert prescreen_of(space({"quant": ["none", "int8-weight"]}, backend="llamacpp"), SHIPPED) == 16
    assert prescreen_of(space({"quant": ["none", "gguf-q8_0"]}, backend="llamacpp-server"), SHIPPED) == 0
    assert prescreen_of(space({"engine": ["hf", "vllm-server"]}), SHIPPED) == 0


@pytest.mark.slow
def test_a_pre_screen_trial_brings_its_argmax_back_fresh_and_from_the_store(tiny_overrides, mlflow_client):
    """Through the production dispatcher: a pre-screen trial of the tiny model comes back with its argmax ids, and a
    second ask finds the same trial in the MLflow store by hash and reads the same ids from its artifact."""
    from experiments.optimize.measurement import Request, point_key
    from experiments.optimize.prescreen import Prescreener
    from experiments.optimize.run import prepare

    space, o, disp = prepare([*tiny_overrides, "sweep_name=t-prescreen", "kv_cache=off,contiguous",
                              "optimize.gate.enabled=false", "workload.max_new_tokens=2"])
    disp.in_process = True
    runs: list[Request] = []

    def run(req):
        runs.append(req)
        (ms,) = disp([req])
        return ms

    screen = Prescreener(3, run)
    a, b = {"kv_cache": "off"}, {"kv_cache": "contiguous"}
    screen.measure([a, b])
    fresh = screen.compare(a, b)
    assert fresh is not None and fresh.positions > 0 and fresh.differ == 0  # the same weights: the same argmax
    again = Prescreener(3, run)
    ((m,),) = disp([Request((again.point(a),))])
    assert m.reused and m.top1 == screen._ids[point_key(a)] and m.top1["top1"]
