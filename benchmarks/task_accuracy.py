"""The fp32 reference's task accuracy: which tasks can SmolLM2-135M-Instruct do at all? (docs/accuracy.md)

Runs lm-evaluation-harness through the trial contract (engine=hf, float32, sdpa, no quantization: the
reference configuration) on the shipped multiple-choice tasks and/or the needle tasks, and prints each task's
acc / acc_norm / exact_match +- stderr with n and the chance level (mean of 1 / number of choices over the
examples scored). Needs `infersweep prepare` and `infersweep prepare --data`.

    .venv/bin/python benchmarks/task_accuracy.py [--tasks a,b] [--limit 100] [--context-len 1024] [--depths 0.1,0.5,0.9]
"""
from __future__ import annotations

import argparse
import time


def main() -> None:
    from engine import engines
    from engine.config import EvalConfig, ModelConfig, TrialConfig, WorkloadConfig
    from engine.tasks import data
    from engine.tasks.run import available_tasks, needs_generation, primary_metric, run_lmeval

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", default=",".join(t for t in available_tasks() if not needs_generation(t)))
    p.add_argument("--limit", type=int, default=100, help="examples per task (needle: per depth)")
    p.add_argument("--context-len", type=int, default=1024, help="needle tasks' context length")
    p.add_argument("--depths", default="0.1,0.5,0.9")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--dtype", default="float32", help="model.dtype (float32: the reference)")
    args = p.parse_args()
    problem = data.data_problems(args.tasks.split(","))
    if problem:
        raise SystemExit(problem)
    tasks = args.tasks.split(",")
    trial = TrialConfig(model=ModelConfig(name="smollm2-135m-instruct", path="prepared://smollm2-135m-instruct",
                                          dtype=args.dtype),
                        workload=WorkloadConfig(context_len=args.context_len),
                        eval=EvalConfig(tasks=tasks, limit=args.limit, depths=[float(d) for d in args.depths.split(",")]))
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    t0 = time.time()
    eng = engines.get(trial.engine.backend)
    session = eng.open(trial, eng.load(trial, print), print)
    res = run_lmeval(session, trial, tasks, 8192, lambda m: print(f"[{time.time() - t0:.0f}s] {m}", flush=True))
    print(f"\nSmolLM2-135M-Instruct {args.dtype} (hf, sdpa), lm-eval, {time.time() - t0:.0f} s\n")
    print("| task | n | acc | acc_norm | exact_match | chance | judged by |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for t in tasks:
        m = res.metrics

        def cell(name: str) -> str:
            return f"{m[f'{name}.{t}']:.3f} ± {m.get(f'{name}_stderr.{t}', float('nan')):.3f}" if f"{name}.{t}" in m else "-"

        if needs_generation(t):
            chance = "0"
            depths = ", ".join(f"d{k.rsplit('.d', 1)[1]} {v:.2f}" for k, v in m.items() if k.startswith(f"task_score.{t}.d"))
            t_label = f"{t} @ {args.context_len} ({depths})"
        else:
            chance = f"{res.chance[t]:.3f}"
            t_label = t
        print(f"| {t_label} | {int(m[f'task_n.{t}'])} | {cell('acc')} | {cell('acc_norm')} | {cell('exact_match')} "
              f"| {chance} | {primary_metric(t)} |")


if __name__ == "__main__":
    main()
