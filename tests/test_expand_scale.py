"""Sweep expansion at scale: a value axis costs one Hydra compose, and gives exactly the configs (and the
error messages) that one full compose per trial gives."""
from __future__ import annotations

import pytest

from experiments.config import compose as compose_module
from experiments.config.compose import Composer, SweepError, expand


def test_fast_expansion_equals_full_compose_per_trial():
    over = ["experiment=smoke", "seed=0,1", "workload.context_len=16,32", "model.tiny.seed=1,2"]
    specs = expand(over)
    assert len(specs) == 2 * 2 * 2 * 2 * 2  # smoke's kv_cache x attention axes too
    with Composer() as c:
        for s in specs:
            full, _ = c.compose(["experiment=smoke"] + [f"{k}={v}" for k, v in s.swept.items()])
            assert full == s.config, s.swept


def test_bad_value_in_a_long_axis_reads_as_before():
    with pytest.raises(SweepError) as e:
        expand(["model=tiny-llama", "workload.context_len=16,abc,32"])
    assert "workload.context_len=abc: Value 'abc' of type 'str' could not be converted to Integer" in str(e.value)


def test_thousand_trial_value_axis_costs_a_few_hydra_composes_not_one_per_trial(monkeypatch):
    """A value axis is applied to one cached composition (one full compose ~0.15-0.3 s; 1,000 of them were
    minutes): count the full composes rather than time them."""
    calls = []
    real = Composer.compose_raw

    def counted(self, overrides):
        calls.append(list(overrides))
        return real(self, overrides)

    monkeypatch.setattr(Composer, "compose_raw", counted)
    monkeypatch.setattr(compose_module, "_COMPOSITIONS", {})  # count from cold: nothing composed earlier helps
    specs = expand(["model=tiny-llama", "seed=range(0,1000)", "eval.enabled=false"])
    assert len(specs) == 1000 and len({s.config_hash for s in specs}) == 1000
    assert len(calls) <= 5, calls
