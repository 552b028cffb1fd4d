"""Start `mlflow server` for a sweep's lifetime (`tracking.serve=true`): bound to `tracking.host`
(127.0.0.1 by default), artifacts proxied by the server, so clients need no access to the store's disk."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator, Optional

from ..config.compose import PROJECT_ROOT
from .store import redact


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_in_use(host: str, port: int) -> Optional[str]:
    """Why `host:port` cannot be bound now, or None. Binds the way uvicorn does (SO_REUSEADDR), so a
    port that only has connections in TIME_WAIT counts as free."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e.strerror or str(e)
    return None


# What the server logs when it cannot serve. `mlflow server` itself lingers about a minute after its
# uvicorn/gunicorn child gave up and then exits 0, so its exit status comes too late and says nothing.
FATAL_LOG_LINES = ("address already in use", "error while attempting to bind", "Connection in use")


def mlflow_bin() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "mlflow")
    return here if os.path.exists(here) else (shutil.which("mlflow") or "mlflow")


def server_command(tracking: dict[str, Any], port: int, host: Optional[str] = None, workers: Optional[int] = None) -> list[str]:
    from .store import resolve_artifact_root, resolve_uri

    return [
        mlflow_bin(), "server",
        "--backend-store-uri", resolve_uri(tracking["uri"]),
        "--artifacts-destination", resolve_artifact_root(tracking),
        "--serve-artifacts",
        "--host", host or tracking.get("host") or "127.0.0.1",
        "--port", str(port),
        "--workers", str(workers or tracking.get("workers") or 1),
    ]


def healthy(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False


class PortInUse(RuntimeError):
    pass


class MlflowServer:
    """A running `mlflow server`; `url` is what clients use."""

    def __init__(self, tracking: dict[str, Any], port: Optional[int] = None, log_path: Optional[Path] = None):
        self.host = host = tracking.get("host") or "127.0.0.1"
        self.port = port or int(tracking.get("port") or 0) or free_port(host)
        # clients on this machine reach a wildcard bind through loopback
        self.url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{self.port}"
        self.log_path = log_path or PROJECT_ROOT / "mlflow" / f"server-{self.port}.log"
        self.cmd = server_command(tracking, self.port)
        self.store_uri = str(tracking["uri"])
        self.proc: Optional[subprocess.Popen] = None

    def start(self, timeout_s: float = 90.0) -> "MlflowServer":
        """Check the port, then launch: with the port taken, /health could be answered by whatever
        server holds it (another store) while ours fails to bind."""
        self.check_port()
        return self.launch(timeout_s)

    def check_port(self) -> None:
        problem = port_in_use(self.host, self.port)
        if problem is not None:
            raise PortInUse(f"port {self.port} on {self.host} is not free ({problem}): another `infersweep ui` "
                            f"or mlflow server? Stop it, or choose another port")

    def launch(self, timeout_s: float = 90.0) -> "MlflowServer":
        """Start the server and wait until it answers; fail as soon as it dies or logs that it cannot
        serve, with the log's last lines in the message."""
        from .store import open_store, resolve_uri, sqlite_path

        uri = resolve_uri(self.store_uri)
        if sqlite_path(uri) is not None:  # a new store's schema, created once under its lock (see open_store)
            open_store(uri)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        start = log.tell()  # the log is appended to: read only this start's lines
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        # own process group: Ctrl-C at the terminal does not kill it before the sweep has recorded
        # its interrupted trials; stop() ends the whole group (gunicorn/uvicorn workers included)
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited with {self.proc.returncode} before it answered"
                                   f"{self._log_excerpt(start)}\n(log: {self.log_path})")
            fatal = self._fatal_line(start)
            if fatal is not None:
                self.stop()
                raise RuntimeError(f"mlflow server failed to start on port {self.port}: {fatal}\n(log: {self.log_path})")
            if healthy(self.url, timeout=1.0):
                return self
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"mlflow server did not answer {self.url}/health within {timeout_s:.0f} s"
                           f"{self._log_excerpt(start)}\n(log: {self.log_path})")

    def _log_since(self, offset: int) -> str:
        with open(self.log_path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")

    def _fatal_line(self, offset: int) -> Optional[str]:
        for line in self._log_since(offset).splitlines():
            if any(m.lower() in line.lower() for m in FATAL_LOG_LINES):
                return line.strip()
        return None

    def _log_excerpt(self, offset: int, n: int = 8) -> str:
        lines = self._log_since(offset).strip().splitlines()[-n:]
        return (":\n  " + "\n  ".join(lines)) if lines else ""

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=5)

    def __enter__(self) -> "MlflowServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@contextlib.contextmanager
def serving(tracking: dict[str, Any], echo=print) -> Iterator[dict[str, Any]]:
    """Yield the tracking config clients should use: unchanged, or (serve=true) pointing at a server
    started here on the configured store and stopped on exit."""
    if not tracking.get("serve"):
        yield tracking
        return
    from .paths import with_paths

    server = MlflowServer(tracking)
    store = redact(str(tracking["uri"]))
    echo(f"starting mlflow server on {server.url} (store {store}; log {server.log_path})")
    with server:
        # the server's URI says nothing of the store's folder: the artifact root and spool stay the store's
        yield dict(with_paths(tracking), uri=server.url, serve=False)
