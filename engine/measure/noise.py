"""How quiet the machine was while a trial's timed runs ran, from /proc (Linux; nothing elsewhere).

`with NoiseMonitor() as n: ...` reads, around the region:
- `noise_other_cpu_frac`: CPU time that *other* processes took, as a share of all CPUs' time over the
  region (busy jiffies of every core from /proc/stat, less this process's and its finished children's
  CPU time): 0 on a quiet machine, 0.5 when another process kept one of two cores busy;
- `noise_steal_frac`: CPU steal (a hypervisor running someone else on our cores), same units;
- `noise_load_avg`: the 1-minute load average at the end, per CPU;
- on a CUDA device (with NVML, `pip install nvidia-ml-py`; nothing without it): `noise_gpu_other_procs`,
  the most processes other than this one seen holding the device (at entry or exit), and
  `noise_gpu_other_mem_bytes`, the device memory they held.
"""
from __future__ import annotations

import os
import time
from typing import Optional

UNSTABLE = "unstable"  # the label (MLflow tag) naming why a trial's timings cannot be trusted; absent when they can
# Its value is "; "-joined reasons, each led by its cause. The causes weigh differently in a comparison:
# LOAD (other processes took the machine) biases the medians in a way no interval carries, so such a trial
# never decides one; SPREAD (an interval wider than the smallest effect judged) is carried by the interval,
# so such a trial decides where the intervals still separate.
LOAD, SPREAD = "load", "spread"


def unstable_causes(reason: str) -> set[str]:
    """The causes ({LOAD, SPREAD}) in an `unstable` label's value; a label written before the causes led
    each reason reads by its wording ("other process" is load, a CV is spread)."""
    out = set()
    for part in filter(None, (p.strip() for p in (reason or "").split(";"))):
        cause = part.split(":", 1)[0].strip()
        if cause in (LOAD, SPREAD):
            out.add(cause)
        else:
            out.add(LOAD if "other process" in part else SPREAD)
    return out

# /proc/stat cpu line: user nice system idle iowait irq softirq steal guest guest_nice
_BUSY = (0, 1, 2, 5, 6, 7)
_STEAL = 7


def _cpu_jiffies() -> Optional[tuple[int, int]]:
    """(busy, steal) jiffies summed over all CPUs since boot, or None without /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    fields += [0] * (10 - len(fields))
    return sum(fields[i] for i in _BUSY), fields[_STEAL]


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def load_per_cpu() -> Optional[float]:
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:
        return None


def gpu_other_processes(index: int) -> Optional[tuple[int, int]]:
    """(processes other than this one on CUDA device `index`, the device memory they hold), from NVML;
    None without NVML or a driver (every CPU-only machine)."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            procs = list(pynvml.nvmlDeviceGetComputeRunningProcesses(handle))
            procs += list(pynvml.nvmlDeviceGetGraphicsRunningProcesses(handle))
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # pynvml.NVMLError and driver mismatches: no reading, not a failed trial
        return None
    others = {p.pid: (p.usedGpuMemory or 0) for p in procs if p.pid != os.getpid()}
    return len(others), int(sum(others.values()))


class NoiseMonitor:
    """`gpu`: the CUDA device index whose other processes to count (None: CPU only)."""

    def __init__(self, gpu: Optional[int] = None) -> None:
        self._start: Optional[tuple[float, float, tuple[int, int]]] = None
        self._gpu = gpu
        self._gpu_start: Optional[tuple[int, int]] = None
        self.result: dict[str, float] = {}

    def __enter__(self) -> "NoiseMonitor":
        jiffies = _cpu_jiffies()
        if jiffies is not None:
            self._start = (time.monotonic(), _own_cpu_s(), jiffies)
        if self._gpu is not None:
            self._gpu_start = gpu_other_processes(self._gpu)
        return self

    def __exit__(self, *exc) -> None:
        self.result = self.measure()
        if self._gpu is not None:
            seen = [x for x in (self._gpu_start, gpu_other_processes(self._gpu)) if x is not None]
            if seen:
                self.result["noise_gpu_other_procs"] = float(max(n for n, _ in seen))
                self.result["noise_gpu_other_mem_bytes"] = float(max(m for _, m in seen))

    def measure(self) -> dict[str, float]:
        """The noise metrics from entry until now ({} where /proc cannot be read)."""
        end = _cpu_jiffies()
        if self._start is None or end is None:
            return {}
        t0, own0, (busy0, steal0) = self._start
        wall = time.monotonic() - t0
        tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        capacity = wall * (os.cpu_count() or 1)
        if capacity <= 0:
            return {}
        busy_s = (end[0] - busy0) / tick
        other = max(0.0, busy_s - (_own_cpu_s() - own0))
        out = {"noise_other_cpu_frac": min(1.0, other / capacity),
               "noise_steal_frac": min(1.0, (end[1] - steal0) / tick / capacity)}
        load = load_per_cpu()
        if load is not None:
            out["noise_load_avg"] = load
        return out
