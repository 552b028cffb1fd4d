"""Bad input to `infersweep probe` and to the dtype `auto` (issue 18, point 9): a clean exit 2 whose message
names the option or environment variable, before anything is probed, cached or launched; and the note a
slow number format gets."""
from __future__ import annotations

import json

import pytest
import torch

from experiments.cli import main

BF16_ENV = "INFERSWEEP_CPU_BF16"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache root: a probe that ran would leave hardware/<host>.json in it."""
    monkeypatch.setenv("INFERSWEEP_CACHE", str(tmp_path))
    monkeypatch.delenv(BF16_ENV, raising=False)
    return tmp_path


def _nothing_probed(cache) -> bool:
    return not (cache / "hardware").exists()


def test_probe_on_a_cuda_device_this_machine_lacks(cache, capsys):
    if torch.cuda.is_available():  # a GPU machine: ask for one past the last
        n = torch.cuda.device_count()
        assert main(["probe", "--device", f"cuda:{n}"]) == 2
        assert f"--device cuda:{n}: this machine has {n} CUDA device(s)" in capsys.readouterr().err
    else:
        assert main(["probe", "--device", "cuda"]) == 2
        err = capsys.readouterr().err
        assert "invalid probe:" in err and "--device cuda: no CUDA GPU is visible here" in err and "--device cpu" in err
    assert _nothing_probed(cache)


@pytest.mark.parametrize("spec,words", [("banana", "not a device; use cpu or cuda"),
                                        ("meta", "the probe measures cpu or cuda devices only")])
def test_probe_device_that_is_not_one(cache, capsys, spec, words):
    assert main(["probe", "--device", spec]) == 2
    err = capsys.readouterr().err
    assert f"--device {spec!r}: {words}" in err and "Traceback" not in err
    assert _nothing_probed(cache)


@pytest.mark.parametrize("value", ["-1", "0", "two"])
def test_probe_threads_must_be_a_positive_whole_number(cache, capsys, value):
    with pytest.raises(SystemExit) as ei:
        main(["probe", "--threads", value])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert "argument --threads: expected a whole number >= 1" in err and value.lstrip("-") in err
    assert _nothing_probed(cache)


def test_probe_with_a_bad_bf16_override_names_the_variable(cache, capsys, monkeypatch):
    monkeypatch.setenv(BF16_ENV, "banana")
    assert main(["probe", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert f"environment variable {BF16_ENV}='banana': expected 1/true/yes/on or 0/false/no/off" in err
    assert "Traceback" not in err
    assert _nothing_probed(cache)


def test_probe_notes_a_dtype_without_arithmetic_units(cache, capsys, monkeypatch):
    """A cached probe (nothing measured) in bf16 on a CPU the override declares bf16-less: the note says so."""
    from engine.measure.hardware import DtypeRates, NodeProbe, cache_path, device_name, probe_key

    device = torch.device("cpu")
    rates = {d: DtypeRates(gemm_flops=f, gemv_bw=5e9) for d, f in (("float32", 80e9), ("bfloat16", 0.3e9),
                                                                   ("float16", 0.2e9))}
    path = cache_path()
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({probe_key(device_name(device), device, 2): NodeProbe("x", 18e9, rates).to_json()}))
    monkeypatch.setenv(BF16_ENV, "0")
    assert main(["probe", "--device", "cpu", "--threads", "2", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "[cache]" in out and "preferred dtype here: float32" in out
    assert out.rstrip().endswith("note: bfloat16 on this CPU has no bf16 units (avx512_bf16/amx_bf16): "
                                 "expect ~8-10x slower than float32")
    assert main(["probe", "--device", "cpu", "--threads", "2", "--dtype", "float32"]) == 0
    assert "note:" not in capsys.readouterr().out


# --- model.dtype=auto resolution with a bad override --------------------------------------------------
# `auto` is resolved by experiments/config/compose.py resolve_auto_dtype (it calls
# engine.measure.hardware.preferred_cpu_dtype, which raises EngineError naming the variable); the sweep turns
# it into a clean SweepError only once resolve_auto_dtype's caller in `expand` catches EngineError.
@pytest.mark.parametrize("overrides", [["model=tiny-llama", "model.dtype=auto"], []], ids=["tiny-auto", "default-model"])
def test_dtype_auto_with_a_bad_bf16_override_is_a_sweep_error(monkeypatch, overrides):
    from experiments.config.compose import SweepError, expand

    monkeypatch.setenv(BF16_ENV, "banana")
    with pytest.raises(SweepError) as ei:
        expand(overrides, gpu_available=False)
    assert any(f"{BF16_ENV}='banana'" in p for p in ei.value.problems), ei.value.problems


def test_sweep_cli_with_a_bad_bf16_override_exits_2_and_logs_nothing(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(BF16_ENV, "banana")
    store = tmp_path / "mlflow"
    rc = main(["sweep", "--in-process", "model=tiny-llama", "model.dtype=auto",
               f"tracking.uri=sqlite:///{store}/mlflow.db", f"tracking.artifact_root={store}/artifacts"])
    assert rc == 2
    err = capsys.readouterr().err
    assert f"{BF16_ENV}='banana'" in err and "Traceback" not in err
    assert not store.exists()  # nothing recorded


def test_a_slow_dtype_is_noted_under_the_results_table():
    """model.dtype=bfloat16 on a CPU without bf16 units runs, and the sweep table says why it is slow."""
    from engine import ModelConfig, TrialConfig, WorkloadConfig, run_engine_trial
    from engine.config import EvalConfig
    from engine.measure.hardware import slow_dtype_note
    from experiments.analysis.summary import table
    from experiments.run.trial import TrialOutcome

    trial = TrialConfig(model=ModelConfig(name="tiny", path="tiny://llama", dtype="bfloat16"),
                        workload=WorkloadConfig(context_len=8, max_new_tokens=2, repeats=1, warmup=0),
                        eval=EvalConfig(enabled=False))
    result = run_engine_trial(trial)
    expected = slow_dtype_note("bfloat16", "cpu")
    assert result.info.get("dtype_note") == expected  # None on a CPU with bf16 units: then no note
    outcome = TrialOutcome(config_hash="abc", index=0, status="FINISHED", metrics=result.metrics, info=result.info)
    text = table([{"hash": "abc123", "swept": {"model.dtype": "bfloat16"}, "metrics": result.metrics,
                   "status": "FINISHED", "outcome": outcome}])
    assert (f"note (abc123): {expected}" in text) == bool(expected)
    assert "note (" not in table([{"hash": "f", "swept": {}, "metrics": {}, "status": "FINISHED", "outcome": None}])
