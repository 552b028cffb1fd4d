"""`reproduce` compares like with like: a trial measured in an interleaved group is re-run with its partners,
interleaved, and judged on the paired ratio it was decided by; peak memory only between measurements of one
kind; the output says which was done. Real tiny model, real MLflow (an own store per module: the test deletes a
run), in-process trials."""
from __future__ import annotations

import random

import pytest
from mlflow.tracking import MlflowClient

from conftest import TINY
from engine.measure.noise import UNSTABLE
from experiments.run.reproduce import (CONSISTENT, DIFFERS_BEYOND_NOISE, INTERLEAVED, LOAD_CANNOT_JUDGE, NOT_JUDGED,
                                       PAIRED, SOLO, TIMING, format_comparison, paired, paired_verdict, reproduce)
from experiments.run.sweep import run_sweep


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    d = tmp_path_factory.mktemp("reproduce")
    tracking = {"uri": f"sqlite:///{d}/mlflow.db", "artifact_root": f"{d}/artifacts", "spool_dir": f"{d}/spool"}
    over = TINY + [f"tracking.{k}={v}" for k, v in tracking.items()]
    return tracking, over, MlflowClient(tracking["uri"])


@pytest.fixture(scope="module")
def interleaved(store):
    tracking, over, _ = store
    res = run_sweep(over + ["sweep_name=t-repro-pair", "seed=5151", "kv_cache=off,contiguous", "cluster.interleave=3"],
                    in_process=True, echo=lambda *_: None)
    assert [r["status"] for r in res.rows] == ["FINISHED"] * 2
    return res


def test_an_interleaved_trial_is_reproduced_with_its_partner_and_judged_on_the_paired_ratio(store, interleaved):
    tracking, _, client = store
    orig_id, partner_id = interleaved.rows[1]["run_id"], interleaved.rows[0]["run_id"]
    cmp = reproduce(interleaved.rows[1]["hash"], tracking)
    out = format_comparison(cmp)
    assert cmp.original_run_id == orig_id and cmp.deterministic_match
    assert cmp.arrangement.startswith(f"{INTERLEAVED}, as the original") and partner_id[:8] in cmp.arrangement
    assert "arrangement: interleaved, as the original" in out and "paired ratios" in out
    # the partner ran again, interleaved with it: both new runs nested under (and tagged with) their originals
    (new_partner,) = cmp.partner_run_ids
    for new, old in ((cmp.new_run_id, orig_id), (new_partner, partner_id)):
        run = client.get_run(new)
        assert run.data.tags["reproduces"] == old and run.data.tags["mlflow.parentRunId"] == old
        assert run.data.tags["reproduce.arrangement"] == INTERLEAVED
        assert run.info.run_name == "reproduce: " + client.get_run(old).info.run_name
        assert "group_peak_mem_bytes" in run.data.metrics and run.data.tags["env.interleave_size"] == "2"
    assert client.get_run(cmp.new_run_id).data.tags["env.interleave_group"] == \
        client.get_run(orig_id).data.tags["env.interleave_group"]
    rows = {m: (a, b, v) for m, a, b, v in cmp.rows}
    paired_rows = [v for m, (_, _, v) in rows.items() if " paired vs " in m]
    assert "output_tok_s paired vs " + client.get_run(partner_id).info.run_name in rows
    assert paired_rows and all(v.startswith(PAIRED) for v in paired_rows)
    assert rows["output_tok_s paired vs " + client.get_run(partner_id).info.run_name][0].startswith("x")
    # peak memory judged between two measurements of one kind (each variant's own footprint), not refused
    assert not rows["peak_mem_bytes"][2].startswith("not compared")
    assert "token ids of partner " + client.get_run(partner_id).info.run_name in rows


def test_a_group_flagged_for_load_has_its_timings_shown_not_judged(store, interleaved):
    """A run flagged `unstable: load` never decides a comparison (docs/metrics.md): reproduce shows its timings
    and paired ratios as "load: cannot judge" instead of "consistent" / "differs beyond noise"; memory and
    the deterministic results are still judged. (The flag as the pipeline writes it: a group shares one
    monitor, so every member of a loaded group carries it.)"""
    tracking, _, client = store
    flag = "load: other processes used 40.3% of the CPUs (> 25.0%)"
    ids = [r["run_id"] for r in interleaved.rows]
    for rid in ids:
        client.set_tag(rid, UNSTABLE, flag)
    try:
        cmp = reproduce(interleaved.rows[1]["hash"], tracking)
    finally:  # the module's other tests read this group unflagged
        for rid in ids:
            client.delete_tag(rid, UNSTABLE)
    rows = {m: v for m, _, _, v in cmp.rows}
    timings = [m for m in rows if m in TIMING and m != "peak_mem_bytes"]
    assert timings and all(rows[m].endswith(LOAD_CANNOT_JUDGE) for m in timings), rows
    paired_rows = [v for m, v in rows.items() if " paired vs " in m]
    assert paired_rows and all(v == f"{PAIRED} {LOAD_CANNOT_JUDGE}" for v in paired_rows)
    assert not rows["peak_mem_bytes"].endswith(LOAD_CANNOT_JUDGE) and cmp.deterministic_match
    out = format_comparison(cmp)
    assert f"flagged for load, so its timings decide no comparison: the original: {flag}" in out
    assert CONSISTENT not in out.split("timings (reproduced/original")[1].split("\n")[0]


def test_a_solo_trial_is_reproduced_alone(store):
    tracking, over, client = store
    res = run_sweep(over + ["sweep_name=t-repro-solo", "seed=5152"], in_process=True, echo=lambda *_: None)
    cmp = reproduce(res.rows[0]["hash"], tracking)
    assert cmp.arrangement == f"{SOLO}, as the original" and not cmp.partner_run_ids
    rows = {m: v for m, _, _, v in cmp.rows}
    assert not any(" paired vs " in m for m in rows)
    assert rows["peak_mem_bytes"].startswith("x") and NOT_JUDGED not in rows["peak_mem_bytes"]
    # judged, unless a run was flagged for load (a busy machine): then shown, not judged, and the flag named
    assert rows["output_tok_s"].endswith((LOAD_CANNOT_JUDGE,) if cmp.loaded else (CONSISTENT, DIFFERS_BEYOND_NOISE))
    assert client.get_run(cmp.new_run_id).data.tags["mlflow.parentRunId"] == res.rows[0]["run_id"]


def test_without_its_partners_an_interleaved_trial_runs_alone_and_its_timings_are_not_judged(store):
    tracking, over, client = store
    res = run_sweep(over + ["sweep_name=t-repro-gone", "seed=5153", "kv_cache=off,contiguous", "cluster.interleave=2"],
                    in_process=True, echo=lambda *_: None)
    client.delete_run(res.rows[0]["run_id"])  # the partner is gone
    cmp = reproduce(res.rows[1]["hash"], tracking)
    assert cmp.arrangement.startswith(f"{SOLO}, NOT as the original") and "0 of its 1 partner" in cmp.arrangement
    assert cmp.deterministic_match
    rows = {m: v for m, _, _, v in cmp.rows}
    assert rows["peak_mem_bytes"].startswith("not compared: the original's is a variant's own footprint")
    assert rows["output_tok_s"].endswith(NOT_JUDGED)
    assert "arrangement: solo, NOT as the original" in format_comparison(cmp)


def _pair(rng: random.Random, ratio: float, rounds: int, noise: float) -> tuple[list[float], list[float]]:
    """Per-round throughputs of a base and a variant `ratio` times faster; each round shares a drift."""
    base, new = [], []
    for _ in range(rounds):
        drift = rng.uniform(0.7, 1.3)  # the machine's load in that round, alike for both
        base.append(100 * drift * rng.gauss(1, noise))
        new.append(100 * ratio * drift * rng.gauss(1, noise))
    return base, new


def test_paired_verdict_simulated_consistent_for_the_same_ratio_differs_for_another():
    """The rule, simulated: a pair re-measured with the same true ratio (under another round-by-round drift) is
    judged consistent with the recorded one nearly always; one whose ratio moved by 30% differs nearly always."""
    rng = random.Random(7)
    same = differ = 0
    n = 200
    for _ in range(n):
        rec = paired(*_pair(rng, 1.4, 6, 0.03), "output_tok_s")
        same += paired_verdict(rec, paired(*_pair(rng, 1.4, 6, 0.03), "output_tok_s")) == CONSISTENT
        differ += paired_verdict(rec, paired(*_pair(rng, 1.0, 6, 0.03), "output_tok_s")) == DIFFERS_BEYOND_NOISE
    assert same / n >= 0.95 and differ / n >= 0.95, (same, differ)
