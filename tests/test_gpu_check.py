"""benchmarks/gpu_check.py: its --dry-run runs every section's code path on CPU with tiny shapes and writes
a JSON report with numbers in every section (the CUDA run itself needs a lent GPU). The full dry run goes
through the command line as a user types it; the option checks call its main() in this process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("kv_cache", "attention", "speculative", "batching", "paged_kv", "int8")


def run_check(out: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": str(out), "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def gpu_check():
    """The script as a module, to call its main() in this process (its imports are then paid once)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up while being defined
    spec.loader.exec_module(mod)
    return mod


def numbers(d: dict) -> list[float]:
    return [v for v in d.values() if isinstance(v, (int, float)) and not isinstance(v, bool)]


def test_dry_run_measures_every_section(tmp_path):
    p = run_check(tmp_path, "--dry-run")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["meta"]["dry_run"] is True and report["meta"]["device"] == "cpu"
    assert list(report["sections"]) == list(SECTIONS)
    for name, sec in report["sections"].items():
        assert sec["status"] == "ok", (name, sec.get("reason"))
        assert sec["rows"] and all(numbers(r) for r in sec["rows"]), name
        assert numbers(sec["summary"]) or any(isinstance(v, dict) for v in sec["summary"].values()), name
    s = {n: report["sections"][n]["summary"] for n in SECTIONS}
    assert s["kv_cache"]["decode_speedup_kv_on_vs_off"] > 0
    assert s["batching"]["continuous_over_static_throughput"] > 0
    # What the ratios must be by construction (timings themselves are noise on a shared CPU; never bound them).
    # kv_cache: the speedup is on/off decode rate, and each rate is 1 / time per output token (batch 1)
    sizes, shape = report["meta"]["sizes"], report["meta"]["shape"]
    on, off = report["sections"]["kv_cache"]["rows"]
    assert (on["kv_cache"], off["kv_cache"]) == ("contiguous", "off")
    assert s["kv_cache"]["decode_speedup_kv_on_vs_off"] == pytest.approx(on["decode_tok_s"] / off["decode_tok_s"], rel=1e-9)
    assert s["kv_cache"]["decode_speedup_kv_on_vs_off"] == pytest.approx(off["tpot_ms"] / on["tpot_ms"], rel=1e-9)
    for r in (on, off):
        assert r["decode_tok_s"] * r["tpot_ms"] == pytest.approx(1e3, rel=1e-9)
    # the cache holds K and V of every layer for context + new tokens; without one there is nothing
    elsize = {"float32": 4, "bfloat16": 2, "float16": 2}[report["meta"]["dtype"]]
    head_dim = shape["hidden"] // shape["heads"]
    assert on["kv_cache_bytes"] == 2 * shape["layers"] * shape["kv_heads"] * head_dim * elsize * \
        (sizes["kv_context"] + sizes["kv_on_tokens"]) and off["kv_cache_bytes"] == 0
    # batching: one seeded workload, so both modes generate the same tokens; the throughput ratio is then
    # the inverse ratio of the run durations, and continuous batching keeps at least as many sequences per
    # step as static batching (it refills freed slots; arrivals are all at once, so the schedule is fixed)
    static, cont = report["sections"]["batching"]["rows"]
    assert (static["batching"], cont["batching"]) == ("static", "continuous")
    total = static["output_tok_s"] * static["duration_s"]
    assert total == pytest.approx(round(total), rel=1e-9) and round(total) >= sizes["serve_requests"]
    assert cont["output_tok_s"] * cont["duration_s"] == pytest.approx(total, rel=1e-9)
    assert s["batching"]["continuous_over_static_throughput"] == pytest.approx(static["duration_s"] / cont["duration_s"], rel=1e-9)
    assert 1 <= static["mean_batch_size"] <= cont["mean_batch_size"] <= sizes["serve_batch"]
    assert s["int8"]["linears_swapped"] > 0 and s["int8"]["weights_ratio"] < 1  # int8 weights are smaller
    attn = report["sections"]["attention"]["rows"]
    assert {(r["attention"], r["context"]) for r in attn} == {(a, n) for a in ("sdpa", "eager") for n in (32, 64)}
    # eager materializes the T x S scores: its transient attention memory grows faster than sdpa's
    by = {(r["attention"], r["context"]): r["attn_peak_bytes"] for r in attn}
    assert by["eager", 64] / by["eager", 32] > by["sdpa", 64] / by["sdpa", 32]
    md = (tmp_path / "gpu_check.md").read_text()
    assert all(f"## {n} (ok" in md for n in SECTIONS)


def test_spent_budget_skips_sections_with_the_reason(gpu_check, tmp_path):
    rc = gpu_check.main(["--dry-run", "--budget-s", "0.01", "--sections", "kv_cache,int8", "--out", str(tmp_path)])
    assert rc == 0
    secs = json.loads((tmp_path / "gpu_check.json").read_text())["sections"]
    assert list(secs) == ["kv_cache", "int8"]
    assert all(s["status"] == "skipped" and "budget" in s["reason"] for s in secs.values())


def test_unknown_section_is_refused(gpu_check, tmp_path, capsys):
    rc = gpu_check.main(["--dry-run", "--sections", "kv_cache,warp_drive", "--out", str(tmp_path)])
    assert rc == 2 and "warp_drive" in capsys.readouterr().err
