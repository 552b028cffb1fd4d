"""Which regime am I in? A roofline cost model of one trial, from the model config and the workload.

For every forward pass it counts the *essential* work -- FLOPs of the matmuls and of causal attention, and
the bytes that must cross the memory bus: every matmul weight once per pass, the KV cache read (and the
new K/V written) and, for attention kernels that materialize the score matrix (eager), the scores written
and read back. Activations are ignored (small next to weights at decode, next to FLOPs at prefill).

    time bound  = max(FLOPs / peak FLOP/s, bytes / peak bandwidth)
    intensity   = FLOPs / bytes;  memory-bound when intensity < machine balance (peak FLOP/s / bandwidth)

Prefill is one pass over the prompt (only the last position's logits are essential); decode is one pass
per generated token after the first -- one new token against the cache, or, with `kv_cache=off`, the
whole sequence recomputed. Decode bounds are summed step by step (the cache grows every step).

The engine imports nothing of Hydra, Ray or MLflow here either: plain numbers in, plain numbers out.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional

from .. import axes
from ..config import EngineError
from ..model_facts import ModelShape
from .hardware import HardwarePeaks

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
MEMORY, COMPUTE = "memory", "compute"

# llama.cpp block formats: q8_0 34 B per 32 weights, q4_0 18 B per 32, q4_1 20 B per 32 (SmolLM2's shipped
# file, engine=llamacpp quant=gguf-shipped); q4_k_m ~4.85 bits on average (Q4_K's 4.5 bits, with some tensors
# at Q6_K -- llama.cpp's figure for 7B Llamas)
GGUF_BYTES = {"gguf-q8_0": 34 / 32, "gguf-q4_0": 18 / 32, "gguf-q4_1": 20 / 32, "gguf-q4_k_m": 4.85 / 8}


def weight_bytes_per_param(dtype: str, quant: str = "none") -> float:
    """Bytes one weight occupies in memory: the dtype's width, or the quantized width plus its scales.

    int8 (LLM.int8 / weight-only int8): 1 byte + a per-row scale (negligible). 4-bit (nf4 / fp4 / int4):
    half a byte + one fp32 absmax per 64-weight block (bitsandbytes' default block size).
    """
    if dtype not in DTYPE_BYTES:
        raise EngineError(f"cost model: unknown dtype {dtype!r}; known: {sorted(DTYPE_BYTES)}")
    q = (quant or axes.QUANT.off).lower()
    if q in (axes.QUANT.off, ""):
        return float(DTYPE_BYTES[dtype])
    if q in GGUF_BYTES:
        return GGUF_BYTES[q]
    if "int8" in q or "8bit" in q:
        return 1.0
    if q == "int4-weight":  # ours (engine/quant.py): one fp32 scale per group of 32
        return 0.5 + 4 / 32
    if any(s in q for s in ("nf4", "fp4", "int4", "4bit")):
        return 0.5 + 4 / 64
    raise EngineError(f"cost model: unknown quantization {quant!r} (expected none, *int8*, *nf4*, *fp4*, *int4*)")


@dataclass(frozen=True)
class PhaseCost:
    """Work of one or more forward passes: FLOPs and the bytes they move, by kind."""

    flops: float = 0.0
    weight_bytes: float = 0.0
    kv_bytes: float = 0.0
    attn_score_bytes: float = 0.0  # materialized attention scores/probs (eager); 0 for fused kernels

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes + self.attn_score_bytes

    @property
    def intensity(self) -> float:
        """Arithmetic intensity, FLOP per byte."""
        return self.flops / self.bytes if self.bytes else float("inf")

    def __add__(self, other: "PhaseCost") -> "PhaseCost":
        return PhaseCost(
            self.flops + other.flops,
            self.weight_bytes + other.weight_bytes,
            self.kv_bytes + other.kv_bytes,
            self.attn_score_bytes + other.attn_score_bytes,
        )

    def scaled(self, k: float) -> "PhaseCost":
        return PhaseCost(self.flops * k, self.weight_bytes * k, self.kv_bytes * k, self.attn_score_bytes * k)

    def compute_s(self, peaks: HardwarePeaks) -> float:
        return self.flops / peaks.flops

    def memory_s(self, peaks: HardwarePeaks) -> float:
        return self.bytes / peaks.mem_bw

    def bound_s(self, peaks: HardwarePeaks) -> float:
        return max(self.compute_s(peaks), self.memory_s(peaks))

    def regime(self, peaks: HardwarePeaks) -> str:
        return MEMORY if self.memory_s(peaks) >= self.compute_s(peaks) else COMPUTE


@dataclass(frozen=True)
class Precision:
    """How wide weights and activations are. With quantization, `quant_bytes` applies to the quantized
    matmuls; the lm_head (often skipped) and the last `full_last_layers` layers stay at the dtype's width."""

    dtype_bytes: float  # per element of unquantized weights, activations, KV cache and attention scores
    quant_bytes: Optional[float] = None  # per quantized weight; None = no quantization
    quantize_lm_head: bool = False
    full_last_layers: int = 0
    kv_elt_bytes: Optional[float] = None  # per K/V element where the engine stores them in another type

    @classmethod
    def of(cls, dtype: str, quant: str = "none", skip_lm_head: bool = True, full_last_layers: int = 0,
           kv_elt_bytes: Optional[float] = None) -> "Precision":
        full = weight_bytes_per_param(dtype)
        q = weight_bytes_per_param(dtype, quant)
        if q == full:
            return cls(full, kv_elt_bytes=kv_elt_bytes)
        return cls(full, q, not skip_lm_head, full_last_layers, kv_elt_bytes)

    @property
    def act_bytes(self) -> float:
        return self.dtype_bytes

    @property
    def kv_bytes(self) -> float:
        return self.dtype_bytes if self.kv_elt_bytes is None else self.kv_elt_bytes

    def weight_bytes(self, shape: "ModelShape") -> float:
        """Bytes of the matmul weights one forward pass reads."""
        if self.quant_bytes is None:
            return shape.matmul_params * self.dtype_bytes
        n_full = min(self.full_last_layers, shape.num_layers)
        layers = shape.layer_params * ((shape.num_layers - n_full) * self.quant_bytes + n_full * self.dtype_bytes)
        head = shape.lm_head_params * (self.quant_bytes if self.quantize_lm_head else self.dtype_bytes)
        return layers + head


def forward_cost(
    shape: ModelShape,
    prec: Precision,
    batch: int,
    new_tokens: int,
    past_tokens: int,
    cached: bool,
    materialize_scores: bool,
    logits_tokens: int = 1,
) -> PhaseCost:
    """One forward pass of `new_tokens` per sequence after `past_tokens` already in the KV cache.

    Attention is causal: query i (0-based among the new tokens) sees past + i + 1 keys.
    """
    b, t, p = batch, new_tokens, past_tokens
    s = shape
    # (query, key) pairs per sequence per head, causal, summed over layers (a sliding window caps a layer's)
    pairs = sum(_pairs(t, p, w) for w in s.layer_windows) if s.layer_windows else s.num_layers * _pairs(t, p, None)
    flops = 2 * b * t * s.num_layers * s.layer_params + 2 * b * logits_tokens * s.lm_head_params
    flops += 4 * b * s.num_heads * s.head_dim * pairs  # QK^T and PV, 2 FLOPs per MAC each
    weight = prec.weight_bytes(s)
    # read the attended past (a windowed layer: its window), write the new
    kv = b * s.attended_keys(p + t) * s.kv_bytes_per_token(prec.kv_bytes) if cached else 0.0
    scores = 0.0
    if materialize_scores:
        # the full T x (P+T) matrix per head (masked entries too): scores written, read by softmax,
        # probabilities written, read by PV
        scores = 4 * b * s.num_layers * s.num_heads * t * (p + t) * prec.act_bytes
    return PhaseCost(flops=flops, weight_bytes=weight, kv_bytes=kv, attn_score_bytes=scores)


def _pairs(t: int, p: int, window: Optional[int]) -> float:
    """(query, key) pairs of `t` new queries after `p` cached tokens: query i sees min(p + i + 1, window)."""
    if window is None or p + t <= window:
        return t * p + t * (t + 1) / 2
    k = max(0, min(t, window - p))  # queries that still see their whole past
    return k * p + k * (k + 1) / 2 + (t - k) * window


@dataclass(frozen=True)
class Workload:
    batch: int
    context: int  # prompt tokens per sequence
    new_tokens: int  # generated tokens per sequence (the first comes from prefill)
    kv_cache: bool = True
    materialize_scores: bool = False  # the attention kernel writes the score matrix (the engine says)

    @property
    def decode_steps(self) -> int:
        return max(0, self.new_tokens - 1)


@dataclass(frozen=True)
class Prediction:
    """The roofline of one trial on one device."""

    workload: Workload
    peaks: HardwarePeaks
    prefill: PhaseCost
    decode: PhaseCost  # summed over all decode steps
    prefill_s: float  # bound
    decode_s: float  # bound, summed step by step
    decode_regime: Optional[str]  # None when there is no decode step

    @property
    def prefill_regime(self) -> str:
        return self.prefill.regime(self.peaks)

    @property
    def decode_step(self) -> PhaseCost:
        """The mean decode step."""
        return self.decode.scaled(1 / self.workload.decode_steps) if self.workload.decode_steps else PhaseCost()

    @property
    def prefill_tok_s(self) -> float:
        w = self.workload
        return w.batch * w.context / self.prefill_s

    @property
    def decode_tok_s(self) -> float:
        w = self.workload
        return w.batch * w.decode_steps / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def output_tok_s(self) -> float:
        """Same definition as the measured `output_tok_s`: generated tokens / (prefill + decode)."""
        w = self.workload
        return w.batch * w.new_tokens / (self.prefill_s + self.decode_s)


def predict(shape: ModelShape, prec: Precision, wl: Workload, peaks: HardwarePeaks) -> Prediction:
    prefill = forward_cost(shape, prec, wl.batch, wl.context, 0, wl.kv_cache, wl.materialize_scores)
    decode = PhaseCost()
    decode_s = 0.0
    mem_s = comp_s = 0.0
    for step in range(1, wl.decode_steps + 1):
        seq = wl.context + step  # tokens per sequence once this step's token is in
        if wl.kv_cache:
            c = forward_cost(shape, prec, wl.batch, 1, seq - 1, True, wl.materialize_scores)
        else:  # recompute the whole sequence; logits of the last position only
            c = forward_cost(shape, prec, wl.batch, seq, 0, False, wl.materialize_scores)
        decode = decode + c
        decode_s += c.bound_s(peaks)
        mem_s += c.memory_s(peaks)
        comp_s += c.compute_s(peaks)
    regime = None if not wl.decode_steps else (MEMORY if mem_s >= comp_s else COMPUTE)
    return Prediction(wl, peaks, prefill, decode, prefill.bound_s(peaks), decode_s, regime)


@dataclass
class Assessment:
    """A prediction set against measured throughput: metrics and regime labels to record."""

    metrics: dict[str, float] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)


def _measured_regime(cost: PhaseCost, seconds: float, peaks: HardwarePeaks) -> tuple[float, float, str]:
    """(bandwidth utilization, compute utilization, the roof the run is nearer to)."""
    bw = cost.bytes / seconds / peaks.mem_bw
    comp = cost.flops / seconds / peaks.flops
    return bw, comp, MEMORY if bw >= comp else COMPUTE


def assess(pred: Prediction, measured: dict[str, float]) -> Assessment:
    """Compare a prediction with measured `output_tok_s`, `prefill_tok_s`, `decode_tok_s`.

    The measured regime of a phase is the roof it runs nearer to: the larger of its attained bandwidth and
    attained FLOP/s, each as a fraction of the peak (work counted by the cost model, time measured).
    """
    w, pk = pred.workload, pred.peaks
    m: dict[str, float] = {
        "roofline_tok_s": pred.output_tok_s,
        "roofline_prefill_tok_s": pred.prefill_tok_s,
        "cost_weight_bytes_per_step": pred.prefill.weight_bytes,
        "cost_prefill_flops": pred.prefill.flops,
        "cost_prefill_bytes": pred.prefill.bytes,
        "cost_prefill_intensity": pred.prefill.intensity,
        "cost_attn_score_bytes": pred.prefill.attn_score_bytes,
        "hw_mem_bw": pk.mem_bw,
        "hw_flops": pk.flops,
        "hw_balance": pk.balance,
    }
    if pk.gemv_bw:
        m["hw_gemv_bw"] = pk.gemv_bw
    labels = {"regime.prefill": pred.prefill_regime, "hw.source": pk.source}
    times: dict[str, float] = {}
    if measured.get("output_tok_s"):
        m["roofline_efficiency"] = measured["output_tok_s"] / pred.output_tok_s
    if measured.get("prefill_tok_s"):
        t = w.batch * w.context / measured["prefill_tok_s"]
        times["prefill"] = t
        m["roofline_prefill_efficiency"] = pred.prefill_s / t
        bw, comp, reg = _measured_regime(pred.prefill, t, pk)
        m["prefill_bw_util"], m["prefill_compute_util"] = bw, comp
        labels["regime.prefill.measured"] = reg
    if w.decode_steps:
        step = pred.decode_step
        m.update({
            "roofline_decode_tok_s": pred.decode_tok_s,
            "cost_kv_bytes_per_step": step.kv_bytes,
            "cost_decode_flops_per_step": step.flops,
            "cost_decode_bytes_per_step": step.bytes,
            "cost_decode_intensity": pred.decode.intensity,
        })
        labels["regime.decode"] = pred.decode_regime or ""
        if measured.get("decode_tok_s"):
            t = w.batch * w.decode_steps / measured["decode_tok_s"]
            times["decode"] = t
            m["roofline_decode_efficiency"] = pred.decode_s / t
            # speculative decoding emits tokens_per_step tokens per target pass: weights and KV were streamed
            # that many times fewer; FLOPs stay per emitted token (a lower bound: rejected drafts and a
            # draft model's own passes are not counted)
            passes = 1.0 / measured["tokens_per_step"] if measured.get("tokens_per_step") else 1.0
            moved = replace(pred.decode.scaled(passes), flops=pred.decode.flops)
            bw, comp, reg = _measured_regime(moved, t, pk)
            m["decode_bw_util"], m["decode_compute_util"] = bw, comp
            if pk.gemv_bw:  # how near the dtype's own batch-1 GEMV rate: ~1 = the matmul kernel is the limit
                m["decode_gemv_util"] = moved.bytes / t / pk.gemv_bw
            labels["regime.decode.measured"] = reg
    if times:  # the phase that took the most measured time decides the trial's regime
        phase = max(times, key=times.get)
        labels["regime.phase"] = phase
        labels["regime"] = labels[f"regime.{phase}.measured"]
    return Assessment(m, labels)


def assess_trial(trial, shape: ModelShape, device, measured: dict[str, float], *, materialize_scores: bool,
                 kv_elt_bytes: Optional[float] = None, compute_dtype: Optional[str] = None) -> Assessment:
    """The cost model of a `TrialConfig` run on `device` (peaks from the table, the cache or a probe).
    What depends on the engine -- whether its attention materializes scores, the K/V element size at
    `kv_cache.dtype`, the dtype whose arithmetic runs its matmuls (`compute_dtype`, default model.dtype) --
    comes from the engine's declaration (engine/engines/), passed in by the caller."""
    import torch

    from .hardware import node_peaks

    wl = trial.workload
    q = trial.quant  # QuantConfig: level, skip_modules, keep_last_layers
    if q.level != axes.QUANT.off:
        prec = Precision.of(trial.model.dtype, q.level, "lm_head" in q.skip_modules, q.keep_last_layers, kv_elt_bytes)
    else:
        prec = Precision.of(trial.model.dtype, kv_elt_bytes=kv_elt_bytes)
    workload = Workload(
        batch=wl.batch_size,
        context=wl.context_len,
        new_tokens=wl.max_new_tokens,
        kv_cache=axes.KV_CACHE.applied({axes.KV_CACHE.key: trial.kv_cache.mode}),
        materialize_scores=materialize_scores,
    )
    threads = torch.get_num_threads() if device.type == "cpu" else None
    # the roofs of the dtype the engine computes in: torch on a CPU without bf16 units runs bf16 matmuls 100x+
    # slower than fp32, llama.cpp widens f16/bf16 weights and runs at the f32 rate
    peaks = node_peaks(device, compute_dtype or trial.model.dtype, threads)
    return assess(predict(shape, prec, workload, peaks), measured)
