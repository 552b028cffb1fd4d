"""Typed schema of a trial config, registered once with Hydra's ConfigStore.

The YAML files in conf/ stay short and only set values; this schema gives them types, so an unknown key
or a wrong type is a composition error. Value ranges are checked in `experiments.validate`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


@dataclass
class TinyConf:
    num_layers: int = 2
    hidden_size: int = 64
    intermediate_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    vocab_size: int = 384
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    seed: int = 0


@dataclass
class ModelConf:
    name: str = MISSING
    path: str = MISSING  # local dir | hub id | prepared://NAME | tiny://NAME
    dtype: str = "float32"
    revision: Optional[str] = None
    trust_remote_code: bool = False
    tiny: TinyConf = field(default_factory=TinyConf)


@dataclass
class AttentionConf:
    impl: str = "sdpa"  # eager | sdpa | flash


@dataclass
class KVCacheConf:
    mode: str = "contiguous"  # off | contiguous | paged
    block_size: int = 16  # tokens per block (paged)
    prefix_caching: bool = False  # serving: share computed full blocks of common prompt prefixes
    num_blocks: int = 0  # serving: blocks in the shared pool; 0 = max_batch_size x the longest request
    dtype: str = "auto"  # KV element type: auto (the model dtype) | fp8 (engine=vllm only)


@dataclass
class QuantConf:
    level: str = "none"  # none | int8-weight | int8-dynamic | bnb-int8 | bnb-nf4 | bnb-fp4
    compute_dtype: str = "float32"  # bnb 4-bit compute dtype
    skip_modules: List[str] = field(default_factory=lambda: ["lm_head"])  # kept in full precision (fnmatch)
    keep_last_layers: int = 0  # mixed precision: last N decoder layers unquantized
    kernel: str = "dequant"  # int8-weight matmul: dequant (int8 -> float, then GEMM) | int8pack (torch._weight_int8pack_mm)


@dataclass
class EngineConf:
    backend: str = "hf"  # hf | native | vllm (its own venv: make setup-vllm)
    compile: bool = False
    threads: int = 0  # torch intra-op threads; 0 = the CPUs Ray gives the trial


@dataclass
class SamplingConf:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0


@dataclass
class TextConf:
    kind: str = "pydoc"  # pydoc | file | datasets
    path: Optional[str] = None
    name: Optional[str] = None
    config: Optional[str] = None
    split: str = "test"
    column: str = "text"


@dataclass
class LengthConf:
    dist: str = "fixed"  # fixed (always `value`) | uniform (min..max inclusive)
    value: int = 128
    min: int = 32
    max: int = 256


@dataclass
class WorkloadConf:
    name: str = "static"
    kind: str = "static"  # static (one batch of context_len prompts) | serving (requests over time)
    context_len: int = 128
    max_new_tokens: int = 32
    batch_size: int = 1
    warmup: int = 1
    repeats: int = 3
    sampling: SamplingConf = field(default_factory=SamplingConf)
    text: TextConf = field(default_factory=TextConf)
    prompt_style: str = "window"  # window (continue a text window) | repeat (instruction + passage to copy)
    # kind=serving (see engine.config.ServingSpec)
    num_requests: int = 64
    input_len: LengthConf = field(default_factory=LengthConf)  # own tokens, after the shared prefix
    output_len: LengthConf = field(default_factory=lambda: LengthConf(value=32, min=16, max=64))
    length_trace: Optional[str] = None  # JSONL of {"input_len", "output_len"}; replaces both distributions
    arrival: str = "all-at-once"  # all-at-once | fixed-rate | poisson
    rate: float = 4.0  # requests/s (fixed-rate, poisson)
    burstiness: float = 1.0  # gamma shape of poisson gaps: 1 = Poisson, < 1 burstier
    prefix_len: int = 0  # shared system-prompt tokens at the start of every prompt
    max_concurrency: int = 0  # client-side cap on requests in flight; 0 = unlimited


@dataclass
class BatchingConf:
    mode: str = "static"  # static (run a batch to its longest request) | continuous (iteration-level)
    max_batch_size: int = 8  # sequences per batch
    max_batch_tokens: int = 2048  # new tokens per forward step (continuous)
    chunked_prefill: bool = False  # split prompts across steps to fit max_batch_tokens (continuous)


@dataclass
class SLOConf:
    ttft_ms: float = 2000.0  # goodput counts requests with time to first token <= this
    tpot_ms: float = 200.0  # ... and time per output token <= this


@dataclass
class DraftModelConf:
    name: Optional[str] = None  # None: the path
    path: Optional[str] = None  # local dir | hub id | prepared://NAME | tiny://NAME (the target's tiny shape)
    dtype: Optional[str] = None  # None: the target's dtype
    revision: Optional[str] = None


@dataclass
class SpeculativeConf:
    method: str = "off"  # off | draft | self-draft | prompt-lookup
    k: int = 4  # lookahead: tokens drafted per target step
    draft_layers: int = 1  # self-draft: the target's first N layers (+ final norm + LM head) draft
    prompt_lookup_min: int = 1  # prompt-lookup: shortest n-gram matched
    prompt_lookup_max: int = 3  # prompt-lookup: longest n-gram matched (tried first)
    draft_model: DraftModelConf = field(default_factory=DraftModelConf)  # draft: the separate draft model


@dataclass
class EvalConf:
    name: str = "ppl"
    enabled: bool = True
    num_windows: int = 2
    fidelity: bool = False  # KL / top-1 agreement vs the unoptimized reference (cached on disk)
    topk: int = 256  # reference log-probs kept per position
    text: TextConf = field(default_factory=TextConf)


@dataclass
class ClusterConf:
    name: str = "local"
    address: Optional[str] = None  # None: start an embedded local Ray; "auto" or ray://host:port: connect
    num_cpus_per_trial: float = 2
    num_gpus_per_trial: float = 0
    memory_per_trial_gb: float = 0
    max_retries: int = 1  # retries after a worker/node crash (application errors are never retried)
    resources: Dict[str, float] = field(default_factory=dict)  # custom Ray resources per trial
    isolation: str = "shared"  # shared | exclusive-node (never two trials on one node: clean timings)
    warm_workers: bool = True  # trials with the same model/attention/backend reuse a loaded model
    placement_timeout_s: float = 600  # fail queued trials when no worker can be placed for this long
    local_num_cpus: Optional[int] = None  # embedded Ray only; None = all cores
    local_num_gpus: Optional[int] = None  # embedded Ray only; None = detected


@dataclass
class TrackingConf:
    # where runs go: sqlite:///... | postgresql://... (with serve) | http://host:port (a running server)
    uri: str = "sqlite:///mlflow/mlflow.db"
    artifact_root: str = "mlflow/artifacts"
    ui_port: int = 5000
    serve: bool = False  # start `mlflow server` on `uri` for the sweep's lifetime and log through it
    host: str = "127.0.0.1"  # bind address of that server; keep loopback unless you mean it
    port: int = 0  # 0 = any free port
    workers: int = 1  # server worker processes (1 for SQLite; more with PostgreSQL)
    spool_dir: str = "mlflow/spool"  # results wait here when the store is unreachable (`infersweep sync`)
    request_timeout_s: float = 10  # per HTTP request to a tracking server
    request_retries: int = 2  # HTTP retries before the result is spooled instead
    writers: int = 1  # driver threads writing results to a server (>1 wants PostgreSQL behind it)


# mappings whose keys are the user's (`+cluster.resources.accel=1`), not the schema's
OPEN_MAPPINGS = ("cluster.resources",)


@dataclass
class TrialConf:
    sweep_name: str = "default"
    seed: int = 0
    model: ModelConf = field(default_factory=ModelConf)
    attention: AttentionConf = field(default_factory=AttentionConf)
    kv_cache: KVCacheConf = field(default_factory=KVCacheConf)
    engine: EngineConf = field(default_factory=EngineConf)
    quant: QuantConf = field(default_factory=QuantConf)
    workload: WorkloadConf = field(default_factory=WorkloadConf)
    speculative: SpeculativeConf = field(default_factory=SpeculativeConf)
    batching: BatchingConf = field(default_factory=BatchingConf)
    slo: SLOConf = field(default_factory=SLOConf)
    eval: EvalConf = field(default_factory=EvalConf)
    cluster: ClusterConf = field(default_factory=ClusterConf)
    tracking: TrackingConf = field(default_factory=TrackingConf)


def register() -> None:
    ConfigStore.instance().store(name="trial_schema", node=TrialConf)
