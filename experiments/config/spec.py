"""TrialSpec: one validated, resolved trial: its config (plain containers, hashed and logged) and the
engine's typed `TrialConfig` built from it once, on the driver, and shipped to the worker as is."""
from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
from dataclasses import dataclass, field
from typing import Any

from cluster.config import ClusterConfig
from engine.config import SPECULATIVE_USES, SpeculativeConfig, TrialConfig

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

    @functools.cached_property
    def trial(self) -> TrialConfig:
        """Built once (cached in the instance, so it travels with the spec to the worker); raises
        `EngineError` for a config the engine's dataclasses reject."""
        return build_trial(self.config, self.cluster)

    @functools.cached_property
    def cluster(self) -> ClusterConfig:
        """The typed `cluster` section, parsed once (cached like `trial`): what the driver and the worker read
        of where and how the trial runs."""
        return ClusterConfig.from_dict(self.config.get("cluster") or {})

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


def build_trial(config: dict[str, Any], cluster: ClusterConfig | None = None) -> TrialConfig:
    """The engine's TrialConfig of a resolved config. `engine.threads: 0` becomes the CPUs the trial is given
    (the engine's own 0 means torch's default, which on a shared node is every core). `cluster`: the config's
    `cluster` section already parsed (else parsed here)."""
    from .schema import PLATFORM_KEYS

    trial = TrialConfig.from_dict(config, ignore=PLATFORM_KEYS + ("hydra",))
    if not trial.engine.threads:
        cluster = cluster or ClusterConfig.from_dict(config.get("cluster") or {})
        trial.engine.threads = int(cluster.num_cpus_per_trial or 0)
    return trial


def inert_keys(config: dict[str, Any]) -> list[str]:
    """Dotted config keys whose value cannot change what this trial measures (speculative.k with
    speculative=off): `normalize` resets them to their defaults, so `speculative=off,self-draft
    speculative.k=2,4` expands to one off trial and two self-draft trials."""
    s = config.get("speculative") or {}
    uses = SPECULATIVE_USES.get(s.get("method"))
    if uses is None:  # unknown method: validation reports it
        return []
    return [f"speculative.{k}" for k in s if k != "method" and k not in uses]


def fold_aliases(config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config with every value its engine runs *as* another replaced by that one, {key: folded value}):
    llama.cpp's attention=sdpa is its non-flash path, eager; vLLM's kv_cache=contiguous is its paged cache.
    Identical runs then share one config hash (the engine's declaration says which values alias)."""
    from engine import engines

    name = (config.get("engine") or {}).get("backend")
    if name not in engines.NAMES:
        return config, {}
    folded: dict[str, Any] = {}
    for key in engines.get(name).support:
        group, _, leaf = key.partition(".")
        value = (config.get(group) or {}).get(leaf)
        if value is not None and engines.canonical(name, key, value) != value:
            folded[key] = engines.canonical(name, key, value)
    if not folded:
        return config, folded
    out = copy.deepcopy(config)
    for key, value in folded.items():
        group, _, leaf = key.partition(".")
        out[group][leaf] = value
    return out, folded


def normalize(config: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(config with its inert keys reset to the schema's defaults, the inert keys)."""
    inert = inert_keys(config)
    if not inert:
        return config, inert
    out = copy.deepcopy(config)
    defaults = dataclasses.asdict(SpeculativeConfig())
    for key in inert:
        leaf = key.split(".", 1)[1]
        out["speculative"][leaf] = copy.deepcopy(defaults[leaf])
    return out, inert
