"""A load the benchmark scripts put on the machine themselves: one busy process per core.

    with CpuBurners():            # busy from here to the end of the block
    with CpuBurners(after_s=30):  # busy from 30 s into the block (drift in the middle of a measurement)
    with CpuBurners(enabled=False):  # no load (the same code path for the quiet run)
    with CpuBurners(after_s=float("inf")) as b: ... b.start_now()  # started by the caller
"""
from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time


def _burn(stop) -> None:
    while not stop.is_set():
        pass


class CpuBurners:
    def __init__(self, after_s: float = 0.0, enabled: bool = True, n: int | None = None, settle_s: float = 0.5):
        self.after_s, self.enabled, self.n, self.settle_s = after_s, enabled, n or os.cpu_count() or 1, settle_s
        self._stop, self._procs, self._timer = mp.Event(), [], None

    def start_now(self) -> None:
        """Start the burners at once (for a caller that knows when: a round of an interleaved run)."""
        if self.enabled and not self._procs:
            if self._timer is not None:
                self._timer.cancel()
            self._start()

    def _start(self) -> None:
        self._procs = [mp.Process(target=_burn, args=(self._stop,), daemon=True) for _ in range(self.n)]
        for p in self._procs:
            p.start()

    def __enter__(self) -> "CpuBurners":
        if not self.enabled:
            return self
        if self.after_s == float("inf"):
            return self  # the caller calls start_now()
        if self.after_s > 0:
            self._timer = threading.Timer(self.after_s, self._start)
            self._timer.start()
        else:
            self._start()
            time.sleep(self.settle_s)  # let them reach the cores before the measurement starts
        return self

    def __exit__(self, *exc) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._stop.set()
        for p in self._procs:
            p.join(5)
            if p.is_alive():
                p.kill()
