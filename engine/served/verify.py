"""Launch server command lines as a user would and measure them side by side: the check that the deploy command
`optimize` prints really serves what the trials measured, against the engine's default launch.

Every launch is a fresh process (nothing shared with the trials), all are up together, and each round drives the
trial's serving workload through one server at a time, in ABBA order (reversed every other round), so the per-round
ratios are paired as in an interleaved trial pair (engine.pipeline.run_interleaved). Every server is ended on every
exit path (engine/served/process.py).
"""
from __future__ import annotations

import shlex
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from ..config import EngineError, TrialConfig
from ..measure.metrics import request_metrics
from .client import Api, drive
from .process import HOST, ServerProcess, free_port, port_in_use


@dataclass(frozen=True)
class Launch:
    """A command line to launch as given (`command`, a shell line) and the model name its API answers to."""

    label: str
    command: str
    model: str


@dataclass
class LaunchResult:
    label: str
    command: str  # as launched (the printed one, its port changed only where that port was taken)
    startup_s: float
    rounds: list[dict[str, float]] = field(default_factory=list)  # request_metrics of each round
    port_note: str = ""

    def series(self, metric: str) -> list[float]:
        return [r[metric] for r in self.rounds]


def split_command(command: str) -> tuple[dict[str, str], list[str]]:
    """A shell line as (the `VAR=value` assignments before the program, argv)."""
    words = shlex.split(command)
    env = {}
    while words and "=" in words[0] and words[0].split("=", 1)[0].isidentifier():
        k, v = words.pop(0).split("=", 1)
        env[k] = v
    return env, words


def _with_free_port(argv: list[str]) -> tuple[list[str], int, str]:
    """The command's own --port where it is free, else a free one (and a note saying so)."""
    if "--port" in argv:
        i = argv.index("--port") + 1
        asked = int(argv[i])
        if not port_in_use(asked):
            return argv, asked, ""
        port = free_port()
        return argv[:i] + [str(port)] + argv[i + 1:], port, f"port {asked} was in use here: launched on {port}"
    port = free_port()
    return argv + ["--host", HOST, "--port", str(port)], port, f"no --port given: launched on {port}"


def measure_launches(launches: list[Launch], trial: TrialConfig, tokenizer, body: dict, exact_length_key: str,
                     rounds: int, say: Callable[[str], None], ready_timeout_s: float = 180.0) -> list[LaunchResult]:
    """Start every launch, warm each up with the workload's warm-up requests, then `rounds` rounds of the trial's
    serving workload on each, one server at a time. Returns one result per launch, in order."""
    from ..pipeline import serving_plan
    from ..prompts import corpus_ids

    if rounds < 2:
        raise EngineError(f"a paired check needs at least 2 rounds, got {rounds}")
    wl = trial.workload
    plan = serving_plan(wl, corpus_ids(tokenizer, wl.text), trial.seed, wl.warmup, 1)
    servers: list[ServerProcess] = []
    results: list[LaunchResult] = []
    apis: list[Api] = []
    with tempfile.TemporaryDirectory(prefix="infersweep-launch-") as d:
        try:
            for i, ln in enumerate(launches):
                env, words = split_command(ln.command)
                argv, port, note = _with_free_port(words)
                say(f"launching {ln.label}: {ln.command}")
                srv = ServerProcess(argv, port, Path(d) / f"server{i}.log", env=env, timeout_s=ready_timeout_s, say=say)
                servers.append(srv)
                results.append(LaunchResult(ln.label, srv.command, srv.startup_s, port_note=note))
                apis.append(Api(srv.url, ln.model, dict(body), tokenizer, exact_length_key=exact_length_key))
            for api in apis:
                for _ in range(plan.warmup):
                    drive(api, plan.warmup_requests)
            for r in range(rounds):
                order = range(len(apis)) if r % 2 == 0 else reversed(range(len(apis)))
                for i in order:
                    recs, duration = drive(apis[i], plan.requests, plan.follow_up, plan.max_concurrency)
                    results[i].rounds.append(request_metrics(recs, duration, trial.slo))
                say(f"launch check: round {r + 1}/{rounds}")
            for srv in servers:
                if not srv.running():
                    raise EngineError(f"a launched server exited during the check ({srv.command})")
        finally:
            for srv in servers:
                srv.stop()
    return results


def describe_rounds(res: LaunchResult, metric: str) -> Optional[str]:
    """Why a launch's `metric` gives no ratio (a round at 0), or None."""
    zeros = sum(1 for v in res.series(metric) if not v > 0)
    if not zeros:
        return None
    cut = sum(int(r.get("incomplete_requests", 0)) for r in res.rounds)
    return (f"{res.label}: {metric} 0 in {zeros} of {len(res.rounds)} rounds"
            + (f" ({cut} request(s) ended before their length)" if cut else ""))
