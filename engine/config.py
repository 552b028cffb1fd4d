"""The trial config: one set of plain dataclasses, shaped exactly like the config users write.

A field path here is the key a user types: `trial.kv_cache.mode` is `kv_cache.mode`, `trial.engine.backend`
is `engine.backend`. The same classes are the engine's input (a notebook builds them by hand) and the Hydra
schema (`experiments.config.schema` registers them in the ConfigStore), so every default lives here and
nowhere else, and validation messages name config keys with no translation table.

The engine knows nothing of Hydra, Ray or MLflow: the classes are plain and mutable (OmegaConf merges into
them); treat an instance as a value. `TrialConfig.from_dict` builds one from plain containers (a resolved
config, a stored run) and rejects unknown keys.
"""
from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

ATTENTION_IMPLS = ("eager", "sdpa", "flash")
KV_CACHE_MODES = ("off", "contiguous", "paged")
DTYPES = ("float32", "bfloat16", "float16")
# the levels engine/quant.py implements (the torch engines'); an engine adds its own through its support table
# (llama.cpp's gguf-* weight types): validation accepts `engine.engines.values("quant.level")`, every engine's
QUANT_LEVELS = ("none", "int8-weight", "int8-dynamic", "bnb-int8", "bnb-nf4", "bnb-fp4", "int4-weight")
# kv_cache.dtype (the K/V element type) has no engine-independent values but `auto` (the engine's default): each
# engine declares its own (engine/engines/<name>), and validation accepts `engine.engines.values("kv_cache.dtype")`
# likewise quant.kernel (engine/quant.py's matmuls, declared by the torch engines hf and native: engine/engines/hf
# TORCH_KERNELS) and engine.compile_mode (engine=native's COMPILE_MODES: engine/engines/native)
WORKLOAD_KINDS = ("static", "serving", "multi-turn")
BATCHING_MODES = ("static", "continuous")
ARRIVALS = ("all-at-once", "fixed-rate", "poisson")
LENGTH_DISTS = ("fixed", "uniform")
SPECULATIVE_METHODS = ("off", "draft", "self-draft", "prompt-lookup")
PROMPT_STYLES = ("window", "repeat")
TEXT_KINDS = ("pydoc", "file", "datasets")


def added(implicit: Any) -> dict[str, Any]:
    """Field metadata of a key added after the first schema: `implicit` is the value every config written
    before it existed had (what that code did). A config hash leaves the key out at that value, so runs
    recorded earlier keep their hashes (experiments/hashing.py)."""
    return {"added_implicit": implicit}


def added_keys(cls=None, prefix: str = "") -> dict[str, Any]:
    """{dotted key: implicit value} of every `added` field under `cls` (default: TrialConfig)."""
    cls = cls or TrialConfig
    out: dict[str, Any] = {}
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        if "added_implicit" in f.metadata:
            out[key] = f.metadata["added_implicit"]
        sub = _dataclass_of(hints[f.name])
        if sub is not None:
            out.update(added_keys(sub, key + "."))
    return out


class EngineError(RuntimeError):
    """A request the engine cannot honour (bad path, unsupported backend on this device, ...)."""


@dataclass
class TinyModelConfig:
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


@dataclass
class ModelConfig:
    """Which model to load. `path`: a local HF checkpoint directory, a hub id, `prepared://NAME` (a model
    `engine.prepare_model` converts once into a local checkpoint) or `tiny://NAME` (random weights from
    `tiny`)."""

    name: str
    path: str
    dtype: str = "float32"
    revision: Optional[str] = None
    trust_remote_code: bool = False
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)


@dataclass
class AttentionConfig:
    impl: str = "sdpa"  # eager | sdpa | flash


@dataclass
class KVCacheConfig:
    mode: str = "contiguous"  # off | contiguous | paged
    block_size: int = 16  # tokens per block (paged)
    prefix_caching: bool = False  # serving: reuse computed full blocks of a shared prompt prefix (paged)
    num_blocks: int = 0  # serving: blocks in the shared pool; 0 = max_batch_size x the longest request
    # K/V element type, one its engine declares (engine.engines.values); added after the first schema
    dtype: str = field(default="auto", metadata=added("auto"))


@dataclass
class EngineConfig:
    """Which runtime executes the trial and how it is driven."""

    backend: str = "hf"  # hf (transformers forward, our decode loop) | native (engine/native) | llamacpp
    compile: bool = False  # torch.compile the forward
    # one its engine declares (engine=native's COMPILE_MODES: engine/engines/native); added after the first schema
    compile_mode: str = field(default="dynamic", metadata=added("dynamic"))
    # how a prompt is computed: default = the engine's own prefill (torch's GEMMs on hf and native); cpp = engine=native's
    # C++ step over the prompt's rows (with compile_mode=cpp); one its engine declares; added after the first schema
    prefill: str = field(default="default", metadata=added("default"))
    threads: int = 0  # torch intra-op threads; 0 = the CPUs the trial was given


@dataclass
class QuantConfig:
    """Quantization level (engine/quant.py says what each does) and mixed-precision exceptions."""

    level: str = "none"  # none | int8-weight | int8-dynamic | bnb-int8 | bnb-nf4 | bnb-fp4 | int4-weight
    compute_dtype: str = "float32"  # bnb 4-bit compute dtype (bfloat16/float16 on GPUs)
    skip_modules: list[str] = field(default_factory=lambda: ["lm_head"])  # kept in full precision (fnmatch)
    keep_last_layers: int = 0  # mixed precision: the last N decoder layers stay unquantized
    kernel: str = "dequant"  # int8-weight / int4-weight matmul, one the torch engines declare (engine/engines/hf TORCH_KERNELS)


@dataclass
class SamplingConfig:
    """Greedy when `temperature == 0`; otherwise multinomial sampling (seeded by the trial's `seed`) with
    optional top-k/top-p."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0


@dataclass(unsafe_hash=True)  # a cache key of the tokenized text (engine/prompts.py)
class TextConfig:
    """Where prompt and evaluation text comes from: `pydoc` (the Python reference manual that ships with
    CPython, offline), `file` (`path`), or `datasets` (`name`, `split`, `column`; data available locally)."""

    kind: str = "pydoc"
    path: Optional[str] = None
    name: Optional[str] = None
    config: Optional[str] = None
    split: str = "test"
    column: str = "text"


@dataclass
class LengthConfig:
    """A token-length distribution: `fixed` (always `value`) or `uniform` over [min, max] (inclusive)."""

    dist: str = "fixed"
    value: int = 128
    min: int = 32
    max: int = 256


@dataclass
class WorkloadConfig:
    """What is asked of the model.

    kind=static: `batch_size` prompts of exactly `context_len` tokens, `max_new_tokens` each, `warmup`
    untimed runs then `repeats` timed ones (medians reported). `prompt_style`: `window` (a window of the
    text, continued: free generation) or `repeat` (an instruction to repeat a passage + the passage: the
    output copies its context, which prompt-lookup decoding exploits).

    kind=serving: `num_requests` requests, each the shared system-prompt prefix (`prefix_len` tokens) plus
    `input_len` tokens of its own, generating exactly `output_len` tokens. `length_trace`, a JSONL file of
    {"input_len", "output_len"} lines, replaces both distributions (cycled in order). Arrivals:
    `all-at-once`, `fixed-rate` (every 1/rate s) or `poisson` at `rate` req/s with gamma gaps of shape
    `burstiness` (1 = Poisson, < 1 burstier; vLLM's benchmark convention). `max_concurrency` (0 = no cap)
    is a client-side cap on requests in flight. The same seed gives the same requests."""

    name: str = "static"
    kind: str = "static"  # static | serving
    context_len: int = 128
    max_new_tokens: int = 32
    batch_size: int = 1
    warmup: int = 1
    repeats: int = 3
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    text: TextConfig = field(default_factory=TextConfig)
    prompt_style: str = "window"  # window | repeat
    num_requests: int = 64
    input_len: LengthConfig = field(default_factory=LengthConfig)
    output_len: LengthConfig = field(default_factory=lambda: LengthConfig(value=32, min=16, max=64))
    length_trace: Optional[str] = None
    arrival: str = "all-at-once"  # all-at-once | fixed-rate | poisson
    rate: float = 4.0  # requests/s (fixed-rate, poisson)
    burstiness: float = 1.0
    prefix_len: int = 0
    max_concurrency: int = 0
    # kind=multi-turn (engine/serving/conversations.py): `conversations` conversations arriving like requests
    # (`arrival`, `rate`), each `turns` turns; a turn's prompt is the conversation so far + `input_len` new
    # tokens, its answer `output_len` tokens, the next turn is sent `think_time_s` after the answer.
    # `num_requests` is not used (conversations x turns requests). Added after the first schema.
    conversations: int = field(default=8, metadata=added(8))
    turns: int = field(default=4, metadata=added(4))
    think_time_s: float = field(default=1.0, metadata=added(1.0))

    @property
    def serving(self) -> bool:
        """Requests arriving over time (kind=serving, or the turns of kind=multi-turn)."""
        return self.kind in ("serving", "multi-turn")

    @property
    def multi_turn(self) -> bool:
        return self.kind == "multi-turn"


@dataclass
class BatchingConfig:
    """How a serving workload's requests share forward passes (engine/engines/native/serving/scheduler.py).

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


@dataclass
class SLOConfig:
    """Service-level objectives for goodput: a request counts when it meets both."""

    ttft_ms: float = 2000.0
    tpot_ms: float = 200.0


@dataclass
class CapacityConfig:
    """Capacity search (engine/serving/capacity.py): with `search`, a serving trial ignores `workload.rate`
    and finds the highest Poisson rate at which the `percentile`-th percentile of TTFT and of TPOT meet
    `slo.ttft_ms` and `slo.tpot_ms`: a synchronous probe, a saturating probe, then bisection until the
    bracket is within `tolerance` of its top, or `max_probes` probes or `max_s` seconds are spent.
    Every key was added after the first schema (neutral values keep earlier hashes)."""

    search: bool = field(default=False, metadata=added(False))
    percentile: float = field(default=99.0, metadata=added(99.0))  # the share of requests the SLO holds for
    max_probes: int = field(default=8, metadata=added(8))
    tolerance: float = field(default=0.1, metadata=added(0.1))
    max_s: float = field(default=1800.0, metadata=added(1800.0))


@dataclass
class TimingConfig:
    """How many timed repeats a trial takes (pyperf/criterion style): `workload.repeats` first, then more
    until the 95% interval of every judged timing's median (output tok/s, TTFT, TPOT) is within
    +-`target_ci` of it, at most `max_repeats` repeats and `budget_s` seconds of extra timed runs.
    `max_repeats` <= `workload.repeats` pins the count. Engines in their own process (vLLM) restart per
    call, so they run the fixed count. How precisely a number is measured is not what is measured: this
    section is outside the config hash, like placement."""

    target_ci: float = 0.05  # relative half-width of the 95% interval of the median
    max_repeats: int = 30  # runs of tens of ms need ~20-30 for a +-5% median through 100-250 ms stalls; budget_s bounds slow ones
    budget_s: float = 20.0  # seconds of extra timed runs a trial may spend to reach the target


@dataclass
class DraftModelConfig:
    """speculative=draft: the separate draft model. Unset fields follow the target."""

    name: Optional[str] = None  # None: the path
    path: Optional[str] = None  # local dir | hub id | prepared://NAME | tiny://NAME (the target's tiny shape)
    dtype: Optional[str] = None  # None: the target's dtype
    revision: Optional[str] = None

    def resolve(self, target: ModelConfig) -> Optional[ModelConfig]:
        """The draft as a full ModelConfig (None without a path)."""
        if not self.path:
            return None
        return ModelConfig(name=self.name or self.path, path=self.path, dtype=self.dtype or target.dtype,
                           revision=self.revision, tiny=target.tiny)


# speculative keys each method reads; the others cannot change what such a trial measures
SPECULATIVE_USES = {"off": (), "self-draft": ("k", "draft_layers"), "draft": ("k", "draft_model"),
                    "prompt-lookup": ("k", "prompt_lookup_min", "prompt_lookup_max")}


@dataclass
class SpeculativeConfig:
    """Speculative decoding: a drafter proposes `k` tokens, the target verifies them in one forward.

    `method`: `off`; `draft` (a separate model sharing the tokenizer, `draft_model`, its own KV cache);
    `self-draft` (the target's first `draft_layers` blocks + its final norm and LM head, weights shared);
    `prompt-lookup` (the tokens that followed the latest earlier occurrence of the context's last n-gram,
    n from `prompt_lookup_max` down to `prompt_lookup_min`; no model). Batch size 1 only."""

    method: str = "off"
    k: int = 4
    draft_layers: int = 1
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    draft_model: DraftModelConfig = field(default_factory=DraftModelConfig)

    @property
    def enabled(self) -> bool:
        return self.method != "off"


@dataclass
class EvalConfig:
    """Accuracy over `num_windows` windows of `workload.context_len` tokens: perplexity, and with
    `fidelity` also KL divergence / top-1 agreement against the unoptimized reference (the same model in
    float32 on the hf backend, no quantization), whose top-`topk` log-probs are cached on disk."""

    name: str = "ppl"
    enabled: bool = True
    num_windows: int = 2
    fidelity: bool = False
    topk: int = 256
    text: TextConfig = field(default_factory=TextConfig)
    # task accuracy through lm-evaluation-harness (engine/tasks, docs/accuracy.md), added after the first
    # schema: the tasks (names under engine/tasks/yaml, or needle tasks), examples per task (needle: per
    # depth), the needle depths (fractions of the haystack), and the accuracy gate (>= gate x the reference's)
    tasks: list[str] = field(default_factory=list, metadata=added([]))
    limit: int = field(default=50, metadata=added(50))
    depths: list[float] = field(default_factory=lambda: [0.1, 0.5, 0.9], metadata=added([0.1, 0.5, 0.9]))
    gate: float = field(default=0.99, metadata=added(0.99))
    # the user's own task files (engine/tasks/user.py: multiple-choice or generation JSONL, or an lm-eval task YAML
    # with local data), each defining a task that eval.tasks names; hashed by content, not path (config hash)
    task_files: list[str] = field(default_factory=list, metadata=added([]))
    # which items a limit takes: "first" -- the first eval.limit documents of each task (lm-eval's limit); "pooled"
    # -- eval.limit items in all over the (non-needle) tasks, the first of one seeded shuffle of every task's
    # documents together (seed: the trial's). A larger limit extends a smaller one's items, so looks at growing
    # limits see nested samples; the pool draws each task in proportion to its size (the accuracy gate's items).
    order: str = field(default="first", metadata=added("first"))


@dataclass
class TrialConfig:
    """Everything that changes what one trial measures."""

    model: ModelConfig
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    kv_cache: KVCacheConfig = field(default_factory=KVCacheConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    slo: SLOConfig = field(default_factory=SLOConfig)
    capacity: CapacityConfig = field(default_factory=CapacityConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    seed: int = 0
    timing: TimingConfig = field(default_factory=TimingConfig)  # precision of the timings (not hashed)

    @classmethod
    def from_dict(cls, data: dict[str, Any], ignore: tuple[str, ...] = ()) -> "TrialConfig":
        """Build from plain containers (a resolved config); top-level keys in `ignore` (placement, tracking)
        are skipped, any other unknown key raises `EngineError` naming it."""
        return from_dict(cls, {k: v for k, v in data.items() if k not in ignore})


def replace(obj, path: str, value):
    """A copy of a config with the dotted `path` set: `replace(trial, "kv_cache.mode", "off")`."""
    head, _, rest = path.partition(".")
    return dataclasses.replace(obj, **{head: replace(getattr(obj, head), rest, value) if rest else value})


@functools.lru_cache(maxsize=None)
def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _dataclass_of(tp) -> Optional[type]:
    if dataclasses.is_dataclass(tp):
        return tp
    for arg in typing.get_args(tp):  # Optional[SomeConfig]
        if dataclasses.is_dataclass(arg):
            return arg
    return None


def from_dict(cls, data: dict[str, Any], where: str = ""):
    if not isinstance(data, dict):
        raise EngineError(f"{where or 'config'}: expected a mapping, got {type(data).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise EngineError(f"{where + '.' if where else ''}{unknown[0]}: unknown key; keys "
                          f"{'in ' + where if where else 'at top level'}: {', '.join(sorted(names))}")
    hints, kwargs = _hints(cls), {}
    for name, value in data.items():
        sub = _dataclass_of(hints[name])
        key = f"{where}.{name}" if where else name
        if sub is not None and isinstance(value, dict):
            value = from_dict(sub, value, key)
        elif isinstance(value, tuple):
            value = list(value)
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required key (model.name, model.path) is missing
        raise EngineError(f"{where or 'config'}: {e}") from None
