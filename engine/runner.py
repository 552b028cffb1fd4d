"""Run one measured trial: load -> apply optimizations -> warm up -> timed repeats -> accuracy."""
from __future__ import annotations

import logging
import os
import platform
import random
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from .backends import make_backend
from .config import EngineError, EngineTrial
from .fidelity import perplexity
from .generate import device_synchronizer, generate
from .memory import PeakMemory
from .metrics import median_metrics, static_batch_metrics, tokens_equal
from .models import LoadedModel, load_model
from .workload import corpus_ids, static_batch_prompts, windows

log = logging.getLogger(__name__)


@dataclass
class EngineResult:
    metrics: dict[str, float]
    token_ids: list[list[int]]  # generated ids per sequence
    sample_text: str  # decoded first sequence, for humans
    info: dict[str, str] = field(default_factory=dict)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def device_info(device: torch.device) -> dict[str, str]:
    info = {
        "device": str(device),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": str(os.cpu_count()),
        "torch_threads": str(torch.get_num_threads()),
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            info["ram_bytes"] = str(int(f.readline().split()[1]) * 1024)
    except OSError:
        pass
    if device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(device)
    else:
        info["device_name"] = info["cpu"]
    return info


def check_context(trial: EngineTrial, loaded: LoadedModel) -> None:
    need = trial.workload.context_len + trial.workload.max_new_tokens
    if loaded.max_positions and need > loaded.max_positions:
        raise EngineError(
            f"context_len + max_new_tokens = {need} exceeds the model's maximum of {loaded.max_positions} positions"
        )


def run_engine_trial(
    trial: EngineTrial,
    loaded: Optional[LoadedModel] = None,
    progress: Optional[Callable[[str], None]] = None,
) -> EngineResult:
    """Measure one configuration. `loaded` lets a warm worker reuse a model (same spec and attention)."""
    say = progress or (lambda msg: log.info(msg))
    if trial.threads > 0:
        torch.set_num_threads(trial.threads)
    seed_everything(trial.seed)
    if loaded is None:
        say(f"loading {trial.model.name}")
        loaded = load_model(trial.model, attention=trial.optimization.attention)
    check_context(trial, loaded)
    backend = make_backend(loaded, trial.optimization)
    device = loaded.device
    sync = device_synchronizer(device)
    wl = trial.workload
    prompts = static_batch_prompts(loaded.tokenizer, wl.text, wl.context_len, wl.batch_size).to(device)
    max_len = wl.context_len + wl.max_new_tokens

    def one_run():
        session = backend.new_session(wl.batch_size, max_len)
        return generate(session, prompts, wl.max_new_tokens, wl.sampling, trial.seed, sync)

    for i in range(wl.warmup):
        say(f"warm-up {i + 1}/{wl.warmup}")
        one_run()
    runs, traces = [], []
    with PeakMemory(device) as mem:
        for i in range(max(1, wl.repeats)):
            say(f"timed run {i + 1}/{wl.repeats}")
            trace = one_run()
            traces.append(trace)
            runs.append(static_batch_metrics(trace))
    # Sampling is seeded per run, so greedy or not, every repeat must produce the same tokens.
    for t in traces[1:]:
        if not tokens_equal(t.tokens, traces[0].tokens):
            raise EngineError("generation is not deterministic: repeats produced different tokens")
    metrics = median_metrics(runs)
    metrics["peak_mem_bytes"] = float(mem.peak_bytes)
    metrics["weights_bytes"] = float(backend.weights_bytes())
    metrics["model_load_s"] = float(loaded.load_s)
    if hasattr(backend, "extra_metrics"):  # backend-specific measurements of the timed runs (native)
        metrics.update(backend.extra_metrics())
    if trial.eval.enabled and trial.eval.num_windows > 0:
        say("evaluating perplexity")
        ids = corpus_ids(loaded.tokenizer, trial.eval.text)
        metrics.update(perplexity(backend, windows(ids, wl.context_len, trial.eval.num_windows).to(device)))
    token_ids = traces[0].tokens.tolist()
    return EngineResult(
        metrics=metrics,
        token_ids=token_ids,
        sample_text=loaded.tokenizer.decode(token_ids[0]),
        info=device_info(device),
    )
