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

from .compose import PROJECT_ROOT
from .tracking import redact


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def mlflow_bin() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "mlflow")
    return here if os.path.exists(here) else (shutil.which("mlflow") or "mlflow")


def server_command(tracking: dict[str, Any], port: int, host: Optional[str] = None, workers: Optional[int] = None) -> list[str]:
    from .tracking import resolve_artifact_root, resolve_uri

    return [
        mlflow_bin(), "server",
        "--backend-store-uri", resolve_uri(tracking["uri"]),
        "--artifacts-destination", resolve_artifact_root(tracking["artifact_root"]),
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


class MlflowServer:
    """A running `mlflow server`; `url` is what clients use."""

    def __init__(self, tracking: dict[str, Any], port: Optional[int] = None, log_path: Optional[Path] = None):
        host = tracking.get("host") or "127.0.0.1"
        self.port = port or int(tracking.get("port") or 0) or free_port(host)
        # clients on this machine reach a wildcard bind through loopback
        self.url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{self.port}"
        self.log_path = log_path or PROJECT_ROOT / "mlflow" / f"server-{self.port}.log"
        self.cmd = server_command(tracking, self.port)
        self.store_uri = str(tracking["uri"])
        self.proc: Optional[subprocess.Popen] = None

    def start(self, timeout_s: float = 90.0) -> "MlflowServer":
        from .tracking import open_store, resolve_uri, sqlite_path

        uri = resolve_uri(self.store_uri)
        if sqlite_path(uri) is not None:  # a new store's schema, created once under its lock (see open_store)
            open_store(uri)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        # own process group: Ctrl-C at the terminal does not kill it before the sweep has recorded
        # its interrupted trials; stop() ends the whole group (gunicorn/uvicorn workers included)
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited with {self.proc.returncode}; see {self.log_path}")
            if healthy(self.url, timeout=1.0):
                return self
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"mlflow server did not answer {self.url}/health within {timeout_s:.0f} s; see {self.log_path}")

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
    server = MlflowServer(tracking)
    store = redact(str(tracking["uri"]))
    echo(f"starting mlflow server on {server.url} (store {store}; log {server.log_path})")
    with server:
        yield dict(tracking, uri=server.url, serve=False)
