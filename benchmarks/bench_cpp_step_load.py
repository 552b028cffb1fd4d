"""The C++ decode step on a loaded machine (issue 42 item 4): its speed under a standard background load as a ratio to
its quiet speed, for the two ways its threads meet between phases, measured side by side in one interleaved run.

    python benchmarks/bench_cpp_step_load.py [--rounds 5] [--threads 2] [--tokens 24] [--variants fp32,w8a8]

SmolLM2-135M-Instruct (prepared), batch 1, a 128-token prompt, then `--tokens` greedy C++ decode steps. Each round
measures, for each variant, both sync modes quiet and then both under load (`benchmarks/cpu_load.py`: one busy
process per core, started for the loaded half of the round and stopped after it), the modes' order alternating by
round:
- `barrier`: each thread its fixed share of every phase, OpenMP barriers between phases (the step before issue 42);
- `chunks`: the phase's chunks taken from counters, a thread with nothing left spinning 10 us then sleeping on a
  futex (the default).
Prints markdown: tok/s medians with their 95% intervals, and the paired per-round ratios loaded / quiet per mode and
chunks / barrier per condition (engine/measure/spread.py's paired_ratio: the median of per-round ratios, the wider
of its bootstrap and t intervals). The goal: loaded >= x0.5 of quiet at 2 threads -- the load takes a core's worth
of the two, so x0.5 is what a step that loses nothing but its fair share keeps.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from cpu_load import CpuBurners  # noqa: E402

from bench_native_cpp_profile import SMOL, VARIANTS, cpp_backend  # noqa: E402

from engine.measure.spread import paired_ratio, spread  # noqa: E402

MODES = {"barrier": 1, "chunks": 0}  # isw_set_sync's codes


def tok_s(backend, ids: torch.Tensor, tokens: int) -> float:
    session = backend.new_session(1, ids.shape[1] + tokens + 1)
    with torch.inference_mode():
        tok = session.forward(ids)[:, -1:].argmax(-1)
        t0 = time.perf_counter()
        for _ in range(tokens):
            tok = session.forward(tok)[:, -1:].argmax(-1)
        return tokens / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--variants", default="fp32,w8a8")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    ids = torch.randint(3, 1000, (1, 128), generator=torch.Generator().manual_seed(0))
    backends = {}
    for name in a.variants.split(","):
        backends[name] = cpp_backend(SMOL, *VARIANTS[name], a.threads)
    lib = next(iter(backends.values())).decode_step.lib
    load0 = open("/proc/loadavg").read().split()[:3]
    print(f"C++ step under load, SmolLM2-135M-Instruct, batch 1, context 128 + {a.tokens} tokens, {a.threads} threads, "
          f"{a.rounds} interleaved rounds, background load {os.cpu_count()} busy processes, load before "
          f"{' '.join(load0)}, {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, {os.cpu_count()} CPUs\n")
    for b in backends.values():  # warm: the library built, the pages touched
        tok_s(b, ids, 4)
    samples: dict[tuple[str, str, str], list[float]] = {}
    t_start = time.perf_counter()
    for r in range(a.rounds):
        order = list(MODES) if r % 2 == 0 else list(MODES)[::-1]
        for cond in ("quiet", "loaded"):
            with CpuBurners(enabled=cond == "loaded"):
                for name, b in backends.items():
                    for mode in order:
                        lib.isw_set_sync(MODES[mode])
                        samples.setdefault((name, mode, cond), []).append(tok_s(b, ids, a.tokens))
        lib.isw_set_sync(0)
        print(f"round {r + 1}/{a.rounds} done ({time.perf_counter() - t_start:.0f} s)", file=sys.stderr)
    print("| variant | sync | quiet tok/s | loaded tok/s | loaded / quiet (paired) |")
    print("|---|---|---:|---:|---:|")
    for name in backends:
        dtype, quant = VARIANTS[name]
        for mode in MODES:
            q, ld = samples[name, mode, "quiet"], samples[name, mode, "loaded"]
            sq, sl, rr = spread(q), spread(ld), paired_ratio(q, ld)
            print(f"| {name} ({dtype}, {quant.level}) | {mode} | {sq.median:.1f} [{sq.ci_lo:.1f}, {sq.ci_hi:.1f}] | "
                  f"{sl.median:.1f} [{sl.ci_lo:.1f}, {sl.ci_hi:.1f}] | x{rr.value:.2f} [{rr.lo:.2f}, {rr.hi:.2f}] |")
    print("\n| variant | chunks / barrier, quiet | chunks / barrier, loaded |")
    print("|---|---:|---:|")
    for name in backends:
        cells = []
        for cond in ("quiet", "loaded"):
            rr = paired_ratio(samples[name, "barrier", cond], samples[name, "chunks", cond])
            cells.append(f"x{rr.value:.2f} [{rr.lo:.2f}, {rr.hi:.2f}]")
        print(f"| {name} | " + " | ".join(cells) + " |")
    print(f"\nload before {' '.join(load0)}, after {' '.join(open('/proc/loadavg').read().split()[:3])}; "
          f"{time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
