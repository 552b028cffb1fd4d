"""The decision's deliverable: the final configuration as the command that deploys it, where its engine is one
users deploy. Each engine says how (`Engine.deploy_commands`, engine/engines/base.py): vLLM's `vllm serve`
arguments (translated from its own `engine_args`, the arguments the trials ran with), llama.cpp's `llama-server`
and llama-cpp-python server arguments. The in-process research engines (hf, native) have no server: their
deliverable is the configuration itself (`infersweep reproduce HASH` re-runs it), and the text says so."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from engine import engines
from engine.config import EngineError, TrialConfig
from engine.engines.base import Engine


@dataclass(frozen=True)
class Deployment:
    engine: str
    commands: tuple[str, ...]  # empty where the engine is not one users deploy
    notes: tuple[str, ...] = ()

    def text(self) -> str:
        lines = [f"# deploy the final configuration (engine {self.engine})"]
        lines += list(self.commands) or ["# no server command: this engine runs in-process for measuring only"]
        lines += [f"# {n}" for n in self.notes]
        return "\n".join(lines) + "\n"


def served_engines() -> list[str]:
    """The registry's engines users deploy (those that give a deploy command)."""
    return [e.name for e in engines.all_engines() if type(e).deploy_commands is not Engine.deploy_commands]


def deployment(trial: TrialConfig, gguf: Optional[Callable[[TrialConfig], str]] = None) -> Deployment:
    """The deploy command(s) of `trial`'s configuration on its engine. `gguf`: the path of the weights file the
    trials loaded, for an engine that runs its own format (`weights_of`)."""
    backend = trial.engine.backend
    try:
        d = engines.get(backend).deploy_commands(trial, gguf)
    except EngineError as e:  # e.g. a draft model that cannot be resolved here
        return Deployment(backend, (), (f"no deploy command: {e}",))
    if d is not None:
        return Deployment(backend, d.commands, d.notes)
    served = " or ".join(f"engine={n}" for n in served_engines())
    return Deployment(backend, (), (f"engine {backend} is infersweep's in-process engine (measured, not served); "
                                    f"its configuration is the deliverable: `infersweep reproduce` re-runs it, and "
                                    f"the same settings run under {served} where they apply",))


def weights_of(trial: TrialConfig) -> Optional[str]:
    """The weights file of its engine's own format the trials loaded (llama.cpp's GGUF, cached by content: written
    when the trial ran); None where the engine loads the checkpoint itself."""
    return engines.get(trial.engine.backend).weights_file(trial)


gguf_of = weights_of  # experiments/optimize/run.py's name for it
