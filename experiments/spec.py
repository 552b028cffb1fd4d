"""TrialSpec: one validated, resolved trial, and its translation into the engine's dataclasses."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from engine.config import (
    WORKLOAD_KINDS,
    BatchingSpec,
    EngineError,
    EngineTrial,
    EvalSpec,
    LengthSpec,
    ModelSpec,
    OptimizationSpec,
    QuantSpec,
    SamplingSpec,
    SpeculativeSpec,
    ServingSpec,
    SLOSpec,
    TextSource,
    TinyModelSpec,
    WorkloadSpec,
)

from .hashing import SHORT, canonical_json, config_hash


@dataclass(frozen=True)
class TrialSpec:
    config: dict[str, Any]  # the resolved config, plain containers (cluster/tracking included)
    swept: dict[str, str] = field(default_factory=dict)  # swept key -> value of this trial
    index: int = 0

    @property
    def config_hash(self) -> str:
        return config_hash(self.config)

    @property
    def short_hash(self) -> str:
        return self.config_hash[:SHORT]

    @property
    def label(self) -> str:
        if not self.swept:
            return f"trial {self.index}"
        return " ".join(f"{k}={v}" for k, v in self.swept.items())


# config sections that change the loaded model object itself (a quantization group, when present, too)
MODEL_SECTIONS = ("model", "quant", "quantization")


def model_key(config: dict[str, Any]) -> str | None:
    """What a loaded model depends on: trials with equal keys may share one loaded model (warm workers).
    Attention is baked in at load time (attn_implementation); the backend is included so a backend that
    adapts the model in place never hands its changes to another. None (never share) with engine.compile,
    which patches the model's forward."""
    if config["engine"].get("compile"):
        return None
    view = {k: config[k] for k in MODEL_SECTIONS if k in config}
    view["attention"] = config["attention"]["impl"]
    view["backend"] = config["engine"]["backend"]
    return hashlib.sha256(canonical_json(view).encode()).hexdigest()[:16]


def _text(d: dict[str, Any]) -> TextSource:
    return TextSource(**d)


def to_engine_trial(config: dict[str, Any]) -> EngineTrial:
    """Map config keys to engine fields (the only place that knows both vocabularies)."""
    m = dict(config["model"])
    tiny = TinyModelSpec(**m.pop("tiny"))
    model = ModelSpec(tiny=tiny, **m)
    kv = config["kv_cache"]
    opt = OptimizationSpec(
        backend=config["engine"]["backend"],
        attention=config["attention"]["impl"],
        kv_cache=kv["mode"],
        kv_block_size=kv["block_size"],
        compile=config["engine"]["compile"],
        prefix_caching=kv.get("prefix_caching", False),
        kv_num_blocks=kv.get("num_blocks", 0),
        kv_cache_dtype=kv.get("dtype", "auto"),
    )
    q = dict(config.get("quant") or {})
    quant = QuantSpec(**q) if q else QuantSpec()
    w = dict(config["workload"])
    w.pop("name", None)
    kind = w.pop("kind", "static")
    if kind not in WORKLOAD_KINDS:
        raise EngineError(f"workload.kind: {kind!r} is not allowed; choose one of {', '.join(WORKLOAD_KINDS)}")
    serving_keys = {k: w.pop(k) for k in SERVING_KEYS if k in w}
    serving = _serving(serving_keys) if kind == "serving" else None
    sampling = SamplingSpec(seed=config["seed"], **w.pop("sampling"))
    workload = WorkloadSpec(sampling=sampling, text=_text(w.pop("text")), **w)
    e = dict(config["eval"])
    e.pop("name", None)
    ev = EvalSpec(text=_text(e.pop("text")), **e)
    threads = config["engine"]["threads"] or int(config["cluster"]["num_cpus_per_trial"])
    speculative = _speculative(config, model)
    batching = BatchingSpec(**config["batching"]) if "batching" in config else BatchingSpec()
    slo = SLOSpec(**config["slo"]) if "slo" in config else SLOSpec()
    return EngineTrial(model=model, optimization=opt, quant=quant, workload=workload, eval=ev, seed=config["seed"], threads=threads,
                       speculative=speculative,
                       serving=serving, batching=batching, slo=slo)


# workload keys of kind=serving (engine.config.ServingSpec)
SERVING_KEYS = ("num_requests", "input_len", "output_len", "length_trace", "arrival", "rate", "burstiness", "prefix_len",
                "max_concurrency")


def _serving(w: dict[str, Any]) -> ServingSpec:
    lens = {k: LengthSpec(**w.pop(k)) for k in ("input_len", "output_len") if k in w}
    return ServingSpec(**lens, **w)


def _speculative(config: dict[str, Any], target: ModelSpec) -> SpeculativeSpec:
    s = dict(config.get("speculative") or {})
    d = dict(s.pop("draft_model", None) or {})
    draft = None
    if d.get("path"):  # a tiny:// draft takes the target's tiny shape (tests, smoke runs)
        draft = ModelSpec(name=d.get("name") or d["path"], path=d["path"], dtype=d.get("dtype") or target.dtype,
                          revision=d.get("revision"), tiny=target.tiny)
    return SpeculativeSpec(draft_model=draft, **s)


# Keys with no effect given the method (speculative=off has no k): `normalize` resets them to their defaults,
# so `speculative=off,self-draft speculative.k=2,4` expands to one off trial and two self-draft trials.
SPECULATIVE_USES = {"off": (), "self-draft": ("k", "draft_layers"), "draft": ("k", "draft_model"),
                    "prompt-lookup": ("k", "prompt_lookup_min", "prompt_lookup_max")}


def inert_keys(config: dict[str, Any]) -> list[str]:
    """Dotted config keys whose value cannot change what this trial measures."""
    s = config.get("speculative") or {}
    uses = SPECULATIVE_USES.get(s.get("method"))
    if uses is None:  # unknown method: validation reports it
        return []
    return [f"speculative.{k}" for k in s if k != "method" and k not in uses]


def normalize(config: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(config with its inert keys reset to the schema's defaults, the inert keys)."""
    import copy
    import dataclasses

    from . import schema

    inert = inert_keys(config)
    if not inert:
        return config, inert
    out = copy.deepcopy(config)
    defaults = dataclasses.asdict(schema.SpeculativeConf())
    for key in inert:
        leaf = key.split(".", 1)[1]
        out["speculative"][leaf] = copy.deepcopy(defaults[leaf])
    return out, inert


# engine field path -> config key, for error messages in the user's vocabulary
ENGINE_TO_CONFIG = {
    "optimization.backend": "engine.backend",
    "optimization.attention": "attention (attention.impl)",
    "optimization.kv_cache": "kv_cache (kv_cache.mode)",
    "optimization.kv_block_size": "kv_cache.block_size",
    "threads": "engine.threads",
    "speculative.method": "speculative (speculative.method)",
    "optimization.prefix_caching": "kv_cache.prefix_caching",
    "optimization.kv_num_blocks": "kv_cache.num_blocks",
    "optimization.kv_cache_dtype": "kv_cache.dtype",
    "optimization.compile": "engine.compile",
}


def config_key(engine_field: str) -> str:
    if engine_field.startswith("serving."):  # the serving workload's keys live under workload
        return "workload." + engine_field[len("serving."):]
    return ENGINE_TO_CONFIG.get(engine_field, engine_field)
