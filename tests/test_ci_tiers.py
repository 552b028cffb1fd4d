"""CI's two test tiers share the work (.ci/run, tests/conftest.py): the newcomer tier logs the tests it skipped,
the full tier runs the marked slower tiers and those skips only. Run for real: pytest in a subprocess on a small
suite that carries this project's conftest."""
from __future__ import annotations

from pathlib import Path

pytest_plugins = ["pytester"]

CONFTEST = (Path(__file__).parent / "conftest.py").read_text()
SUITE = '''
import os
import pytest

def test_fast_passes():
    assert 1 + 1 == 2

def test_fast_needs_an_engine():
    if not os.environ.get("ENGINE_HERE"):
        pytest.skip("the engine is not installed")
    assert os.environ["ENGINE_HERE"] == "1"

@pytest.mark.slow
def test_slow_one():
    assert sum(range(4)) == 6

@pytest.mark.vllm
def test_vllm_one():
    assert "vllm".upper() == "VLLM"
'''
INI = '[pytest]\nmarkers =\n    slow: s\n    vllm: v\naddopts = -m "not slow and not vllm" -p no:cacheprovider\n'


def _suite(pytester):
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_suite=SUITE)
    pytester.makeini(INI)


def test_the_full_tier_runs_the_slower_tiers_and_the_newcomer_tiers_skips_only(pytester, monkeypatch):
    _suite(pytester)
    log = pytester.path / "skipped.txt"
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("ENGINE_HERE", raising=False)
    monkeypatch.setenv("INFERSWEEP_SKIPPED_LOG", str(log))
    newcomer = pytester.runpytest_subprocess("-q")
    newcomer.assert_outcomes(passed=1, skipped=1, deselected=2)
    assert log.read_text().split() == ["test_suite.py::test_fast_needs_an_engine"]

    monkeypatch.delenv("INFERSWEEP_SKIPPED_LOG")
    monkeypatch.setenv("INFERSWEEP_REST_OF", str(log))
    monkeypatch.setenv("ENGINE_HERE", "1")
    full = pytester.runpytest_subprocess("-m", "slow or not slow", "-v")
    full.assert_outcomes(passed=3, deselected=1)  # the fast test that passed before is not run again
    ran = {ln.split(" ")[0] for ln in full.outlines if " PASSED" in ln}
    assert ran == {"test_suite.py::test_fast_needs_an_engine", "test_suite.py::test_slow_one",
                   "test_suite.py::test_vllm_one"}


def test_without_the_variables_every_selected_test_runs(pytester, monkeypatch):
    _suite(pytester)
    for var in ("INFERSWEEP_SKIPPED_LOG", "INFERSWEEP_REST_OF", "CI"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("ENGINE_HERE", "1")
    pytester.runpytest_subprocess("-q", "-m", "slow or not slow").assert_outcomes(passed=4)
