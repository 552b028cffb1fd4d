"""Logits-level engines (hf, native, llama.cpp): a `Backend` turns token ids into logits, and one adapter
(`LogitsEngine` / `LogitsSession`) turns any such backend into the trial contract (engine/engines/base.py):
the decode loop (engine/generate.py), speculative decoding (engine/speculative/) and window scoring are
written once here, on top of `Backend.new_session` / `DecodeSession.forward` (engine/traces.py) / `Backend.score`.

Shapes: B = batch, T = new tokens in this call, V = vocabulary.
"""
from __future__ import annotations

from typing import Any, Protocol

import torch

from ..config import EngineError, TrialConfig
from ..traces import DecodeSession
from .base import Engine, Problems, Runs, Say, ServingPlan, StaticPlan, TrialSession, WindowScores, ends_generation


class Backend(Protocol):
    name: str

    def new_session(self, batch_size: int, max_len: int) -> DecodeSession:
        """A fresh session able to hold `max_len` tokens per sequence."""
        ...

    def score(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits [B, T, V] for input_ids [B, T] (no cache kept)."""
        ...

    # Optional (`scores_trees` True): logits [R, V] float32 of `pack.rows` for one row of context-shared trees
    # (engine/engines/packing.py: its tokens at their positions, attention by `pack.mask`).
    # def score_tree(self, pack: TreePack) -> torch.Tensor: ...

    def weights_bytes(self) -> int: ...


# --- the adapter ---------------------------------------------------------------------------------------

class LogitsEngine(Engine):
    """An engine whose runtime is a `Backend` in this process. Subclasses say how to load the model and
    how to build the backend; serving engines override `LogitsSession.run_serving` via `session_class`."""

    task_requests = ("loglikelihood", "generate_until")  # full logits: any token sequence scores and decodes

    def make_backend(self, loaded: Any, trial: TrialConfig) -> Backend:
        raise NotImplementedError

    def open(self, trial: TrialConfig, loaded: Any, say: Say) -> "LogitsSession":
        return self.session_class(self, trial, loaded, self.make_backend(loaded, trial))

    @property
    def session_class(self):
        return LogitsSession


def torch_checks(trial: TrialConfig, gpu_available: bool) -> Problems:
    """Rules every engine that runs torch kernels in this process shares."""
    if trial.attention.impl == "flash" and not gpu_available:
        return [("attention.impl", "flash needs a CUDA GPU (none requested/available); use sdpa or eager "
                                   "(or engine=llamacpp, whose flash attention runs on CPU)")]
    return []


class LogitsSession(TrialSession):
    """The trial contract over a logits-level backend: warm-up and timed repeats of the static batch
    (plain or speculative decoding), peak memory of the timed region, and window scoring by full logits."""

    def __init__(self, engine: LogitsEngine, trial: TrialConfig, loaded: Any, backend: Backend):
        self.engine, self.trial, self.loaded, self.backend = engine, trial, loaded, backend
        self.tokenizer = loaded.tokenizer
        self.device = loaded.device
        self.load_s = float(loaded.load_s)
        self._draft = None

    def run_static(self, plan: StaticPlan, say: Say) -> Runs:
        from ..generate import device_synchronizer, generate
        from ..measure.memory import PeakMemory

        trial, spec = self.trial, self.trial.speculative
        sync = device_synchronizer(self.device)
        prompts = plan.prompts.to(self.device)
        max_len = int(prompts.shape[1]) + plan.max_new_tokens
        draft = None
        if spec.enabled:  # the drafter (a draft model is loaded here) is built outside every timed region
            from ..speculative import generate_speculative, make_draft_source

            say(f"preparing the {spec.method} drafter")
            draft = self._draft = make_draft_source(trial, self.loaded)

        def one_run(new_tokens: int):
            session = self.backend.new_session(int(prompts.shape[0]), max_len)
            if draft is not None:
                return generate_speculative(session, draft.new(max_len), prompts, new_tokens, spec.k,
                                            trial.workload.sampling, trial.seed, sync)
            return generate(session, prompts, new_tokens, trial.workload.sampling, trial.seed, sync)

        for i in range(plan.warmup):
            # the full prefill plus a couple of decode steps warms every kernel and allocation size;
            # decoding all max_new_tokens again would only cost time (speculative: one full k-token verification)
            say(f"warm-up {i + 1}/{plan.warmup}")
            one_run(min(plan.max_new_tokens, 2 if draft is None else spec.k + 2))
        self.reset_peaks()
        traces, extra = [], []
        with PeakMemory(self.device) as mem:
            for i in range(plan.repeats):
                say(f"timed run {i + 1}/{plan.repeats}")
                trace = one_run(plan.max_new_tokens)
                traces.append(trace)
                extra.append(self.run_metrics(trace))
        return Runs(traces, extra, mem.peak_bytes)

    def run_metrics(self, trace) -> dict[str, float]:
        """Metrics of one timed run beyond the trace's timings: speculative decoding's statistics."""
        from ..measure.metrics import speculative_metrics

        stats = trace.extra.get("speculative")
        return speculative_metrics(stats) if stats is not None else {}

    def reset_peaks(self) -> None:
        """Forget transient peaks of the warm-up (an engine that tracks its own, e.g. native's attention)."""

    def run_serving(self, plan: ServingPlan, say: Say) -> Runs:
        from . import all_engines

        serves = " or ".join(e.serving_usage or f"engine={e.name}" for e in all_engines() if e.serves)
        raise EngineError(f"engine={self.engine.name} runs one static batch; serving workloads run on {serves}")

    def score_windows(self, windows: torch.Tensor, topk: int, say: Say) -> WindowScores:
        return self.backend

    def loglikelihood(self, pairs: list[tuple[list[int], list[int]]], say: Say) -> list[tuple[float, bool]]:
        """Teacher-forced on the trial's model as it runs here. Where the backend scores trees
        (`Backend.score_tree`: hf, native with eager or sdpa attention), the requests that share a context are
        scored as one tree (engine/engines/packing.py: each context once, logits only where a target is scored);
        otherwise, and for a request with an empty context, one by one in padded batches (`padded_loglikelihood`)."""
        from .packing import pack_trees, tree_results

        if not getattr(self.backend, "scores_trees", False):
            return self.padded_loglikelihood(pairs, say)
        packs, alone = pack_trees(pairs, device=self.device)
        out: list = [None] * len(pairs)
        done, total = 0, len(pairs)
        for n, pack in enumerate(packs):
            if n % 16 == 0:
                say(f"scoring {done + 1}/{total} (context-shared rows {n + 1}/{len(packs)})")
            for i, res in tree_results(pack, self.backend.score_tree(pack)):
                out[i] = res
            done += len(pack.targets)
        if alone:
            for i, res in zip(alone, self.padded_loglikelihood([pairs[i] for i in alone], say)):
                out[i] = res
        return out

    def padded_loglikelihood(self, pairs: list[tuple[list[int], list[int]]], say: Say,
                             batch: int = 8) -> list[tuple[float, bool]]:
        """Teacher-forced by `Backend.score`, `batch` pairs per call, right-padded: a causal model's logits at a
        position never see the positions after it."""
        out = []
        for start in range(0, len(pairs), batch):
            if start % (batch * 8) == 0:
                say(f"scoring {start + 1}/{len(pairs)}")
            chunk = pairs[start:start + batch]
            seqs = [list(ctx) + list(cont)[:-1] for ctx, cont in chunk]
            width = max(len(q) for q in seqs)
            ids = torch.tensor([q + [0] * (width - len(q)) for q in seqs], dtype=torch.long, device=self.device)
            logits = self.backend.score(ids)
            for row, (ctx, cont) in enumerate(chunk):
                logp = torch.log_softmax(logits[row, len(ctx) - 1:len(ctx) - 1 + len(cont)].float(), dim=-1)
                target = torch.tensor(cont, dtype=torch.long, device=logp.device)
                out.append((float(logp.gather(-1, target[:, None]).sum()), bool((logp.argmax(-1) == target).all())))
        return out

    def generate_greedy(self, prompt: list[int], max_new_tokens: int, stop: list[str], say: Say) -> list[int]:
        """Greedy decoding on the trial's decode path (its KV cache), one token per step."""
        session = self.backend.new_session(1, len(prompt) + max_new_tokens)
        with torch.inference_mode():
            logits = session.forward(torch.tensor([prompt], dtype=torch.long, device=self.device))
            out: list[int] = []
            while len(out) < max_new_tokens:
                nxt = int(logits[0, -1].argmax())
                out.append(nxt)
                if ends_generation(out, self.tokenizer, stop):
                    break
                if len(out) < max_new_tokens:
                    logits = session.forward(torch.tensor([[nxt]], dtype=torch.long, device=self.device))
        return out

    def weights_bytes(self) -> int:
        return int(self.backend.weights_bytes())  # a draft model's own weights: draft_weights_bytes

    def metrics(self) -> dict[str, float]:
        return {"draft_weights_bytes": float(self._draft.weights_bytes)} if self._draft is not None else {}

    def info(self) -> dict[str, str]:
        return {}
