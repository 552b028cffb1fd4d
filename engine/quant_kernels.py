"""Our own fused dequantize-GEMV kernels for weight-only INT8 / INT4 on CPU (issue 28), and a GEMV of the same
kind for full-precision fp32 / bf16 weights (`quant.kernel=gemv-all`).

At batch-1 decode a linear layer is a GEMV bound by reading its weights. torch's paths for int8 weights
read them badly on CPU: dequantize-then-GEMM casts the whole weight to float (it reads 1 byte and writes 4
per weight, then the GEMM reads 4), and torch 2.13's `_weight_int8pack_mm` is an unblocked loop. These
kernels read each int8 (or packed int4) weight once, widen it to fp32 in registers and accumulate in fp32:
y[r, o] = s[o] * sum_k x[r, k] * q[o, k]  (INT4: a scale per group of 32 inputs). Output rows are split
over torch's OpenMP threads (`at::parallel_for`), so `engine.threads` governs them like every other op.

They are C++ compiled at first use on the machine that runs them (`torch.utils.cpp_extension.load_inline`,
`-O3 -march=native`, cached in torch's extensions directory): AVX-512 or AVX2 intrinsics, chosen by what
the compiler finds on this CPU, with a plain C++ loop otherwise. If the compile fails (no compiler, no
headers), `load()` returns None, `load_error()` says why, and callers use the portable torch path
(dequantize, then `F.linear`), which computes the same function.
"""
from __future__ import annotations

import functools
import hashlib
import os

import torch
import torch.nn.functional as F

INT4_GROUP = 32  # inputs per INT4 scale; one group = 16 bytes = one 128-bit load
# A weight smaller than this per thread runs on fewer threads (grain_for in the C++ source)
MIN_BYTES_PER_THREAD = int(os.environ.get("INFERSWEEP_GEMV_MIN_BYTES", 1 << 20))

_CPP = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <cstring>

// at::parallel_for's grain (output rows per chunk): at least min_bytes of weight per thread, because an OpenMP
// region costs a barrier and on a loaded machine a descheduled thread stalls it for a whole time slice
static int64_t grain_for(int64_t N, int64_t weight_bytes, int64_t min_bytes) {
  int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), weight_bytes / std::max<int64_t>(1, min_bytes)));
  return std::max<int64_t>(16, (N + threads - 1) / threads);
}

// Weight elements widened to fp32 in registers: int8 (weight-only INT8), fp32, or bf16 held as uint16 and widened
// by a 16-bit shift (exact, so bf16 needs no bf16 arithmetic from the CPU); all accumulate in fp32
static inline float to_f(float v) { return v; }
static inline float to_f(int8_t v) { return (float)v; }
static inline float to_f(uint16_t v) { uint32_t u = (uint32_t)v << 16; float f; std::memcpy(&f, &u, 4); return f; }
#if defined(__AVX512F__)
static inline __m512 ld16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 ld16(const int8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p))); }
static inline __m512 ld16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
#elif defined(__AVX2__) && defined(__FMA__)
static inline __m256 ld8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 ld8(const int8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p))); }
static inline __m256 ld8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
#endif

// RB rows of x against one weight row of element type T: out[r] = sum_k x[r*K + k] * w[k]. U independent
// accumulators per row keep the FMA latency chain from bounding a single row (RB * U = 4 chains in flight)
template <int RB, typename T>
static inline void dot_w(const float* x, int64_t K, const T* w, float* out) {
  constexpr int U = RB >= 4 ? 1 : 4 / RB;
  int64_t k = 0;
#if defined(__AVX512F__)
  __m512 a[RB][U];
  for (int r = 0; r < RB; ++r) for (int u = 0; u < U; ++u) a[r][u] = _mm512_setzero_ps();
  for (; k + 16 * U <= K; k += 16 * U) {
    for (int u = 0; u < U; ++u) {
      __m512 wf = ld16(w + k + 16 * u);
      for (int r = 0; r < RB; ++r) a[r][u] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * K + k + 16 * u), wf, a[r][u]);
    }
  }
  for (; k + 16 <= K; k += 16) {
    __m512 wf = ld16(w + k);
    for (int r = 0; r < RB; ++r) a[r][0] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * K + k), wf, a[r][0]);
  }
  for (int r = 0; r < RB; ++r) {
    for (int u = 1; u < U; ++u) a[r][0] = _mm512_add_ps(a[r][0], a[r][u]);
    out[r] = _mm512_reduce_add_ps(a[r][0]);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 a[RB][U];
  for (int r = 0; r < RB; ++r) for (int u = 0; u < U; ++u) a[r][u] = _mm256_setzero_ps();
  for (; k + 8 * U <= K; k += 8 * U) {
    for (int u = 0; u < U; ++u) {
      __m256 wf = ld8(w + k + 8 * u);
      for (int r = 0; r < RB; ++r) a[r][u] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k + 8 * u), wf, a[r][u]);
    }
  }
  for (; k + 8 <= K; k += 8) {
    __m256 wf = ld8(w + k);
    for (int r = 0; r < RB; ++r) a[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k), wf, a[r][0]);
  }
  for (int r = 0; r < RB; ++r) {
    for (int u = 1; u < U; ++u) a[r][0] = _mm256_add_ps(a[r][0], a[r][u]);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a[r][0]), _mm256_extractf128_ps(a[r][0], 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    out[r] = _mm_cvtss_f32(s);
  }
#else
  for (int r = 0; r < RB; ++r) out[r] = 0.f;
#endif
  for (int r = 0; r < RB; ++r)
    for (int64_t j = k; j < K; ++j) out[r] += x[r * K + j] * to_f(w[j]);
}

// Output rows [n0, n1) of y [R, N] for RB rows of x: y[r, n] = dot(x[r], w[n]) (* s[n] when s is given)
template <int RB, typename T>
static void rows_w(const float* x, int64_t K, const T* w, const float* s, float* y, int64_t N, int64_t n0, int64_t n1) {
  float acc[RB];
  for (int64_t n = n0; n < n1; ++n) {
    dot_w<RB>(x, K, w + n * K, acc);
    for (int r = 0; r < RB; ++r) y[r * N + n] = s ? acc[r] * s[n] : acc[r];
  }
}

// y fp32 [R, N] = x fp32 [R, K] against weight rows w [N, K] of type T (scaled by s [N] if given), output rows split
// over torch's threads; blocks of 4 rows of x share each widened weight vector
template <typename T>
static torch::Tensor gemv_rows(const torch::Tensor& x, const T* wp, const float* sp, int64_t N, int64_t weight_bytes,
                               int64_t min_bytes) {
  const int64_t R = x.size(0), K = x.size(1);
  auto y = torch::empty({R, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, grain_for(N, weight_bytes, min_bytes), [&](int64_t n0, int64_t n1) {
    int64_t r = 0;
    for (; r + 4 <= R; r += 4) rows_w<4>(xp + r * K, K, wp, sp, yp + r * N, N, n0, n1);
    for (; r + 2 <= R; r += 2) rows_w<2>(xp + r * K, K, wp, sp, yp + r * N, N, n0, n1);
    for (; r < R; ++r) rows_w<1>(xp + r * K, K, wp, sp, yp + r * N, N, n0, n1);
  });
  return y;
}

// x fp32 [R, K], w int8 [N, K], s fp32 [N] -> y fp32 [R, N]
torch::Tensor int8_gemv(torch::Tensor x, torch::Tensor w, torch::Tensor s, int64_t min_bytes) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && w.dtype() == torch::kInt8 && s.dtype() == torch::kFloat32);
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && s.is_contiguous() && x.size(1) == w.size(1));
  return gemv_rows(x, w.data_ptr<int8_t>(), s.data_ptr<float>(), w.size(0), w.numel(), min_bytes);
}

// INT4: w uint8 [N, G*16], group g of row n holds inputs g*32+j in the low nibble of byte j and g*32+16+j
// in the high nibble (j < 16), stored as q+8 for q in [-8, 7]; s fp32 [N, G]; x fp32 [R, G*32] (zero-padded)
template <int RB>
static void rows_i4(const float* x, int64_t G, const uint8_t* w, const float* s, float* y, int64_t N,
                    int64_t n0, int64_t n1) {
  const int64_t K = G * 32;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * G * 16;
    const float* sr = s + n * G;
#if defined(__AVX512F__)
    __m512 a[RB];
    for (int r = 0; r < RB; ++r) a[r] = _mm512_setzero_ps();
    // nibble -> float by a 16-entry table lookup (one permute instead of subtract + convert)
    const __m512 lut = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t g = 0; g < G; ++g) {
      __m512i b32 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(wr + g * 16)));
      __m512 lo = _mm512_permutexvar_ps(b32, lut);  // uses the index's low 4 bits: the low nibble
      __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(b32, 4), lut);
      __m512 sc = _mm512_set1_ps(sr[g]);
      for (int r = 0; r < RB; ++r) {
        const float* xr = x + r * K + g * 32;
        __m512 t = _mm512_mul_ps(_mm512_loadu_ps(xr), lo);
        t = _mm512_fmadd_ps(_mm512_loadu_ps(xr + 16), hi, t);
        a[r] = _mm512_fmadd_ps(t, sc, a[r]);
      }
    }
    for (int r = 0; r < RB; ++r) y[r * N + n] = _mm512_reduce_add_ps(a[r]);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 a[RB];
    for (int r = 0; r < RB; ++r) a[r] = _mm256_setzero_ps();
    const __m128i m = _mm_set1_epi8(0x0F);
    const __m256i eight = _mm256_set1_epi32(8);
    for (int64_t g = 0; g < G; ++g) {
      __m128i b = _mm_loadu_si128((const __m128i*)(wr + g * 16));
      __m128i l = _mm_and_si128(b, m), h = _mm_and_si128(_mm_srli_epi16(b, 4), m);
      __m256 w0 = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(l), eight));
      __m256 w1 = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(l, 8)), eight));
      __m256 w2 = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(h), eight));
      __m256 w3 = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(h, 8)), eight));
      __m256 sc = _mm256_set1_ps(sr[g]);
      for (int r = 0; r < RB; ++r) {
        const float* xr = x + r * K + g * 32;
        __m256 t = _mm256_mul_ps(_mm256_loadu_ps(xr), w0);
        t = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8), w1, t);
        t = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 16), w2, t);
        t = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 24), w3, t);
        a[r] = _mm256_fmadd_ps(t, sc, a[r]);
      }
    }
    for (int r = 0; r < RB; ++r) {
      __m128 t = _mm_add_ps(_mm256_castps256_ps128(a[r]), _mm256_extractf128_ps(a[r], 1));
      t = _mm_add_ps(t, _mm_movehl_ps(t, t));
      t = _mm_add_ss(t, _mm_movehdup_ps(t));
      y[r * N + n] = _mm_cvtss_f32(t);
    }
#else
    for (int r = 0; r < RB; ++r) {
      const float* xr = x + r * K;
      float acc = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        float t = 0.f;
        for (int j = 0; j < 16; ++j) {
          uint8_t b = wr[g * 16 + j];
          t += xr[g * 32 + j] * (float)((int)(b & 15) - 8) + xr[g * 32 + 16 + j] * (float)((int)(b >> 4) - 8);
        }
        acc += t * sr[g];
      }
      y[r * N + n] = acc;
    }
#endif
  }
}

torch::Tensor int4_gemv(torch::Tensor x, torch::Tensor w, torch::Tensor s, int64_t min_bytes) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && w.dtype() == torch::kUInt8 && s.dtype() == torch::kFloat32);
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && s.is_contiguous());
  const int64_t R = x.size(0), N = w.size(0), G = s.size(1);
  TORCH_CHECK(x.size(1) == G * 32 && w.size(1) == G * 16);
  auto y = torch::empty({R, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* sp = s.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t K = G * 32;
  at::parallel_for(0, N, grain_for(N, w.numel(), min_bytes), [&](int64_t n0, int64_t n1) {
    int64_t r = 0;
    for (; r + 4 <= R; r += 4) rows_i4<4>(xp + r * K, G, wp, sp, yp + r * N, N, n0, n1);
    for (; r < R; ++r) rows_i4<1>(xp + r * K, G, wp, sp, yp + r * N, N, n0, n1);
  });
  return y;
}

// x fp32 [R, K], w fp32 or bf16 [N, K] -> y fp32 [R, N]
torch::Tensor dense_gemv(torch::Tensor x, torch::Tensor w, int64_t min_bytes) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && (w.dtype() == torch::kFloat32 || w.dtype() == torch::kBFloat16));
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && x.size(1) == w.size(1));
  const int64_t bytes = w.numel() * w.element_size();
  if (w.dtype() == torch::kFloat32) return gemv_rows(x, w.data_ptr<float>(), nullptr, w.size(0), bytes, min_bytes);
  return gemv_rows(x, reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), nullptr, w.size(0), bytes, min_bytes);
}

std::string isa() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#else
  return "scalar";
#endif
}
"""

_load_error: str | None = None
_OPS: tuple | None = None  # the custom ops, once load() succeeded


@functools.lru_cache(maxsize=1)
def load():
    """The compiled kernels (a module with int8_gemv, int4_gemv, dense_gemv, isa), or None with `load_error()` set."""
    global _load_error, _OPS
    if os.environ.get("INFERSWEEP_NO_CPP_KERNELS"):
        _load_error = "INFERSWEEP_NO_CPP_KERNELS is set"
        return None
    try:
        from torch.utils.cpp_extension import load_inline

        # the source's hash names the build, so an edited kernel never reuses a stale cached .so
        name = "infersweep_woq_" + hashlib.sha256(_CPP.encode()).hexdigest()[:10]
        mod = load_inline(
            name=name, cpp_sources=[_CPP], functions=["int8_gemv", "int4_gemv", "dense_gemv", "isa"],
            # -fopenmp makes at::parallel_for's pragma real; libgomp.so.1 is torch's own, already loaded
            extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-lgomp"], verbose=False,
        )
        _OPS = _register_ops(mod)
        return mod
    except Exception as e:  # no compiler / headers / unsupported platform: the torch path stands in
        _load_error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else e}"
        return None


def _register_ops(mod) -> tuple:
    """The kernels as torch custom ops (torch.ops.infersweep.*), so that torch.compile (engine.compile_mode=
    static, fullgraph) traces through them; eager calls go straight to the extension (no dispatcher cost)."""

    @torch.library.custom_op("infersweep::int8_gemv", mutates_args=())
    def int8_op(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, min_bytes: int) -> torch.Tensor:
        return mod.int8_gemv(x, w, s, min_bytes)

    @torch.library.custom_op("infersweep::int4_gemv", mutates_args=())
    def int4_op(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, min_bytes: int) -> torch.Tensor:
        return mod.int4_gemv(x, w, s, min_bytes)

    @torch.library.custom_op("infersweep::dense_gemv", mutates_args=())
    def dense_op(x: torch.Tensor, w: torch.Tensor, min_bytes: int) -> torch.Tensor:
        return mod.dense_gemv(x, w, min_bytes)

    for op in (int8_op, int4_op):
        op.register_fake(lambda x, w, s, min_bytes: x.new_empty((x.shape[0], w.shape[0])))
    dense_op.register_fake(lambda x, w, min_bytes: x.new_empty((x.shape[0], w.shape[0])))
    return int8_op, int4_op, dense_op


def _entry(i: int, device: torch.device):
    """Kernel i (0: int8, 1: int4, 2: dense fp32/bf16) for a tensor on `device`, or None (then the torch path runs). While
    torch.compile traces, only module globals are read (it cannot trace the loader) and the custom op is used."""
    if device.type != "cpu":
        return None
    if torch.compiler.is_compiling():
        return None if _OPS is None else _OPS[i]
    mod = load()
    return None if mod is None else (mod.int8_gemv, mod.int4_gemv, mod.dense_gemv)[i]


def load_error() -> str | None:
    load()
    return _load_error


def isa() -> str:
    """Which code path the compiled kernels took on this CPU, or why there are none."""
    mod = load()
    return mod.isa() if mod is not None else f"torch fallback ({_load_error})"


def int8_gemv(x2: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x2 [rows, in] (any float dtype) @ (q int8 [out, in] * scales [out])^T -> [rows, out] in x2's dtype."""
    fn = _entry(0, x2.device)
    if fn is None:
        return F.linear(x2, q.to(x2.dtype)) * scales.to(x2.dtype)
    return fn(x2.float().contiguous(), q, scales, MIN_BYTES_PER_THREAD).to(x2.dtype)


def quantize_int4(w: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT4 per group of `group` inputs: w [out, in] -> (packed uint8 [out, G*16], fp32 scales [out, G]),
    G = ceil(in / group); the inputs are zero-padded to G*group. As llama.cpp's Q4_0: the scale is the group's
    largest-magnitude weight / -8, so that weight lands exactly on -8 and all 16 levels are used (absmax / 7
    leaves -8 unused). Layout: see the C++ source above."""
    if group != 32:
        raise ValueError("the INT4 kernel's layout is fixed at groups of 32 inputs")
    w = w.detach().float()
    out, k = w.shape
    g = -(-k // group)
    wp = F.pad(w, (0, g * group - k)).reshape(out, g, group)
    peak = wp.gather(2, wp.abs().argmax(dim=2, keepdim=True)).squeeze(2)  # signed
    scales = torch.where(peak == 0, torch.full_like(peak, 1e-8), peak / -8.0)
    q = torch.clamp(torch.round(wp / scales[..., None]), -8, 7).to(torch.int32) + 8  # [out, G, 32] in 0..15
    packed = (q[..., :16] | (q[..., 16:] << 4)).to(torch.uint8).reshape(out, g * 16)
    return packed.contiguous(), scales.contiguous()


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, in_features: int) -> torch.Tensor:
    """The float32 weight [out, in] the INT4 kernel multiplies by (the reference for tests and the fallback)."""
    out, g = scales.shape
    b = packed.reshape(out, g, 16).to(torch.int32)
    q = torch.cat([b & 15, b >> 4], dim=2).float() - 8.0  # [out, G, 32]
    return (q * scales[..., None]).reshape(out, g * 32)[:, :in_features]


def int4_gemv(x2: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, in_features: int) -> torch.Tensor:
    """x2 [rows, in] @ dequantize_int4(...)^T -> [rows, out] in x2's dtype."""
    fn = _entry(1, x2.device)
    if fn is None:
        return F.linear(x2, dequantize_int4(packed, scales, in_features).to(x2.dtype))
    xf = x2.float()
    pad = scales.shape[1] * 32 - in_features
    if pad:
        xf = F.pad(xf, (0, pad))
    return fn(xf.contiguous(), packed, scales, MIN_BYTES_PER_THREAD).to(x2.dtype)


def dense_gemv(x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x2 [rows, in] @ w^T for a full-precision weight w [out, in] (fp32 or bf16; others take F.linear) -> [rows, out]
    in x2's dtype. Accumulates in fp32 (as torch's CPU bf16 GEMM does), rounds once at the end."""
    fn = _entry(2, x2.device) if w.dtype in (torch.float32, torch.bfloat16) else None
    if fn is None:
        return F.linear(x2, w)
    return fn(x2.float().contiguous(), w.contiguous(), MIN_BYTES_PER_THREAD).to(x2.dtype)
