"""Run one measured trial: load -> apply optimizations -> warm up -> timed repeats -> accuracy."""
from __future__ import annotations

import dataclasses
import logging
import os
import platform
import random
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from .backends import make_backend
from .config import EngineError, TrialConfig, replace
from .measure.fidelity import ReferenceCache, compute_reference, fidelity, perplexity
from .generate import device_synchronizer, generate
from .measure.memory import PeakMemory
from .measure.metrics import median_metrics, speculative_metrics, static_batch_metrics, tokens_equal
from .models import LoadedModel, cache_root, load_model
from .prompts import corpus_ids, windows, workload_prompts

log = logging.getLogger(__name__)


@dataclass
class EngineResult:
    metrics: dict[str, float]
    token_ids: list[list[int]]  # generated ids per sequence
    sample_text: str  # decoded first sequence, for humans
    info: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)  # what the trial *is* (regime.*), not where it ran


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


def check_context(trial: TrialConfig, loaded: LoadedModel) -> None:
    need = trial.workload.context_len + trial.workload.max_new_tokens
    if loaded.max_positions and need > loaded.max_positions:
        raise EngineError(
            f"context_len + max_new_tokens = {need} exceeds the model's maximum of {loaded.max_positions} positions"
        )


def load_trial_model(trial: TrialConfig, progress: Optional[Callable[[str], None]] = None):
    """The trial's model. engine=llamacpp holds no HF model (its peak memory is llama.cpp's): only the
    tokenizer, the config and the GGUF (engine/backends/llamacpp.py)."""
    if trial.engine.backend == "llamacpp":
        from .backends.llamacpp import load_gguf_model

        return load_gguf_model(trial.model, trial.quant, trial.engine.threads, progress)
    return load_model(trial.model, attention=trial.attention.impl, quant=trial.quant)


def reference_backend(trial: TrialConfig, loaded: LoadedModel):
    """The unoptimized reference of the same model: float32, hf backend, sdpa, no quantization.
    Reuses the trial's own model when the trial *is* the reference configuration."""
    from .backends.hf import HFBackend

    ref = TrialConfig(model=dataclasses.replace(trial.model, dtype="float32"))  # defaults: hf, sdpa, no quant
    if (isinstance(loaded, LoadedModel) and trial.model.dtype == "float32" and loaded.quant.level == "none"
            and trial.attention.impl == "sdpa"):
        return HFBackend(loaded, ref)
    ref_model = load_model(ref.model, attention="sdpa", device=str(loaded.device))
    return HFBackend(ref_model, ref)


def evaluate_fidelity(trial: TrialConfig, backend, loaded: LoadedModel, evw: torch.Tensor) -> dict[str, float]:
    identity = {k: v for k, v in dataclasses.asdict(trial.model).items() if k != "dtype"}
    cache = ReferenceCache(cache_root() / "fidelity")
    key = cache.key(identity, evw.cpu(), trial.eval.topk)
    ref, cached = cache.get_or_compute(
        key, lambda: compute_reference(reference_backend(trial, loaded), evw, trial.eval.topk)
    )
    out = fidelity(backend, evw, ref)
    out["fidelity_ref_cached"] = float(cached)
    return out


def roofline(trial: TrialConfig, loaded: LoadedModel, metrics: dict[str, float]) -> dict[str, str]:
    """Add the cost model's roofline metrics to `metrics`; return its regime labels. A model the cost model
    cannot read (an unusual architecture) costs the trial nothing but these numbers."""
    from .measure.costmodel import assess_trial

    try:
        a = assess_trial(trial, loaded.config, loaded.device, metrics)
    except EngineError as e:
        log.warning("cost model skipped: %s", e)
        return {"costmodel": f"unavailable: {e}"}
    metrics.update(a.metrics)
    return a.labels


def evaluate(trial: TrialConfig, backend, loaded: LoadedModel, metrics: dict[str, float], say) -> None:
    """Accuracy at `workload.context_len` (perplexity, or fidelity against the reference) into `metrics`."""
    if not (trial.eval.enabled and trial.eval.num_windows > 0):
        return
    ids = corpus_ids(loaded.tokenizer, trial.eval.text)
    evw = windows(ids, trial.workload.context_len, trial.eval.num_windows).to(loaded.device)
    if trial.eval.fidelity:
        say("evaluating fidelity against the reference")
        metrics.update(evaluate_fidelity(trial, backend, loaded, evw))
    else:
        say("evaluating perplexity")
        metrics.update(perplexity(backend, evw))


def run_engine_trial(
    trial: TrialConfig,
    loaded: Optional[LoadedModel] = None,
    progress: Optional[Callable[[str], None]] = None,
) -> EngineResult:
    """Measure one configuration. `loaded` lets a warm worker reuse a model (same spec and attention)."""
    say = progress or (lambda msg: log.info(msg))
    if trial.engine.backend == "vllm":  # vLLM runs in its own interpreter; no model is loaded here
        from .backends.vllm_runner import run_vllm_trial

        return run_vllm_trial(trial, say)
    if trial.engine.threads > 0:
        torch.set_num_threads(trial.engine.threads)
    seed_everything(trial.seed)
    if loaded is None:
        say(f"loading {trial.model.name}")
        loaded = load_trial_model(trial, say)
    backend = make_backend(loaded, trial)
    device = loaded.device
    if trial.workload.serving:  # requests arriving over time, scheduled (engine/serving)
        from .serving.serve import run_serving

        metrics, token_ids = run_serving(trial, loaded, backend, say)
        evaluate(trial, backend, loaded, metrics, say)
        return EngineResult(metrics=metrics, token_ids=token_ids, sample_text=loaded.tokenizer.decode(token_ids[0]),
                            info=device_info(device))
    check_context(trial, loaded)
    sync = device_synchronizer(device)
    wl = trial.workload
    prompts = workload_prompts(loaded.tokenizer, wl).to(device)
    max_len = wl.context_len + wl.max_new_tokens
    spec = trial.speculative
    draft = None
    if spec.enabled:  # the drafter (a draft model is loaded here) is built outside every timed region
        from .speculative import generate_speculative, make_draft_source

        say(f"preparing the {spec.method} drafter")
        draft = make_draft_source(trial, loaded)

    def one_run(new_tokens: int = wl.max_new_tokens):
        session = backend.new_session(wl.batch_size, max_len)
        if draft is not None:
            return generate_speculative(session, draft.new(max_len), prompts, new_tokens, spec.k, wl.sampling,
                                        trial.seed, sync)
        return generate(session, prompts, new_tokens, wl.sampling, trial.seed, sync)

    for i in range(wl.warmup):
        # the full prefill plus a couple of decode steps warms every kernel and allocation size;
        # decoding all max_new_tokens again would only cost time (speculative: one full k-token verification)
        say(f"warm-up {i + 1}/{wl.warmup}")
        one_run(min(wl.max_new_tokens, 2 if draft is None else spec.k + 2))
    runs, traces = [], []
    with PeakMemory(device) as mem:
        for i in range(max(1, wl.repeats)):
            say(f"timed run {i + 1}/{wl.repeats}")
            trace = one_run()
            traces.append(trace)
            m = static_batch_metrics(trace)
            if "speculative" in trace.extra:
                m.update(speculative_metrics(trace.extra["speculative"]))
            runs.append(m)
    # Sampling is seeded per run, so greedy or not, every repeat must produce the same tokens.
    for t in traces[1:]:
        if not tokens_equal(t.tokens, traces[0].tokens):
            raise EngineError("generation is not deterministic: repeats produced different tokens")
    metrics = median_metrics(runs)
    metrics["peak_mem_bytes"] = float(mem.peak_bytes)
    metrics["weights_bytes"] = float(backend.weights_bytes())
    if draft is not None:
        metrics["draft_weights_bytes"] = float(draft.weights_bytes)
    metrics["model_load_s"] = float(loaded.load_s)
    if hasattr(backend, "extra_metrics"):  # backend-specific measurements of the timed runs (native)
        metrics.update(backend.extra_metrics())
    labels = roofline(trial, loaded, metrics)
    evaluate(trial, backend, loaded, metrics, say)
    token_ids = traces[0].tokens.tolist()
    return EngineResult(
        metrics=metrics,
        token_ids=token_ids,
        sample_text=loaded.tokenizer.decode(token_ids[0]),
        info=device_info(device),
        labels=labels,
    )
