"""Run one TrialSpec on the engine and package the result as plain data (runs on a Ray worker).

Application errors are caught and returned as a FAILED outcome with the traceback, so one bad trial never
stops a sweep; a worker that dies is the cluster layer's business (retries).
"""
from __future__ import annotations

import os
import socket
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Optional

from .spec import TrialSpec, to_engine_trial

FINISHED, FAILED = "FINISHED", "FAILED"


@dataclass
class TrialOutcome:
    config_hash: str
    index: int
    status: str
    metrics: dict[str, float] = field(default_factory=dict)
    token_ids: list[list[int]] = field(default_factory=list)
    sample_text: str = ""
    info: dict[str, str] = field(default_factory=dict)
    error: Optional[str] = None
    start_ms: int = 0
    end_ms: int = 0


def _quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        import transformers

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    except Exception:
        pass


def execute_trial(spec: TrialSpec) -> TrialOutcome:
    from engine import run_engine_trial

    _quiet_libraries()
    start = int(time.time() * 1000)
    base: dict[str, Any] = dict(config_hash=spec.config_hash, index=spec.index, start_ms=start)
    try:
        result = run_engine_trial(to_engine_trial(spec.config))
    except Exception as e:
        return TrialOutcome(
            status=FAILED,
            error=f"{type(e).__name__}: {e}\n\n{traceback.format_exc()}",
            end_ms=int(time.time() * 1000),
            info={"host": socket.gethostname(), "pid": str(os.getpid())},
            **base,
        )
    info = dict(result.info, host=socket.gethostname(), pid=str(os.getpid()))
    return TrialOutcome(
        status=FINISHED,
        metrics=result.metrics,
        token_ids=result.token_ids,
        sample_text=result.sample_text,
        info=info,
        end_ms=int(time.time() * 1000),
        **base,
    )
