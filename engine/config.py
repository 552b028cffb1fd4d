"""Plain dataclasses that describe one engine run.

The engine knows nothing of Hydra, Ray or MLflow: callers (a notebook, `experiments/`) build these
objects and call `engine.run_trial_engine`. Validation of user input lives in `experiments/`; the engine
only asserts its own invariants and raises `EngineError` with a clear message when asked the impossible.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

ATTENTION_IMPLS = ("eager", "sdpa", "flash")
KV_CACHE_MODES = ("off", "contiguous", "paged")
BACKENDS = ("hf", "native", "vllm")
# KV cache element type: auto = the model dtype; fp8 (e4m3) is vLLM's (engine=vllm only)
KV_CACHE_DTYPES = ("auto", "fp8")
DTYPES = ("float32", "bfloat16", "float16")
QUANT_LEVELS = ("none", "int8-weight", "int8-dynamic", "bnb-int8", "bnb-nf4", "bnb-fp4")
# int8-weight matmul: dequant = cast the int8 weight to the activation dtype per call, then a float GEMM;
# int8pack = torch._weight_int8pack_mm (gpt-fast's op; CPU/MPS only; unvectorized in some CPU builds)
INT8_KERNELS = ("dequant", "int8pack")
WORKLOAD_KINDS = ("static", "serving")
BATCHING_MODES = ("static", "continuous")
ARRIVALS = ("all-at-once", "fixed-rate", "poisson")
LENGTH_DISTS = ("fixed", "uniform")
SPECULATIVE_METHODS = ("off", "draft", "self-draft", "prompt-lookup")
PROMPT_STYLES = ("window", "repeat")


class EngineError(RuntimeError):
    """A request the engine cannot honour (bad path, unsupported backend on this device, ...)."""


@dataclass(frozen=True)
class TinyModelSpec:
    """A seeded random-weight Llama for fast tests (built from a transformers `LlamaConfig`)."""

    num_layers: int = 2
    hidden_size: int = 64
    intermediate_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    vocab_size: int = 384  # >= 259 so the byte tokenizer fits
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    seed: int = 0


@dataclass(frozen=True)
class ModelSpec:
    """Which model to load.

    `path` is a local HF checkpoint directory, a hub id, `prepared://NAME` (a model that
    `engine.prepare` converts once into a local checkpoint) or `tiny://NAME` (random weights from `tiny`).
    """

    name: str
    path: str
    dtype: str = "float32"
    revision: Optional[str] = None
    trust_remote_code: bool = False
    tiny: TinyModelSpec = field(default_factory=TinyModelSpec)


@dataclass(frozen=True)
class OptimizationSpec:
    """The switchable parts of the optimization chain."""

    backend: str = "hf"
    attention: str = "sdpa"
    kv_cache: str = "contiguous"
    kv_block_size: int = 16
    compile: bool = False
    prefix_caching: bool = False  # serving: reuse computed full blocks of a shared prompt prefix (paged cache)
    kv_num_blocks: int = 0  # serving: blocks in the shared pool; 0 = enough for max_batch_size longest requests
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES


@dataclass(frozen=True)
class QuantSpec:
    """Quantization level (see engine/quant.py for what each does) and mixed-precision exceptions."""

    level: str = "none"
    compute_dtype: str = "float32"  # bnb 4-bit compute dtype (bfloat16/float16 on GPUs)
    skip_modules: tuple[str, ...] = ("lm_head",)  # fnmatch patterns of module names kept in full precision
    keep_last_layers: int = 0  # mixed precision: the last N decoder layers stay unquantized
    kernel: str = "dequant"  # int8-weight matmul, one of INT8_KERNELS (see engine/quant.py)

    def __post_init__(self):
        object.__setattr__(self, "skip_modules", tuple(self.skip_modules))


@dataclass(frozen=True)
class SamplingSpec:
    """Greedy when `temperature == 0`; otherwise seeded multinomial sampling with optional top-k/top-p."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0


@dataclass(frozen=True)
class TextSource:
    """Where prompt and evaluation text comes from.

    `kind`: `pydoc` (the Python reference manual that ships with CPython, offline), `file` (`path`),
    or `datasets` (`name`, `split`, `column`; needs the `datasets` package and the data locally).
    """

    kind: str = "pydoc"
    path: Optional[str] = None
    name: Optional[str] = None
    config: Optional[str] = None
    split: str = "test"
    column: str = "text"


@dataclass(frozen=True)
class WorkloadSpec:
    """A static batch: `batch_size` prompts of exactly `context_len` tokens, `max_new_tokens` each.

    `prompt_style`: `window` (a window of the text, which the model continues: free generation) or
    `repeat` (an instruction to repeat a passage + the passage, both cut to context_len tokens in all:
    the output copies its context, which is what prompt-lookup decoding exploits)."""

    context_len: int = 128
    max_new_tokens: int = 32
    batch_size: int = 1
    warmup: int = 1
    repeats: int = 1
    sampling: SamplingSpec = field(default_factory=SamplingSpec)
    text: TextSource = field(default_factory=TextSource)
    prompt_style: str = "window"


@dataclass(frozen=True)
class SpeculativeSpec:
    """Speculative decoding: a drafter proposes `k` tokens, the target verifies them in one forward.

    `method`: `off`; `draft` (a separate model sharing the tokenizer, `draft_model`, its own KV cache);
    `self-draft` (the target's first `draft_layers` blocks + its final norm and LM head, weights shared);
    `prompt-lookup` (the tokens that followed the latest earlier occurrence of the context's last n-gram,
    n from `prompt_lookup_max` down to `prompt_lookup_min`; no model). Batch size 1 only."""

    method: str = "off"
    k: int = 4
    draft_layers: int = 1
    draft_model: Optional[ModelSpec] = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3

    @property
    def enabled(self) -> bool:
        return self.method != "off"


@dataclass(frozen=True)
class LengthSpec:
    """A token-length distribution: `fixed` (always `value`) or `uniform` over [min, max] (inclusive)."""

    dist: str = "fixed"
    value: int = 128
    min: int = 32
    max: int = 256


@dataclass(frozen=True)
class ServingSpec:
    """A serving workload: `num_requests` requests with seeded input/output lengths arriving over time.

    Each prompt is the shared system-prompt prefix (`prefix_len` tokens, the same for every request)
    followed by `input_len` tokens of its own; it generates exactly `output_len` tokens. `length_trace`, a
    JSONL file of {"input_len": .., "output_len": ..} lines, replaces both distributions (requests take
    its lines in order, cycling). Arrivals: `all-at-once` (t=0), `fixed-rate` (every 1/rate s) or
    `poisson` at `rate` requests/s with gamma-distributed gaps of shape `burstiness` (1 = Poisson,
    < 1 burstier, > 1 more regular; vLLM's benchmark convention). `max_concurrency` (0 = unlimited) is a
    client-side cap on requests in flight: a request beyond it is sent when one finishes, and its latency
    counts from then. The same seed gives the same requests."""

    num_requests: int = 64
    input_len: LengthSpec = field(default_factory=LengthSpec)
    output_len: LengthSpec = field(default_factory=lambda: LengthSpec(value=32, min=16, max=64))
    length_trace: Optional[str] = None
    arrival: str = "all-at-once"
    rate: float = 4.0
    burstiness: float = 1.0
    prefix_len: int = 0
    max_concurrency: int = 0


@dataclass(frozen=True)
class BatchingSpec:
    """How a serving workload's requests share forward passes (engine/serving/scheduler.py).

    `static`: take up to `max_batch_size` waiting requests, run that batch until its longest request is
    done, then form the next. `continuous`: iteration-level scheduling; every step finished sequences
    leave and waiting ones are admitted while the batch has fewer than `max_batch_size` sequences, the
    step stays within `max_batch_tokens` new tokens and the KV pool has blocks (preempting the newest
    running sequence by recompute when it runs out). `chunked_prefill` splits prompts across steps to
    fit `max_batch_tokens` instead of waiting for a step with room for the whole prompt."""

    mode: str = "static"
    max_batch_size: int = 8
    max_batch_tokens: int = 2048
    chunked_prefill: bool = False


@dataclass(frozen=True)
class SLOSpec:
    """Service-level objectives for goodput: a request counts when it meets both."""

    ttft_ms: float = 2000.0
    tpot_ms: float = 200.0


@dataclass(frozen=True)
class EvalSpec:
    """Accuracy measurement over `num_windows` windows of `workload.context_len` tokens: perplexity, and
    with `fidelity` also KL divergence / top-1 agreement against the unoptimized reference (the same model
    in float32 on the hf backend, no quantization), whose top-`topk` log-probs are cached on disk."""

    enabled: bool = True
    num_windows: int = 2
    fidelity: bool = False
    topk: int = 256
    text: TextSource = field(default_factory=TextSource)


@dataclass(frozen=True)
class EngineTrial:
    """Everything the engine needs for one measured trial."""

    model: ModelSpec
    optimization: OptimizationSpec = field(default_factory=OptimizationSpec)
    quant: QuantSpec = field(default_factory=QuantSpec)
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    eval: EvalSpec = field(default_factory=EvalSpec)
    speculative: SpeculativeSpec = field(default_factory=SpeculativeSpec)
    seed: int = 0
    threads: int = 0  # torch intra-op threads; 0 leaves torch's default
    serving: Optional[ServingSpec] = None  # a serving workload instead of `workload`'s static batch
    batching: BatchingSpec = field(default_factory=BatchingSpec)
    slo: SLOSpec = field(default_factory=SLOSpec)
