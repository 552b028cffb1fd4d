"""Platform overhead at scale: a 1,000-trial sweep of the tiny random model on the local Ray cluster.

Each trial is made nearly free (context 8, 2 new tokens, no warm-up, eval off), so what is left is the
platform: expansion, scheduling on warm workers, result transfer, and the driver's MLflow writes.

    flock /tmp/infersweep-bench.lock python benchmarks/bench_platform_overhead.py --trials 1000 --tracking sqlite
    flock /tmp/infersweep-bench.lock python benchmarks/bench_platform_overhead.py --trials 1000 --tracking server

Prints a Markdown table (BENCHMARKS.md "Platform overhead (1,000 trials)").
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.tracking import spool as spool_mod  # noqa: E402
from experiments.config.compose import expand  # noqa: E402
from experiments.run.sweep import run_specs  # noqa: E402

CHEAP = ["model=tiny-llama", "workload.context_len=8", "workload.max_new_tokens=2", "workload.warmup=0",
         "workload.repeats=1", "eval.enabled=false", "cluster.num_cpus_per_trial=1", "cluster.local_num_cpus=2"]


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def start_postgres(tmp: Path) -> str:
    """A throwaway PostgreSQL cluster (Debian's binaries; as the `postgres` user when run as root)."""
    import atexit
    import glob
    import shutil
    import subprocess

    from experiments.tracking.server import free_port

    bindir = sorted(glob.glob("/usr/lib/postgresql/*/bin"))[-1]
    root = tmp / "pg"
    root.mkdir()
    as_user = []
    if os.geteuid() == 0:
        shutil.chown(tmp, "postgres")
        shutil.chown(root, "postgres")
        as_user = ["runuser", "-u", "postgres", "--"]
    port = free_port()

    def run(*a):
        subprocess.run([*as_user, *a], check=True, capture_output=True, text=True)

    run(f"{bindir}/initdb", "-D", str(root / "data"), "-U", "postgres", "--auth=trust")
    run(f"{bindir}/pg_ctl", "-D", str(root / "data"), "-l", str(root / "pg.log"), "-w", "-o",
        f"-p {port} -k {root} -c listen_addresses=127.0.0.1", "start")
    atexit.register(lambda: subprocess.run([*as_user, f"{bindir}/pg_ctl", "-D", str(root / "data"), "-m", "fast", "stop"],
                                           capture_output=True))
    for sql in ("CREATE ROLE infersweep LOGIN PASSWORD 'infersweep'", "CREATE DATABASE infersweep OWNER infersweep"):
        run("psql", "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", "-c", sql)
    return f"postgresql+psycopg2://infersweep:infersweep@127.0.0.1:{port}/infersweep"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=1000)
    ap.add_argument("--tracking", default="sqlite",
                    help="sqlite (driver writes the db) | server (local mlflow server on SQLite) | "
                         "postgres (a throwaway local PostgreSQL behind a local mlflow server) | a URI")
    ap.add_argument("--writers", type=int, default=1, help="tracking.writers (driver writer threads; server only)")
    ap.add_argument("--server-workers", type=int, default=4, help="mlflow server workers for --tracking postgres")
    ap.add_argument("--json", default=None, help="also write the numbers here")
    ap.add_argument("--full-text", action="store_true",
                    help="prompts from the whole pydoc corpus (default: its first 4 KB, so the engine does not "
                         "tokenize ~1 MB per trial and the trial is as cheap as it gets)")
    ap.add_argument("--no-resume", action="store_true", help="skip the resume (skip-all) measurement")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="infersweep-bench-"))
    if args.tracking == "sqlite":
        tracking = [f"tracking.uri=sqlite:///{tmp}/mlflow.db"]
    elif args.tracking == "server":
        tracking = ["tracking=server", f"tracking.uri=sqlite:///{tmp}/mlflow.db"]
    elif args.tracking == "postgres":
        tracking = ["tracking=postgres", f"tracking.uri={start_postgres(tmp)}", f"tracking.workers={args.server_workers}"]
    else:
        tracking = [f"tracking.uri={args.tracking}"]
    tracking += [f"tracking.artifact_root={tmp}/artifacts", f"tracking.spool_dir={tmp}/spool",
                 f"tracking.writers={args.writers}"]
    text = []
    if not args.full_text:
        from pydoc_data.topics import topics

        (tmp / "text.txt").write_text("\n\n".join(topics[k] for k in sorted(topics))[:4096])
        text = ["workload.text.kind=file", f"workload.text.path={tmp}/text.txt"]
    over = CHEAP + text + tracking + [f"sweep_name=bench-overhead-{int(time.time())}", f"seed=range(0,{args.trials})"]

    t0 = time.perf_counter()
    specs = expand(over)
    expand_s = time.perf_counter() - t0

    import ray

    from cluster import ensure_ray

    t0 = time.perf_counter()
    ensure_ray(specs[0].config["cluster"])
    ray_init_s = time.perf_counter() - t0

    dispatched: dict[int, float] = {}
    received: dict[int, float] = {}
    track_s: list[float] = []
    orig, orig_write = spool_mod.Recorder.log_trial, spool_mod.Recorder._log_trial

    def timed_log_trial(self, exp_name, spec, outcome, *a, **k):  # the driver receives a result
        received[spec.index] = time.time()
        return orig(self, exp_name, spec, outcome, *a, **k)

    def timed_write(self, *a, **k):  # the actual write (a writer thread's, with --writers > 1)
        t = time.perf_counter()
        try:
            return orig_write(self, *a, **k)
        finally:
            track_s.append(time.perf_counter() - t)

    spool_mod.Recorder.log_trial = timed_log_trial
    spool_mod.Recorder._log_trial = timed_write
    t0 = time.perf_counter()
    t0_wall = time.time()
    res = run_specs(specs, "bench", echo=lambda *_: None,
                    on_start=lambda s, meta: dispatched.__setitem__(s.index, time.time()))
    wall_s = time.perf_counter() - t0
    spool_mod.Recorder.log_trial, spool_mod.Recorder._log_trial = orig, orig_write

    rows = [r for r in res.rows if r["outcome"] is not None]
    ok = [r for r in rows if r["status"] == "FINISHED"]
    trial_s = [(r["outcome"].end_ms - r["outcome"].start_ms) / 1e3 for r in rows]
    first_result = min(received.values()) - t0_wall
    slots = len({r["outcome"].info.get("worker_pid") for r in rows})
    loads = sum(1 for r in ok if r["metrics"].get("model_load_s", 0) > 0)
    # round trip seen by the driver minus the trial's own time = scheduling + transfer + queueing behind
    # the driver's tracking writes
    sched = [(received[i] - dispatched[i]) - (r["outcome"].end_ms - r["outcome"].start_ms) / 1e3
             for i, r in ((r["outcome"].index, r) for r in rows) if i in dispatched]
    steady_wall = wall_s - first_result
    n = len(rows)
    per_trial_overhead = steady_wall * slots / n - statistics.fmean(trial_s)

    # resume: the same sweep again skips everything; time the finished-hash lookup
    resume_s, skipped = float("nan"), 0
    if not args.no_resume:
        t0 = time.perf_counter()
        skipped = run_specs(specs, "bench", echo=lambda *_: None, skip_finished=True).skipped
        resume_s = time.perf_counter() - t0
    ray.shutdown()

    out = {
        "tracking": args.tracking + (f" ({args.writers} writers)" if args.writers > 1 else ""), "trials": n, "finished": len(ok), "worker_slots": slots, "model_loads": loads,
        "expand_s": expand_s, "ray_init_s": ray_init_s, "sweep_wall_s": wall_s, "first_result_s": first_result,
        "sum_trial_s": sum(trial_s), "mean_trial_ms": 1e3 * statistics.fmean(trial_s),
        "ideal_wall_s": sum(trial_s) / slots,
        "per_trial_overhead_ms": 1e3 * per_trial_overhead,
        "tracking_ms_mean": 1e3 * statistics.fmean(track_s), "tracking_ms_p50": 1e3 * pct(track_s, 50),
        "tracking_ms_p99": 1e3 * pct(track_s, 99), "tracking_total_s": sum(track_s),
        "sched_ms_p50": 1e3 * pct(sched, 50), "sched_ms_p99": 1e3 * pct(sched, 99),
        "throughput_trials_s": n / steady_wall, "resume_skip_all_s": resume_s, "resume_skipped": skipped,
        "spooled": res.spooled,
    }
    print(json.dumps(out, indent=1))
    print()
    print(f"| tracking | trials | slots | sweep wall | Σ trial | Σ trial / slots | first result | per-trial overhead | "
          f"tracking write p50 / p99 | dispatch→result − trial p50 / p99 | trials/s | model loads | resume (skip all) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    o = out
    print(f"| {o['tracking']} | {o['trials']} | {o['worker_slots']} | {o['sweep_wall_s']:.1f} s | {o['sum_trial_s']:.1f} s | "
          f"{o['ideal_wall_s']:.1f} s | {o['first_result_s']:.1f} s | {o['per_trial_overhead_ms']:.0f} ms | "
          f"{o['tracking_ms_p50']:.0f} / {o['tracking_ms_p99']:.0f} ms | {o['sched_ms_p50']:.0f} / {o['sched_ms_p99']:.0f} ms | "
          f"{o['throughput_trials_s']:.1f} | {o['model_loads']} | {o['resume_skip_all_s']:.1f} s ({o['resume_skipped']} skipped) |")
    print(f"\nexpansion of {n} trials: {expand_s:.1f} s; ray.init: {ray_init_s:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0 if len(ok) == n else 1


if __name__ == "__main__":
    sys.exit(main())
