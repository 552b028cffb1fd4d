"""Paired static/continuous serving runs (ABBA) on one loaded SmolLM2: wall and process-CPU throughput.

All 32 requests arrive at once (offline throughput), so the only difference is the scheduler. Tokens per
CPU-second of this process is the ratio that survives a shared, noisy machine.

    flock /tmp/infersweep-bench.lock python benchmarks/batching_paired.py
"""
import dataclasses
import time

import torch

from engine import TrialConfig, ModelConfig
from engine.config import BatchingConfig, EngineConfig, KVCacheConfig, LengthConfig, TextConfig, WorkloadConfig
from engine.models import load_model
from engine.engines import make_backend
from engine.engines.native.serving.serve import ServingSetup, warmup_requests
from engine.serving.requests import make_requests
from engine.prompts import corpus_ids
torch.set_num_threads(1)
spec_m = ModelConfig(name="smol", path="prepared://smollm2-135m-instruct")
loaded = load_model(spec_m, attention="sdpa")
sv = WorkloadConfig(kind="serving", num_requests=32, input_len=LengthConfig("uniform", 0, 32, 256), output_len=LengthConfig("uniform", 0, 16, 64),
                 arrival="all-at-once", prefix_len=64)
reqs = make_requests(sv, corpus_ids(loaded.tokenizer, TextConfig()), 0)
base = TrialConfig(model=spec_m, engine=EngineConfig(backend="native"), kv_cache=KVCacheConfig(mode="paged", block_size=16), workload=sv)
be = make_backend(loaded, base)
setups = {m: ServingSetup(dataclasses.replace(base, batching=BatchingConfig(m, max_batch_size=8)), be)
          for m in ("static", "continuous")}
for s in setups.values():
    s.run(warmup_requests(reqs))
res = {m: [] for m in setups}
for rnd in range(2):
    for m in ("static", "continuous") if rnd == 0 else ("continuous", "static"):
        c0, w0 = time.process_time(), time.perf_counter()
        tr = setups[m].run(reqs)
        c, w = time.process_time() - c0, time.perf_counter() - w0
        out = sum(len(r.output) for r in tr.requests)
        res[m].append((out / w, out / c, tr.steps, tr.step_seqs / tr.steps))
        print(m, f"wall {w:.1f}s cpu {c:.1f}s  {out/w:.1f} tok/s wall  {out/c:.1f} tok/cpu-s  steps {tr.steps} batch {tr.step_seqs/tr.steps:.2f}", flush=True)
for k, name in ((0, "wall"), (1, "cpu")):
    s = sum(x[k] for x in res["static"]) / 2; c = sum(x[k] for x in res["continuous"]) / 2
    print(f"{name}: continuous/static = {c / s:.2f}")
