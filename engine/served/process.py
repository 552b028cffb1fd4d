"""A server process a trial starts: launched on 127.0.0.1 in its own session, ready when its HTTP API answers,
ended on every exit path -- and found and ended by the next run when its owner died without ending it.

`ServerProcess` launches the argv exactly as given (the command a user would type), waits until
`GET <ready_path>` answers 200 (or fails at once when the process exits, with the tail of its log), and `stop()`
sends SIGTERM to the whole process group, then SIGKILL after a grace period. Use it as a context manager, or
call `stop()` in a `finally`: an exception, Ctrl-C or `kill` (the CLI turns SIGTERM into KeyboardInterrupt)
all end it.

A SIGKILLed owner (a driver or Ray worker killed outright) cannot run a `finally`. So every server is recorded
while it runs, in `<cache>/servers/<pid>.json` (its pid, process group and start time; the owner's pid and
start time; the argv, port and log). `reap_orphans()` -- called when the next server starts, and by the
sweep / optimize drivers when they start -- ends the recorded servers whose owner is gone (the pid is dead or
now names another process) and only those: never by name, never a process that merely reuses a recorded pid.
Linux only for the reaping (/proc); elsewhere servers are still ended on every other path.
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from ..cachedir import cache_root
from ..config import EngineError

HOST = "127.0.0.1"
LOG_TAIL = 3000


RECORDS_ENV = "INFERSWEEP_SERVER_RECORDS"  # where the records live (default <cache>/servers; tests use their own)


def records_dir() -> Path:
    return Path(os.environ.get(RECORDS_ENV) or cache_root() / "servers")


def start_time(pid: int) -> Optional[str]:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22): with the pid it names
    one process, never a later one that reused the pid. None when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]


def alive(pid: int, started: Optional[str]) -> bool:
    now = start_time(pid)
    return now is not None and (started is None or now == started)


def free_port(host: str = HOST) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_in_use(port: int, host: str = HOST) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def log_tail(path: Path, n: int = LOG_TAIL) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return text[-n:].strip()


def group_members(pgid: int, started: Optional[str] = None) -> list[int]:
    """The live (not zombie) processes of the process group a server led (its leader `pgid`, started at
    `started`), the leader included while it lives: [] when none is left, or when the group id now belongs to
    another process's group (a process `pgid` with another start time leads it)."""
    if started is not None and start_time(pgid) not in (None, started):
        return []
    out = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for name in entries:
        if not name.isdigit():
            continue
        try:
            fields = Path(f"/proc/{name}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(name))
    return out


def _kill_group(pgid: int, pid: int, started: Optional[str], grace_s: float) -> None:
    """SIGTERM to the group, SIGKILL to what is left after `grace_s`: the leader and every other member, since a
    server's children (vLLM's engine core and worker) can outlive their leader. A group id is never reused while
    any member lives, and a leader's pid that now names another process is never signalled."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        if not group_members(pgid, started):
            return
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and group_members(pgid, started):
            time.sleep(0.05)


SESSION_DIR_PREFIX = "infersweep-server-"  # a served trial's own temporary folder (engine/served/session.py)


def _remove_session_dir(log: Optional[str]) -> None:
    """The folder a dead owner's served trial kept its server log in (its `finally` never ran)."""
    if not log:
        return
    d = Path(log).parent
    if d.name.startswith(SESSION_DIR_PREFIX):
        import shutil

        shutil.rmtree(d, ignore_errors=True)


def reap_orphans(say: Optional[Callable[[str], None]] = None) -> list[str]:
    """End the recorded servers whose owner is gone; returns one line per server ended."""
    d = records_dir()
    out: list[str] = []
    if not d.is_dir():
        return out
    for path in sorted(d.glob("*.json")):
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError):
            path.unlink(missing_ok=True)
            continue
        if alive(rec["owner_pid"], rec.get("owner_started")):
            continue  # its owner still runs (another sweep): its server is its own to end
        if group_members(rec["pgid"], rec.get("started")):  # the server, or children that outlived it
            _kill_group(rec["pgid"], rec["pid"], rec.get("started"), grace_s=5.0)
            line = (f"ended server pid {rec['pid']} (port {rec['port']}) left by process {rec['owner_pid']}, which is gone: "
                    f"{rec['command'][:200]}")
            out.append(line)
            if say:
                say(line)
        _remove_session_dir(rec.get("log"))
        path.unlink(missing_ok=True)
    return out


def reap_after_interrupt(say: Optional[Callable[[str], None]] = None, wait_s: float = 15.0) -> list[str]:
    """After an interrupted run retired its workers (Ray kills an actor outright: the trial's `finally` never
    runs), end the servers they left as their processes go: the records there now are reaped as their owners
    die, for up to `wait_s` (a record whose owner outlives that -- another run's -- is left to it)."""
    d = records_dir()
    pending = {p.name for p in d.glob("*.json")} if d.is_dir() else set()
    out: list[str] = []
    deadline = time.monotonic() + wait_s
    while pending:
        out += reap_orphans(say)
        pending &= {p.name for p in d.glob("*.json")}
        if not pending or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    return out


class ServerProcess:
    """A server launched from `argv` on `port` (its log in `log_path`), ready when `GET http://127.0.0.1:port
    <ready_path>` answers 200 within `timeout_s`. `env`: variables added to this process's environment for the
    server (its `command` shows them as a shell line would: `VAR=value cmd ...`)."""

    def __init__(self, argv: Sequence[str], port: int, log_path: Path, ready_path: str = "/v1/models",
                 timeout_s: float = 180.0, env: Optional[dict[str, str]] = None,
                 say: Optional[Callable[[str], None]] = None):
        self.argv, self.port, self.log_path = list(argv), port, Path(log_path)
        self.env = dict(env or {})
        self.command = " ".join([f"{k}={shlex.quote(v)}" for k, v in self.env.items()] + [shlex.join(self.argv)])
        self.url = f"http://{HOST}:{port}"
        self.proc: Optional[subprocess.Popen] = None
        self._record: Optional[Path] = None
        self.startup_s = 0.0
        reap_orphans(say)
        if port_in_use(port):
            raise EngineError(f"port {port} on {HOST} is in use: another server listens there; free it or choose "
                              "another port (nothing was started)")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        with open(self.log_path, "ab") as log:
            try:
                self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                             start_new_session=True, env={**os.environ, **self.env} if self.env else None)
            except OSError as e:
                raise EngineError(f"could not start the server ({self.command}): {e}") from e
        self._started = start_time(self.proc.pid)
        try:
            self._write_record()
            self._wait_ready(ready_path, timeout_s)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.perf_counter() - t0

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def _write_record(self) -> None:
        d = records_dir()
        d.mkdir(parents=True, exist_ok=True)
        rec = {"pid": self.pid, "pgid": self.pid, "started": self._started, "owner_pid": os.getpid(),
               "owner_started": start_time(os.getpid()), "port": self.port, "command": self.command,
               "log": str(self.log_path)}
        path = d / f"{self.pid}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(rec))
        tmp.replace(path)
        self._record = path

    def _wait_ready(self, ready_path: str, timeout_s: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        with httpx.Client(trust_env=False, timeout=2.0) as client:
            while True:
                code = self.proc.poll()
                if code is not None:
                    raise EngineError(f"the server exited with code {code} before it was ready ({self.command}); "
                                      f"its log ({self.log_path}) ends:\n{log_tail(self.log_path)}")
                try:
                    if client.get(self.url + ready_path).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise EngineError(f"the server was not ready after {timeout_s:.0f} s ({self.command}); its log "
                                      f"({self.log_path}) ends:\n{log_tail(self.log_path)}")
                time.sleep(0.1)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def peak_rss_bytes(self) -> int:
        """The server's peak resident memory so far: VmHWM summed over its process group (vLLM serves from an API
        process and an engine-core process; each one's own peak, so an upper bound on the group's at any one time;
        0 where it cannot be read)."""
        if self.proc is None:
            return 0
        from ..measure.memory import status_kb

        return sum(status_kb("VmHWM", pid) * 1024 for pid in group_members(self.pid) or [self.pid])

    def stop(self, grace_s: float = 10.0) -> None:
        """End the server's process group (SIGTERM, then SIGKILL after `grace_s`) and forget its record.
        Idempotent."""
        if self.proc is not None:  # its children too, where the server itself has already exited
            _kill_group(self.proc.pid, self.proc.pid, self._started, grace_s)
        if self.proc is not None:
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        if self._record is not None:
            self._record.unlink(missing_ok=True)
            self._record = None

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
