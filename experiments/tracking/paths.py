"""Where a tracking store's files go. `tracking.artifact_root` and `tracking.spool_dir`, left unset, follow the
store: beside a local one (the folder holding its SQLite database or file store: `sqlite:////tmp/x/mlflow.db`
-> /tmp/x/artifacts, /tmp/x/spool), so two local stores never share one artifact folder or spool; under the
checkout's mlflow/ for a store elsewhere (PostgreSQL, a server). Set, they are used as given (relative to the
checkout). A leaf: the store, the spool and the server read it; it imports none of them."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional
from urllib.parse import unquote, urlparse

from ..config.compose import PROJECT_ROOT

DEFAULT_URI = "sqlite:///mlflow/mlflow.db"  # conf/tracking/local.yaml, the schema's default
REMOTE_HOME = "mlflow"  # a remote store's artifacts and spool default into the checkout's mlflow/
DEFAULT_NAMES = {"artifact_root": "artifacts", "spool_dir": "spool"}


def sqlite_path(uri: str) -> Optional[Path]:
    """The database file of a `sqlite:///` URI; None for other stores and in-memory databases."""
    prefix = "sqlite:///"
    if not uri.startswith(prefix):
        return None
    path = uri[len(prefix):].split("?", 1)[0]
    return None if path in ("", ":memory:") else Path(path)


def local_store(uri: str) -> Optional[Path]:
    """The SQLite database or file-store folder `uri` names on this machine (relative: to the checkout), else None."""
    path = sqlite_path(uri)
    if path is None and uri.startswith("file:"):
        path = Path(unquote(urlparse(uri).path))
    elif path is None and "://" not in uri and not uri.startswith("sqlite:") and uri:
        path = Path(uri)  # MLflow reads a plain path as a file store
    if path is None:
        return None
    return path if path.is_absolute() else PROJECT_ROOT / path


def tracking_path(tracking: dict[str, Any], key: str) -> str:
    """`tracking[key]` (artifact_root, spool_dir) as set (a path relative to the checkout, or for artifacts a
    URI), else its default beside a local store (module doc), absolute."""
    given = tracking.get(key)
    if given:
        return str(given)
    store = local_store(str(tracking.get("uri") or DEFAULT_URI))
    return str((store.parent if store is not None else PROJECT_ROOT / REMOTE_HOME) / DEFAULT_NAMES[key])


def with_paths(tracking: dict[str, Any]) -> dict[str, Any]:
    """`tracking` with its artifact root and spool spelled out: what a client of another URI for the same store
    (the HTTP server `tracking.serve` starts in front of it) must keep."""
    return dict(tracking, **{k: tracking_path(tracking, k) for k in DEFAULT_NAMES})
