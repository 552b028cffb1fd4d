"""`cluster.interleave=N`: the variants of each workload measured round-robin on one worker (ABBA rounds), each
recorded as its own trial, with per-round values the report pairs into ratios (engine.run_interleaved,
experiments/run/sweep.py, experiments/analysis/results.compare)."""
from __future__ import annotations

import pytest

from experiments.analysis.report import build
from experiments.cli import main
from experiments.run.sweep import interleave_groups, run_sweep


@pytest.fixture(scope="module")
def interleaved(ray_local, tiny_overrides):
    return run_sweep(tiny_overrides + ["sweep_name=t-interleave", "kv_cache=off,contiguous", "attention=eager,sdpa",
                                       "workload.context_len=16,24", "cluster.interleave=3",
                                       "timing.max_repeats=0"],  # pinned: exactly 3 rounds
                     echo=lambda *_: None)


def test_each_workload_is_one_group_measured_round_robin(interleaved, mlflow_client):
    assert not interleaved.failed and len(interleaved.rows) == 8
    groups: dict[str, set[str]] = {}
    group_peaks: dict[str, set[float]] = {}
    for row in interleaved.rows:
        run = mlflow_client.get_run(row["run_id"])
        tags, m = run.data.tags, run.data.metrics
        assert tags["env.interleave_rounds"] == "3" and tags["env.repeats_stop"] == "interleaved: 3 round(s)"
        assert m["timed_repeats"] == 3 and m["output_tok_s_n"] == 3
        rounds = [h.value for h in sorted(mlflow_client.get_metric_history(row["run_id"], "repeat.output_tok_s"),
                                          key=lambda h: h.step)]
        assert len(rounds) == 3 and sorted(rounds)[1] == pytest.approx(m["output_tok_s"])  # the median of its rounds
        groups.setdefault(tags["env.interleave_group"], set()).add(run.data.params["workload.context_len"])
        # memory: the variant's own footprint, below the peak of the process the group shared
        assert m["weights_bytes"] <= m["peak_mem_bytes"] < m["group_peak_mem_bytes"]
        group_peaks.setdefault(tags["env.interleave_group"], set()).add(m["group_peak_mem_bytes"])
    # two workloads (context 16 and 24), four variants each: one group per workload
    assert sorted(len(g) for g in groups.values()) == [1, 1] and len(groups) == 2
    assert all(len(p) == 1 for p in group_peaks.values())  # one process peak per group, logged by each variant


def test_report_pairs_the_rounds_of_interleaved_variants(interleaved, tracking, tmp_path):
    from engine.measure.spread import paired_ratio

    rep = build("t-interleave", tracking, out_dir=tmp_path, log_artifacts=False, progress=False)
    checked = 0
    for ln in rep.lines:
        if ln.is_baseline:
            continue
        cmp = ln.comparisons["speedup"]
        want = paired_ratio(ln.baseline.repeats["output_tok_s"], ln.row.repeats["output_tok_s"])
        assert cmp == want and cmp.verdict in ("faster", "slower", "within noise")
        checked += 1
    assert checked == 6


def test_groups_hold_the_variants_of_one_workload():
    from experiments.config.compose import expand

    from conftest import TINY

    specs = expand(TINY + ["kv_cache=off,contiguous", "workload.context_len=16,24", "seed=1,2"])
    groups = interleave_groups(specs)
    assert len(groups) == 4 and all(len(g) == 2 for g in groups)
    for g in groups:
        assert len({(s.config["workload"]["context_len"], s.config["seed"]) for s in g}) == 1
        assert {s.config["kv_cache"]["mode"] for s in g} == {"off", "contiguous"}


@pytest.mark.parametrize("rounds", ["1", "-2"])
def test_interleave_needs_two_rounds(tiny_overrides, rounds, capsys):
    assert main(["sweep", *tiny_overrides, "sweep_name=t-interleave-bad", f"cluster.interleave={rounds}"]) == 2
    assert "cluster.interleave: rounds must be 0 (off) or >= 2" in capsys.readouterr().err


def test_a_capacity_search_cannot_be_interleaved_and_is_refused_before_launch(tiny_overrides, capsys):
    args = ["sweep", *tiny_overrides, "sweep_name=t-interleave-capacity", "workload=serving-mixed", "engine=native",
            "kv_cache=paged", "capacity.search=true", "cluster.interleave=2", "batching=static,continuous"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "cluster.interleave: a capacity search runs its own probes" in err
