"""Task scoring: every request alone in padded batches vs the choices of an item as one context-shared tree
(engine/engines/packing.py, docs/accuracy.md).

Round five scored each loglikelihood request alone, longest first, in right-padded batches of 8
(`LogitsSession.padded_loglikelihood`); the session now scores the requests that share a context as a tree, the
context once, several trees packed per row (`LogitsSession.loglikelihood`). This benchmark takes the real
requests lm-eval builds for the tasks (SmolLM2-135M-Instruct, engine=hf or native, sdpa), times both on the same pairs,
interleaved (the arm that goes first alternates each round), and prints each round, the median seconds of each
and the per-round ratios' median [min, max]. It also checks that both give the same log-likelihoods
(max |difference|) and the same greedy flag per request.
Needs `infersweep prepare --data`.

    .venv/bin/python benchmarks/bench_task_scoring.py [--tasks arc_easy,sciq,piqa] [--limit 50] [--rounds 3]
        [--dtype float32|bfloat16|auto] [--engine hf|native] [--quant none|int8-dynamic|...] [--attention sdpa|eager]
"""
from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    import torch

    from engine import engines
    from engine.config import EvalConfig, ModelConfig, TrialConfig, replace
    from engine.measure.hardware import preferred_cpu_dtype
    from engine.tasks import data, lmeval
    from engine.tasks.run import run_lmeval

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", default="arc_easy,sciq,piqa")
    p.add_argument("--limit", type=int, default=50, help="documents per task")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--engine", default="hf", choices=["hf", "native"])
    p.add_argument("--attention", default="sdpa", choices=["eager", "sdpa"])
    p.add_argument("--quant", default="none", help="quant.level (int8-dynamic: W8A8 on our integer kernel)")
    p.add_argument("--dtype", default="float32", help="model.dtype (auto: bfloat16 where the CPU has bf16 units)")
    args = p.parse_args()
    tasks = args.tasks.split(",")
    problem = data.data_problems(tasks)
    if problem:
        raise SystemExit(problem)
    dtype = preferred_cpu_dtype() if args.dtype == "auto" else args.dtype
    trial = TrialConfig(model=ModelConfig(name="smollm2-135m-instruct", path="prepared://smollm2-135m-instruct",
                                          dtype=dtype), eval=EvalConfig(tasks=tasks, limit=args.limit))
    trial = replace(replace(replace(trial, "engine.backend", args.engine), "quant.level", args.quant),
                    "attention.impl", args.attention)
    eng = engines.get(args.engine)
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
    from engine.engines.packing import pack_trees

    packs, alone = pack_trees(doc)
    print(f"SmolLM2-135M-Instruct {dtype} quant={args.quant}, engine={args.engine} {trial.attention.impl}, {torch.get_num_threads()} "
          f"threads: {len(doc)} requests of {', '.join(tasks)} (limit {args.limit}), {min(lens)}-{max(lens)} tokens "
          f"(median {statistics.median(lens):.0f}); {sum(lens)} tokens one by one, "
          f"{sum(p.num_tokens for p in packs)} as {len(packs)} context-shared rows ({len(alone)} requests alone)")

    def padded(pairs):  # round five's path: every request alone, right-padded batches of 8, longest first
        out = session.padded_loglikelihood(longest, lambda m: None)
        back = {id(pq): res for pq, res in zip(longest, out)}
        return [back[id(pq)] for pq in pairs]

    def trees(pairs):
        return session.loglikelihood(pairs, lambda m: None)

    arms = {"padded, longest first": padded, "context-shared trees": trees}
    session.padded_loglikelihood(longest[:16], lambda m: None)  # warm-up
    session.loglikelihood(doc[:16], lambda m: None)
    secs: dict[str, list[float]] = {k: [] for k in arms}
    results = {}
    for r in range(args.rounds):
        order = list(arms) if r % 2 == 0 else list(arms)[::-1]
        for name in order:
            t = time.perf_counter()
            results[name] = arms[name](doc)
            secs[name].append(time.perf_counter() - t)
        print(f"round {r + 1}: " + ", ".join(f"{k} {secs[k][-1]:.1f} s" for k in arms), flush=True)
    a, b = (results[k] for k in arms)
    ratios = sorted(x / y for x, y in zip(*secs.values()))
    diff = max(abs(x[0] - y[0]) for x, y in zip(a, b))
    same_greedy = sum(x[1] == y[1] for x, y in zip(a, b))
    print(f"\n| scoring | median s | min-max s | requests/s |\n|---|---:|---:|---:|")
    for name, v in secs.items():
        print(f"| {name} | {statistics.median(v):.1f} | {min(v):.1f}-{max(v):.1f} | "
              f"{len(doc) / statistics.median(v):.1f} |")
    print(f"\ncontext-shared trees are x{statistics.median(ratios):.2f} [{ratios[0]:.2f}, {ratios[-1]:.2f}] as fast "
          f"(median [min, max] of {args.rounds} interleaved rounds); log-likelihoods differ by at most {diff:.1e}, "
          f"greedy flags equal on {same_greedy}/{len(doc)}")


if __name__ == "__main__":
    main()
