"""Peak memory of a region: process RSS high-water mark on CPU, allocator peak on CUDA; and how far the
region grew above what the process held when it began (what the region itself allocated)."""
from __future__ import annotations

import ctypes
import ctypes.util
from functools import lru_cache

import torch


def status_kb(field: str, pid: int | str = "self") -> int:
    """A kB field of /proc/<pid>/status (VmRSS, VmHWM); 0 where it cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


@lru_cache(maxsize=1)
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    except OSError:
        return None


def release_free_memory() -> bool:
    """Hand the C allocator's free pages back to the OS (glibc's `malloc_trim`; False where there is none).
    Memory freed earlier and kept by the allocator is reused without raising the RSS, so without this a
    region's growth would hide what it allocated in what an earlier region freed."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


class PeakMemory:
    """`with PeakMemory(device) as m: ...; m.peak_bytes, m.growth_bytes`.

    On CPU the kernel's RSS high-water mark (VmHWM) is reset on entry by writing 5 to
    /proc/self/clear_refs, so the peak belongs to this region even in a reused worker process.
    `growth_bytes` is the peak less what the process held on entry (RSS on CPU, allocated on CUDA): what the
    region allocated on top, e.g. a generation's KV cache and scratch. `release`: first hand freed memory
    back to the OS (CPU), so that growth is not hidden in pages an earlier region freed.
    """

    def __init__(self, device: torch.device, release: bool = False):
        self.device = device
        self.release = release
        self.peak_bytes = 0
        self.base_bytes = 0
        self.scoped = True  # False: the CPU peak could not be reset and covers the process' lifetime

    @property
    def growth_bytes(self) -> int:
        return max(0, self.peak_bytes - self.base_bytes)

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base_bytes = int(torch.cuda.memory_allocated(self.device))
        else:
            if self.release:
                release_free_memory()
            self.base_bytes = status_kb("VmRSS") * 1024
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            except OSError:  # not Linux, or not permitted: the peak then covers the process lifetime
                self.scoped = False
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = int(torch.cuda.max_memory_allocated(self.device))
        else:
            self.peak_bytes = status_kb("VmHWM") * 1024
        return False
