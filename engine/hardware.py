"""Hardware peaks for the roofline: memory bandwidth (bytes/s) and matmul FLOP/s per dtype.

Known GPUs come from a table of datasheet numbers (dense, no sparsity). Anything else (every CPU, an
unknown GPU) is measured once per node by a short probe -- a streaming read of a large tensor and square
matmuls of growing size, best of a few repeats -- and cached in
`cache_root()/hardware/<host>.json`, keyed by device, thread count and dtype, so each trial after the
first pays nothing. The probe runs outside every timed region.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from .models import TORCH_DTYPES, cache_root

log = logging.getLogger(__name__)

PROBE_VERSION = 1


@dataclass(frozen=True)
class HardwarePeaks:
    name: str  # device name as torch reports it
    mem_bw: float  # bytes/s the device reads from its main memory (HBM, DRAM)
    flops: float  # matmul FLOP/s at the trial's compute dtype
    dtype: str
    source: str  # "table" | "probe" | "cache"

    @property
    def balance(self) -> float:
        """Machine balance (FLOP/byte): kernels below it are memory-bound, above it compute-bound."""
        return self.flops / self.mem_bw


@dataclass(frozen=True)
class GPUSpec:
    mem_bw: float  # bytes/s
    flops: dict[str, float]  # dtype -> dense FLOP/s (tensor cores for 16-bit; plain fp32 for float32)


T = 1e12
# Datasheet numbers, dense (no 2:4 sparsity). float32 is the non-tensor-core rate, which is what PyTorch
# uses unless TF32 is enabled. Matched by substring of torch.cuda.get_device_name, first match wins, so
# more specific names come first.
GPU_TABLE: list[tuple[str, GPUSpec]] = [
    ("H200", GPUSpec(4.8e12, {"bfloat16": 989 * T, "float16": 989 * T, "float32": 67 * T})),
    ("H100 PCIe", GPUSpec(2.0e12, {"bfloat16": 756 * T, "float16": 756 * T, "float32": 51 * T})),
    ("H100 NVL", GPUSpec(3.9e12, {"bfloat16": 835 * T, "float16": 835 * T, "float32": 60 * T})),
    ("H100", GPUSpec(3.35e12, {"bfloat16": 989 * T, "float16": 989 * T, "float32": 67 * T})),
    ("A100-SXM4-80GB", GPUSpec(2.039e12, {"bfloat16": 312 * T, "float16": 312 * T, "float32": 19.5 * T})),
    ("A100 80GB PCIe", GPUSpec(1.935e12, {"bfloat16": 312 * T, "float16": 312 * T, "float32": 19.5 * T})),
    ("A100", GPUSpec(1.555e12, {"bfloat16": 312 * T, "float16": 312 * T, "float32": 19.5 * T})),
    ("L40S", GPUSpec(0.864e12, {"bfloat16": 362 * T, "float16": 362 * T, "float32": 91.6 * T})),
    ("L4", GPUSpec(0.3e12, {"bfloat16": 121 * T, "float16": 121 * T, "float32": 30.3 * T})),
    ("T4", GPUSpec(0.32e12, {"float16": 65 * T, "float32": 8.1 * T})),
    ("V100", GPUSpec(0.9e12, {"float16": 125 * T, "float32": 15.7 * T})),
]


def gpu_spec(name: str) -> Optional[GPUSpec]:
    for key, spec in GPU_TABLE:
        if key.lower() in name.lower():
            return spec
    return None


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "cpu"


# --- probe ---------------------------------------------------------------------------------------------
def _best_of(fn: Callable[[], None], sync: Callable[[], None], repeats: int) -> float:
    fn()  # warm-up (first call pays allocation, kernel selection, page faults)
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def probe_bandwidth(device: torch.device, nbytes: int = 256 << 20, repeats: int = 6) -> float:
    """Bytes/s of a streaming read (a sum over a tensor far larger than any cache)."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        nbytes = max(nbytes, 2 << 30)
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dt = _best_of(lambda: x.sum(), sync, repeats)
    return x.numel() * 4 / dt


def probe_matmul(device: torch.device, dtype: torch.dtype, budget_s: float = 1.5, repeats: int = 3) -> float:
    """Best FLOP/s of square matmuls of growing size; stops growing once one matmul takes > 0.2 s (a dtype
    without hardware support, e.g. bf16 on many CPUs, is slow and must not make the probe slow)."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    sizes = (256, 512, 1024, 2048) if device.type == "cpu" else (1024, 2048, 4096, 8192)
    best = 0.0
    start = time.perf_counter()
    for n in sizes:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        dt = _best_of(lambda: a @ b, sync, repeats)
        best = max(best, 2 * n**3 / dt)
        if dt > 0.2 or time.perf_counter() - start > budget_s:
            break
    return best


# --- cache -----------------------------------------------------------------------------------------------
def cache_path(host: Optional[str] = None) -> Path:
    return cache_root() / "hardware" / f"{host or socket.gethostname()}.json"


def _key(name: str, device: torch.device, threads: int, dtype: str) -> str:
    return f"v{PROBE_VERSION}|{device.type}|{name}|threads={threads}|{dtype}"


def node_peaks(device: torch.device, dtype: str, threads: Optional[int] = None, refresh: bool = False) -> HardwarePeaks:
    """Peaks of this node for `dtype` at `threads` torch threads (CPU): table, else cache, else probe.

    `refresh` probes again and keeps the higher of the old and new numbers per peak (a probe taken while
    the node was busy reads low; peaks only ever move up towards the truth)."""
    name = device_name(device)
    if device.type == "cuda" and not refresh:
        spec = gpu_spec(name)
        if spec is not None and dtype in spec.flops:
            return HardwarePeaks(name, spec.mem_bw, spec.flops[dtype], dtype, "table")
    threads = threads if threads is not None else (torch.get_num_threads() if device.type == "cpu" else 0)
    path = cache_path()
    key = _key(name, device, threads, dtype)
    path.parent.mkdir(parents=True, exist_ok=True)
    # One probe per node even when several trials start at once: the others wait on the lock, then read.
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        entries = _read(path)
        old = entries.get(key)
        if old is not None and not refresh:
            return HardwarePeaks(name, float(old["mem_bw"]), float(old["flops"]), dtype, "cache")
        log.info("probing %s (%s, %d threads)", name, dtype, threads)
        t0 = time.perf_counter()
        if threads and device.type == "cpu":
            torch.set_num_threads(threads)
        bw, flops = probe_bandwidth(device), probe_matmul(device, TORCH_DTYPES[dtype])
        if old is not None:
            bw, flops = max(bw, float(old["mem_bw"])), max(flops, float(old["flops"]))
        peaks = HardwarePeaks(name=name, mem_bw=bw, flops=flops, dtype=dtype, source="probe")
        entries[key] = {**asdict(peaks), "threads": threads, "probe_s": round(time.perf_counter() - t0, 2),
                        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(entries, indent=2, sort_keys=True))
        tmp.replace(path)
        return peaks


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
