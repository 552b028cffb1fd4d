"""Speculative decoding on SmolLM2-135M (issue 5's check): `experiment=speculative`, measured in-process.

The trials are exactly the sweep's -- `experiments.config.compose.expand(["experiment=speculative", ...])`, the same
expansion `infersweep sweep experiment=speculative` runs on Ray -- but they run here, one after the other,
on one loaded model (what a warm worker does), without Ray or MLflow in the process. Per workload
(prompt_style repeat | window) the speculative=off trial runs first and again last; its mean is the
baseline. For every trial: alpha, measured vs predicted tokens/step, draft cost ratio c, per-step clocks,
and the speedup over off (`experiments.analysis.speedups.speculative_speedups`, what a report computes from the
MLflow rows). Writes the section "## Speculative decoding" of BENCHMARKS.md (other sections are kept).

    flock /tmp/infersweep-bench.lock python benchmarks/bench_speculative.py          # ~15 min on 2 cores
    python benchmarks/bench_speculative.py --no-write workload.max_new_tokens=16 speculative.k=1,4   # smoke
"""
from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_native import _cpu_jiffies, foreign_share, wait_until_quiet  # noqa: E402
from engine import load_model, run_engine_trial  # noqa: E402
from engine.pipeline import device_info  # noqa: E402
from experiments.config.compose import expand  # noqa: E402
from experiments.analysis.results import TrialRow  # noqa: E402
from experiments.config.spec import build_trial  # noqa: E402
from experiments.analysis.speedups import speculative_speedups  # noqa: E402

SECTION = "## Speculative decoding"


def flatten(d: dict, prefix: str = "") -> dict[str, str]:
    """The config as MLflow params (experiments.tracking.store.flatten, without importing mlflow here)."""
    out: dict[str, str] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = "null" if v is None else str(v)
    return out


def measure(trial, loaded, a) -> tuple[dict, list]:
    for attempt in range(a.retries + 1):
        wait_until_quiet(a.max_foreign / 2, a.max_wait)
        before = _cpu_jiffies()
        r = run_engine_trial(trial, loaded=loaded)
        foreign = foreign_share(before, _cpu_jiffies())
        if foreign <= a.max_foreign or attempt == a.retries:
            break
        print(f"  other processes used {100 * foreign:.0f}% of the CPU: measuring again", flush=True)
    m = dict(r.metrics)
    m["foreign_cpu"] = foreign
    return m, r.token_ids


def label(cfg: dict) -> tuple[str, str, str]:
    s = cfg["speculative"]
    if s["method"] == "off":
        return "off", "", ""
    depth = str(s["draft_layers"]) if s["method"] == "self-draft" else ""
    return s["method"], depth, str(s["k"])


def f(x, fmt=".2f") -> str:
    return "—" if x is None else format(x, fmt)


def write_section(path: Path, section: str) -> None:
    """Replace this script's section of BENCHMARKS.md (or append it), keeping every other section."""
    text = path.read_text() if path.exists() else "# Benchmarks\n\nLatest results of the scripts in benchmarks/.\n"
    start = text.find(SECTION + "\n")
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        nxt = text.find("\n## ", start + len(SECTION))
        text = text[:start] + section + ("" if nxt < 0 else "\n" + text[nxt + 1:])
    path.write_text(text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides after experiment=speculative")
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--out", default=str(ROOT / "BENCHMARKS.md"))
    p.add_argument("--max-foreign", type=float, default=0.15)
    p.add_argument("--retries", type=int, default=2)
    p.add_argument("--max-wait", type=float, default=120.0, help="seconds to wait for a quiet machine per attempt")
    a = p.parse_args(argv)
    command = "python benchmarks/bench_speculative.py" + (" " + shlex.join(a.overrides) if a.overrides else "")
    specs = expand(["experiment=speculative", *a.overrides])
    first = build_trial(specs[0].config)
    print(f"{len(specs)} trials; loading {first.model.name}", flush=True)
    loaded = load_model(first.model, attention=first.attention.impl, quant=first.quant)
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    styles = list(dict.fromkeys(s.config["workload"]["prompt_style"] for s in specs))
    rows: list[TrialRow] = []
    results: dict[str, dict] = {}
    for style in styles:
        block = [s for s in specs if s.config["workload"]["prompt_style"] == style]
        offs = [s for s in block if s.config["speculative"]["method"] == "off"]
        order = offs + [s for s in block if s not in offs] + offs  # off first and last: drift shows
        off_runs: dict[str, list] = {}
        for s in order:
            m, toks = measure(build_trial(s.config), loaded, a)
            method, depth, k = label(s.config)
            print(f"[{time.perf_counter() - t0:5.0f}s] {style:6s} {method:13s} {depth:>2s} k={k:>1s}: "
                  f"tpot {m['tpot_ms_mean']:6.1f} ms, tok/step {m.get('tokens_per_step', 1):.2f}, "
                  f"alpha {f(m.get('acceptance_rate'))}, c {f(m.get('draft_cost_ratio'))}, "
                  f"foreign cpu {100 * m['foreign_cpu']:.0f}%", flush=True)
            if method == "off":
                off_runs.setdefault(s.config_hash, []).append((m, toks))
                continue
            results[s.config_hash] = dict(spec=s, m=m, toks=toks)
        for h, runs in off_runs.items():
            m = dict(runs[0][0])
            m["tpot_ms_mean"] = statistics.fmean(r[0]["tpot_ms_mean"] for r in runs)
            m["tpot_first_last"] = tuple(r[0]["tpot_ms_mean"] for r in runs)
            spec = next(s for s in offs if s.config_hash == h)
            results[h] = dict(spec=spec, m=m, toks=runs[0][1])
    for h, r in results.items():
        rows.append(TrialRow(run_id=h, name=r["spec"].label, status="FINISHED", params=flatten(r["spec"].config),
                             metrics={"tpot_ms": r["m"]["tpot_ms_mean"]}, tags={}))
    speedups = speculative_speedups(rows)
    cfg0 = specs[0].config
    wl = cfg0["workload"]
    info = device_info(loaded.device)
    L = [SECTION, ""]
    L.append(f"`{command}` (run under `flock /tmp/infersweep-bench.lock`; {len(specs)} trials in "
             f"{(time.perf_counter() - t0) / 60:.0f} min; load average {load0:.1f} at the start). The trials are "
             "`infersweep sweep experiment=speculative` run in-process on one loaded model.")
    L.append("")
    L.append(f"{cfg0['model']['name']}, engine={cfg0['engine']['backend']}, kv_cache={cfg0['kv_cache']['mode']}, "
             f"attention={cfg0['attention']['impl']}, fp32, batch 1, greedy, context {wl['context_len']}, "
             f"{wl['max_new_tokens']} new tokens, median of {wl['repeats']} runs after {wl['warmup']} warm-up; "
             f"{info.get('cpu', '?')}, {info.get('torch_threads')} threads.")
    L.append("")
    for style in styles:
        off = next(r for r in results.values() if r["spec"].config["workload"]["prompt_style"] == style
                   and r["spec"].config["speculative"]["method"] == "off")
        om = off["m"]
        first_last = " / ".join(f"{x:.1f}" for x in om["tpot_first_last"])
        what = {"repeat": "repetitive: instruction + passage, the model copies it",
                "window": "free generation: continue a window of the Python reference manual"}.get(style, style)
        L.append(f"### workload.prompt_style={style} ({what})")
        L.append("")
        L.append(f"speculative=off: tpot {om['tpot_ms_mean']:.1f} ms (first / last run of the block: {first_last}), "
                 f"{1e3 / om['tpot_ms_mean']:.1f} tok/s decode.")
        L.append("")
        L.append("| method | draft layers | k | α | tokens/step measured | predicted (1−α^(k+1))/(1−α) | drafted/step "
                 "| c | draft ms/token | verify ms/step | verify / off step | tpot ms | speedup vs off | tokens = off |")
        L.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in results.values():
            s = r["spec"]
            if s.config["workload"]["prompt_style"] != style or s.config["speculative"]["method"] == "off":
                continue
            m = r["m"]
            busy = " †" if m["foreign_cpu"] > a.max_foreign else ""
            method, depth, k = label(s.config)
            same = "yes" if r["toks"] == off["toks"] else "**no**"
            vr = m.get("verify_forward_ms")
            L.append(f"| {method} | {depth or '—'} | {k} | {f(m.get('acceptance_rate'))} | {f(m.get('tokens_per_step'))} "
                     f"| {f(m.get('predicted_tokens_per_step'))} | {f(m.get('draft_tokens_per_step'))} "
                     f"| {f(m.get('draft_cost_ratio'), '.3f')} | {f(m.get('draft_forward_ms'), '.1f')} | {f(vr, '.1f')} "
                     f"| {f(vr / om['tpot_ms_mean'] if vr else None)} | {m['tpot_ms_mean']:.1f}{busy} "
                     f"| **{f(speedups.get(s.config_hash))}×** | {same} |")
        L.append("")
    L.append(f"† other processes used more than {100 * a.max_foreign:.0f}% of the CPU during that trial, after "
             f"{a.retries} re-measurements: its clocks are inflated. Speedup = tpot(off) / tpot(trial) "
             "(`experiments.analysis.speedups.speculative_speedups`); c = draft time per drafted token / verify time "
             "per step; \"verify / off step\" = one verification forward over 1 + k' tokens / one plain decode step.")
    L.append("")
    section = "\n".join(L) + "\n"
    print("\n" + section)
    if not a.no_write:
        write_section(Path(a.out), section)
        print(f"wrote section to {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
