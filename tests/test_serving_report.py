"""The report's serving view (Pareto of tok/s per user vs total tok/s, goodput vs rate) and the re-prompting
claim, on constructed trial rows with known answers."""
from __future__ import annotations

from dataclasses import dataclass

from experiments.analysis import serving as sv
from experiments.analysis.claims import ABSENT, NO, PARTLY, YES, evaluate
from experiments.analysis.results import TrialRow


def _row(i: int, *, kind="serving", batching="continuous", prefix=False, metrics=None, rate="2.0") -> TrialRow:
    params = {"workload.kind": kind, "workload.name": f"serving-{kind}", "batching.mode": batching,
              "kv_cache.prefix_caching": str(prefix), "kv_cache.mode": "paged", "engine.backend": "native",
              "workload.arrival": "poisson", "workload.rate": rate, "workload.turns": "4", "model.name": "m"}
    m = {"output_tok_s": 10.0, "tpot_ms_p50": 100.0, "goodput": 1.0, **(metrics or {})}
    return TrialRow(run_id=f"r{i}", name=f"t{i}", status="FINISHED", params=params, metrics=m,
                    tags={"config_hash": f"{i:064x}", "env.device": "cpu"})


@dataclass
class _Line:  # what the report's Line offers the serving view
    row: TrialRow
    workload: str
    optimizations: str


def test_frontier_keeps_exactly_the_undominated_points():
    xy = [(10, 5), (20, 4), (15, 6), (5, 5), (20, 3), (15, 6)]
    # (10,5) < (15,6); (5,5) < (10,5); (20,3) < (20,4); the two (15,6) tie and neither dominates the other
    assert sv.frontier(xy) == [1, 2, 5]
    assert sv.frontier([(1, 1)]) == [0] and sv.frontier([]) == []


def test_serving_points_table_and_plot_name_every_configuration(tmp_path):
    rows = [_row(1, batching="static", metrics={"output_tok_s": 20.0, "tpot_ms_p50": 250.0}),  # 4 tok/s per user
            _row(2, metrics={"output_tok_s": 30.0, "tpot_ms_p50": 200.0}),  # dominates 1: 30 total, 5 per user
            _row(3, prefix=True, metrics={"output_tok_s": 25.0, "tpot_ms_p50": 50.0, "max_rate_at_slo": 1.5,
                                          "goodput_at_slo": 1.4}),  # 20 per user: on the frontier
            _row(4, metrics={"ppl": 3.0})]  # ... and a static trial without serving metrics: not a point
    rows[3].metrics.pop("goodput")
    lines = [_Line(r, "serving-mixed", f"cfg{r.run_id}") for r in rows]
    pts = sv.points(lines)
    assert [p.name for p in pts] == ["cfgr1", "cfgr2", "cfgr3"]
    assert [p.user_tok_s for p in pts] == [4.0, 5.0, 20.0]
    assert pts[2].searched and pts[2].rate == 1.5 and pts[2].goodput == 1.4  # a search: at its found rate
    assert not pts[0].searched and pts[0].rate == 2.0 and pts[0].goodput == 1.0
    md = sv.to_markdown(pts).splitlines()
    assert md[2].startswith("| serving-mixed | cfgr2 | (2 offered) | 1 | 30.0 | 5.0 | * |")  # by total tok/s
    assert md[3].startswith("| serving-mixed | cfgr3 | 1.5 | 1.4 | 25.0 | 20.0 | * |")
    assert md[4].endswith("| 20.0 | 4.0 |  |")  # dominated: not starred
    assert sv.plot(pts, tmp_path / "p.png") == tmp_path / "p.png" and (tmp_path / "p.png").stat().st_size > 0
    # a search that found no rate is shown with its one-at-a-time numbers, but never ranked on the frontier
    none = _row(5, metrics={"output_tok_s": 99.0, "tpot_ms_p50": 10.0, "max_rate_at_slo": 0.0, "goodput_at_slo": 0.0})
    pts = sv.points(lines + [_Line(none, "serving-mixed", "cfgr5")])
    assert not pts[-1].within_slo and all(p.within_slo for p in pts[:-1])
    md = sv.to_markdown(pts).splitlines()
    assert md[2] == "| serving-mixed | cfgr5 | none (one at a time shown) | 0 | 99.0 | 100.0 |  |"
    assert md[3].endswith("| 5.0 | * |")  # cfgr2 still on the frontier
    assert sv.plot(pts, tmp_path / "p2.png") is not None
    assert sv.plot([], tmp_path / "none.png") is None
    # a trial measured under machine load is shown but never ranked: it cannot push another off the frontier
    busy = _row(6, metrics={"output_tok_s": 40.0, "tpot_ms_p50": 40.0})  # would dominate every other point
    busy.tags["unstable"] = "load: other processes used 60.0% of the CPUs (> 25.0%)"
    pts = sv.points(lines + [_Line(busy, "serving-mixed", "cfgr6")])
    md = sv.to_markdown(pts).splitlines()
    assert pts[-1].loaded and md[2].endswith("| 40.0 | 25.0 | not ranked (unstable: load) |")
    assert md[3].endswith("| 5.0 | * |") and md[4].endswith("| 20.0 | * |")  # cfgr2 and cfgr3 still on it


def _reprompt_pair(ttft_off=900.0, ttft_on=300.0, rates=None):
    off = {"prefill_tokens_last_turn": 400.0, "ttft_ms_last_turn": ttft_off}
    on = {"prefill_tokens_last_turn": 50.0, "ttft_ms_last_turn": ttft_on}
    if rates:
        off["max_rate_at_slo"], on["max_rate_at_slo"] = rates
    return [_row(1, kind="multi-turn", prefix=False, metrics=off), _row(2, kind="multi-turn", prefix=True, metrics=on)]


def test_reprompting_claim_is_judged_from_prefill_tokens_and_ttft():
    row = {c.name: c for c in evaluate(_reprompt_pair())}["reprompting"]
    assert row.holds == YES
    assert row.measured == ("last of 4 turns (continuous batching): re-prompting computes 400 prompt tokens vs 50 "
                            "with cached state (x8.0); TTFT 900 vs 300 ms (x3.00)")
    same_ttft = {c.name: c for c in evaluate(_reprompt_pair(ttft_on=900.0))}["reprompting"]
    assert same_ttft.holds == PARTLY  # fewer tokens computed, but no faster here
    searched = {c.name: c for c in evaluate(_reprompt_pair(ttft_on=900.0, rates=(0.5, 1.0)))}["reprompting"]
    assert searched.holds == YES and "max rate at SLO 0.5 vs 1 conversations/s" in searched.measured
    rows = _reprompt_pair()
    rows[1].metrics["prefill_tokens_last_turn"] = 400.0
    rows[1].metrics["ttft_ms_last_turn"] = 900.0
    assert {c.name: c for c in evaluate(rows)}["reprompting"].holds == NO
    no_multi_turn = [_row(1), _row(2, prefix=True)]
    assert {c.name: c for c in evaluate(no_multi_turn)}["reprompting"].holds == ABSENT
