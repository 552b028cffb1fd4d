"""The trial contract on a server the trial starts (`ServedEngine`): the engine's own OpenAI-compatible server
as a separate process, driven over HTTP by engine/served/client.py.

The server starts at the first plan (`load_s` = its start-up: launch to ready), serves every plan of the trial
(warm-up, timed repeats, a capacity search's probes, multi-turn conversations) and is ended by `close()` -- the
pipeline's `close_session`, in a `finally`, so an error or an interrupt ends it too. Each timed repeat is a
`ServedTrace` of `RequestRecord`s, so the metrics are computed by the same code as every in-process serving
trial's (engine/measure/metrics.py `request_metrics`), under the same names. Peak memory is the server
process's peak resident set (it holds the model, its KV cache and the HTTP stack).

Accuracy (perplexity / fidelity windows, task items) is scored in this process on the same weights file by the
engine's in-process runtime (`ServedEngine.local_engine`), loaded only when an evaluation asks: the served
engine's knobs that change outputs are weights, K/V type and attention, which that runtime honours alike.
"""
from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from ..config import EngineError, TrialConfig
from ..engines.base import Engine, Runs, TrialSession
from .client import Api, api_greedy, api_loglikelihood, api_topk_windows, drive
from .process import SESSION_DIR_PREFIX, ServerProcess, free_port, log_tail

LOG_ARTIFACT_CHARS = 20000


@dataclass
class ServedModel:
    """What a served engine loads in this process: the weights file the server will load, and the tokenizer
    (prompt text, output lengths)."""

    path: Path
    tokenizer: Any
    device: torch.device = torch.device("cpu")


@dataclass(frozen=True)
class ServedTrace:
    """One timed serving run through the API (engine/traces.py `ServedRun`)."""

    requests: tuple
    duration_s: float


class ServedEngine(Engine):
    """An engine whose trials run on its own server. Subclasses say how to launch it and what to send."""

    serves = True
    searches_capacity = True
    serves_conversations = True
    in_process = False  # the server's CPU time is another process's: /proc cannot tell it from other load
    interleaves = True  # the session's server stays up between runs: pairs interleave, one server driven at a time
    api_scores = False  # accuracy through the server's API (prompt log-probs, greedy token ids); else `local_engine`
    exact_length_key = ""  # the request option that makes it generate exactly max_tokens (ignore_eos, min_tokens)
    ready_timeout_s = 180.0

    def server_argv(self, trial: TrialConfig, weights: str, port: int, host: str) -> list[str]:
        raise NotImplementedError

    def served_problems(self, trial: TrialConfig, static_runs_on: str, tiny_why: str) -> list[tuple[str, str]]:
        """What every served engine refuses: a workload that is not a request stream (`static_runs_on`: where a
        static batch runs instead) and a tiny random model (`tiny_why`: why its server cannot serve one)."""
        from ..models import TINY_SCHEME

        label = f"engine={self.name}"
        p = []
        if not trial.workload.serving:
            p.append(("workload.kind", f"{label} serves requests over HTTP: give it a serving workload "
                                       f"(workload=serving-mixed, serving-burst or serving-multiturn); a static batch "
                                       f"runs on {static_runs_on}"))
        if trial.model.path.startswith(TINY_SCHEME):
            p.append(("model.path", f"{label}: the server tokenizes text with {tiny_why}: serve a real model "
                                    "(model=smollm2-135m)"))
        return p

    def server_env(self, trial: TrialConfig) -> dict[str, str]:
        """Variables the server's environment adds to this one's (vLLM's CPU thread binding)."""
        return {}

    def request_body(self, trial: TrialConfig) -> dict[str, Any]:
        """The fixed part of every request (sampling as the trial's workload asks)."""
        s = trial.workload.sampling
        return {"temperature": s.temperature, "top_p": s.top_p, "seed": trial.seed}

    def deploy_launch(self, trial: TrialConfig, weights: str):
        """The printed deploy command (`deploy_commands(...).commands[0]`, the one its trials launch) as a `Launch`."""
        from .verify import Launch

        return Launch("the printed command", self.deploy_commands(trial, lambda t: weights).commands[0], trial.model.name)

    def default_launch(self, trial: TrialConfig, weights: str):
        """The engine's server launched with the weights and nothing else (`vllm serve MODEL`,
        `python -m llama_cpp.server --model M`): what the tuned launch is verified against."""
        raise NotImplementedError

    def local_engine(self) -> Engine:
        """The in-process engine that scores accuracy on the same weights file."""
        raise NotImplementedError

    def open(self, trial: TrialConfig, loaded: Any, say) -> "ServedSession":
        return ServedSession(self, trial, loaded)


class ServedSession(TrialSession):
    def __init__(self, engine: ServedEngine, trial: TrialConfig, loaded: ServedModel):
        self.engine, self.trial, self.loaded = engine, trial, loaded
        self.tokenizer = loaded.tokenizer
        self.device = torch.device("cpu")
        self.load_s = 0.0
        self._server: Optional[ServerProcess] = None
        self._dir = Path(tempfile.mkdtemp(prefix=SESSION_DIR_PREFIX))
        self._local: Optional[TrialSession] = None
        self._log_text = ""

    # --- the server ---------------------------------------------------------------------------------
    def server(self, say) -> ServerProcess:
        if self._server is None:
            port = free_port()
            argv = self.engine.server_argv(self.trial, str(self.loaded.path), port, "127.0.0.1")
            say(f"starting {self.engine.name}'s server on port {port}")
            extra = self.engine.server_env(self.trial)
            self._server = ServerProcess(argv, port, self._dir / "server.log", timeout_s=self.engine.ready_timeout_s,
                                         env=extra, say=say)
            self.load_s = self._server.startup_s
        return self._server

    def api(self, say) -> Api:
        srv = self.server(say)
        return Api(srv.url, self.trial.model.name, dict(self.engine.request_body(self.trial)), self.tokenizer,
                   exact_length_key=self.engine.exact_length_key)

    def run_serving(self, plan, say) -> Runs:
        api = self.api(say)
        srv = self._server
        what = "conversations" if plan.follow_up else "requests"
        say(f"serving {len(plan.requests)} {what} through {srv.url} ({plan.warmup} warm-up, {plan.repeats} run(s))")
        traces = []
        try:
            for _ in range(plan.warmup):
                drive(api, plan.warmup_requests)
            for _ in range(plan.repeats):
                recs, duration = drive(api, plan.requests, plan.follow_up, plan.max_concurrency)
                traces.append(ServedTrace(tuple(recs), duration))
        except EngineError:
            raise
        except Exception as e:  # a refused connection, a dropped stream: say what the server said last
            raise EngineError(f"serving through {srv.url} failed ({type(e).__name__}: {e})"
                              + ("" if srv.running() else f"; the server exited, its log ends:\n{log_tail(srv.log_path)}")) from e
        if not srv.running():
            raise EngineError(f"the server exited during the run; its log ends:\n{log_tail(srv.log_path)}")
        return Runs(traces, [{} for _ in traces], srv.peak_rss_bytes())

    def run_static(self, plan, say) -> Runs:
        raise EngineError(f"engine={self.engine.name} serves requests over HTTP: a static batch runs on an in-process "
                          "engine (use a serving workload, workload=serving-mixed)")

    # --- accuracy, on the same weights in this process ------------------------------------------------
    def local(self, say) -> TrialSession:
        if self._local is None:
            eng = self.engine.local_engine()
            say(f"loading {self.loaded.path.name} in this process to score accuracy ({eng.name})")
            self._local = eng.open(self.trial, eng.load(self.trial, say), say)
        return self._local

    def score_windows(self, windows, topk: int, say):
        if self.engine.api_scores:
            return api_topk_windows(self.api(say), windows.tolist(), topk)
        return self.local(say).score_windows(windows, topk, say)

    def loglikelihood(self, pairs, say):
        if self.engine.api_scores:
            if any(not ctx for ctx, _ in pairs):
                raise EngineError(f"engine={self.engine.name} scores a continuation after at least one context token "
                                  "(a server has no log-prob for a prompt's first position)")
            say(f"scoring {len(pairs)} continuations through the server's prompt log-probs")
            return api_loglikelihood(self.api(say), pairs)
        return self.local(say).loglikelihood(pairs, say)

    def generate_greedy(self, prompt, max_new_tokens, stop, say):
        return self.generate_greedy_many([(prompt, max_new_tokens, stop)], say)[0]

    def generate_greedy_many(self, requests, say):
        if self.engine.api_scores:
            from ..engines.base import cut_generation

            say(f"generating {len(requests)} greedy answers through the server")
            got = api_greedy(self.api(say), [(p, n) for p, n, _ in requests])
            return [cut_generation(ids, self.tokenizer, list(stop)) for ids, (_, _, stop) in zip(got, requests)]
        return self.local(say).generate_greedy_many(requests, say)

    # --- facts --------------------------------------------------------------------------------------
    def weights_bytes(self) -> int:
        return self.loaded.path.stat().st_size

    def info(self) -> dict[str, str]:
        if self._server is None:
            return {}
        return {"server_command": self._server.command[:4000], "server_startup_s": f"{self._server.startup_s:.2f}"}

    def artifacts(self) -> dict[str, str]:
        """Files for the run's record: the server's command line and the end of its log."""
        if self._server is None:
            return {}
        return {"server/command.txt": self._server.command + "\n",
                "server/server.log": log_tail(self._server.log_path, LOG_ARTIFACT_CHARS) + "\n"}

    def close(self) -> None:
        try:
            if self._server is not None:
                self._server.stop()
            if self._local is not None:
                self._local.close()
                self._local = None
        finally:
            shutil.rmtree(self._dir, ignore_errors=True)
