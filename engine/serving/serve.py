"""One serving trial: build the requests, the KV pool and the scheduler from a `TrialConfig`, warm up,
run the timed repeats, and turn the traces into metrics."""
from __future__ import annotations

from typing import Callable

from ..config import BatchingConfig, EngineError, TrialConfig, WorkloadConfig
from ..generate import device_synchronizer
from ..measure.memory import PeakMemory
from ..measure.metrics import median_metrics, serving_metrics
from ..models import LoadedModel
from ..native.backend import NativeBackend
from ..native.block_manager import BlockManager
from ..prompts import corpus_ids
from .block_space import BlockSpace
from .llm_engine import ServingEngine, ServingTrace
from .model_runner import ModelRunner
from .sampler import Sampler
from .scheduler import ContinuousScheduler, Scheduler, StaticScheduler
from .requests import Request, make_requests, max_request_tokens


def pool_blocks(spec: WorkloadConfig, batching: BatchingConfig, block_size: int, num_blocks: int) -> int:
    """`num_blocks` when set; otherwise enough for `max_batch_size` of the longest possible requests (so
    neither scheduler ever preempts), plus the continuous scheduler's 1% watermark."""
    if num_blocks:
        return num_blocks
    per_request = -(-max_request_tokens(spec) // block_size)
    n = batching.max_batch_size * per_request
    return n + max(1, n // 100)


def make_scheduler(batching: BatchingConfig, space: BlockSpace) -> Scheduler:
    cls = {"static": StaticScheduler, "continuous": ContinuousScheduler}.get(batching.mode)
    if cls is None:
        raise EngineError(f"batching mode {batching.mode!r} unknown; choose static or continuous")
    return cls(space, batching.max_batch_size, batching.max_batch_tokens, batching.chunked_prefill)


class ServingSetup:
    """What every run of one trial shares: the backend's model and the KV pool tensors. Each run gets a
    fresh block manager (so no prefix-cache content leaks from one run into the next), scheduler and
    sampler."""

    def __init__(self, trial: TrialConfig, backend: NativeBackend, check_invariants: bool = False):
        assert trial.workload.serving, "a serving setup needs workload.kind=serving"
        self.trial = trial
        kv = trial.kv_cache
        self.num_blocks = pool_blocks(trial.workload, trial.batching, kv.block_size, kv.num_blocks)
        self.runner = ModelRunner(backend, self.num_blocks, kv.block_size)
        self.sync = device_synchronizer(backend.device)
        self.check_invariants = check_invariants

    def run(self, requests: list[Request]) -> ServingTrace:
        t = self.trial
        space = BlockSpace(BlockManager(self.num_blocks, t.kv_cache.block_size), t.kv_cache.prefix_caching)
        engine = ServingEngine(self.runner, make_scheduler(t.batching, space),
                               Sampler(t.workload.sampling, t.seed, self.runner.backend.device), self.sync,
                               check_invariants=self.check_invariants)
        return engine.run(requests, t.workload.max_concurrency)


def warmup_requests(requests: list[Request]) -> list[Request]:
    """Two requests at t=0 generating two tokens: prefill, a mixed step and decode kernels all run once."""
    return [Request(i, r.prompt, min(2, r.max_new_tokens), 0.0) for i, r in enumerate(requests[:2])]


def run_serving(trial: TrialConfig, loaded: LoadedModel, backend, say: Callable[[str], None]
                ) -> tuple[dict[str, float], list[list[int]]]:
    """(metrics, generated token ids per request in request order) of a serving trial."""
    if not isinstance(backend, NativeBackend):
        raise EngineError("serving workloads run on the native backend (engine=native)")
    spec = trial.workload
    need = max_request_tokens(spec)
    if loaded.max_positions and need > loaded.max_positions:
        raise EngineError(f"the longest request ({need} tokens) exceeds the model's maximum of {loaded.max_positions} positions")
    backend._check_len(need)
    requests = make_requests(spec, corpus_ids(loaded.tokenizer, trial.workload.text), trial.seed)
    setup = ServingSetup(trial, backend)
    for i in range(trial.workload.warmup):
        say(f"warm-up {i + 1}/{trial.workload.warmup}")
        setup.run(warmup_requests(requests))
    backend.kernel.reset_peak()
    runs, traces = [], []
    with PeakMemory(backend.device) as mem:
        for i in range(max(1, trial.workload.repeats)):
            say(f"serving run {i + 1}/{trial.workload.repeats}: {len(requests)} requests, {trial.batching.mode} batching")
            trace = setup.run(requests)
            traces.append(trace)
            runs.append(serving_metrics(trace, trial.slo))
    metrics = median_metrics(runs)
    metrics["peak_mem_bytes"] = float(mem.peak_bytes)
    metrics["weights_bytes"] = float(backend.weights_bytes())
    metrics["model_load_s"] = float(loaded.load_s)
    metrics.update(backend.extra_metrics())
    return metrics, [list(r.output) for r in traces[0].requests]
