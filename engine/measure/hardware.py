"""Hardware peaks for the roofline: memory bandwidth (bytes/s) and matmul FLOP/s per dtype, and which
number formats this machine computes fast.

Known GPUs come from a table of datasheet numbers (dense, no sparsity). Anything else (every CPU, an
unknown GPU) is measured once per node by a short probe and cached in `cache_root()/hardware/<host>.json`,
keyed by device and thread count, so each trial after the first pays nothing. The probe runs outside
every timed region. It measures

- a streaming read of a large tensor (the memory roof),
- per dtype (float32, bfloat16, float16): square GEMMs of growing size (prefill's kernel) and a
  batch-1 GEMV over a weight matrix larger than the caches (decode's kernel).

CPUs differ most in the 16-bit formats: without bf16 units (no avx512_bf16 / amx_bf16) a bf16 matmul ran
at ~0.3 GFLOP/s against ~85 GFLOP/s in fp32; an EPYC with avx512_bf16 ran bf16 GEMM 1.6x and GEMV 1.5x
faster than fp32, and fp16 at 0.2 GFLOP/s. `preferred_dtype` reads the CPU flags (no benchmark);
the probe's per-dtype numbers say what the formats actually cost, and `slow_dtype_note` says in words when
a trial's dtype has no arithmetic units on this CPU (bf16/fp16 models ran 8-10x slower than fp32 there).

The probe's clock is a parameter (`clock`, default `time.perf_counter`), and `probe_matmul` also takes the
timer of one matrix size, so its budget rule is tested with injected timings instead of patched globals.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import platform
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ..config import EngineError
from ..models import TORCH_DTYPES, cache_root

log = logging.getLogger(__name__)

PROBE_VERSION = 2  # 2: one entry per node with GEMM and GEMV rates of every dtype
PROBE_DTYPES = ("float32", "bfloat16", "float16")
CPU_BF16_ENV = "INFERSWEEP_CPU_BF16"
# /proc/cpuinfo flags of bf16 arithmetic units: x86 AVX512-BF16 and AMX-BF16; aarch64 FEAT_BF16 (Features
# line "bf16") and its SVE form. avx_ne_convert only converts, so it does not count.
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16", "svebf16"})
# fp16 arithmetic units on x86: AVX512-FP16 (Sapphire Rapids and later) and AMX-FP16 (Granite Rapids). F16C
# only converts. aarch64's FEAT_FP16 (asimdhp) is left out: no measurement here says torch's fp16 GEMMs use it.
FP16_CPU_FLAGS = frozenset({"avx512_fp16", "amx_fp16"})
Clock = Callable[[], float]  # seconds, monotonic


@dataclass(frozen=True)
class HardwarePeaks:
    """The roofs of one dtype on one device. `mem_bw` and `flops` are the best rates any probe kernel
    reached at this dtype (so the roofline stays an upper bound whichever kernel a backend uses);
    `gemv_bw` is what a batch-1 GEMV -- decode's kernel -- attains on its own (None: not measured)."""

    name: str  # device name as torch reports it
    mem_bw: float  # bytes/s the device reads from its main memory (HBM, DRAM)
    flops: float  # matmul FLOP/s at the trial's compute dtype
    dtype: str
    source: str  # "table" | "probe" | "cache"
    gemv_bw: Optional[float] = None  # weight bytes/s of a batch-1 matrix-vector product at `dtype`

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


def cpuinfo_text() -> str:
    """/proc/cpuinfo, or "" where it cannot be read (not Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    for line in cpuinfo_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "cpu"


# --- number formats --------------------------------------------------------------------------------------
def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The feature flags of the first processor in /proc/cpuinfo text: the `flags` line on x86, the
    `Features` line on aarch64 (every core of a machine lists the same)."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip().lower() in ("flags", "features"):
            return frozenset(value.split())
    return frozenset()


def _env_bool(name: str) -> Optional[bool]:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    v = raw.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise EngineError(f"environment variable {name}={raw!r}: expected 1/true/yes/on or 0/false/no/off "
                      f"(or unset it to detect from the CPU flags)")


def cpu_bf16_support(cpuinfo: Optional[str] = None) -> bool:
    """Whether this CPU has bf16 arithmetic units, from its /proc/cpuinfo flags (no benchmark).
    `INFERSWEEP_CPU_BF16=0|1` overrides the detection (a CPU that hides its flags, or a test of both
    branches on any machine)."""
    forced = _env_bool(CPU_BF16_ENV)
    if forced is not None:
        return forced
    return bool(cpu_flags(cpuinfo_text() if cpuinfo is None else cpuinfo) & BF16_CPU_FLAGS)


def preferred_cpu_dtype(cpuinfo: Optional[str] = None) -> str:
    """bfloat16 where the CPU computes it natively (half the bytes per weight, and faster GEMMs), else
    float32: emulated bf16 is 100x+ slower than fp32. float16 is never preferred on a CPU (no CPU we
    measured had fast fp16 matmuls)."""
    return "bfloat16" if cpu_bf16_support(cpuinfo) else "float32"


def cpu_fp16_support(cpuinfo: Optional[str] = None) -> bool:
    """Whether this CPU has fp16 arithmetic units, from its /proc/cpuinfo flags (no benchmark)."""
    return bool(cpu_flags(cpuinfo_text() if cpuinfo is None else cpuinfo) & FP16_CPU_FLAGS)


def slow_dtype_note(dtype: str, device: torch.device | str, cpuinfo: Optional[str] = None) -> Optional[str]:
    """A short note when `dtype` has no arithmetic units on `device`, so a model in it runs far slower than
    in float32 (measured: 8-10x end to end for bf16 and fp16 on CPUs without them; emulated matmuls 100x+);
    None when the dtype is native there (or float32). Detected at run time from the CPU flags (bf16 honours
    INFERSWEEP_CPU_BF16) or, on CUDA, from torch; a note for a results table, not an error."""
    device = torch.device(device)
    if device.type == "cuda":  # bf16 tensor cores came with Ampere (compute capability 8.0)
        if dtype == "bfloat16" and torch.cuda.is_available() and torch.cuda.get_device_capability(device)[0] < 8:
            return "bfloat16 on this GPU has no bf16 tensor cores (before Ampere): expect it far slower than float16"
        return None
    if device.type != "cpu":
        return None
    if dtype == "bfloat16" and not cpu_bf16_support(cpuinfo):
        return "bfloat16 on this CPU has no bf16 units (avx512_bf16/amx_bf16): expect ~8-10x slower than float32"
    if dtype == "float16" and not cpu_fp16_support(cpuinfo):
        return "float16 on this CPU has no fp16 units (avx512_fp16/amx_fp16): expect ~8-10x slower than float32"
    return None


def preferred_dtype(device: torch.device | str) -> str:
    """The compute dtype to run a model in on `device`: on CUDA bf16 where the GPU supports it (Ampere and
    later), else fp16 (V100, T4: tensor cores for fp16 only); on a CPU `preferred_cpu_dtype()`."""
    device = torch.device(device)
    if device.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return preferred_cpu_dtype()


# --- probe -----------------------------------------------------------------------------------------------
def _synchronizer(device: torch.device) -> Callable[[], None]:
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def _best_of(fn: Callable[[], None], sync: Callable[[], None], repeats: int, clock: Clock = time.perf_counter,
             samples: Optional[list[float]] = None) -> float:
    """Best seconds of `repeats` calls after a warm-up; every call's seconds go to `samples` if given."""
    fn()  # warm-up (first call pays allocation, kernel selection, page faults)
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = clock()
        fn()
        sync()
        dt = clock() - t0
        best = min(best, dt)
        if samples is not None:
            samples.append(dt)
    return best


def probe_bandwidth(device: torch.device, nbytes: int = 256 << 20, repeats: int = 6,
                    clock: Clock = time.perf_counter, samples: Optional[list[float]] = None) -> float:
    """Bytes/s of a streaming read (a sum over a tensor far larger than any cache); each repeat's bytes/s
    go to `samples` if given (the probe's own spread)."""
    if device.type == "cuda":
        nbytes = max(nbytes, 2 << 30)
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    times: list[float] = []
    dt = _best_of(lambda: x.sum(), _synchronizer(device), repeats, clock, times)
    if samples is not None:
        samples.extend(x.numel() * 4 / t for t in times)
    return x.numel() * 4 / dt


def matmul_timer(device: torch.device, dtype: torch.dtype, repeats: int = 3,
                 clock: Clock = time.perf_counter) -> Callable[[int], float]:
    """n -> best seconds of one n x n by n x n matmul at `dtype` on `device` (warm-up, then `repeats`)."""
    sync = _synchronizer(device)

    def seconds(n: int) -> float:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        return _best_of(lambda: a @ b, sync, repeats, clock)

    return seconds


def probe_matmul(device: torch.device, dtype: torch.dtype, budget_s: float = 1.0, repeats: int = 3,
                 clock: Clock = time.perf_counter, timer: Optional[Callable[[int], float]] = None) -> float:
    """Best FLOP/s of square matmuls of growing size. The next size is tried only if its predicted cost
    (n^3 from the last one, warm-up included) fits in what is left of `budget_s`: a dtype without hardware
    support (bf16/fp16 on many CPUs, 100x slower) stops at a small size instead of running a 1024^3
    matmul four times (that alone took 10 s here). `clock` measures the budget; `timer(n)` gives the best
    seconds of one n x n matmul (default: `matmul_timer` on this clock)."""
    timer = timer or matmul_timer(device, dtype, repeats, clock)
    sizes = (256, 512, 1024, 2048) if device.type == "cpu" else (1024, 2048, 4096, 8192)
    best = 0.0
    start = clock()
    prev: tuple[int, float] | None = None
    for n in sizes:
        if prev is not None:
            predicted = prev[1] * (n / prev[0]) ** 3 * (repeats + 1)
            if clock() - start + predicted > budget_s:
                break
        dt = timer(n)
        best = max(best, 2 * n**3 / dt)
        prev = (n, dt)
    return best


def probe_gemv(device: torch.device, dtype: torch.dtype, nbytes: int = 128 << 20, cols: int = 4096,
               budget_s: float = 0.6, repeats: int = 3, clock: Clock = time.perf_counter) -> float:
    """Weight bytes/s of a batch-1 matrix-vector product (`F.linear` of one row, as a decode step calls
    it) over an `nbytes` weight matrix, larger than the caches. A slow dtype is timed on a 1/16 slice
    instead once that slice shows the whole matrix would overrun `budget_s`: it is compute-bound then,
    so the cache does not flatter it."""
    sync = _synchronizer(device)
    if device.type == "cuda":
        nbytes = max(nbytes, 1 << 30)
    elsize = torch.empty((), dtype=dtype).element_size()
    rows = max(16, nbytes // (elsize * cols))
    w = torch.ones(rows, cols, dtype=dtype, device=device)
    x = torch.ones(1, cols, dtype=dtype, device=device)
    pilot = w[: rows // 16]
    t0 = clock()
    F.linear(x, pilot)
    sync()
    if (clock() - t0) * 16 * (repeats + 1) > budget_s:
        dt = _best_of(lambda: F.linear(x, pilot), sync, 1, clock)
        return pilot.numel() * elsize / dt
    dt = _best_of(lambda: F.linear(x, w), sync, repeats, clock)
    return w.numel() * elsize / dt


@dataclass(frozen=True)
class DtypeRates:
    """What one number format attains on a device."""

    gemm_flops: float  # FLOP/s of large square matmuls (prefill's shape)
    gemv_bw: float  # weight bytes/s of a batch-1 matrix-vector product (decode's shape)

    def gemv_flops(self, elsize: int) -> float:
        return 2.0 * self.gemv_bw / elsize


@dataclass(frozen=True)
class NodeProbe:
    """One node's measured rates: the streaming read and, per dtype, GEMM and GEMV."""

    name: str
    stream_bw: float  # bytes/s of a streaming read (dtype-independent)
    rates: dict[str, DtypeRates]
    stream_bw_cv: float = 0.0  # spread of the streaming read's repeats (stdev / mean)

    def peaks(self, dtype: str, source: str) -> HardwarePeaks:
        if dtype not in self.rates:
            raise EngineError(f"hardware probe has no numbers for dtype {dtype!r}; probed: {sorted(self.rates)}")
        r = self.rates[dtype]
        elsize = torch.empty((), dtype=TORCH_DTYPES[dtype]).element_size()
        return HardwarePeaks(self.name, mem_bw=max(self.stream_bw, r.gemv_bw),
                             flops=max(r.gemm_flops, r.gemv_flops(elsize)), dtype=dtype, source=source,
                             gemv_bw=r.gemv_bw)

    def fast_dtypes(self) -> tuple[str, ...]:
        """The formats this node computes natively: GEMMs at least half as fast as float32's. Emulated
        formats run 100x+ slower, so the threshold does not sit near any real machine."""
        ref = self.rates["float32"].gemm_flops
        return tuple(d for d in PROBE_DTYPES if d in self.rates and self.rates[d].gemm_flops >= 0.5 * ref)

    def merged(self, other: "NodeProbe") -> "NodeProbe":
        """Per number, the higher of two probes (a probe taken while the node was busy reads low)."""
        rates = dict(other.rates)
        for d, r in self.rates.items():
            o = other.rates.get(d)
            rates[d] = r if o is None else DtypeRates(max(r.gemm_flops, o.gemm_flops), max(r.gemv_bw, o.gemv_bw))
        return NodeProbe(self.name, max(self.stream_bw, other.stream_bw), rates, self.stream_bw_cv)

    def to_json(self) -> dict:
        return {"name": self.name, "stream_bw": self.stream_bw, "stream_bw_cv": self.stream_bw_cv,
                "rates": {d: asdict(r) for d, r in self.rates.items()}}

    @classmethod
    def from_json(cls, d: dict) -> "NodeProbe":
        rates = {k: DtypeRates(float(v["gemm_flops"]), float(v["gemv_bw"])) for k, v in d["rates"].items()}
        return cls(d["name"], float(d["stream_bw"]), rates, float(d.get("stream_bw_cv", 0.0)))


def probe_node(device: torch.device, dtypes: tuple[str, ...] = PROBE_DTYPES, clock: Clock = time.perf_counter) -> NodeProbe:
    """Measure the streaming read and each dtype's GEMM and GEMV (a few seconds on a CPU)."""
    import statistics

    rates = {}
    for d in dtypes:
        dt = TORCH_DTYPES[d]
        rates[d] = DtypeRates(gemm_flops=probe_matmul(device, dt, clock=clock), gemv_bw=probe_gemv(device, dt, clock=clock))
    bws: list[float] = []
    bw = probe_bandwidth(device, clock=clock, samples=bws)
    cv = statistics.stdev(bws) / statistics.fmean(bws) if len(bws) > 1 else 0.0
    return NodeProbe(device_name(device), bw, rates, cv)


# A probe during which other processes took more than this share of the CPUs reads low (the loaded
# machine cached 4 GB/s instead of 20.9): it is used for the trial at hand, flagged, and never cached.
PROBE_MAX_OTHER_CPU = 0.25
PROBE_LOADED = "probe-loaded"  # hw.source of such a probe


def _quiet_probe(device: torch.device, attempts: int = 2, wait_s: float = 2.0) -> tuple[NodeProbe, dict[str, float]]:
    """A probe with the load it ran under ({noise_other_cpu_frac, noise_steal_frac, noise_load_avg}); a
    probe taken under load is tried again after `wait_s` (a passing burst), at most `attempts` times."""
    from .noise import NoiseMonitor, load_per_cpu

    for i in range(attempts):
        with NoiseMonitor() as noise:
            probe = probe_node(device)
        load = dict(noise.result)
        if load.get("noise_other_cpu_frac", 0.0) <= PROBE_MAX_OTHER_CPU:
            break
        if i + 1 < attempts:
            log.info("hardware probe under load (other processes used %.0f%% of the CPUs): probing again in %.0f s",
                     100 * load["noise_other_cpu_frac"], wait_s)
            time.sleep(wait_s)
    if "noise_load_avg" not in load and load_per_cpu() is not None:
        load["noise_load_avg"] = load_per_cpu()
    return probe, load


# --- cache -----------------------------------------------------------------------------------------------
def cache_path(host: Optional[str] = None) -> Path:
    return cache_root() / "hardware" / f"{host or socket.gethostname()}.json"


def probe_key(name: str, device: torch.device, threads: int) -> str:
    return f"v{PROBE_VERSION}|{device.type}|{name}|threads={threads}"


def node_probe(device: torch.device, threads: Optional[int] = None, refresh: bool = False) -> tuple[NodeProbe, str]:
    """(this node's probe at `threads` torch threads (CPU), "cache" | "probe"): cached, else measured now.

    `refresh` probes again and keeps the higher of the old and new numbers (peaks only ever move up
    towards the truth)."""
    name = device_name(device)
    threads = threads if threads is not None else (torch.get_num_threads() if device.type == "cpu" else 0)
    path = cache_path()
    key = probe_key(name, device, threads)
    path.parent.mkdir(parents=True, exist_ok=True)
    # One probe per node even when several trials start at once: the others wait on the lock, then read.
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        entries = _read(path)
        old = NodeProbe.from_json(entries[key]) if key in entries else None
        if old is not None and not refresh:
            return old, "cache"
        log.info("probing %s (%d threads)", name, threads)
        t0 = time.perf_counter()
        if threads and device.type == "cpu":
            torch.set_num_threads(threads)
        probe, load = _quiet_probe(device)
        other = load.get("noise_other_cpu_frac", 0.0)
        if other > PROBE_MAX_OTHER_CPU:  # never cached: the next trial probes again
            log.warning("hardware probe taken under load (other processes used %.0f%% of the CPUs, > %.0f%%): "
                        "not cached; this trial's roofline numbers read high (hw.source=%s). Re-probe on a quiet "
                        "machine with `infersweep probe --refresh`.", 100 * other, 100 * PROBE_MAX_OTHER_CPU, PROBE_LOADED)
            return (probe.merged(old) if old is not None else probe), PROBE_LOADED
        if old is not None:
            probe = probe.merged(old)
        entries[key] = {**probe.to_json(), "threads": threads, "fast_dtypes": list(probe.fast_dtypes()),
                        "probe_s": round(time.perf_counter() - t0, 2),
                        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                        "load": {k: round(v, 4) for k, v in load.items()}}
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(entries, indent=2, sort_keys=True))
        tmp.replace(path)
        return probe, "probe"


def cached_entry(device: torch.device, threads: int) -> Optional[dict]:
    """The cache's record of this node's probe at `threads` (with when and under what load), or None."""
    return _read(cache_path()).get(probe_key(device_name(device), device, threads))


def node_peaks(device: torch.device, dtype: str, threads: Optional[int] = None, refresh: bool = False) -> HardwarePeaks:
    """Peaks of this node for `dtype` at `threads` torch threads (CPU): table, else cache, else probe."""
    if dtype not in TORCH_DTYPES:
        raise EngineError(f"dtype {dtype!r} unknown; choose one of {sorted(TORCH_DTYPES)}")
    if device.type == "cuda" and not refresh:
        name = device_name(device)
        spec = gpu_spec(name)
        if spec is not None and dtype in spec.flops:
            return HardwarePeaks(name, spec.mem_bw, spec.flops[dtype], dtype, "table", gemv_bw=spec.mem_bw)
    probe, source = node_probe(device, threads, refresh)
    return probe.peaks(dtype, source)


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
