"""`infersweep ui`'s front door: MLflow's own server, reached through a thin same-origin proxy that gives a browser
the two defaults MLflow 3.17 has no server setting for.

MLflow's UI keeps two choices in the browser's storage, per origin, and no server setting decides them (read in
its bundle, `mlflow/server/js/build`): the GenAI / Model training mode (`mlflow.workflowType_v1`, default GenAI;
the experiment tag `mlflow.experimentKind` is no longer read, and the URL's `workflowType` is lost at the first
click into a run), and whether the Assistant panel has been opened once on a local host
(`mlflow.assistant.fab.autoOpenedOnFirstLoad_v1`: on `localhost` / `127.0.0.1` it opens itself, a quarter of the
window, on the first load). The front answers every request by forwarding it to the server, byte for byte, except
the UI's HTML shell, in whose `<head>` it puts a script that sets those keys to Model training and "already
opened once, closed" -- only where the browser has no value yet, so the mode switch and the Assistant's button
work as MLflow made them and a browser's own choice is never overwritten. `infersweep ui --plain` serves
MLflow's server directly instead.
"""
from __future__ import annotations

import gzip
import http.client
import threading
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional
from urllib.parse import urlsplit

# MLflow's `useLocalStorage` stores `${key}_v${version}` as JSON
DEFAULTS = {"mlflow.workflowType_v1": '"machine_learning"',
            "mlflow.assistant.fab.autoOpenedOnFirstLoad_v1": "true",
            "mlflow.assistant.panelOpen_v1": "false"}
# the panel's state is only set together with its "opened once" flag: a browser that saw it keeps its own
SCRIPT = ("<script>(function(){try{var s=window.localStorage,d=%s;"
          "if(s.getItem('mlflow.workflowType_v1')===null)s.setItem('mlflow.workflowType_v1',d['mlflow.workflowType_v1']);"
          "if(s.getItem('mlflow.assistant.fab.autoOpenedOnFirstLoad_v1')===null){"
          "s.setItem('mlflow.assistant.fab.autoOpenedOnFirstLoad_v1','true');"
          "s.setItem('mlflow.assistant.panelOpen_v1','false');}}catch(e){}})();</script>")
SHELL_PATHS = ("/", "/index.html")
HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "trailers",
              "transfer-encoding", "upgrade"}


def defaults_script() -> str:
    import json

    return SCRIPT % json.dumps(DEFAULTS)


def with_defaults(html: bytes) -> bytes:
    """The UI's HTML shell with the defaults script first in its `<head>` (unchanged without a `<head>`)."""
    low = html.lower()
    i = low.find(b"<head")
    j = low.find(b">", i) if i >= 0 else -1
    if j < 0:
        return html
    return html[:j + 1] + defaults_script().encode() + html[j + 1:]


def _decoded(body: bytes, encoding: str) -> Optional[bytes]:
    if encoding in ("", "identity"):
        return body
    if encoding == "gzip":
        return gzip.decompress(body)
    if encoding == "deflate":
        return zlib.decompress(body)
    return None  # an encoding this front does not read: the shell goes out as the server sent it


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # one request per connection: the body ends where the connection does
    upstream: tuple[str, int] = ("127.0.0.1", 0)

    def log_message(self, *args) -> None:  # the server's own log has the requests
        pass

    def _body(self) -> Optional[bytes]:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            out = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    self.rfile.readline()
                    return out
                out += self.rfile.read(size)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else None

    def _forward(self) -> None:
        body = self._body()
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
        if body is not None:
            headers["Content-Length"] = str(len(body))
        conn = http.client.HTTPConnection(*self.upstream, timeout=600)
        try:
            conn.request(self.command, self.path, body=body, headers=headers)
            resp = conn.getresponse()
            out = [(k, v) for k, v in resp.getheaders() if k.lower() not in HOP_BY_HOP]
            shell = (self.command == "GET" and resp.status == 200 and urlsplit(self.path).path in SHELL_PATHS
                     and resp.getheader("Content-Type", "").startswith("text/html"))
            if shell:
                raw = resp.read()
                html = _decoded(raw, resp.getheader("Content-Encoding", "").lower())
                payload = with_defaults(html) if html is not None else raw
                drop = {"content-length"} | ({"content-encoding"} if html is not None else set())
                self.send_response(resp.status, resp.reason)
                for k, v in out:
                    if k.lower() not in drop:
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
                return
            self.send_response(resp.status, resp.reason)
            for k, v in out:
                self.send_header(k, v)
            self.end_headers()
            if self.command == "HEAD":
                return
            while chunk := resp.read1(65536):  # as it comes: the Assistant's answers stream
                self.wfile.write(chunk)
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the browser went away
        except OSError as e:  # the server behind is gone or did not answer
            try:
                self.send_error(502, f"mlflow server: {e}")
            except OSError:
                pass
        finally:
            conn.close()

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = _forward


class UiFront:
    """The proxy, bound at construction (a taken port fails here, before any server starts)."""

    def __init__(self, host: str, port: int):
        handler = type("Handler", (_Handler,), {})
        self._handler = handler
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        self._thread: Optional[threading.Thread] = None

    def start(self, upstream_url: str) -> "UiFront":
        u = urlsplit(upstream_url)
        self._handler.upstream = (u.hostname or "127.0.0.1", int(u.port or 80))
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="ui-front", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join(timeout=10)
        self.httpd.server_close()
