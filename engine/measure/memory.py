"""Peak memory of a region: process RSS high-water mark on CPU, allocator peak on CUDA."""
from __future__ import annotations

import torch


def _read_status_kb(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class PeakMemory:
    """`with PeakMemory(device) as m: ...; m.peak_bytes`.

    On CPU the kernel's RSS high-water mark (VmHWM) is reset on entry by writing 5 to
    /proc/self/clear_refs, so the peak belongs to this region even in a reused worker process.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.peak_bytes = 0

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            except OSError:
                pass  # not Linux, or not permitted: the peak then covers the process lifetime
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = int(torch.cuda.max_memory_allocated(self.device))
        else:
            self.peak_bytes = _read_status_kb("VmHWM") * 1024
        return False
