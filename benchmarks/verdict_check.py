"""Are the report's verdicts stable on a quiet machine, and does a loaded run get flagged?

Runs one small sweep three times into a throwaway MLflow store -- quiet, quiet again, then with one busy
process per core that this script starts and ends itself -- and prints, per run, every comparison the
report makes against the baseline (speedup with its 95% interval and verdict: faster / slower / within
noise; "not decidable" when drawn from a trial measured under load), the trials labelled `unstable`,
and whether the two quiet runs agree on every verdict.

    .venv/bin/python benchmarks/verdict_check.py [--tiny] [--context 128] [-- extra overrides]
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time



def one_sweep(name: str, overrides: list[str], tracking: list[str], loaded: bool) -> dict:
    from cpu_load import CpuBurners
    from experiments.analysis.report import build
    from experiments.run.sweep import run_sweep

    with CpuBurners(enabled=loaded):
        res = run_sweep(overrides + tracking + [f"sweep_name={name}"], echo=lambda *_: None, force=True)
    uri = next(t.split("=", 1)[1] for t in tracking if t.startswith("tracking.uri="))
    rep = build(name, {"uri": uri}, out_dir=tempfile.mkdtemp(prefix="verdicts-"), log_artifacts=False, progress=False)
    out = {"failed": len(res.failed), "verdicts": {}, "unstable": {}}
    for ln in rep.lines:
        if ln.is_baseline:
            continue
        for key, cmp in ln.comparisons.items():
            if cmp is not None:  # a ratio drawn from a load-flagged trial decides nothing (results.loaded)
                out["verdicts"][(ln.optimizations, key)] = (cmp.cell() + " " + cmp.verdict if ln.decidable
                                                            else f"x{cmp.value:.2f} not decidable (unstable: load)")
    for ln in rep.lines:
        if ln.values.get("unstable"):
            out["unstable"][ln.optimizations] = ln.values["unstable"]
    return out


def _verdict(cell: str) -> str:
    return next((v for v in ("not decidable", "within noise", "faster", "slower") if v in cell), cell)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="the tiny random model instead of SmolLM2")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("extra", nargs="*", help="more overrides for the sweep")
    args = ap.parse_args()
    overrides = ["kv_cache=off,contiguous", "attention=eager,sdpa", f"workload.context_len={args.context}",
                 "workload.max_new_tokens=16", "eval=none", "model=" + ("tiny-llama" if args.tiny else "smollm2-135m"),
                 "model.dtype=float32", *args.extra]
    store = tempfile.mkdtemp(prefix="verdict-check-")
    tracking = [f"tracking.uri=sqlite:///{store}/mlflow.db", f"tracking.artifact_root={store}/artifacts"]
    print(f"sweep: {' '.join(overrides)}; {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f} at start, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    runs = {}
    for name, loaded in (("quiet-1", False), ("quiet-2", False), ("loaded", True)):
        t0 = time.perf_counter()
        runs[name] = one_sweep(f"verdicts-{name}", overrides, tracking, loaded)
        print(f"{name}: {time.perf_counter() - t0:.0f} s, {runs[name]['failed']} failed, "
              f"{len(runs[name]['unstable'])} unstable", flush=True)
    keys = sorted(set().union(*(r["verdicts"] for r in runs.values())))
    print("\n| comparison | " + " | ".join(runs) + " |")
    print("|---|" + "---|" * len(runs))
    for k in keys:
        cells = [r["verdicts"].get(k, "-") for r in runs.values()]
        print(f"| {k[0]} ({k[1]}) | " + " | ".join(cells) + " |")
    same = [k for k in keys if all(k in runs[q]["verdicts"] for q in ("quiet-1", "quiet-2"))
            and _verdict(runs["quiet-1"]["verdicts"][k]) == _verdict(runs["quiet-2"]["verdicts"][k])]
    print(f"\nquiet runs agree on {len(same)} of {len(keys)} verdicts")
    for name, r in runs.items():
        for opt, why in r["unstable"].items():
            print(f"unstable in {name}: {opt}: {why}")


if __name__ == "__main__":
    main()
