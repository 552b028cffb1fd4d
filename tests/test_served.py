"""Served trials (engine/served/, engine=llamacpp-server): a server process started per trial, driven over its
OpenAI-compatible HTTP API, ended on every exit path.

Fast tier, no engine needed: the process lifecycle on a real HTTP server (Python's own `http.server`: ready,
early exit with its log, not ready in time, port in use, a SIGKILLed owner's server ended by the next run, a
live owner's left alone); the streaming request driver's timing rules against a small SSE server written here
whose delays are known (arrivals, the concurrency cap, follow-ups, the output count); the engine's refusals.
Engine tier (llama-cpp-python with its server extras, `make setup-llamacpp`, and SmolLM2 prepared): a served
trial through the sweep, its greedy text against the in-process llama.cpp engine on the same GGUF, SIGTERM and
SIGKILL of a driver mid-trial, and the deploy command launched as printed."""
from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import statistics
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from conftest import need_prepared, require_installed
from engine.config import EngineError, SLOConfig
from engine.measure.metrics import request_metrics
from engine.served.client import Api, drive
from engine.served.process import ServerProcess, alive, free_port, records_dir, reap_orphans
from engine.serving.requests import Request
from engine.tokenizer import ByteTokenizer
from experiments.config.compose import SweepError, expand

ROOT = Path(__file__).resolve().parents[1]
needs_server = require_installed("llamacpp-server")
SMOL = "smollm2-135m-instruct"


@pytest.fixture(autouse=True)
def own_records(tmp_path, monkeypatch):
    """Server records in this test's own folder (another test's or a user's servers are never touched)."""
    from engine.served.process import RECORDS_ENV

    monkeypatch.setenv(RECORDS_ENV, str(tmp_path / "servers"))


def http_server(port: int) -> list[str]:
    return [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]


# --- the process ------------------------------------------------------------------------------------------

def test_a_server_is_ready_when_it_answers_and_stop_ends_it(tmp_path):
    port = free_port()
    with ServerProcess(http_server(port), port, tmp_path / "log", ready_path="/") as s:
        pid = s.pid
        assert s.running() and alive(pid, None)
        assert [p.name for p in records_dir().glob("*.json")] == [f"{pid}.json"]
        assert s.peak_rss_bytes() > 1_000_000
    assert not s.running() and not list(records_dir().glob("*.json"))
    s.stop()  # idempotent


def test_a_server_that_exits_before_ready_fails_with_its_log(tmp_path):
    argv = [sys.executable, "-c", "import sys; print('cannot load the model file'); sys.exit(3)"]
    with pytest.raises(EngineError, match="exited with code 3 before it was ready") as ei:
        ServerProcess(argv, free_port(), tmp_path / "log")
    assert "cannot load the model file" in str(ei.value)
    assert not list(records_dir().glob("*.json"))


def test_a_server_not_ready_in_time_is_ended(tmp_path):
    argv = [sys.executable, "-c", "import time; print('loading...', flush=True); time.sleep(600)"]
    t0 = time.monotonic()
    with pytest.raises(EngineError, match="not ready after 1 s") as ei:
        ServerProcess(argv, free_port(), tmp_path / "log", timeout_s=1.0)
    assert "loading..." in str(ei.value) and time.monotonic() - t0 < 30
    assert not list(records_dir().glob("*.json"))
    pids = subprocess.run(["pgrep", "-f", "time.sleep\\(600\\)"], capture_output=True, text=True).stdout.split()
    assert not [p for p in pids if alive(int(p), None)], "the server that never got ready still runs"


def test_a_port_in_use_is_refused_before_anything_starts(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(EngineError, match=f"port {port} on 127.0.0.1 is in use"):
            ServerProcess(http_server(port), port, tmp_path / "log", ready_path="/")
    assert not (tmp_path / "log").exists()


def test_an_interrupt_ends_the_server(tmp_path):
    port = free_port()
    with pytest.raises(KeyboardInterrupt):
        with ServerProcess(http_server(port), port, tmp_path / "log", ready_path="/") as s:
            pid = s.pid
            raise KeyboardInterrupt
    assert not alive(pid, None) or _zombie_or_gone(pid)
    assert not list(records_dir().glob("*.json"))


def _zombie_or_gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except OSError:
        return True


STUBBORN_CHILD = """
import signal, subprocess, sys
# a child in the server's process group that ignores SIGTERM (as vLLM's engine core can outlive its API server)
child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                          "print('child', flush=True); time.sleep(600)"])
print(child.pid, flush=True)
import http.server, socketserver
http.server.test(HandlerClass=http.server.SimpleHTTPRequestHandler, port=int(sys.argv[1]), bind="127.0.0.1")
"""


def test_stop_ends_the_servers_children_that_outlive_it(tmp_path):
    from engine.served.process import group_members

    port = free_port()
    log = tmp_path / "log"
    s = ServerProcess([sys.executable, "-c", STUBBORN_CHILD, str(port)], port, log, ready_path="/")
    child = int(log.read_text().split()[0])
    assert child in group_members(s.pid)
    s.stop(grace_s=1.0)
    assert not group_members(s.pid) and _zombie_or_gone(child)


OWNER = """
import sys, time
from pathlib import Path
from engine.served.process import ServerProcess, free_port
port = free_port()
s = ServerProcess([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"], port,
                  Path(sys.argv[1]), ready_path="/")
print(s.pid, flush=True)
time.sleep(600)
"""


def test_a_sigkilled_owners_server_is_ended_by_the_next_run_and_a_live_owners_is_not(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    # each log in a served trial's own folder (engine/served/session.py), which a dead owner never removed
    dirs = [tmp_path / f"infersweep-server-{i}" for i in range(2)]
    owners = [subprocess.Popen([sys.executable, "-c", OWNER, str(dirs[i] / "server.log")], env=env, cwd=ROOT,
                               stdout=subprocess.PIPE, text=True) for i in range(2)]
    try:
        servers = [int(o.stdout.readline()) for o in owners]
        owners[0].send_signal(signal.SIGKILL)  # no `finally` runs: its server outlives it
        owners[0].wait(timeout=30)
        assert alive(servers[0], None) and not _zombie_or_gone(servers[0])
        lines = []
        assert len(reap_orphans(lines.append)) == 1
        assert f"ended server pid {servers[0]}" in lines[0] and f"left by process {owners[0].pid}, which is gone" in lines[0]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not _zombie_or_gone(servers[0]):
            time.sleep(0.05)
        assert _zombie_or_gone(servers[0])
        assert alive(servers[1], None) and not _zombie_or_gone(servers[1])  # its owner lives: not ours to end
        assert [p.name for p in records_dir().glob("*.json")] == [f"{servers[1]}.json"]
        assert not dirs[0].exists() and dirs[1].exists()  # the dead owner's folder goes with its server
    finally:
        for o in owners:
            o.kill()
            o.wait()
        reap_orphans()  # the second owner is gone now: its server goes too
    assert not list(records_dir().glob("*.json"))


# --- the request driver -------------------------------------------------------------------------------------

class SSE(BaseHTTPRequestHandler):
    """An OpenAI-style streaming completions endpoint with known delays: the first chunk `ttft_s` after the request,
    then one chunk per token every `itl_s`; "usage" in the last chunk when the server is told to."""

    ttft_s, itl_s, usage, fail, bodies = 0.15, 0.03, True, False, []

    def log_message(self, *a):
        pass

    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b'{"data": []}')

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        if self.fail:
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b"model exploded")
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        time.sleep(self.ttft_s)
        n = body["max_tokens"]
        for i in range(n):
            if i:
                time.sleep(self.itl_s)
            chunk = {"choices": [{"text": "a", "finish_reason": None}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
        last = {"choices": [{"text": "", "finish_reason": "length"}]}
        if self.usage:
            last["usage"] = {"completion_tokens": n}
        self.wfile.write(f"data: {json.dumps(last)}\n\ndata: [DONE]\n\n".encode())


@pytest.fixture
def sse():
    SSE.bodies, SSE.usage, SSE.fail = [], True, False
    srv = ThreadingHTTPServer(("127.0.0.1", 0), SSE)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def _api(url: str, **kw) -> Api:
    return Api(url, "m", {"temperature": 0.0}, ByteTokenizer(), **kw)


def _req(i: int, arrival: float, n: int = 5) -> Request:
    return Request(i, tuple(ByteTokenizer().encode(f"hello {i}")), n, arrival)


def test_streamed_timings_follow_the_servers_delays_and_arrivals(sse):
    recs, duration = drive(_api(sse, exact_length_key="min_tokens"), [_req(0, 0.0), _req(1, 0.4, 8)])
    assert [r.id for r in recs] == [0, 1] and [len(r.output) for r in recs] == [5, 8]
    assert recs[0].sent_s < 0.1 and 0.4 <= recs[1].sent_s < 0.6  # sent at its arrival time
    for r in recs:  # causal bounds, whatever the machine's stalls: token k cannot arrive before the server wrote it
        assert r.ttft_s >= SSE.ttft_s and len(r.token_times_s) == len(r.output)
        for k, t in enumerate(r.token_times_s):
            assert t - r.sent_s >= SSE.ttft_s + k * SSE.itl_s - 1e-3, (k, t - r.sent_s)
    assert duration == max(r.token_times_s[-1] for r in recs)
    m = request_metrics(recs, duration, SLOConfig())
    tpots = sorted(1e3 * (r.token_times_s[-1] - r.token_times_s[0]) / (len(r.output) - 1) for r in recs)
    assert m["tpot_ms_p50"] == pytest.approx(statistics.median(tpots), rel=1e-6)  # the stream's own per-token time
    assert m["ttft_ms_p50"] >= SSE.ttft_s * 1e3
    # what was sent: the prompt as text, the exact-length option at max_tokens, streaming
    assert SSE.bodies[0]["prompt"] == "hello 0" and SSE.bodies[0]["min_tokens"] == 5 and SSE.bodies[0]["stream"] is True


def test_the_concurrency_cap_holds_requests_back_and_follow_ups_join(sse):
    follow = lambda req, out, t: _req(10 + req.id, t + 0.05, 3) if req.id < 10 else None  # noqa: E731
    recs, _ = drive(_api(sse, exact_length_key="ignore_eos"), [_req(0, 0.0), _req(1, 0.0)], follow_up=follow,
                    max_concurrency=1)
    by_id = {r.id: r for r in recs}
    assert sorted(by_id) == [0, 1, 10, 11]
    first, second = sorted((by_id[0], by_id[1]), key=lambda r: r.sent_s)
    assert second.sent_s >= first.token_times_s[-1] - 0.01  # one in flight at a time: sent when the slot freed
    assert by_id[10].sent_s >= by_id[0].token_times_s[-1] + 0.05
    assert all(b.get("ignore_eos") is True for b in SSE.bodies)


def test_without_usage_the_output_is_counted_by_the_tokenizer(sse):
    SSE.usage = False
    recs, _ = drive(_api(sse), [_req(0, 0.0, 6)])
    assert len(recs[0].output) == 6  # six "a" -> six byte tokens


def test_a_server_error_fails_the_run_with_what_it_said(sse):
    SSE.fail = True
    with pytest.raises(EngineError, match="HTTP 500: model exploded"):
        drive(_api(sse), [_req(0, 0.0)])


# --- the engine's refusals (no llama.cpp needed) -----------------------------------------------------------

def _problems(overrides: list[str]) -> str:
    from conftest import expand_with_engines_absent

    with pytest.raises(SweepError) as ei:
        expand_with_engines_absent(overrides, gpu_available=False)
    return str(ei.value)


def test_llamacpp_server_refuses_what_its_server_cannot_run():
    msg = _problems(["model=tiny-llama", "server=llamacpp", "workload=serving-mixed", "batching.max_batch_size=4",
                     "speculative=self-draft"])
    assert "batching.max_batch_size: engine=llamacpp-server: llama-cpp-python's server answers one request at a time" in msg
    assert "model.path: engine=llamacpp-server: the server tokenizes text with the GGUF's own vocabulary" in msg
    assert "speculative.method: engine=llamacpp-server cannot honour speculative.method=self-draft" in msg
    msg = _problems(["model=tiny-llama", "engine=llamacpp-server"])
    assert "workload.kind: engine=llamacpp-server serves requests over HTTP: give it a serving workload" in msg


def test_llamacpp_server_missing_names_its_setup(monkeypatch):
    import importlib.util

    from engine import engines

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "sse_starlette" else real(n, *a))
    why = engines.get("llamacpp-server").missing()
    if engines.get("llamacpp").missing() is None:
        assert why == ("engine=llamacpp-server needs llama-cpp-python's server extras (sse_starlette not installed): "
                       "run `make setup-llamacpp`")
    else:
        assert "make setup-llamacpp" in why


def test_the_server_command_speaks_the_servers_language():
    import dataclasses

    from engine.config import KVCacheConfig, ModelConfig, SpeculativeConfig, WorkloadConfig
    from engine.engines.llamacpp import python_server_argv
    from support import make_trial

    trial = make_trial(ModelConfig(name="smollm2-135m-instruct", path="prepared://smollm2-135m-instruct"), backend="llamacpp-server", attention="flash",
                       threads=1, workload=WorkloadConfig(kind="serving"), speculative=SpeculativeConfig(method="prompt-lookup"))
    trial = dataclasses.replace(trial, kv_cache=KVCacheConfig(dtype="q8_0", prefix_caching=True))
    argv = python_server_argv(trial, "/m.gguf", 8123, "127.0.0.1")
    cmd = " ".join(argv)
    assert argv[0] == sys.executable  # this venv's interpreter, not whatever `python` the shell finds
    assert "--type_k 8 --type_v 8" in cmd  # ggml's type number, which is what the server's argparse takes
    assert "--n_ctx 2048" in cmd and "--interrupt_requests false" in cmd and "--flash_attn true" in cmd
    assert "--cache true" in cmd and "--draft_model prompt-lookup-decoding" in cmd and "--n_threads 1" in cmd
    assert "--model_alias smollm2-135m-instruct" in cmd and "--port 8123" in cmd


# --- the real server (llama-cpp-python's, on SmolLM2) -----------------------------------------------------

SERVED = ["model=smollm2-135m", "server=llamacpp", "quant=gguf-shipped", "workload=serving-mixed",
          "workload.num_requests=3", "workload.output_len.min=4", "workload.output_len.max=8", "eval=none",
          "engine.threads=1"]


@needs_server
def test_a_served_trial_is_recorded_like_any_serving_trial_and_leaves_no_server(tmp_path):
    need_prepared(SMOL)
    from support import served_trial_run

    client, run = served_trial_run(tmp_path, SERVED, "t-served")
    for k in ("ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "itl_ms_p50", "e2e_s_p99", "goodput", "request_s",
              "output_tok_s", "slo_attainment", "peak_mem_bytes", "model_load_s"):
        assert k in run.data.metrics, k
    assert run.data.metrics["model_load_s"] > 0  # the server's start-up
    assert "llama_cpp.server" in run.data.tags["env.server_command"]
    arts = {a.path for a in client.list_artifacts(run.info.run_id, "server")}
    assert arts == {"server/command.txt", "server/server.log"}
    log = Path(client.download_artifacts(run.info.run_id, "server/server.log", str(tmp_path))).read_text()
    assert "POST /v1/completions" in log
    assert not list(records_dir().glob("*.json"))  # ended with the trial
    # every request, overlapping the others at the server, ran its whole length (the server's default cancels the
    # request in progress when another arrives)
    from engine.serving.requests import lengths

    trial = expand(SERVED + ["workload.arrival=all-at-once"], gpu_available=False)[0].trial
    outputs = json.loads(Path(client.download_artifacts(run.info.run_id, "token_ids.json", str(tmp_path))).read_text())
    assert [len(o) for o in outputs] == [n for _, n in lengths(trial.workload, trial.seed)]


@needs_server
def test_greedy_text_through_the_server_equals_the_in_process_engine_on_the_same_gguf():
    need_prepared(SMOL)
    from engine.pipeline import close_session, open_trial

    trial = expand(SERVED, gpu_available=False)[0].trial
    m = open_trial(trial, progress=lambda *_: None)
    try:
        tok = m.session.tokenizer
        prompt = tok.encode("The capital of France is Paris. The capital of Italy is")
        recs, _ = drive(m.session.api(lambda *_: None), [Request(0, tuple(prompt), 12, 0.0)])
        local = m.session.generate_greedy(prompt, 12, [], lambda *_: None)
        assert len(local) == 12  # no EOS within 12 tokens here: both ran the full length
        assert tok.decode(list(recs[0].output)) == tok.decode(local)
    finally:
        close_session(m.session)
    assert not list(records_dir().glob("*.json"))


def _driver_with_a_server(tmp_path, sig: int, command: str = "run") -> tuple[subprocess.Popen, dict]:
    """`infersweep run` (or `sweep`: on Ray) of a served trial with slow requests; `sig` once its server is recorded."""
    args = [sys.executable, "-m", "experiments.cli", command, *SERVED, "workload.output_len.min=400",
            "workload.output_len.max=400", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", f"tracking.spool_dir={tmp_path}/s"]
    proc = subprocess.Popen(args, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and not list(records_dir().glob("*.json")):
        assert proc.poll() is None, "the driver ended before its server started"
        time.sleep(0.1)
    rec = json.loads(next(records_dir().glob("*.json")).read_text())
    time.sleep(1.0)  # requests in flight
    proc.send_signal(sig)
    proc.wait(timeout=120)
    return proc, rec


@needs_server
def test_sigterm_of_a_driver_mid_trial_ends_its_server(tmp_path):
    need_prepared(SMOL)
    proc, rec = _driver_with_a_server(tmp_path, signal.SIGTERM)
    assert proc.returncode == 130
    assert not alive(rec["pid"], rec["started"]) or _zombie_or_gone(rec["pid"])
    assert not list(records_dir().glob("*.json"))


@needs_server
@pytest.mark.slow  # a local Ray cluster
def test_sigterm_of_a_sweep_on_ray_mid_trial_ends_its_server(tmp_path):
    """On Ray the interrupted driver kills its actors outright (the trial's `finally` never runs there): the
    driver then ends the servers they leave before it exits."""
    need_prepared(SMOL)
    proc, rec = _driver_with_a_server(tmp_path, signal.SIGTERM, "sweep")
    assert proc.returncode == 130
    assert not alive(rec["pid"], rec["started"]) or _zombie_or_gone(rec["pid"])
    assert not list(records_dir().glob("*.json"))


@needs_server
def test_sigkill_of_a_driver_mid_trial_leaves_a_server_the_next_run_ends(tmp_path):
    need_prepared(SMOL)
    proc, rec = _driver_with_a_server(tmp_path, signal.SIGKILL)
    assert alive(rec["pid"], rec["started"])  # nothing could end it...
    assert len(reap_orphans()) == 1  # ...until the next run
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and alive(rec["pid"], rec["started"]) and not _zombie_or_gone(rec["pid"]):
        time.sleep(0.05)
    assert _zombie_or_gone(rec["pid"])


@needs_server
def test_the_printed_deploy_command_starts_and_serves(tmp_path):
    need_prepared(SMOL)
    import httpx

    from engine import engines

    trial = expand(SERVED, gpu_available=False)[0].trial
    eng = engines.get("llamacpp-server")
    py = eng.deploy_commands(trial, eng.weights_file).commands[0]  # the one its trials launch
    argv = shlex.split(py)
    port = free_port()
    argv[argv.index("--port") + 1] = str(port)
    with ServerProcess(argv, port, tmp_path / "log") as s:
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 3,
                                                         "temperature": 0}, timeout=60, trust_env=False)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


# --- requests cut short, interleaving, the objective ------------------------------------------------------

def test_a_request_the_server_ended_early_never_counts_toward_goodput(sse):
    class Stops(SSE):
        def do_POST(self):  # streams two tokens of the five asked, then says "stop"
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.end_headers()
            for i in range(2):
                self.wfile.write(f'data: {json.dumps({"choices": [{"text": "a", "finish_reason": None}]})}\n\n'.encode())
            self.wfile.write(f'data: {json.dumps({"choices": [{"text": "", "finish_reason": "stop"}]})}\n\n'.encode())

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Stops)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        recs, duration = drive(_api(f"http://127.0.0.1:{srv.server_address[1]}"), [_req(0, 0.0, 5)])
    finally:
        srv.shutdown()
    assert not recs[0].complete and len(recs[0].output) == 2
    m = request_metrics(recs, duration, SLOConfig(ttft_ms=1e9, tpot_ms=1e9))  # an SLO nothing misses...
    assert m["goodput"] == 0 and m["incomplete_requests"] == 1  # ...but the request did not get its answer
    assert m["goodput_cc"] == pytest.approx(0.5 / duration)  # what optimize pairs: half a request, never a 0
    ok, d2 = drive(_api(sse), [_req(0, 0.0, 5)])
    assert ok[0].complete and request_metrics(ok, d2, SLOConfig(ttft_ms=1e9, tpot_ms=1e9))["incomplete_requests"] == 0


def test_served_trials_interleave_and_in_process_only_engines_still_refuse():
    from conftest import expand_on_a_new_machine

    specs, _, unprepared = expand_on_a_new_machine(["model=smollm2-135m", "server=llamacpp", "workload=serving-mixed",
                                                    "eval=none", "cluster.interleave=3"], gpu_available=False)
    if specs is None:  # a new machine: SmolLM2 not prepared yet, and that is the only problem (no interleave one)
        assert unprepared and not [p for p in unprepared if "cluster.interleave" in p]
    else:
        assert specs[0].trial.engine.backend == "llamacpp-server"
    msg = _problems(["model=tiny-llama", "server=vllm", "workload=serving-mixed", "cluster.interleave=3"])
    assert "cluster.interleave: engine=vllm runs in its own process" in msg and "llamacpp-server" in msg


def test_goodput_is_an_objective_higher_is_better():
    from experiments.optimize.objective import Objective

    o = Objective.parse("goodput")
    assert [(t.metric, t.higher_is_better) for t in o.terms] == [("goodput_cc", True)]
    from engine.measure.metrics import TIMINGS

    assert "goodput_cc" in TIMINGS  # recorded round by round: what a pair's verdict is computed from


def test_a_candidate_that_breaks_the_slo_in_most_rounds_still_gets_a_paired_ratio():
    """Goodput is a count over a round's time: a candidate where no request met the SLO in a round has goodput 0, and
    a ratio of 0 has no log. Paired by round on goodput_cc (half a request added to each round's count) the
    verdict exists, and it says worse (measured: vLLM with ngram speculation, 0 in 8 of 9 rounds)."""
    from engine.measure.spread import paired_ratio

    dur = 6.0
    inc = [(met + 0.5) / dur for met in (9, 8, 10, 9, 7, 9, 8, 10, 9)]
    cand = [(met + 0.5) / dur for met in (0, 0, 0, 0, 0, 0, 1, 0, 0)]
    assert paired_ratio([m * dur - 0.5 for m in inc], [m * dur - 0.5 for m in cand], higher_is_better=True) is None
    r = paired_ratio(inc, cand, higher_is_better=True)
    assert r is not None and r.hi < 0.2
    # a harmless change keeps a ratio near 1, pulled toward it (never past it) by the half request
    same = paired_ratio(inc, [(met + 0.5) / dur for met in (9, 9, 9, 8, 8, 9, 9, 9, 9)], higher_is_better=True)
    assert same.lo < 1 < same.hi


@needs_server
def test_two_servers_interleave_one_driven_at_a_time_and_both_end():
    need_prepared(SMOL)
    from engine.pipeline import run_interleaved

    a = expand(SERVED + ["engine.threads=1"], gpu_available=False)[0].trial
    b = expand(SERVED + ["engine.threads=2"], gpu_available=False)[0].trial
    res = run_interleaved([a, b], 3, progress=lambda *_: None)
    assert not list(records_dir().glob("*.json"))  # both servers ended
    for r in res:
        assert len(r.samples["goodput"]) == len(r.samples["ttft_ms_p50"]) >= 3  # one value per round: paired
        assert r.metrics["peak_mem_bytes"] > r.metrics["weights_bytes"]  # its own server's peak, not this process's
        assert r.info["server_command"].count(" --n_threads ") == 1
    assert res[0].info["server_command"] != res[1].info["server_command"]


@needs_server
def test_the_deploy_check_launches_the_printed_command_beside_the_defaults():
    need_prepared(SMOL)
    from experiments.optimize.verify import verify_deploy

    trial = expand(SERVED + ["workload.arrival=all-at-once"], gpu_available=False)[0].trial
    lines: list[str] = []
    note, metrics = verify_deploy(trial, 2, lines.append)
    assert note.startswith(f"verified by launching the printed command beside the defaults (`{sys.executable} -m "
                           "llama_cpp.server --model ")
    # a ratio, or -- where the defaults met no SLO in a round (their cut-short requests) -- the reason there is none
    import re

    assert re.search(r"2 interleaved rounds: goodput at the SLO( x[\d.]+ \[|: no paired ratio \(the defaults: goodput 0 in)",
                     note), note
    assert "goodput over all rounds " in note
    launched = [ln for ln in lines if ln.startswith("launching ")]
    assert len(launched) == 2 and "--interrupt_requests false" in launched[0] and "--n_threads" not in launched[1]
    assert metrics["deploy_verified"] == 1.0 and not list(records_dir().glob("*.json"))


@needs_server
@pytest.mark.slow  # two chain pairs, the total and the deploy check on real servers (~4 min)
def test_optimize_a_served_space_ends_with_a_verified_deploy_command(tmp_path):
    need_prepared(SMOL)
    from experiments.optimize.run import run_optimize

    res = run_optimize(SERVED + ["workload.arrival=all-at-once", "engine.threads=2,1", "optimize.objective=goodput",
                                 "optimize.gate.enabled=false", "optimize.rounds=3", "optimize.remeasure=0",
                                 "optimize.retries=0", "optimize.verify_rounds=2", f"tracking.uri=sqlite:///{tmp_path}/m.db",
                                 f"tracking.spool_dir={tmp_path}/s", "sweep_name=t-serve-opt"],
                       in_process=True, echo=lambda *_: None)
    assert res.deploy.splitlines()[1].startswith(f"{sys.executable} -m llama_cpp.server ")
    assert "# verified by launching the printed command beside the defaults" in res.deploy
    assert res.verified["deploy_verified"] == 1.0
    assert not list(records_dir().glob("*.json"))


@needs_server
@pytest.mark.slow  # a chain pair in-process, its served counterpart, the deploy check on real servers (~3 min)
def test_an_in_process_winner_ends_with_its_served_counterpart_measured_and_verified(tmp_path):
    need_prepared(SMOL)
    from experiments.optimize.run import run_optimize

    lines: list[str] = []
    res = run_optimize(["model=smollm2-135m", "engine=native", "kv_cache=contiguous", "attention=eager,sdpa",
                        "quant=int8-weight", "speculative=off", "eval=none", "workload.context_len=32",
                        "workload.max_new_tokens=6", "engine.threads=1", "optimize.gate.enabled=false",
                        "optimize.rounds=3", "optimize.remeasure=0", "optimize.retries=0", "optimize.verify_rounds=2",
                        f"tracking.uri=sqlite:///{tmp_path}/m.db", f"tracking.spool_dir={tmp_path}/s",
                        "sweep_name=t-counterpart"], in_process=True, echo=lines.append)
    # the counterpart: int8 weights -> llama.cpp's Q8_0, the final's own lengths, one request at a time
    said = next(ln for ln in lines if "measuring its served counterpart" in ln)
    assert "quant=gguf-q8_0" in said and "workload.max_concurrency=1" in said and "workload.input_len.value=32" in said
    note = next(n for n in res.notes if n.startswith("served counterpart (llama.cpp's server"))
    v = res.verified
    assert 0 < v["counterpart_tpot_ms_p50_ratio_ci_lo"] <= v["counterpart_tpot_ms_p50_ratio"] \
        <= v["counterpart_tpot_ms_p50_ratio_ci_hi"], v
    assert f"x{v['counterpart_tpot_ms_p50_ratio']:.2f}" in note and v["counterpart_tpot_ms_p50"] > 0
    # the printed deliverable: the in-process final says it has no server, then its counterpart's command, launched
    # beside the server's defaults and checked
    head, served = res.deploy.split("# deploy its served counterpart (engine llamacpp-server)", 1)
    assert "no server command" in head
    assert f"{sys.executable} -m llama_cpp.server " in served and "-Q8_0" in served and "--n_threads 1" in served
    assert "# verified by launching the printed command beside the defaults" in served
    assert v["deploy_verified"] == 1.0
    assert not list(records_dir().glob("*.json"))  # every server ended
