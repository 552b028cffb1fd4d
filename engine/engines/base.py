"""The engine contract: what every engine declares about itself, and the trial-level session the one
pipeline (engine/pipeline.py) drives. An engine is a package under engine/engines/ whose `ENGINE` is an
`Engine`; the registry (engine/engines/__init__.py) lists the packages, and validation, the cost model,
the README's tables and the trial pipeline ask it -- none of them spells an engine's name.

The pipeline owns the measurement protocol: it hands a session a plan (warm-up count, repeats) and gets
back one raw trace per timed repeat; it turns traces into metrics (engine/measure/metrics.py), checks
determinism, takes medians, and scores evaluation windows for perplexity / fidelity. An engine owns only
what is its own: loading, running the plan, scoring windows, its bytes and its extra facts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

import torch

from ..config import EngineError, TrialConfig
from ..measure.fidelity import WindowScores
from ..traces import Trace

Problems = list[tuple[str, str]]  # (config key, message): validation's currency
Say = Callable[[str], None]


@dataclass(frozen=True)
class Support:
    """What an engine does with one config key: the values it honours, the values it runs *as* another
    (`aliases`: asked value -> value it really runs; aliased trials fold to one config hash), and what it
    does instead when asked for anything else."""

    values: tuple[str, ...]
    why: str
    aliases: Mapping[str, str] = field(default_factory=dict)

    def accepts(self, value: Any) -> bool:
        return str(value) in self.values or str(value) in self.aliases

    def runs_as(self, value: Any) -> Any:
        """The value the engine really runs when asked for `value` (its alias target, else `value`)."""
        return self.aliases.get(str(value), value)


@dataclass
class StaticPlan:
    """A static batch: the prompts [B, T], how many tokens to generate, warm-up runs and timed repeats."""

    prompts: torch.Tensor
    max_new_tokens: int
    warmup: int
    repeats: int


@dataclass
class ServingPlan:
    """A serving run: requests arriving over time (engine/serving/requests.py), warm-up requests, repeats."""

    requests: list
    warmup_requests: list
    warmup: int
    repeats: int
    # multi-turn: (finished request, its output, finish time s) -> the request it leads to, or None
    follow_up: Optional[Callable[[Any, list, float], Any]] = None
    max_concurrency: int = 0  # client-side cap on requests in flight (0 = none; a capacity search's
    # synchronous probe sends one at a time)


@dataclass
class Runs:
    """What a session measured: one trace per timed repeat (engine/traces.py: a GenerationTrace for a static
    batch, a ServedRun for serving), each repeat's engine-specific metrics (speculative statistics,
    vLLM's scheduler counters), and the peak memory of the timed region."""

    traces: list[Trace]
    extra: list[dict[str, float]]
    peak_mem_bytes: int


GreedyRequest = tuple[list[int], int, list[str]]  # (prompt ids, max_new_tokens, stop strings)


class TrialSession:
    """One trial's model on one engine, ready to run. Made by `Engine.open`; the pipeline drives it. Every
    member the pipeline and the task evaluation call is declared here; the optional ones have their default."""

    tokenizer: Any  # engine/tokenizer.py Tokenizer: prompts and evaluation windows are built with it
    device: torch.device
    load_s: float  # seconds the model took to load / start (0 when a warm worker reused it)

    def run_static(self, plan: StaticPlan, say: Say) -> Runs:
        raise NotImplementedError

    def run_serving(self, plan: ServingPlan, say: Say) -> Runs:
        raise NotImplementedError

    def score_windows(self, windows: torch.Tensor, topk: int, say: Say) -> WindowScores:
        raise NotImplementedError

    # Task evaluation (engine/tasks: lm-evaluation-harness requests), where `Engine.task_requests` lists them:
    def loglikelihood(self, pairs: list[tuple[list[int], list[int]]], say: Say) -> list[tuple[float, bool]]:
        """For each (context ids, continuation ids): the sum of log p(continuation token | everything before
        it) and whether every continuation token was the model's argmax ("loglikelihood")."""
        raise NotImplementedError

    def generate_greedy(self, prompt: list[int], max_new_tokens: int, stop: list[str], say: Say) -> list[int]:
        """Greedy tokens after `prompt`, ending after EOS, `max_new_tokens`, or the token that completes one of
        the `stop` strings in the decoded output ("generate_until"; `ends_generation` says where)."""
        raise NotImplementedError

    def generate_greedy_many(self, requests: list[GreedyRequest], say: Say) -> list[list[int]]:
        """Every (prompt, max_new_tokens, stop) of a task, each answer as `generate_greedy` gives it. Default: one
        `generate_greedy` per request; an engine whose start costs much answers them all at once (one start)."""
        out = []
        for i, (prompt, max_new, stop) in enumerate(requests):
            say(f"generating {i + 1}/{len(requests)} ({len(prompt)} prompt tokens)")
            out.append(self.generate_greedy(prompt, max_new, stop, say))
        return out

    def weights_bytes(self) -> int:
        raise NotImplementedError

    def metrics(self) -> dict[str, float]:
        """Engine-specific metrics of the timed runs as a whole (native: attention's transient peak)."""
        return {}

    def info(self) -> dict[str, str]:
        """Where and how it ran, for the run's tags (versions, thread binding)."""
        return {}

    def artifacts(self) -> dict[str, str]:
        """Files for the run's record, name -> text (a served trial: its server's command and log). Default: none."""
        return {}

    def close(self) -> None:
        """End what the session holds outside this process (vLLM's server); the pipeline calls it once the trial
        is measured and evaluated (engine/pipeline.py `close_session`). Default: nothing to end."""


def ends_generation(out: list[int], tokenizer: Any, stop: list[str]) -> bool:
    """Whether greedy generation ends after `out`: its last token is EOS, or its decoded text holds a stop string
    (every engine cuts its answers here, so they compare token for token)."""
    return bool(out) and (out[-1] == tokenizer.eos_token_id or any(s and s in tokenizer.decode(out) for s in stop))


def cut_generation(out: list[int], tokenizer: Any, stop: list[str]) -> list[int]:
    """`out` (greedy tokens generated past the end) cut after the token where `ends_generation` first holds."""
    for n in range(1, len(out) + 1):
        if ends_generation(out[:n], tokenizer, stop):
            return out[:n]
    return out


@dataclass(frozen=True)
class DeployCommands:
    """The command(s) that deploy a trial's configuration on its engine's own server (experiments/optimize/deploy.py
    prints them as the optimizer's deliverable), and notes for whoever runs them."""

    commands: tuple[str, ...]
    notes: tuple[str, ...] = ()


WeightsFile = Callable[[TrialConfig], str]  # trial -> the path of the weights file its trials loaded


class Engine:
    """An engine's declaration. Subclasses set the class attributes and implement `load`/`open`."""

    name: str = ""
    summary: str = ""  # one line for tables and --help
    setup: str = ""  # how to install what it needs beyond `make setup` ("" = nothing)
    support: Mapping[str, Support] = {}  # config key -> what it honours; a key not listed: every value
    serves: bool = False  # runs serving workloads (requests arriving over time)
    serving_usage: str = ""  # the overrides that make a serving trial run on it, for error messages
    # runs a capacity search (capacity.search: the pipeline probes the same requests at several rates);
    # searches_capacity_why: why not, for an engine that serves but cannot
    searches_capacity: bool = False
    searches_capacity_why: str = ""
    # serves workload.kind=multi-turn: requests that follow finished ones (ServingPlan.follow_up)
    serves_conversations: bool = False
    serves_conversations_why: str = ""
    # its timed work runs in this process (and threads), so /proc can tell other processes' CPU time from its
    # own (engine/measure/noise.py); an engine that runs in other processes cannot be told apart that way
    in_process: bool = True
    # runs in its own process that the session keeps between runs (a server started once per trial), so its runs
    # can be interleaved round-robin with other trials' (both servers up, one driven at a time)
    interleaves: bool = False
    # its greedy outputs may change with the batch a request shares (continuous batching over floating-point kernels
    # whose reduction order follows the batch's shape): repeats that differ are counted (metric
    # `outputs_changed`, the share of requests whose tokens differ from the first repeat's), not a failure
    batch_variant_outputs: bool = False
    # the lm-evaluation-harness request types its sessions serve (engine/tasks): "loglikelihood" (also
    # multiple choice and rolling), "generate_until" (greedy); task_why: why the others are not (for messages)
    task_requests: tuple[str, ...] = ()
    task_why: str = ""
    # runs the draft of speculative.method=self-draft (the target's first layers) over the in-process model a torch
    # engine loaded, whatever engine runs the target (engine/speculative/self_draft.py asks the registry for it)
    runs_self_draft: bool = False

    def missing(self) -> Optional[str]:
        """Why this engine cannot run on this machine (not installed), or None."""
        return None

    def check(self, trial: TrialConfig, facts, gpu_available: bool) -> Problems:
        """The engine's own rules beyond `support` (several keys, the model's facts, the hardware).
        `facts`: engine.model_facts.ModelFacts, or None where the model is not on this machine yet."""
        return []

    def materializes_scores(self, trial: TrialConfig) -> bool:
        """Whether its attention writes the [T, S] score matrix to memory (the cost model charges it)."""
        return False

    def weight_level(self, trial: TrialConfig) -> str:
        """The weight format the trial's matmuls read, as a quant level the cost model knows: quant.level, or
        what a level that names a file (llama.cpp's gguf-shipped) holds."""
        return trial.quant.level

    def skip_modules(self, trial: TrialConfig) -> list[str]:
        """The modules the engine keeps in full precision at the trial's quant level (the cost model prices the LM
        head by it): quant.skip_modules for our levels; an engine whose weight format covers every matrix says so."""
        return list(trial.quant.skip_modules)

    def kv_element_bytes(self, trial: TrialConfig) -> Optional[float]:
        """Bytes per K/V element at `kv_cache.dtype`; None: the model's dtype."""
        return None

    def compute_dtype(self, trial: TrialConfig, device: torch.device) -> str:
        """The number format whose arithmetic units run the trial's matmuls on `device`: the roofline's peaks
        (engine/measure/hardware.py `node_peaks`) and the slow-dtype note are judged at it, so each engine says
        which dtype paths it runs fast here. Default (torch): the model's dtype -- on a CPU bf16 is fast only
        with avx512_bf16/amx_bf16 units and fp16 is slow without avx512_fp16/amx_fp16."""
        return trial.model.dtype

    def load(self, trial: TrialConfig, say: Say) -> Any:
        """The model in this process, reusable by the next trial with the same model key (a warm worker
        keeps it); None where the engine holds nothing here (it loads in its own process)."""
        return None

    def open(self, trial: TrialConfig, loaded: Any, say: Say) -> TrialSession:
        raise NotImplementedError

    def make_backend(self, loaded: Any, trial: TrialConfig) -> Any:
        """The logits-level backend (engine/engines/logits.py `Backend`) over a model from `load`: what tests,
        benchmarks, notebooks and the speculative drafters drive token by token. Default: none in this process."""
        raise EngineError(f"engine={self.name} runs whole trials (engine.pipeline.run_engine_trial); it has no "
                          "logits-level backend in this process")

    def self_draft_backend(self, loaded: Any, trial: TrialConfig, num_layers: int) -> Any:
        """Where `runs_self_draft`: a logits-level backend over the first `num_layers` decoder blocks of `loaded`
        (weights shared with the target), the draft of `trial`'s self-draft."""
        raise EngineError(f"engine={self.name} does not run self-draft drafts")

    def self_draft_problem(self, facts, num_tokens: int) -> Optional[str]:
        """Where `runs_self_draft`: why it cannot run the draft of a model with these facts
        (engine.model_facts.ModelFacts) over `num_tokens` positions; None when it can."""
        return None

    def reference(self, trial: TrialConfig, loaded: Any) -> Any:
        """The unoptimized reference of `trial`'s model (a logits-level `Backend`: float32, the engine's default
        attention, no quantization) that fidelity and task accuracy compare against; asked of the registry's
        `REFERENCE` engine. `loaded`: the trial's own model, reused where it already is the reference."""
        raise EngineError(f"engine={self.name} has no fp32 reference backend; the reference engine is the default one")

    def deploy_commands(self, trial: TrialConfig, weights_file: Optional[WeightsFile] = None) -> Optional[DeployCommands]:
        """The server command(s) that deploy `trial`'s configuration, where this engine is one users deploy (translated
        from the settings its trials ran with); None for an in-process engine, measured but not served: its
        configuration itself is the deliverable. `weights_file`: the path of the weights file the trials loaded, for an
        engine that runs one of its own (None: named by what it holds). May raise EngineError (e.g. a draft model
        that cannot be resolved here)."""
        return None

    def weights_file(self, trial: TrialConfig) -> Optional[str]:
        """The weights file of its own format the trials loaded (cached by content), where the engine converts the
        checkpoint into one; None where it loads the checkpoint itself. May raise EngineError or OSError."""
        return None
