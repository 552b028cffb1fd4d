"""The optimization axes, in the seed's chain order: one registry every reader of configs and results uses.

An axis is one switch of the optimization chain: the config key that holds its choice, the value that
means "not applied", its place in the seed's order (KV cache -> continuous batching -> fused attention ->
quantization -> speculative decoding -> right-sized model) and its label. `engine.backend` is an axis too
(which runtime executes the chain) but not a step of the chain. Analysis code (advice, claims, report,
results, summary) and the cost model ask this module; none of them spells a key or an "off" value itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional


@dataclass(frozen=True)
class Axis:
    group: str  # config group / section: `kv_cache`
    key: str  # the config key holding the choice: `kv_cache.mode`
    off: str  # the value meaning "not applied"
    label: str  # what the seed calls the step
    chain: Optional[int]  # position in the seed's chain; None: an axis that is not a step of it
    whole_group: bool = True  # every key of the group belongs to the optimization (kv_cache.block_size does)

    def value(self, params: Mapping[str, Any]) -> Optional[str]:
        """The axis' value in a flat {config key: value} mapping (None when the key is absent)."""
        v = params.get(self.key)
        return None if v is None else str(v)

    def applied(self, params: Mapping[str, Any]) -> Optional[bool]:
        """True/False, or None when the mapping has no such key (the feature did not exist then)."""
        v = self.value(params)
        return None if v is None else v != self.off


KV_CACHE = Axis("kv_cache", "kv_cache.mode", "off", "KV cache", 0)
BATCHING = Axis("batching", "batching.mode", "static", "continuous batching", 1)
ATTENTION = Axis("attention", "attention.impl", "eager", "fused (flash) attention", 2)
QUANT = Axis("quant", "quant.level", "none", "quantization", 3)
SPECULATIVE = Axis("speculative", "speculative.method", "off", "speculative decoding", 4)
BACKEND = Axis("engine", "engine.backend", "hf", "engine", None)
# the number format the weights and activations run in: an optimization like quantization, though its key
# lives in the model's group (whose other keys -- name, path -- say which model, not how it runs)
PRECISION = Axis("model", "model.dtype", "float32", "half precision", None, whole_group=False)

AXES: tuple[Axis, ...] = (KV_CACHE, BATCHING, ATTENTION, QUANT, SPECULATIVE, BACKEND, PRECISION)
CHAIN: tuple[Axis, ...] = tuple(sorted((a for a in AXES if a.chain is not None), key=lambda a: a.chain))
RIGHT_SIZE = "right-size the model"  # the chain's last step: a different model, not a switch

_BY_GROUP = {a.group: a for a in AXES if a.whole_group}
_BY_KEY = {a.key: a for a in AXES}


def by_group(group: str) -> Optional[Axis]:
    return _BY_GROUP.get(group)


def by_key(key: str) -> Optional[Axis]:
    return _BY_KEY.get(key)


def is_optimization_key(key: str) -> bool:
    """Whether a config key belongs to an optimization axis (`kv_cache.block_size` does, `model.name`
    does not)."""
    if key in _BY_KEY:
        return True
    a = _BY_GROUP.get(key.split(".", 1)[0])
    return a is not None and a.whole_group


def resolve_key(name: str) -> str:
    """A user's short name for an axis (`kv_cache`, `attention`) -> its config key; other keys unchanged."""
    a = _BY_GROUP.get(name)
    return a.key if a is not None else name


def short_key(key: str) -> str:
    """The label of a config key in tables: an axis' choice key shows as its group (`kv_cache`)."""
    a = _BY_KEY.get(key)
    return a.group if a is not None and a.whole_group else key


def is_off(key: str, value: Any) -> bool:
    a = _BY_KEY.get(key)
    return a is not None and str(value) == a.off


# --- which engine honours what ------------------------------------------------------------------------
@dataclass(frozen=True)
class Support:
    values: tuple[str, ...]  # the values of the key this engine honours
    why: str  # what the engine does instead (shown when a sweep asks for another value)


TORCH_QUANT = ("none", "int8-weight", "int8-dynamic", "bnb-int8", "bnb-nf4", "bnb-fp4")
GGUF_QUANT = ("gguf-q8_0", "gguf-q4_0", "gguf-q4_k_m")
KV_DTYPE_KEY = "kv_cache.dtype"  # K/V element type: an engine knob, not a step of the chain
_TORCH_KV = Support(("auto",), "K/V stay in model.dtype on the torch engines")
_TORCH_Q = Support(TORCH_QUANT, "gguf-* levels are GGUF weight types written by llama.cpp (engine=llamacpp)")

# engine -> config key -> what it honours; a key not listed is honoured in every value. Validation rejects
# anything outside before launch, naming the engine; the README's axis x engine table is this table.
SUPPORT: dict[str, dict[str, Support]] = {
    "hf": {
        KV_CACHE.key: Support(("off", "contiguous"), "transformers' DynamicCache is contiguous; paged is engine=native's"),
        BATCHING.key: Support(("static",), "engine=hf runs one static batch; continuous batching is engine=native's"),
        QUANT.key: _TORCH_Q,
        KV_DTYPE_KEY: _TORCH_KV,
    },
    "native": {QUANT.key: _TORCH_Q, KV_DTYPE_KEY: _TORCH_KV},
    "llamacpp": {
        KV_CACHE.key: Support(("contiguous",), "llama.cpp keeps its own KV cache, one contiguous stream per sequence"),
        BATCHING.key: Support(("static",), "llama.cpp runs the static batch as parallel sequences"),
        QUANT.key: Support(("none",) + GGUF_QUANT, "llama.cpp quantizes to GGUF weight types with its own quantizer"),
        SPECULATIVE.key: Support(("off", "prompt-lookup"), "our prompt-lookup drafter verifies on llama.cpp; a draft "
                                                           "model or self-draft would need a second llama.cpp model"),
        KV_DTYPE_KEY: Support(("auto", "f32", "f16", "q8_0", "q4_0"), "llama.cpp's K/V types (auto = f16)"),
        "engine.compile": Support(("False",), "llama.cpp runs its own C++ graph: torch.compile does not apply"),
    },
    "vllm": {
        KV_CACHE.key: Support(("contiguous", "paged"), "vLLM always keeps its paged KV cache (both values run it)"),
        ATTENTION.key: Support(("sdpa",), "vLLM picks its own attention kernels (CPU paged attention)"),
        QUANT.key: Support(("none",), "bitsandbytes, our int8 swaps and GGUF are not vLLM's; its fp8 weights do not "
                                      "run on CPU"),
        SPECULATIVE.key: Support(("off", "prompt-lookup", "draft"), "vLLM has ngram (prompt-lookup) and draft-model "
                                                                   "speculation, no self-draft"),
        KV_DTYPE_KEY: Support(("auto", "fp8"), "vLLM's kv_cache_dtype (auto = model.dtype)"),
    },
}
ENGINES = tuple(SUPPORT)


def unsupported(engine: str, values: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(config key, message) for each value in the flat `values` {config key: value} that `engine` does
    not honour."""
    out = []
    for key, s in SUPPORT.get(engine, {}).items():
        if key in values and str(values[key]) not in s.values:
            out.append((key, f"engine={engine} cannot honour {key}={values[key]}: {s.why} "
                             f"(it supports {', '.join(s.values)})"))
    return out


def support_markdown(keys: tuple[str, ...] = (KV_CACHE.key, BATCHING.key, ATTENTION.key, QUANT.key, SPECULATIVE.key,
                                               KV_DTYPE_KEY)) -> str:
    """The axis x engine table of the README: which values each engine honours."""
    head = "| axis (config key) | " + " | ".join(ENGINES) + " |"
    rows = [head, "|" + "---|" * (len(ENGINES) + 1)]
    for key in keys:
        cells = []
        for e in ENGINES:
            s = SUPPORT[e].get(key)
            cells.append("all" if s is None else ", ".join(s.values))
        rows.append(f"| `{key}` | " + " | ".join(cells) + " |")
    return "\n".join(rows)
