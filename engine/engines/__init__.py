"""The engine registry: one package per engine under engine/engines/, each exporting `ENGINE` (an
`engine.engines.base.Engine` that declares what it honours, its own checks and how it runs a trial).

Everything that depends on which engine runs a trial asks here -- validation (`problems`), the sweep
expansion (`canonical`: aliased values fold to one config hash), the cost model (through the pipeline),
the README's axis x engine table (`support_markdown`) -- so adding an engine is a package plus one line in
`NAMES`. Importing this module is cheap: an engine's package is imported when it is first asked for, and
its runtime (torch kernels, llama-cpp-python, a vLLM subprocess) only when a trial runs on it.
"""
from __future__ import annotations

import importlib
from typing import Any, Mapping

from ..config import EngineConfig
from .base import Engine, Problems, Support

# the engines, in the order tables list them; each is the package engine.engines.<name>
NAMES: tuple[str, ...] = ("hf", "native", "llamacpp", "llamacpp-server", "vllm", "vllm-server")
# the unoptimized reference every fidelity metric compares against runs on the default engine
REFERENCE: str = EngineConfig.backend


def get(name: str) -> Engine:
    if name not in NAMES:
        from ..config import EngineError

        raise EngineError(f"engine.backend: unknown engine {name!r}; choose one of {', '.join(NAMES)}")
    return importlib.import_module(f"{__name__}.{name.replace('-', '_')}").ENGINE


def all_engines() -> list[Engine]:
    return [get(n) for n in NAMES]


def self_draft_runtime() -> Engine:
    """The engine that runs speculative.method=self-draft's draft (`Engine.runs_self_draft`)."""
    for e in all_engines():
        if e.runs_self_draft:
            return e
    from ..config import EngineError

    raise EngineError("speculative.method=self-draft: no engine runs self-draft drafts")


def support_keys() -> tuple[str, ...]:
    """Every config key some engine restricts, in first-declared order."""
    from .. import axes

    keys: dict[str, None] = {}
    for e in all_engines():
        keys.update(dict.fromkeys(e.support))
    chain = [a.key for a in axes.CHAIN if a.key in keys]  # the seed's chain order first, then the rest
    return tuple(chain + [k for k in keys if k not in chain])


def values(key: str) -> tuple[str, ...]:
    """Every value of `key` some engine honours (its values, then the aliases it runs as another), in the
    registry's order: what validation accepts for a key the engines restrict (quant.level, kv_cache.dtype), each
    engine contributing its own (llama.cpp's GGUF levels, vLLM's fp8 K/V); `unsupported` then says which engine
    honours which. A key no engine restricts has none here."""
    out: dict[str, None] = {}
    for e in all_engines():
        s = e.support.get(key)
        if s is not None:
            out.update(dict.fromkeys(s.values))
            out.update(dict.fromkeys(s.aliases))
    return tuple(out)


def _get(obj: Any, key: str) -> Any:
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def unsupported(engine: Engine, values: Mapping[str, Any]) -> Problems:
    """(config key, message) for each value of the flat {config key: value} mapping `engine` does not
    honour (aliases count as honoured: they run as their target)."""
    out = []
    for key, s in engine.support.items():
        if key in values and not s.accepts(values[key]):
            out.append((key, f"engine={engine.name} cannot honour {key}={values[key]}: {s.why} "
                             f"(it supports {', '.join(s.values)})"))
    return out


def problems(trial, facts, gpu_available: bool) -> Problems:
    """Everything the trial's engine says it cannot do: its support table, its own rules, and (last,
    so that what is wrong with the trial itself reads first) whether it is installed here."""
    engine = get(trial.engine.backend)
    flat = {key: _get(trial, key) for key in engine.support}
    out = unsupported(engine, flat) + engine.check(trial, facts, gpu_available)
    why = engine.missing()
    if why:
        out.append(("engine.backend", why))
    return out


def canonical(engine_name: str, key: str, value: Any) -> Any:
    """The value `engine_name` really runs for `key=value` (its alias target), else `value` unchanged."""
    if engine_name not in NAMES:
        return value
    s = get(engine_name).support.get(key)
    return value if s is None else s.runs_as(value)


def support_markdown(keys: tuple[str, ...] | None = None) -> str:
    """The axis x engine table of the README: which values each engine honours (alias -> target)."""
    keys = keys or support_keys()
    engines = all_engines()
    rows = ["| axis (config key) | " + " | ".join(e.name for e in engines) + " |",
            "|" + "---|" * (len(engines) + 1)]
    for key in keys:
        cells = []
        for e in engines:
            s = e.support.get(key)
            if s is None:
                cells.append("all")
                continue
            cells.append(", ".join(list(s.values) + [f"{a}→{t}" for a, t in s.aliases.items()]))
        rows.append(f"| `{key}` | " + " | ".join(cells) + " |")
    return "\n".join(rows)


__all__ = ["NAMES", "REFERENCE", "Engine", "Support", "all_engines", "canonical", "get", "make_backend", "problems", "self_draft_runtime",
           "support_keys", "support_markdown", "unsupported", "values"]


def make_backend(loaded: Any, trial) -> Any:
    """The logits-level backend (engine/engines/logits.py) of `trial`'s engine over a model from its
    `load`: what tests, benchmarks and notebooks drive token by token (`Engine.make_backend`)."""
    return get(trial.engine.backend).make_backend(loaded, trial)
