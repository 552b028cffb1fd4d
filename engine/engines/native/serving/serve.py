"""What every timed run of one native serving trial shares: the KV pool and the model runner; each run
gets a fresh block manager, scheduler and sampler. Warm-up and repeats are the trial pipeline's
(engine/pipeline.py through engine/engines/native/__init__.py)."""
from __future__ import annotations

from typing import Optional

from ....config import BatchingConfig, EngineError, TrialConfig, WorkloadConfig
from ....generate import device_synchronizer
from ..backend import NativeBackend
from ..block_manager import BlockManager
from .block_space import BlockSpace
from .llm_engine import ServingEngine, ServingTrace
from .model_runner import ModelRunner
from .sampler import Sampler
from .scheduler import ContinuousScheduler, Scheduler, StaticScheduler
from ....serving.requests import Request, max_request_tokens


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

    def run(self, requests: list[Request], follow_up=None, max_concurrency: Optional[int] = None) -> ServingTrace:
        """One run; `max_concurrency` None: the trial's workload.max_concurrency."""
        t = self.trial
        space = BlockSpace(BlockManager(self.num_blocks, t.kv_cache.block_size), t.kv_cache.prefix_caching)
        engine = ServingEngine(self.runner, make_scheduler(t.batching, space),
                               Sampler(t.workload.sampling, t.seed, self.runner.backend.device), self.sync,
                               check_invariants=self.check_invariants)
        cap = t.workload.max_concurrency if max_concurrency is None else max_concurrency
        return engine.run(requests, cap, follow_up)
