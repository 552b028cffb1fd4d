"""Quantization levels: a module swap over `nn.Linear` (gpt-fast style), so no model file knows about it.

Levels
- `none`: weights at `model.dtype`.
- `int8-weight`: weight-only INT8, symmetric per output channel; activations stay in float. `kernel`
  picks the matmul: `dequant` (default: cast the int8 weight to the activation dtype, float GEMM, scale
  the output; under torch.compile on a GPU the cast fuses into the GEMM's prologue, gpt-fast style) or
  `int8pack` (torch's `_weight_int8pack_mm`, CPU/MPS). On the pinned torch 2.13 CPU wheel int8pack is
  1.6-2.3x slower than dequant at one row and ~40x slower at 128 rows (its time grows linearly in rows,
  an unblocked loop), so a weight-only trial with it prefilled at 1/24 of fp32's speed; BENCHMARKS.md
  has the micro-benchmark. `gemv`: our fused dequantize-GEMV (engine/quant_kernels.py: C++ compiled on
  this machine, reads each int8 weight once) for up to GEMV_MAX_ROWS rows (decode), dequant above
  (prefill is compute-bound, where the float GEMM's blocking wins). `auto`: per weight shape the fastest
  of dequant / int8pack / gemv at one row, timed once per machine at load and cached (`choose_kernel`); the choice
  is in the trial's info (`kernel_info`).
- `int4-weight`: weight-only INT4, symmetric per group of 32 inputs (packed two per byte, fp32 scale per
  group, llama.cpp Q4_0's scaling); `kernel` gemv (our fused kernel) or dequant (unpack to float, GEMM), or
  auto (gemv vs dequant), or gemv-q8: INT4 x INT8, the decode row quantized per block of 32 and multiplied in
  integers (llama.cpp's Q4_0 x Q8_0; not weight-only any more: the activation rounding shows in the fidelity).
  The LM head, when not skipped, gets INT8 (`WIDER`).
- `kernel=gemv-all` (levels none, int8-weight, int4-weight): gemv for the quantized linears, and our dense
  fp32/bf16 GEMV (engine/quant_kernels.py, same structure) for the linears left in full precision: every one at
  level none, the skipped ones (the LM head by default) otherwise. torch's own fp32 / bf16 GEMV at one row
  streams well under the machine's read bandwidth on CPU (BENCHMARKS.md); prefill keeps F.linear.
- `int8-dynamic`: INT8 weights + INT8 activations (W8A8): per-token dynamic activation scales, an int8 x
  int8 -> int32 matmul (our kernel: AVX-512 VNNI `vpdpbusd` or AVX2 `vpmaddubsw`; torch's integer matmul without
  it), rescaled by both scales. No outlier handling: this is the "naive activation quantization" the seed warns about.
- `bnb-int8`: bitsandbytes LLM.int8() (int8 weights + activations with fp16 outlier decomposition).
- `bnb-nf4`, `bnb-fp4`: bitsandbytes 4-bit weight-only, `compute_dtype` configurable.

Our INT8 kernels are our own (~100 lines) rather than torchao's: no extra dependency, the arithmetic is in
plain sight, and they run on the CPU wheel pinned here. bitsandbytes levels are applied by transformers at
load time (`BitsAndBytesConfig`), ours after load; both leave the model's module tree intact, so the
native backend, which reuses the loaded model's projection modules, inherits either.

Mixed precision (the seed's long-context mitigation): `skip_modules` (fnmatch patterns of module names
kept in full precision) and `keep_last_layers` (the last N decoder layers stay unquantized).
"""
from __future__ import annotations

import dataclasses
import fnmatch
import re

import torch
import torch.nn.functional as F
from torch import nn

from . import quant_kernels as qk
from .config import QUANT_LEVELS, EngineError, QuantConfig  # noqa: F401  (re-exported)

BNB_LEVELS = ("bnb-int8", "bnb-nf4", "bnb-fp4")
GEMV_ALL_LEVELS = ("none", "int8-weight", "int4-weight")  # the levels quant.kernel=gemv-all runs with
OWN_LEVELS = ("int8-weight", "int8-dynamic", "int4-weight")
# decode-sized batches go through the fused GEMV kernels; more rows (prefill) through dequant + float GEMM
GEMV_MAX_ROWS = 8
CANDIDATES = {"int8-weight": ("dequant", "int8pack", "gemv"), "int4-weight": ("dequant", "gemv")}
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def skipped(name: str, spec: QuantConfig, num_layers: int) -> bool:
    if any(fnmatch.fnmatch(name, pat) or fnmatch.fnmatch(name.split(".")[-1], pat) for pat in spec.skip_modules):
        return True
    m = _LAYER_RE.search(name)
    return bool(m and spec.keep_last_layers and int(m.group(1)) >= num_layers - spec.keep_last_layers)


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel. w [out, in] -> (int8 [out, in], float32 scales [out])."""
    w = w.detach().float()
    scales = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
    q = torch.clamp(torch.round(w / scales[:, None]), -127, 127).to(torch.int8)
    return q, scales


def kernel_problems(level: str, kernel: str) -> list[str]:
    """Why quant.kernel=`kernel` cannot run with quant.level=`level` ([] when it can): the one home of the kernel x
    level rules (the torch engines that run these modules, hf and native, ask here in their checks:
    engine/engines/hf `quant_kernel_checks`; the modules refuse the same at construction)."""
    if kernel == "gemv-all":
        if level not in GEMV_ALL_LEVELS:
            return [f"gemv-all (our GEMV for the full-precision linears too) runs with quant.level "
                    f"{', '.join(GEMV_ALL_LEVELS)}, not {level}"]
        return []
    if level in MODULES and kernel not in MODULES[level].KERNELS:
        return [f"{level} runs kernel={', '.join(MODULES[level].KERNELS)} (or gemv-all), not {kernel}"]
    if level == "int8-weight" and kernel == "int8pack" and not hasattr(torch, "_weight_int8pack_mm"):
        return [f"int8pack needs torch._weight_int8pack_mm, missing in torch {torch.__version__}"]
    if level not in MODULES and kernel == "gemv-q8":
        return [f"gemv-q8 (INT4 x INT8) is a kernel of quant.level=int4-weight, not {level}"]
    return []


class WeightOnlyInt8Linear(nn.Module):
    """y = x @ (W_int8 * s)^T + b, with W stored as int8 [out, in] and s float32 [out]. `kernel` as the
    module docstring says; `chosen` is the kernel `auto` resolved to (set at the first call)."""

    level = "int8-weight"
    KERNELS = ("dequant", "int8pack", "gemv", "auto")

    def __init__(self, linear: nn.Linear, kernel: str = "dequant"):
        super().__init__()
        if kernel not in self.KERNELS:
            raise EngineError(f"{self.level} kernel must be one of {self.KERNELS}, got {kernel!r}")
        q, s = self.quantize(linear.weight)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.kernel = kernel
        self.chosen = None if kernel == "auto" else kernel
        self.register_buffer("weight", q)
        self.register_buffer("scales", s)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    @staticmethod
    def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_per_channel(w)

    def matmul(self, x2: torch.Tensor, kernel: str) -> torch.Tensor:
        if kernel == "int8pack":
            if x2.device.type not in ("cpu", "mps"):
                raise EngineError(f"quant.kernel=int8pack runs on CPU/MPS only, not {x2.device.type}; use kernel=dequant")
            return torch._weight_int8pack_mm(x2.contiguous(), self.weight, self.scales.to(x2.dtype))
        if kernel == "gemv" and x2.shape[0] <= GEMV_MAX_ROWS:
            return qk.int8_gemv(x2, self.weight, self.scales)
        return F.linear(x2, self.weight.to(x2.dtype)) * self.scales.to(x2.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., in] -> [..., out]
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.chosen is None:
            self.chosen = choose_kernel(self, x2.dtype, x2.device)
        y = self.matmul(x2, self.chosen)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


class WeightOnlyInt4Linear(WeightOnlyInt8Linear):
    """y = x @ W^T + b, W stored as packed INT4 [out, ceil(in/32)*16] uint8 with a float32 scale per group of 32
    inputs [out, ceil(in/32)] (engine/kernels/gemv.h has the layout). kernel=gemv-q8 quantizes the activation per
    block of 32 for decode-sized calls and multiplies in integers (llama.cpp's Q4_0 x Q8_0); prefill dequantizes."""

    level = "int4-weight"
    KERNELS = ("dequant", "gemv", "gemv-q8", "auto")

    def __init__(self, linear: nn.Linear, kernel: str = "gemv"):
        super().__init__(linear, kernel)

    @staticmethod
    def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return qk.quantize_int4(w)

    def dequantized(self) -> torch.Tensor:
        return qk.dequantize_int4(self.weight, self.scales, self.in_features)

    def matmul(self, x2: torch.Tensor, kernel: str) -> torch.Tensor:
        if kernel == "gemv" and x2.shape[0] <= GEMV_MAX_ROWS:
            return qk.int4_gemv(x2, self.weight, self.scales, self.in_features)
        if kernel == "gemv-q8" and x2.shape[0] <= GEMV_MAX_ROWS:
            return qk.int4_q8_gemv(x2, self.weight, self.scales, self.in_features).to(x2.dtype)
        return F.linear(x2, qk.dequantize_int4_as(self.weight, self.scales, self.in_features, x2.dtype))


class DenseGemvLinear(nn.Module):
    """A full-precision nn.Linear whose decode-sized calls (<= GEMV_MAX_ROWS rows, fp32 or bf16 weights, CPU) run
    our GEMV (quant.kernel=gemv-all); other calls take F.linear. It holds the linear's own weight tensor (a tied
    LM head stays tied, nothing is copied)."""

    level = "none"
    chosen = kernel = "gemv"

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.shape[0] > GEMV_MAX_ROWS:
            return F.linear(x, self.weight, self.bias)
        y = qk.dense_gemv(x2, self.weight)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


# (level, in, out, dtype) -> kernel, for this process; backed by a JSON file per machine (choose_kernel)
_CHOICES: dict[str, str] = {}


def _machine_key() -> str:
    import hashlib
    import platform

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    raw = f"{cpu}|{torch.__version__}|{torch.get_num_threads()}|{qk.isa()}"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def choose_kernel(mod: WeightOnlyInt8Linear, dtype: torch.dtype, device: torch.device) -> str:
    """The fastest of the level's kernels for `mod`'s shape at one row (decode), timed once per machine (CPU
    model, torch version, thread count) and cached in <cache>/kernels/<machine>.json. Off the CPU: dequant."""
    import json
    import statistics
    import time

    if device.type != "cpu":
        return "dequant"
    from .cachedir import cache_root

    key = f"{mod.level}|{mod.in_features}|{mod.out_features}|{str(dtype).removeprefix('torch.')}"
    path = cache_root() / "kernels" / f"{_machine_key()}.json"
    if not _CHOICES and path.is_file():
        try:
            _CHOICES.update(json.loads(path.read_text()))
        except ValueError:
            pass  # a torn write: measure again
    if key in _CHOICES:
        return _CHOICES[key]
    x = torch.randn(1, mod.in_features, dtype=dtype)
    times: dict[str, list[float]] = {k: [] for k in CANDIDATES[mod.level]}
    with torch.inference_mode():
        for _ in range(5):  # interleaved rounds: load on the machine hits every candidate alike
            for k in times:
                mod.matmul(x, k)
                n, t0 = 0, time.perf_counter()
                while n < 2 or time.perf_counter() - t0 < 0.01:
                    mod.matmul(x, k)
                    n += 1
                times[k].append((time.perf_counter() - t0) / n)
    _CHOICES[key] = min(times, key=lambda k: statistics.median(times[k]))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{__import__('os').getpid()}.tmp")
    tmp.write_text(json.dumps(_CHOICES, indent=1, sort_keys=True))
    tmp.replace(path)
    return _CHOICES[key]


def kernel_info(model: nn.Module) -> dict[str, str]:
    """What the weight-only modules of `model` ran: {"quant_kernels": "gemv x210, dequant x1", "quant_kernel_isa":
    "avx512"} (empty for a model without them). `auto` modules that never ran yet count as `auto`."""
    counts: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, WeightOnlyInt8Linear):
            k = m.chosen or m.kernel
            counts[k] = counts.get(k, 0) + 1
        elif isinstance(m, DenseGemvLinear):
            counts["dense-gemv"] = counts.get("dense-gemv", 0) + 1
    if not counts:
        return {}
    info = {"quant_kernels": ", ".join(f"{k} x{n}" for k, n in sorted(counts.items()))}
    if "gemv" in counts or "dense-gemv" in counts:
        info["quant_kernel_isa"] = qk.isa()
    return info


class DynamicInt8Linear(nn.Module):
    """W8A8: per-token activation scales computed on the fly, int8 x int8 -> int32, then rescaled by both scales.
    The weight is int8 [out, in] (the GEMV layout: one weight row per output, as WeightOnlyInt8Linear), multiplied by
    our integer kernel (engine/quant_kernels.py `w8a8_gemv`: AVX-512 VNNI / AVX2) at every row count; without the
    compiled kernels, by torch's integer matmul (same integers)."""

    level = "int8-dynamic"

    def __init__(self, linear: nn.Linear):
        super().__init__()
        q, s = quantize_per_channel(linear.weight)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", q)  # [out, in]
        self.register_buffer("scales", s)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., in] -> [..., out]
        shape = x.shape
        y = qk.w8a8_gemv(x.reshape(-1, shape[-1]), self.weight, self.scales)  # [rows, out] float32
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)


# level -> the weight-only module and its kernels (kernel_problems)
MODULES = {"int8-weight": WeightOnlyInt8Linear, "int4-weight": WeightOnlyInt4Linear}
# level -> the module that replaces one nn.Linear, built from it and the level's spec
SWAPS = {
    "int8-weight": lambda lin, spec: WeightOnlyInt8Linear(lin, spec.kernel),
    "int8-dynamic": lambda lin, spec: DynamicInt8Linear(lin),
    "int4-weight": lambda lin, spec: WeightOnlyInt4Linear(lin, spec.kernel),
}
# modules a level keeps at a wider type when they are quantized at all: a 4-bit LM head costs most of INT4's
# quality on a small model (SmolLM2-135M), so int4-weight gives it INT8, as llama.cpp's Q4_0 gives its output matrix 6 bits
WIDER = {  # int4's kernels are int8's, but for its integer one (gemv-q8 -> gemv)
    "int4-weight": {"lm_head": lambda lin, spec: WeightOnlyInt8Linear(lin, "gemv" if spec.kernel == "gemv-q8" else spec.kernel)},
}


def swaps_linears(spec: QuantConfig) -> bool:
    """Whether `quantize_model` has work for this spec: our levels, or level none with kernel=gemv-all."""
    return spec.level in OWN_LEVELS or (spec.level == "none" and spec.kernel == "gemv-all")


def quantize_model(model: nn.Module, spec: QuantConfig, num_layers: int) -> int:
    """Swap every eligible nn.Linear of `model` in place for our level; returns how many were quantized. With
    kernel=gemv-all the linears the level leaves in full precision (all of them at level none, the skipped
    ones otherwise) get our dense GEMV (DenseGemvLinear)."""
    if not swaps_linears(spec):
        raise EngineError(f"quantize_model handles {OWN_LEVELS} (and none with kernel=gemv-all), not {spec.level!r}")
    dense = spec.kernel == "gemv-all"
    if dense:
        spec = dataclasses.replace(spec, kernel="gemv")  # the quantized linears' kernel
    swap = SWAPS.get(spec.level)
    wider = WIDER.get(spec.level, {})
    count = 0
    for name, lin in [(n, m) for n, m in model.named_modules() if type(m) is nn.Linear]:
        full = swap is None or skipped(name, spec, num_layers)
        if full and not dense:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        new = DenseGemvLinear(lin) if full else wider.get(name, swap)(lin, spec)
        if getattr(new, "chosen", "") is None:  # kernel=auto: timed now, at load, never inside a timed run
            new.chosen = choose_kernel(new, lin.weight.dtype, lin.weight.device)
        setattr(parent, child, new)
        count += not full
    return count


def bnb_config(spec: QuantConfig, num_layers: int, module_names: list[str]):
    """transformers' BitsAndBytesConfig for a bnb level (skip list expanded to concrete module names)."""
    try:
        import bitsandbytes  # noqa: F401
        from transformers import BitsAndBytesConfig
    except ImportError as e:
        raise EngineError(f"quant={spec.level} needs bitsandbytes: pip install bitsandbytes ({e})") from e
    skip = sorted(n for n in module_names if skipped(n, spec, num_layers))
    if spec.level == "bnb-int8":
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip or None)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4" if spec.level == "bnb-nf4" else "fp4",
        bnb_4bit_compute_dtype=getattr(torch, spec.compute_dtype),  # a DTYPES name is torch's own
        llm_int8_skip_modules=skip or None,
    )
