"""Task scoring: a session's loglikelihood requests in document order vs longest first (docs/accuracy.md).

`SessionLM` hands a task's loglikelihood requests to the session longest first; the session scores them in
right-padded batches of 8, so in document order every batch pads to its longest request. This benchmark takes
the real requests lm-eval builds for the tasks (SmolLM2-135M-Instruct, engine=hf, sdpa), then times the
session's scoring of the same pairs in both orders, interleaved (the order that goes first alternates each
round), and prints each round, the median seconds of each and the per-round ratios' median [min, max]. It also
checks that both orders give the same log-likelihoods (max |difference|) and the same answer per item.
Needs `infersweep prepare --data`.

    .venv/bin/python benchmarks/bench_task_scoring.py [--tasks arc_easy,sciq,piqa] [--limit 50] [--rounds 3]
        [--dtype float32|bfloat16|auto]
"""
from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    import torch

    from engine import engines
    from engine.config import EvalConfig, ModelConfig, TrialConfig
    from engine.measure.hardware import preferred_cpu_dtype
    from engine.tasks import data, lmeval
    from engine.tasks.run import run_lmeval

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", default="arc_easy,sciq,piqa")
    p.add_argument("--limit", type=int, default=50, help="documents per task")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="float32", help="model.dtype (auto: bfloat16 where the CPU has bf16 units)")
    args = p.parse_args()
    tasks = args.tasks.split(",")
    problem = data.data_problems(tasks)
    if problem:
        raise SystemExit(problem)
    dtype = preferred_cpu_dtype() if args.dtype == "auto" else args.dtype
    trial = TrialConfig(model=ModelConfig(name="smollm2-135m-instruct", path="prepared://smollm2-135m-instruct",
                                          dtype=dtype), eval=EvalConfig(tasks=tasks, limit=args.limit))
    eng = engines.get("hf")
    session = eng.open(trial, eng.load(trial, lambda m: None), lambda m: None)

    captured: list = []

    class Capture(lmeval.SessionLM):  # lm-eval's own requests, in the order lm-eval makes them; nothing scored
        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
            captured.extend(self.token_pairs(requests))
            return [(0.0, False)] * len(requests)

    real, lmeval.SessionLM = lmeval.SessionLM, Capture
    try:
        run_lmeval(session, trial, tasks, 8192, lambda m: None)
    finally:
        lmeval.SessionLM = real
    doc = captured
    longest = sorted(doc, key=lambda pq: -(len(pq[0]) + len(pq[1])))
    lens = [len(c) + len(t) for c, t in doc]
    print(f"SmolLM2-135M-Instruct {dtype}, engine=hf sdpa, {torch.get_num_threads()} threads: {len(doc)} requests "
          f"of {', '.join(tasks)} (limit {args.limit}), {min(lens)}-{max(lens)} tokens (median "
          f"{statistics.median(lens):.0f})")

    def score(pairs):
        t = time.perf_counter()
        out = session.loglikelihood(pairs, lambda m: None)
        return time.perf_counter() - t, out

    score(longest[:16])  # warm-up
    secs: dict[str, list[float]] = {"document order": [], "longest first": []}
    results = {}
    for r in range(args.rounds):
        arms = [("document order", doc), ("longest first", longest)]
        for name, pairs in (arms if r % 2 == 0 else arms[::-1]):
            dt, results[name] = score(pairs)
            secs[name].append(dt)
        print(f"round {r + 1}: document order {secs['document order'][-1]:.1f} s, longest first "
              f"{secs['longest first'][-1]:.1f} s", flush=True)
    ratios = sorted(a / b for a, b in zip(secs["document order"], secs["longest first"]))
    # the same pairs in both orders: map the sorted results back to the documents' order
    back = {id(pq): res for pq, res in zip(longest, results["longest first"])}
    mine = [back[id(pq)] for pq in doc]
    diff = max(abs(a[0] - b[0]) for a, b in zip(results["document order"], mine))
    same_greedy = sum(a[1] == b[1] for a, b in zip(results["document order"], mine))
    print(f"\n| order | median s | requests/s |\n|---|---:|---:|")
    for name, v in secs.items():
        print(f"| {name} | {statistics.median(v):.1f} | {len(doc) / statistics.median(v):.1f} |")
    print(f"\nlongest first is x{statistics.median(ratios):.2f} [{ratios[0]:.2f}, {ratios[-1]:.2f}] as fast "
          f"(median [min, max] of {args.rounds} interleaved rounds); log-likelihoods differ by at most {diff:.1e}, "
          f"greedy flags equal on {same_greedy}/{len(doc)}")


if __name__ == "__main__":
    main()
