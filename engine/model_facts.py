"""Model facts, read once: a model's shape and limits from its config alone, without weights.

`inspect(model)` is the one reader of a checkpoint's `config.json` (and of a tiny:// model's settings):
validation, the cost model and every engine ask it instead of opening files or recomputing head_dim.
It is cached per model identity (and the config file's mtime), so a 1,000-trial sweep reads a config once.

A local directory that is no checkpoint, or whose config.json is not a JSON object with well-typed
fields, is a `ModelFactsError` naming the problem -- knowable before any trial loads weights.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
from dataclasses import dataclass
from typing import Any, Optional

from .config import EngineError, ModelConfig
from .safetensors_check import checkpoint_problem
from .models import PREPARED_SCHEME, TINY_SCHEME, prepared_dir, tiny_llama_config

# Known without converting anything, so a sweep can be validated before `prepare` has ever run:
# (max positions, sliding window of its windowed layers or None)
PREPARED_LIMITS = {"smollm2-135m-instruct": (8192, None), "gemma-3-270m": (32768, 512)}
PREPARED_VOCAB = {"smollm2-135m-instruct": 49152, "gemma-3-270m": 262144}
# architectures whose MLP has no gate (two matmuls, not SwiGLU's three)
NON_GATED_MLP = {"gpt2", "gpt_neox", "gptj", "opt", "bloom", "falcon", "phi", "starcoder2", "gpt_bigcode"}
# integer fields of config.json that decide the shape; each may be absent, but never of another type
_INT_FIELDS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
               "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "sliding_window",
               "n_layer", "n_embd", "n_head", "n_inner")


class ModelFactsError(EngineError):
    """The model's files say it cannot be a checkpoint (reported as `model.path` before launch)."""


@dataclass(frozen=True)
class ModelShape:
    """The dimensions that decide the cost of a decoder-only transformer."""

    num_layers: int
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool = True
    gated_mlp: bool = True
    # per layer, the sliding window of its attention (None: global); () = every layer global. Gemma 3's
    # windowed layers attend (and read the K/V of) at most `window` keys whatever the context.
    layer_windows: tuple = ()

    @classmethod
    def from_hf_config(cls, cfg: Any) -> "ModelShape":
        """From a transformers `PretrainedConfig` (Llama-style names, GPT-2-style fallbacks)."""

        def get(*names, default=None):
            for n in names:
                v = getattr(cfg, n, None)
                if v is not None:
                    return v
            if default is None:
                raise EngineError(f"model config has none of {names}")
            return default

        hidden = int(get("hidden_size", "n_embd", "d_model"))
        heads = int(get("num_attention_heads", "n_head"))
        return cls(
            num_layers=int(get("num_hidden_layers", "n_layer")),
            hidden=hidden,
            intermediate=int(get("intermediate_size", "n_inner", "ffn_dim", default=4 * hidden)),
            num_heads=heads,
            num_kv_heads=int(get("num_key_value_heads", default=heads)),
            head_dim=int(get("head_dim", default=hidden // heads)),
            vocab=int(get("vocab_size")),
            tied_embeddings=bool(getattr(cfg, "tie_word_embeddings", True)),
            gated_mlp=getattr(cfg, "model_type", "llama") not in NON_GATED_MLP,
            layer_windows=_layer_windows(cfg),
        )

    @property
    def layer_params(self) -> int:
        """Matmul weights of one layer: q, k, v, o projections and the MLP (norms are negligible)."""
        q_o = 2 * self.hidden * self.num_heads * self.head_dim
        k_v = 2 * self.hidden * self.num_kv_heads * self.head_dim
        mlp = (3 if self.gated_mlp else 2) * self.hidden * self.intermediate
        return q_o + k_v + mlp

    @property
    def lm_head_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def matmul_params(self) -> int:
        """Weights every forward pass multiplies with (the embedding lookup reads only B rows)."""
        return self.num_layers * self.layer_params + self.lm_head_params

    def kv_bytes_per_token(self, elt_bytes: float) -> float:
        """K and V of one token in every layer."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elt_bytes

    def attended_keys(self, context: float) -> float:
        """Keys the newest query attends per layer, averaged over layers, at `context` tokens (a windowed
        layer stops at its window): what one decode step reads of the KV cache, in tokens."""
        if not self.layer_windows:
            return float(context)
        return sum(min(context, w or context) for w in self.layer_windows) / len(self.layer_windows)


@dataclass(frozen=True)
class ModelFacts:
    """What is known of a model without its weights. `config` is the transformers config (None for a
    prepared model before `prepare`, when only the table's max_positions is known)."""

    model_type: Optional[str]
    shape: Optional[ModelShape]
    max_positions: Optional[int]
    sliding_window: Optional[int]
    config: Any = None

    @property
    def num_layers(self) -> Optional[int]:
        return self.shape.num_layers if self.shape else None

    @property
    def head_dim(self) -> Optional[int]:
        return self.shape.head_dim if self.shape else None

    def kv_bytes_per_token(self, elt_bytes: float) -> Optional[float]:
        return self.shape.kv_bytes_per_token(elt_bytes) if self.shape else None


def _layer_windows(cfg: Any) -> tuple:
    """Gemma 3 style `layer_types` with a `sliding_window`: the window per layer; () otherwise."""
    window, types = getattr(cfg, "sliding_window", None), getattr(cfg, "layer_types", None)
    if not window or not types:
        return ()
    return tuple(int(window) if t == "sliding_attention" else None for t in types)


def prepared_name(spec: ModelConfig) -> Optional[str]:
    return spec.path[len(PREPARED_SCHEME):] if spec.path.startswith(PREPARED_SCHEME) else None


def is_local_path(path: str) -> bool:
    """A path on this machine (as opposed to a hub id such as `org/name`)."""
    return os.path.isabs(path) or path.startswith(".") or os.path.isdir(path)


def inspect(spec: ModelConfig) -> Optional[ModelFacts]:
    """The facts of `spec`; None where the model is not on this machine yet (a hub id not cached): its
    load reports that. Raises ModelFactsError for local files that cannot be a checkpoint."""
    if spec.path.startswith(TINY_SCHEME):
        return _tiny_facts(json.dumps(dataclasses.asdict(spec.tiny), sort_keys=True))
    name = prepared_name(spec)
    if name is not None:
        d = prepared_dir(name)
        if not (d / "config.json").is_file():  # not prepared yet: only the table's limit is known
            return ModelFacts(None, None, *PREPARED_LIMITS.get(name, (None, None)))
        return _dir_facts(str(d), _mtime(d / "config.json"), False)
    if is_local_path(spec.path):
        if not os.path.isdir(spec.path):
            raise ModelFactsError(f"{spec.path!r} does not exist or is not a directory (expected a local HF "
                                  "checkpoint directory or a hub id)")
        cfg = os.path.join(spec.path, "config.json")
        if not os.path.isfile(cfg):
            raise ModelFactsError(f"{spec.path!r} is not a model checkpoint: it has no config.json")
        return _dir_facts(os.path.abspath(spec.path), _mtime(cfg), spec.trust_remote_code)
    return _hub_facts(spec.path, spec.revision, spec.trust_remote_code)


def _mtime(path) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0


def _facts(cfg: Any) -> ModelFacts:
    try:
        shape = ModelShape.from_hf_config(cfg)
    except (EngineError, TypeError, ValueError, ZeroDivisionError):
        shape = None  # an unusual architecture: the facts that exist still count
    limit = int(getattr(cfg, "max_position_embeddings", 0) or 0) or None
    # transformers sets sliding_window to None where the config turns the window off (Qwen2's use_sliding_window)
    window = getattr(cfg, "sliding_window", None)
    return ModelFacts(getattr(cfg, "model_type", None), shape, limit, int(window) if window else None, cfg)


@functools.lru_cache(maxsize=16)
def _tiny_facts(tiny_json: str) -> ModelFacts:
    from .config import TinyModelConfig

    return _facts(tiny_llama_config(TinyModelConfig(**json.loads(tiny_json)), "sdpa"))


def read_config_json(path: str) -> dict:
    """config.json of a checkpoint directory as a dict, its shape fields type-checked."""
    file = os.path.join(path, "config.json")
    try:
        with open(file) as f:
            raw = json.load(f)
    except OSError as e:
        raise ModelFactsError(f"cannot read {file}: {e}") from e
    except ValueError as e:
        raise ModelFactsError(f"{file} is not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise ModelFactsError(f"{file} must hold a JSON object, not {type(raw).__name__}")
    bad = [f"{k}={raw[k]!r}" for k in _INT_FIELDS
           if raw.get(k) is not None and (isinstance(raw[k], bool) or not isinstance(raw[k], int) or raw[k] < 1)]
    if raw.get("model_type") is not None and not isinstance(raw["model_type"], str):
        bad.append(f"model_type={raw['model_type']!r}")
    if bad:
        raise ModelFactsError(f"{file} has wrongly typed fields (positive integers and a model_type string "
                              f"expected): {', '.join(bad)}")
    return raw


@functools.lru_cache(maxsize=32)
def _dir_facts(path: str, mtime: float, trust_remote_code: bool) -> ModelFacts:
    read_config_json(path)  # a clear message for what transformers would report as a traceback
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:
        raise ModelFactsError(f"transformers cannot read {os.path.join(path, 'config.json')}: "
                              f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from e
    return _facts(cfg)


@functools.lru_cache(maxsize=32)
def _hub_facts(path: str, revision: Optional[str], trust_remote_code: bool) -> Optional[ModelFacts]:
    from transformers import AutoConfig

    try:  # only what the local HF cache already holds: validation must not download
        cfg = AutoConfig.from_pretrained(path, revision=revision, trust_remote_code=trust_remote_code,
                                         local_files_only=True)
    except Exception:
        return None
    return _facts(cfg)


def weights_problem(spec: ModelConfig) -> Optional[str]:
    """Why the local checkpoint's safetensors files cannot load (truncated, header unreadable), or None;
    from each file's 8-byte header length and header JSON against its size, never the weights themselves."""
    name = prepared_name(spec)
    if name is not None:
        d = prepared_dir(name)
        fix = f"prepare it again: infersweep prepare {name} --force"
    elif not spec.path.startswith(TINY_SCHEME) and is_local_path(spec.path) and os.path.isdir(spec.path):
        d = spec.path
        fix = "save or download the checkpoint again"
    else:
        return None  # tiny:// is built in code; a hub model is checked by its own download
    why = checkpoint_problem(str(d))
    return f"{why}; {fix}" if why else None


def facts_or_none(spec: ModelConfig) -> Optional[ModelFacts]:
    """`inspect`, with a bad checkpoint read as "unknown" (for callers after validation reported it)."""
    try:
        return inspect(spec)
    except ModelFactsError:
        return None
