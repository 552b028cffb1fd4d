"""What a sweep driver killed with SIGKILL leaves of its embedded Ray, found and ended by the next sweep.

Ray's node processes die with the driver that started them, but its agents (`ray::DashboardAgent`,
`ray::RuntimeEnvAgent`) outlive a SIGKILLed driver and ignore SIGTERM. So a driver that starts an embedded
Ray records its session in `<ray temp dir>/infersweep-drivers/<pid>.json` (the driver's pid and start time,
the session dir); the record is removed when the driver exits normally. The next driver to start an embedded
Ray reads the records whose driver is gone (the pid is dead, or now names another process) and ends the
processes of that session only: those whose command line or open files lie inside its session dir (every
Ray process of a session writes its logs there). Never by process name: another user's or another sweep's
Ray is left alone. Linux only (/proc); elsewhere it does nothing.
"""
from __future__ import annotations

import atexit
import json
import os
import signal
import time
from pathlib import Path
from typing import Callable, Optional

RECORDS = "infersweep-drivers"


def _start_time(pid: int) -> Optional[str]:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22): with the pid, it
    names one process, never a later one that reused the pid. None when no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]


def _alive(pid: int, started: Optional[str]) -> bool:
    now = _start_time(pid)
    return now is not None and (started is None or now == started)


def record_session(session_dir: str) -> Optional[Path]:
    """Note that this process started the embedded Ray of `session_dir` (removed again at a normal exit)."""
    started = _start_time(os.getpid())
    if started is None:
        return None
    d = Path(session_dir).parent / RECORDS
    path = d / f"{os.getpid()}.json"
    try:
        d.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"driver_pid": os.getpid(), "driver_start": started, "session_dir": session_dir}))
    except OSError:
        return None
    atexit.register(lambda: path.unlink(missing_ok=True))
    return path


def session_pids(session_dir: str) -> list[int]:
    """Live processes of one Ray session: its session dir on their command line or among their open files."""
    session = session_dir.rstrip("/")
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        pid = int(entry.name)
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
            if any(_names(a, session) for a in args):
                out.append(pid)
                continue
            for fd in os.scandir(f"/proc/{pid}/fd"):
                if _names(os.readlink(fd.path), session):
                    out.append(pid)
                    break
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return out


def _names(text: str, session: str) -> bool:
    """Whether `text` holds the path `session` or a path inside it (not `session_X2` for `session_X`)."""
    i = text.find(session)
    while i >= 0:
        after = text[i + len(session):i + len(session) + 1]
        if after in ("", "/", " ", ","):
            return True
        i = text.find(session, i + 1)
    return False


def end_dead_sessions(ray_temp_dir: str, say: Callable[[str], None], wait_s: float = 10.0) -> int:
    """End the processes left by embedded Rays whose infersweep driver is gone; returns how many were ended."""
    d = Path(ray_temp_dir) / RECORDS
    if not ray_temp_dir or not d.is_dir() or not os.path.isdir("/proc"):
        return 0
    ended = 0
    for rec_path in sorted(d.glob("*.json")):
        try:
            rec = json.loads(rec_path.read_text())
            pid, session = int(rec["driver_pid"]), str(rec["session_dir"])
        except (OSError, ValueError, KeyError, TypeError):
            rec_path.unlink(missing_ok=True)
            continue
        if _alive(pid, rec.get("driver_start")):
            continue  # a sweep still running: its Ray is its own
        pids = session_pids(session)
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)  # Ray's agents ignore SIGTERM
            except OSError:
                pass
        deadline = time.monotonic() + wait_s
        while [p for p in pids if _start_time(p) is not None and not _zombie(p)] and time.monotonic() < deadline:
            time.sleep(0.05)
        if pids:
            say(f"ended {len(pids)} process(es) that the killed sweep driver {pid} left of its Ray session "
                f"{Path(session).name} (pids {', '.join(map(str, pids))})")
        ended += len(pids)
        rec_path.unlink(missing_ok=True)
    return ended


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except OSError:
        return True
