"""Grid vs `optimize` (chain, search) on one space: does a strategy find the grid's best, and at what cost?

Runs, each in its own MLflow experiment (so no strategy reuses another's trials by hash):
1. the exhaustive grid of the space (every configuration validation accepts, one trial each, as a sweep runs
   them: one at a time on the embedded Ray cluster);
2. `infersweep optimize` with the chain strategy on the same space;
3. `infersweep optimize optimize=search` with a budget of a quarter of the grid's trials;
then measures each strategy's pick against the grid's best as one interleaved pair (`--rounds` rounds on one
worker: the machine's drift cancels) and reports the ratio with its 95% interval, judged by equivalence: the pick
is as good as the grid's best when the interval's lower bound is >= x0.95 (x0.95 [0.86-1.04] is not: it may be 14%
slower). Trials and wall time of each are counted.

    python benchmarks/bench_optimize.py                     # the default space below
    python benchmarks/bench_optimize.py kv_cache=off,contiguous attention=eager,sdpa --rounds 9

Trials are counted as MLflow trial runs: a chain pair is 2 trials (candidate and incumbent re-measured
together), so the chain spends 1 + 2 x (candidates tried) trials; the grid's trials are single measurements.
Measured on a shared machine: the load (/proc/loadavg) is printed at start and end.
"""
from __future__ import annotations

import argparse
import itertools
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# SmolLM2 with its KV cache (the no-cache path costs seconds per token on a loaded 2-core machine), a short static
# workload, no task eval (speed only): 2 x 3 x 2 x 2 = 24 configurations. The chain measures at most 1 + 5
# configurations, in 1 + 2 x 5 trials (each pair re-measures its incumbent).
SPACE = ["attention=eager,sdpa", "quant=none,int8-weight,int8-dynamic", "speculative=off,prompt-lookup",
         "model.dtype=float32,bfloat16"]
FIXED = ["model=smollm2-135m", "kv_cache=contiguous", "workload.context_len=64", "workload.max_new_tokens=8",
         "workload.repeats=3", "eval=none"]


def loadavg() -> str:
    try:
        return Path("/proc/loadavg").read_text().split(" ", 3)[:3].__str__()
    except OSError:
        return "?"


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        name = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "?")
        bf16 = "avx512_bf16" in out
        return f"{name}, {os.cpu_count()} cores, avx512_bf16 {'yes' if bf16 else 'no'}"
    except OSError:
        return platform.processor() or "?"


CHECK_ROUNDS = 6  # the fewest interleaved rounds whose paired signed-rank test can reach one-sided 2.5% (1/64)
EQUIVALENT = 0.95  # the pick is as good as the grid's best when its ratio's 95% lower bound is at least this


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("axes", nargs="*", help="the space (comma lists); default: " + " ".join(SPACE))
    ap.add_argument("--fixed", nargs="*", default=FIXED, help="overrides every configuration shares")
    ap.add_argument("--rounds", type=int, default=9, help="interleaved rounds of a pair (the chain's, raised by optimize to its rule's minimum; the final checks use at least 6, the fewest with a 95%% bound)")
    ap.add_argument("--store", default=None, help="tracking directory (default: a fresh temporary one)")
    ap.add_argument("--search-trials", type=int, default=0, help="the search's budget (default: grid trials // 4)")
    ap.add_argument("--dry", action="store_true", help="list the grid's valid configurations and stop")
    args = ap.parse_args()

    from experiments.optimize.dispatch import TrialMeasure
    from experiments.optimize.measurement import Request, describe
    from experiments.optimize.objective import Objective
    from experiments.optimize.run import run_optimize
    from experiments.optimize.space import read_space

    store = Path(args.store or tempfile.mkdtemp(prefix="bench-optimize-"))
    store.mkdir(parents=True, exist_ok=True)
    tracking = [f"tracking.uri=sqlite:///{store}/mlflow.db", f"tracking.artifact_root={store}/artifacts"]
    axes = args.axes or SPACE
    base = list(args.fixed) + tracking
    echo = lambda s: print(s, flush=True)  # noqa: E731
    echo(f"machine: {cpu_name()}; load at start {loadavg()}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    echo(f"space: {' '.join(axes)}; fixed: {' '.join(args.fixed)}; store {store}")
    objective = Objective.parse("tpot")

    # 1. the grid
    sp = read_space(base + axes + ["sweep_name=bench-opt-grid", "optimize.gate.enabled=false"])
    grid = TrialMeasure(sp, "bench-opt-grid", sp.config["tracking"], None, args.rounds, "bench_optimize grid",
                      echo=lambda s: None)
    points = [dict(zip(sp.axes, vs)) for vs in itertools.product(*sp.axes.values())]
    valid = [p for p in points if not grid.validate(p)]
    echo(f"grid: {len(points)} configurations, {len(valid)} valid; running them ...")
    if args.dry:
        for p in points:
            echo(f"  {describe(p)}: {'; '.join(grid.validate(p)) or 'valid'}")
        return 0
    t0 = time.perf_counter()
    measured = [ms[0] for ms in grid([Request((p,)) for p in valid])]
    grid_s = time.perf_counter() - t0
    ok = [m for m in measured if m.ok and m.metrics.get("tpot_ms_p50")]
    best = min(ok, key=lambda m: m.metrics["tpot_ms_p50"])
    echo(f"grid: {len(measured)} trials, {len(ok)} finished, {grid_s / 60:.1f} min; best {describe(best.point)} "
         f"TPOT {best.metrics['tpot_ms_p50']:.1f} ms")
    tpot_of = {tuple(sorted(m.point.items())): m.metrics["tpot_ms_p50"] for m in ok}

    # 2. + 3. the strategies, each from scratch in its own experiment
    rows = [("grid (exhaustive)", best.point, len(measured), grid_s, "(the grid's best)")]
    search_trials = args.search_trials or max(1, len(valid) // 4)
    for name, extra in (("chain", [f"optimize.rounds={args.rounds}", "optimize.remeasure=1"]),
                        ("search", ["optimize=search", f"optimize.max_trials={search_trials}",
                                    "optimize.search.objectives=[tpot]"])):
        echo(f"{name}: running ...")
        res = run_optimize(base + axes + [f"sweep_name=bench-opt-{name}", "optimize.gate.enabled=false"] + extra,
                           echo=lambda s: None)
        echo(f"{name}: {res.trials} trials, {res.wall_s / 60:.1f} min, stop: {res.stop}; pick {describe(res.final)}")
        if name == "chain":
            echo(res.table)
        pick = {k: res.final[k] for k in sp.axes}
        rows.append((f"optimize {name}", pick, res.trials, res.wall_s, None))

    # distinct configurations each spent trials on (a chain pair re-measures its incumbent)
    def configs(experiment: str) -> int:
        exp = grid.client.get_experiment_by_name(experiment)
        runs = grid.client.search_runs([exp.experiment_id], "attributes.status = 'FINISHED'", max_results=5000)
        return len({r.data.tags.get("config_hash") for r in runs if r.data.tags.get("config_hash")})

    distinct = {"grid (exhaustive)": configs("bench-opt-grid"), "optimize chain": configs("bench-opt-chain"),
                "optimize search": configs("bench-opt-search")}

    # 4. each pick against the grid's best: one interleaved pair (the drift of the machine cancels)
    # at least CHECK_ROUNDS: the signed-rank bound at one-sided 2.5% needs 6 rounds (with 4 it is [0, inf])
    check_space = read_space([o for o in sp.fixed if not o.startswith("sweep_name=")] + ["sweep_name=bench-opt-check"])
    check = TrialMeasure(check_space, "bench-opt-check", sp.config["tracking"], None, max(args.rounds, CHECK_ROUNDS),
                       "bench_optimize check",
                       echo=lambda s: None)
    out = []
    for label, pick, trials, wall, verdict in rows:
        grid_tpot = tpot_of.get(tuple(sorted(pick.items())))
        if verdict is None:
            if pick == best.point:
                verdict = "yes: the grid's best itself"
            else:
                # the same pick twice (chain and search agree): its check pair is measured again (attempt 1)
                attempt = sum(1 for r in out if r[1] == describe(pick))
                b, c = check([Request((best.point, pick), interleaved=True, attempt=attempt)])[0]
                # equivalence, not "not shown slower": the pick's ratio to the grid's best has its 95% lower
                # bound at or above x0.95 (x0.95 [0.86-1.04] is no success: it may be 14% slower)
                r = objective.sequential([(b, c)], 0.025) if b.ok and c.ok else None
                if r is None:
                    verdict = "? (the check pair failed)"
                else:
                    within = r.lo >= EQUIVALENT
                    verdict = f"{'yes' if within else 'no'}: pick vs grid best {r.cell()}" + (
                        f" (check pair unstable: {b.unstable or c.unstable})" if (b.unstable or c.unstable) else "")
        out.append((label, describe(pick), f"{grid_tpot:.1f}" if grid_tpot else "?", trials, distinct[label],
                    f"{trials / len(measured):.2f}", f"{wall / 60:.1f}", verdict))
    echo(f"\nload at end {loadavg()}\n")
    echo("| strategy | pick | grid's TPOT of the pick (ms) | trials | configurations | trials / grid's | wall (min) "
         f"| equivalent to the grid's best (95% lower bound >= x{EQUIVALENT}) |")
    echo("|---|---|---|---|---|---|---|---|")
    for row in out:
        echo("| " + " | ".join(str(x) for x in row) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
