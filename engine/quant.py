"""Quantization levels: a module swap over `nn.Linear` (gpt-fast style), so no model file knows about it.

Levels
- `none`: weights at `model.dtype`.
- `int8-weight`: weight-only INT8, symmetric per output channel; activations stay in float. `kernel`
  picks the matmul: `dequant` (default: cast the int8 weight to the activation dtype, float GEMM, scale
  the output; under torch.compile on a GPU the cast fuses into the GEMM's prologue, gpt-fast style) or
  `int8pack` (torch's `_weight_int8pack_mm`, CPU/MPS). On the pinned torch 2.13 CPU wheel int8pack is
  1.6-2.3x slower than dequant at one row and ~40x slower at 128 rows (its time grows linearly in rows,
  an unblocked loop), so a weight-only trial with it prefilled at 1/24 of fp32's speed; BENCHMARKS.md
  has the micro-benchmark.
- `int8-dynamic`: INT8 weights + INT8 activations (W8A8): per-token dynamic activation scales, an int8 x
  int8 -> int32 matmul (`torch._int_mm`), rescaled by both scales. No outlier handling: this is the
  "naive activation quantization" the seed warns about.
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

import fnmatch
import re

import torch
import torch.nn.functional as F
from torch import nn

from .config import INT8_KERNELS, QUANT_LEVELS, EngineError, QuantConfig  # noqa: F401  (re-exported)

BNB_LEVELS = ("bnb-int8", "bnb-nf4", "bnb-fp4")
OWN_LEVELS = ("int8-weight", "int8-dynamic")
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


class WeightOnlyInt8Linear(nn.Module):
    """y = x @ (W_int8 * s)^T + b, with W stored as int8 [out, in] and s float32 [out]."""

    def __init__(self, linear: nn.Linear, kernel: str = "dequant"):
        super().__init__()
        if kernel not in INT8_KERNELS:
            raise EngineError(f"int8-weight kernel must be one of {INT8_KERNELS}, got {kernel!r}")
        q, s = quantize_per_channel(linear.weight)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.kernel = kernel
        self.register_buffer("weight", q)
        self.register_buffer("scales", s)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., in] -> [..., out]
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.kernel == "int8pack":
            if x2.device.type not in ("cpu", "mps"):
                raise EngineError(f"quant.kernel=int8pack runs on CPU/MPS only, not {x2.device.type}; use kernel=dequant")
            y = torch._weight_int8pack_mm(x2.contiguous(), self.weight, self.scales.to(x2.dtype))
        else:
            y = F.linear(x2, self.weight.to(x2.dtype)) * self.scales.to(x2.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


class DynamicInt8Linear(nn.Module):
    """W8A8: per-token activation scales computed on the fly, int8 x int8 -> int32, then rescaled."""

    # torch._int_mm needs more than 16 rows on some builds; smaller batches are padded (rows are independent)
    MIN_ROWS = 17

    def __init__(self, linear: nn.Linear):
        super().__init__()
        q, s = quantize_per_channel(linear.weight)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight_t", q.t().contiguous())  # [in, out] for _int_mm's layout
        self.register_buffer("scales", s)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., in] -> [..., out]
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).float()
        xs = x2.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127.0  # [rows, 1]
        xq = torch.clamp(torch.round(x2 / xs), -127, 127).to(torch.int8)
        rows = xq.shape[0]
        if rows < self.MIN_ROWS:
            xq = F.pad(xq, (0, 0, 0, self.MIN_ROWS - rows))
        acc = torch._int_mm(xq, self.weight_t)[:rows]  # [rows, out] int32
        y = acc.float() * xs * self.scales
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)


# level -> the module that replaces one nn.Linear, built from it and the level's spec
SWAPS = {
    "int8-weight": lambda lin, spec: WeightOnlyInt8Linear(lin, spec.kernel),
    "int8-dynamic": lambda lin, spec: DynamicInt8Linear(lin),
}


def quantize_model(model: nn.Module, spec: QuantConfig, num_layers: int) -> int:
    """Swap every eligible nn.Linear of `model` in place for our level; returns how many were swapped."""
    if spec.level not in OWN_LEVELS:
        raise EngineError(f"quantize_model handles {OWN_LEVELS}, not {spec.level!r}")
    swap = SWAPS[spec.level]
    targets = [(n, m) for n, m in model.named_modules() if type(m) is nn.Linear and not skipped(n, spec, num_layers)]
    for name, lin in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, swap(lin, spec))
    return len(targets)


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
