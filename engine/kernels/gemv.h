// The GEMV row kernels of engine/quant_kernels.py (called from Python through gemv.cpp) and of the native engine's
// C++ decode step (engine/engines/native/csrc/decode_step.cpp): one definition, included by both.
//
// Every kernel computes output rows [n0, n1) of y [R, N] for R activation rows; the caller splits the rows over
// threads (an OpenMP region of its own). No torch, no allocation. The ISA is chosen at compile time by the flags the
// builder passes (engine/quant_kernels.py: -mavx512f ... or -mavx2 -mfma, from the CPU's flags at run time, never
// -march=native), with a plain C++ loop otherwise.
//
// Weight layouts (the Python modules' buffers, engine/quant.py):
//   dense   fp32 or bf16 (uint16, widened to fp32 by a 16-bit shift: exact, no bf16 arithmetic needed) [N, K]
//   int8    int8 [N, K] with an fp32 scale per output row [N]; activations fp32 (weight-only) or int8 (W8A8)
//   int4    uint8 [N, G*16]: group g of row n holds inputs g*32+j in the low nibble of byte j and g*32+16+j in the
//           high nibble (j < 16), stored as q+8 for q in [-8, 7]; an fp32 scale per group [N, G]; activations fp32
//           zero-padded to G*32 (weight-only) or int8 per block of 32 with an fp32 scale per block (Q4_0 x Q8_0)
#pragma once
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#ifdef INFERSWEEP_FORCE_COMPILE_ERROR
#error "INFERSWEEP_FORCE_COMPILE_ERROR is defined (the builder's test of its fallback path)"
#endif

namespace isw {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define ISW_AVX512 1
#endif
#if defined(ISW_AVX512) && defined(__AVX512VNNI__)
#define ISW_VNNI 1
#endif
#if !defined(ISW_AVX512) && defined(__AVX2__) && defined(__FMA__)
#define ISW_AVX2 1
#endif

inline const char* isa_name() {
#if defined(ISW_VNNI)
  return "avx512-vnni";
#elif defined(ISW_AVX512)
  return "avx512";
#elif defined(ISW_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

// ---- scalar helpers -------------------------------------------------------------------------------------------
static inline float bf16_to_f(uint16_t v) { uint32_t u = (uint32_t)v << 16; float f; std::memcpy(&f, &u, 4); return f; }
// fp32 -> the nearest bf16 (ties to even), as torch's .to(torch.bfloat16); NaN stays NaN
static inline uint16_t f_to_bf16(float f) {
  uint32_t u; std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
static inline float round_bf16(float f) { return bf16_to_f(f_to_bf16(f)); }
static inline float to_f(float v) { return v; }
static inline float to_f(int8_t v) { return (float)v; }
static inline float to_f(uint16_t v) { return bf16_to_f(v); }

#if defined(ISW_AVX512)
static inline __m512 ld16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 ld16(const int8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p))); }
static inline __m512 ld16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
#elif defined(ISW_AVX2)
static inline __m256 ld8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 ld8(const int8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p))); }
static inline __m256 ld8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
#endif

#if defined(ISW_AVX512) || defined(ISW_AVX2)
static inline float hsum8(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
static inline int hsum8i(__m256i a) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}
#endif

// ---- float activations x weights of type T (fp32, bf16, int8 weight-only) -------------------------------------
// RB rows of x against one weight row: out[r] = sum_k x[r*K + k] * w[k]. U independent accumulators per row keep
// the FMA latency chain from bounding a single row (RB * U = 4 chains in flight)
template <int RB, typename T>
static inline void dot_w(const float* x, int64_t K, const T* w, float* out) {
  constexpr int U = RB >= 4 ? 1 : 4 / RB;
  int64_t k = 0;
#if defined(ISW_AVX512)
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
#elif defined(ISW_AVX2)
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
    out[r] = hsum8(a[r][0]);
  }
#else
  for (int r = 0; r < RB; ++r) out[r] = 0.f;
#endif
  for (int r = 0; r < RB; ++r)
    for (int64_t j = k; j < K; ++j) out[r] += x[r * K + j] * to_f(w[j]);
}

template <int RB, typename T>
static inline void rows_w_rb(const float* x, int64_t K, const T* w, const float* s, float* y, int64_t ys,
                             int64_t n0, int64_t n1) {
  float acc[RB];
  for (int64_t n = n0; n < n1; ++n) {
    dot_w<RB>(x, K, w + n * K, acc);
    for (int r = 0; r < RB; ++r) y[r * ys + n] = s ? acc[r] * s[n] : acc[r];
  }
}

#if defined(ISW_AVX512)
// 4 rows of x against 4 weight rows [n, n + 4): 16 accumulators (named: held in an array, GCC spills them), each
// loaded vector used 4 times -- at batch >= 4 the FMAs, not the loads, bound it. Per (row, weight row) the same
// one-accumulator sum as dot_w<4> and the same tail: bit-identical to rows_w_rb<4>.
template <typename T>
static inline void w_tile44(const float* x, int64_t K, const T* w, const float* s, float* y, int64_t ys, int64_t n) {
  __m512 a00 = _mm512_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00, a13 = a00;
  __m512 a20 = a00, a21 = a00, a22 = a00, a23 = a00, a30 = a00, a31 = a00, a32 = a00, a33 = a00;
  const T *w0 = w + n * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
  const float *x0 = x, *x1 = x + K, *x2 = x1 + K, *x3 = x2 + K;
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m512 v0 = ld16(w0 + k), v1 = ld16(w1 + k), v2 = ld16(w2 + k), v3 = ld16(w3 + k);
    __m512 u = _mm512_loadu_ps(x0 + k);
    a00 = _mm512_fmadd_ps(u, v0, a00); a01 = _mm512_fmadd_ps(u, v1, a01);
    a02 = _mm512_fmadd_ps(u, v2, a02); a03 = _mm512_fmadd_ps(u, v3, a03);
    u = _mm512_loadu_ps(x1 + k);
    a10 = _mm512_fmadd_ps(u, v0, a10); a11 = _mm512_fmadd_ps(u, v1, a11);
    a12 = _mm512_fmadd_ps(u, v2, a12); a13 = _mm512_fmadd_ps(u, v3, a13);
    u = _mm512_loadu_ps(x2 + k);
    a20 = _mm512_fmadd_ps(u, v0, a20); a21 = _mm512_fmadd_ps(u, v1, a21);
    a22 = _mm512_fmadd_ps(u, v2, a22); a23 = _mm512_fmadd_ps(u, v3, a23);
    u = _mm512_loadu_ps(x3 + k);
    a30 = _mm512_fmadd_ps(u, v0, a30); a31 = _mm512_fmadd_ps(u, v1, a31);
    a32 = _mm512_fmadd_ps(u, v2, a32); a33 = _mm512_fmadd_ps(u, v3, a33);
  }
  const __m512 acc[4][4] = {{a00, a01, a02, a03}, {a10, a11, a12, a13}, {a20, a21, a22, a23}, {a30, a31, a32, a33}};
  const T* ws[4] = {w0, w1, w2, w3};
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 4; ++j) {
      float o = _mm512_reduce_add_ps(acc[i][j]);
      for (int64_t t = k; t < K; ++t) o += x[i * K + t] * to_f(ws[j][t]);
      y[i * ys + n + j] = s ? o * s[n + j] : o;
    }
}
#endif

// y[r, n] (row stride ys) = dot(x[r], w[n]) (* s[n] when s is given), n in [n0, n1), r < R; blocks of 4 rows of x
// share each widened weight vector (AVX-512: 4 x 4 tiles, 4 weight rows at a time)
template <typename T>
static inline void rows_w(const float* x, int64_t R, int64_t K, const T* w, const float* s, float* y, int64_t ys,
                          int64_t n0, int64_t n1) {
  int64_t r = 0;
#if defined(ISW_AVX512)
  const int64_t n4 = n0 + (n1 - n0) / 4 * 4, r4 = R / 4 * 4;
  for (int64_t n = n0; n < n4; n += 4)  // weight tiles outside: each read from memory once, used by every row block
    for (int64_t rr = 0; rr < r4; rr += 4) w_tile44(x + rr * K, K, w, s, y + rr * ys, ys, n);
  for (; r < r4; r += 4) rows_w_rb<4>(x + r * K, K, w, s, y + r * ys, ys, n4, n1);
#endif
  for (; r + 4 <= R; r += 4) rows_w_rb<4>(x + r * K, K, w, s, y + r * ys, ys, n0, n1);
  for (; r + 2 <= R; r += 2) rows_w_rb<2>(x + r * K, K, w, s, y + r * ys, ys, n0, n1);
  for (; r < R; ++r) rows_w_rb<1>(x + r * K, K, w, s, y + r * ys, ys, n0, n1);
}

#if defined(ISW_AVX512)
// ---- many rows (a prompt's): outer products over transposed activations -------------------------------------
// At R >= OUTER_ROWS rows the GEMM is compute-bound, and the dot-product tiles above pay a horizontal sum per output
// and stream the activations from L2 for every 4 weight rows. Here the activations are transposed once into panels of
// 64 rows, xt [Rp / 64][K][64] (Rp = R rounded up to 64, zero-padded; a panel is read front to back), and a tile of NB weight rows x 64 rows accumulates y's columns in 24
// registers: per k, 4 activation vectors and NB broadcast weights, 4 * NB FMAs, no reduction. Measured on a 2-core
// Xeon (AVX-512), R 512 x K 576 x N 1536 fp32: ~258 GFLOP/s, torch's MKL sgemm ~255, the 4 x 4 dot tiles ~150.
// Sums run in k order: not bit-identical to the GEMVs (used only by the C++ step's multi-row steps).
constexpr int64_t OUTER_ROWS = 64;

inline void transpose_rows(const float* x, int64_t R, int64_t K, int64_t xs, float* xt, int64_t Rp) {
  const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_epi32((int)xs));
  for (int64_t r0 = 0; r0 < Rp; r0 += 16) {  // 16 rows' element k in one gather (rows past R: zeros)
    const __mmask16 live = R - r0 >= 16 ? (__mmask16)0xFFFF : R > r0 ? (__mmask16)((1u << (R - r0)) - 1) : (__mmask16)0;
    float* panel = xt + (r0 / 64) * K * 64 + r0 % 64;
    for (int64_t k = 0; k < K; ++k)
      _mm512_storeu_ps(panel + k * 64, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, idx, x + r0 * xs + k, 4));
  }
}

template <int NB, typename T>
static inline void outer_tile(const float* xt, int64_t Rp, int64_t K, const T* w, int64_t n, int64_t r, float* acc_out) {
  __m512 acc[NB][4];
  for (int i = 0; i < NB; ++i)
    for (int v = 0; v < 4; ++v) acc[i][v] = _mm512_setzero_ps();
  const T* wr[NB];
  for (int i = 0; i < NB; ++i) wr[i] = w + (n + i) * K;
  const float* xp = xt + (r / 64) * K * 64;  // the panel of rows [r, r + 64)
  for (int64_t k = 0; k < K; ++k, xp += 64) {
    const __m512 x0 = _mm512_loadu_ps(xp), x1 = _mm512_loadu_ps(xp + 16), x2 = _mm512_loadu_ps(xp + 32),
                 x3 = _mm512_loadu_ps(xp + 48);
    for (int i = 0; i < NB; ++i) {
      const __m512 b = _mm512_set1_ps(to_f(wr[i][k]));
      acc[i][0] = _mm512_fmadd_ps(b, x0, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(b, x1, acc[i][1]);
      acc[i][2] = _mm512_fmadd_ps(b, x2, acc[i][2]);
      acc[i][3] = _mm512_fmadd_ps(b, x3, acc[i][3]);
    }
  }
  for (int i = 0; i < NB; ++i)
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(acc_out + i * 64 + 16 * v, acc[i][v]);
}

// y[r, n] (row stride ys) = dot(x[r], w[n]) (* s[n]), n in [n0, n1), r < R, from xt (transpose_rows)
template <typename T>
static inline void rows_w_outer(const float* xt, int64_t R, int64_t Rp, int64_t K, const T* w, const float* s,
                                float* y, int64_t ys, int64_t n0, int64_t n1) {
  alignas(64) float tile[6 * 64];
  for (int64_t rb = 0; rb < Rp; rb += 128)  // 128 rows of xt (K x 512 B) stay in L2 across the weight tiles
    for (int64_t n = n0; n < n1; n += 6) {
      const int nb = (int)std::min<int64_t>(6, n1 - n);
      for (int64_t r = rb; r < std::min(Rp, rb + 128); r += 64) {
        switch (nb) {
          case 6: outer_tile<6>(xt, Rp, K, w, n, r, tile); break;
          case 5: outer_tile<5>(xt, Rp, K, w, n, r, tile); break;
          case 4: outer_tile<4>(xt, Rp, K, w, n, r, tile); break;
          case 3: outer_tile<3>(xt, Rp, K, w, n, r, tile); break;
          case 2: outer_tile<2>(xt, Rp, K, w, n, r, tile); break;
          default: outer_tile<1>(xt, Rp, K, w, n, r, tile); break;
        }
        const int64_t re = std::min(R, r + 64);
        for (int i = 0; i < nb; ++i) {
          const float sc = s ? s[n + i] : 1.f;
          for (int64_t rr = r; rr < re; ++rr) y[rr * ys + n + i] = s ? tile[i * 64 + rr - r] * sc : tile[i * 64 + rr - r];
        }
      }
    }
}
#endif

// ---- INT4 weights x float activations (weight-only) ---------------------------------------------------------
template <int RB>
static inline void rows_i4_rb(const float* x, int64_t G, const uint8_t* w, const float* s, float* y, int64_t ys,
                              int64_t n0, int64_t n1) {
  const int64_t K = G * 32;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * G * 16;
    const float* sr = s + n * G;
#if defined(ISW_AVX512)
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
    for (int r = 0; r < RB; ++r) y[r * ys + n] = _mm512_reduce_add_ps(a[r]);
#elif defined(ISW_AVX2)
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
    for (int r = 0; r < RB; ++r) y[r * ys + n] = hsum8(a[r]);
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
      y[r * ys + n] = acc;
    }
#endif
  }
}

// x fp32 [R, G*32] (zero-padded inputs), w/s the INT4 layout -> y[r, n] for n in [n0, n1)
static inline void rows_i4(const float* x, int64_t R, int64_t G, const uint8_t* w, const float* s, float* y,
                           int64_t ys, int64_t n0, int64_t n1) {
  const int64_t K = G * 32;
  int64_t r = 0;
  for (; r + 4 <= R; r += 4) rows_i4_rb<4>(x + r * K, G, w, s, y + r * ys, ys, n0, n1);
  for (; r < R; ++r) rows_i4_rb<1>(x + r * K, G, w, s, y + r * ys, ys, n0, n1);
}

// ---- integer activations ----------------------------------------------------------------------------------------
// W8A8 (quant=int8-dynamic): one row x fp32 [K] -> int8 [K] with one scale, as the torch path computes it:
// scale = max|x| / 127 (at least 1e-8 / 127), q = round-half-even(x / scale) clamped to [-127, 127]
static inline float quantize_row_i8(const float* x, int64_t K, int8_t* q) {
  float amax = 0.f;
  for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(x[k]));
  const float sc = std::max(amax, 1e-8f) / 127.0f;
  for (int64_t k = 0; k < K; ++k) {
    float v = std::nearbyint(x[k] / sc);
    q[k] = (int8_t)std::min(127.f, std::max(-127.f, v));
  }
  return sc;
}

// Q8_0 (int4-weight's integer path): x fp32 [G*32] -> int8 [G*32] with a scale per block of 32 inputs (llama.cpp's
// Q8_0: max|x| / 127, round-half-even(x / scale)) and each block's sum of q (the INT4 kernel's -8 offset)
static inline void quantize_row_q8_0(const float* x, int64_t G, int8_t* q, float* scales, int32_t* sums) {
  for (int64_t g = 0; g < G; ++g) {
    const float* xb = x + g * 32;
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float sc = amax / 127.0f;
    const float inv = sc > 0.f ? 1.0f / sc : 0.f;
    int32_t sum = 0;
    for (int j = 0; j < 32; ++j) {
      int v = sc > 0.f ? (int)std::nearbyint(xb[j] * inv) : 0;
      v = std::min(127, std::max(-127, v));
      q[g * 32 + j] = (int8_t)v;
      sum += v;
    }
    scales[g] = sc;
    sums[g] = sum;
  }
}

// int8 dot product of n bytes: sum_k a[k] * b[k] (a, b signed int8 in [-127, 127])
static inline int32_t dot_i8(const int8_t* a, const int8_t* b, int64_t n) {
  int64_t k = 0;
  int32_t out = 0;
#if defined(ISW_VNNI)
  // vpdpbusd multiplies unsigned by signed bytes: |a| as the unsigned side, b negated where a < 0
  __m512i acc = _mm512_setzero_si512();
  for (; k + 64 <= n; k += 64) {
    __m512i va = _mm512_loadu_si512(a + k), vb = _mm512_loadu_si512(b + k);
    __mmask64 neg = _mm512_movepi8_mask(va);
    vb = _mm512_mask_sub_epi8(vb, neg, _mm512_setzero_si512(), vb);
    acc = _mm512_dpbusd_epi32(acc, _mm512_abs_epi8(va), vb);
  }
  if (k < n) {
    __mmask64 m = (n - k) >= 64 ? ~0ULL : ((1ULL << (n - k)) - 1);
    __m512i va = _mm512_maskz_loadu_epi8(m, a + k), vb = _mm512_maskz_loadu_epi8(m, b + k);
    __mmask64 neg = _mm512_movepi8_mask(va);
    vb = _mm512_mask_sub_epi8(vb, neg, _mm512_setzero_si512(), vb);
    acc = _mm512_dpbusd_epi32(acc, _mm512_abs_epi8(va), vb);
    k = n;
  }
  out = _mm512_reduce_add_epi32(acc);
#elif defined(ISW_AVX512)
  __m512i acc = _mm512_setzero_si512();
  const __m512i ones = _mm512_set1_epi16(1);
  for (; k + 64 <= n; k += 64) {
    __m512i va = _mm512_loadu_si512(a + k), vb = _mm512_loadu_si512(b + k);
    __mmask64 neg = _mm512_movepi8_mask(va);
    vb = _mm512_mask_sub_epi8(vb, neg, _mm512_setzero_si512(), vb);
    acc = _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(va), vb), ones));
  }
  out = _mm512_reduce_add_epi32(acc);
#elif defined(ISW_AVX2)
  // vpmaddubsw: |a| (unsigned) x sign(b, a); a pair sums to at most 2 * 127 * 127 < 32767, so no saturation
  __m256i acc = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  for (; k + 32 <= n; k += 32) {
    __m256i va = _mm256_loadu_si256((const __m256i*)(a + k)), vb = _mm256_loadu_si256((const __m256i*)(b + k));
    __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(va, va), _mm256_sign_epi8(vb, va));
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, ones));
  }
  out = hsum8i(acc);
#endif
  for (; k < n; ++k) out += (int32_t)a[k] * (int32_t)b[k];
  return out;
}

// W8A8: xq int8 [R, K] with per-row scales xs [R], w int8 [N, K] with per-row scales ws [N]:
// y[r, n] = (float)(xq[r] . w[n]) * xs[r] * ws[n]  (the torch path's order: acc * xs, then * ws)
static inline void rows_w8a8(const int8_t* xq, const float* xs, int64_t R, int64_t K, const int8_t* w,
                             const float* ws, float* y, int64_t ys, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t r = 0; r < R; ++r) y[r * ys + n] = (float)dot_i8(xq + r * K, w + n * K, K) * xs[r] * ws[n];
}

#if defined(ISW_VNNI)
// W8A8 for many rows (prefill, task scoring): the activations offset to unsigned once (u = x + 128, so vpdpbusd
// multiplies them by the signed weights directly: sum u.w = sum x.w + 128 sum w), then 4 rows x 4 weight rows per
// tile, 16 accumulators, each loaded vector used 4 times. The same integers as dot_i8, the same float scaling: the
// result is bit-identical to rows_w8a8. xu: [R, K] the offset activations.
// The 4 x 4 tile with its 16 accumulators as named variables: held in an array, GCC stores each one to the stack
// after every vpdpbusd (2x slower)
static inline void w8a8_tile44(const uint8_t* xu, const float* xs, int64_t K, const int8_t* w, const float* ws,
                               float* y, int64_t ys, int64_t r0, int64_t n0) {
  const __m512i ones = _mm512_set1_epi8(1);
  __m512i s0 = _mm512_setzero_si512(), s1 = s0, s2 = s0, s3 = s0;
  __m512i a00 = s0, a01 = s0, a02 = s0, a03 = s0, a10 = s0, a11 = s0, a12 = s0, a13 = s0;
  __m512i a20 = s0, a21 = s0, a22 = s0, a23 = s0, a30 = s0, a31 = s0, a32 = s0, a33 = s0;
  const int8_t *w0 = w + n0 * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
  const uint8_t *x0 = xu + r0 * K, *x1 = x0 + K, *x2 = x1 + K, *x3 = x2 + K;
  for (int64_t k = 0; k < K; k += 64) {
    const __mmask64 m = (K - k) >= 64 ? ~0ULL : ((1ULL << (K - k)) - 1);
    const __m512i v0 = _mm512_maskz_loadu_epi8(m, w0 + k), v1 = _mm512_maskz_loadu_epi8(m, w1 + k);
    const __m512i v2 = _mm512_maskz_loadu_epi8(m, w2 + k), v3 = _mm512_maskz_loadu_epi8(m, w3 + k);
    s0 = _mm512_dpbusd_epi32(s0, ones, v0); s1 = _mm512_dpbusd_epi32(s1, ones, v1);
    s2 = _mm512_dpbusd_epi32(s2, ones, v2); s3 = _mm512_dpbusd_epi32(s3, ones, v3);
    __m512i u = _mm512_maskz_loadu_epi8(m, x0 + k);
    a00 = _mm512_dpbusd_epi32(a00, u, v0); a01 = _mm512_dpbusd_epi32(a01, u, v1);
    a02 = _mm512_dpbusd_epi32(a02, u, v2); a03 = _mm512_dpbusd_epi32(a03, u, v3);
    u = _mm512_maskz_loadu_epi8(m, x1 + k);
    a10 = _mm512_dpbusd_epi32(a10, u, v0); a11 = _mm512_dpbusd_epi32(a11, u, v1);
    a12 = _mm512_dpbusd_epi32(a12, u, v2); a13 = _mm512_dpbusd_epi32(a13, u, v3);
    u = _mm512_maskz_loadu_epi8(m, x2 + k);
    a20 = _mm512_dpbusd_epi32(a20, u, v0); a21 = _mm512_dpbusd_epi32(a21, u, v1);
    a22 = _mm512_dpbusd_epi32(a22, u, v2); a23 = _mm512_dpbusd_epi32(a23, u, v3);
    u = _mm512_maskz_loadu_epi8(m, x3 + k);
    a30 = _mm512_dpbusd_epi32(a30, u, v0); a31 = _mm512_dpbusd_epi32(a31, u, v1);
    a32 = _mm512_dpbusd_epi32(a32, u, v2); a33 = _mm512_dpbusd_epi32(a33, u, v3);
  }
  const int32_t o[4] = {128 * _mm512_reduce_add_epi32(s0), 128 * _mm512_reduce_add_epi32(s1),
                        128 * _mm512_reduce_add_epi32(s2), 128 * _mm512_reduce_add_epi32(s3)};
  const __m512i acc[4][4] = {{a00, a01, a02, a03}, {a10, a11, a12, a13}, {a20, a21, a22, a23}, {a30, a31, a32, a33}};
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 4; ++j)
      y[(r0 + i) * ys + n0 + j] = (float)(_mm512_reduce_add_epi32(acc[i][j]) - o[j]) * xs[r0 + i] * ws[n0 + j];
}

// Row counts from which W8A8 takes the tiled kernel (below it: one dot per row and weight row, as decode)
constexpr int64_t W8A8_TILED_ROWS = 4;

// The tiled kernel's unsigned operand: xu = xq + 128, n values
static inline void offset_u8(const int8_t* xq, int64_t n, uint8_t* xu) {
  for (int64_t i = 0; i < n; ++i) xu[i] = (uint8_t)(xq[i] + 128);
}

// The whole 4 x 4 tiles here; the rows and outputs left over (fewer than 4 of each) by rows_w8a8
static inline void rows_w8a8_tiled(const int8_t* xq, const uint8_t* xu, const float* xs, int64_t R, int64_t K,
                                   const int8_t* w, const float* ws, float* y, int64_t ys, int64_t n0, int64_t n1) {
  const int64_t r4 = R - R % 4, n4 = n0 + (n1 - n0) / 4 * 4;
  for (int64_t n = n0; n < n4; n += 4)
    for (int64_t r = 0; r < r4; r += 4) w8a8_tile44(xu, xs, K, w, ws, y, ys, r, n);
  rows_w8a8(xq, xs, r4, K, w, ws, y, ys, n4, n1);
  rows_w8a8(xq + r4 * K, xs + r4, R - r4, K, w, ws, y + r4 * ys, ys, n0, n1);
}
#endif

// INT4 x Q8_0 (llama.cpp's Q4_0 x Q8_0): per block of 32, an integer dot of the weight nibbles (stored as q+8) with
// the int8 activations, minus 8 * the block's activation sum (exact, in int32), times both blocks' scales
#if defined(ISW_AVX512) || defined(ISW_AVX2)
static inline __m256i q4_nibbles(const uint8_t* wb) {  // 16 bytes -> the 32 nibbles in input order, one per byte
  __m128i b = _mm_loadu_si128((const __m128i*)wb);
  const __m128i m = _mm_set1_epi8(0x0F);
  return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_and_si128(b, m)), _mm_and_si128(_mm_srli_epi16(b, 4), m), 1);
}
#endif

static inline void rows_w4a8(const int8_t* xq, const float* xs, const int32_t* xsum, int64_t R, int64_t G,
                             const uint8_t* w, const float* s, float* y, int64_t ys, int64_t n0, int64_t n1) {
  const int64_t K = G * 32;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * G * 16;
    const float* sr = s + n * G;
    for (int64_t r = 0; r < R; ++r) {
      const int8_t* xr = xq + r * K;
      const float* xsr = xs + r * G;
      const int32_t* xsumr = xsum + r * G;
#if defined(ISW_VNNI)
      // two blocks per 512-bit step: [nibbles lo g, hi g, lo g+1, hi g+1] . the 64 int8 activations; the -8 offset
      // comes out in float afterwards (8 * sum(x_b) * xs_b * ws_b, a dot over the blocks)
      __m512 acc16 = _mm512_setzero_ps();
      const __m512i idx = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
      const __m512i pick = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
      const __m256i m4 = _mm256_set1_epi8(0x0F);
      int64_t g = 0;
      for (; g + 2 <= G; g += 2) {
        __m256i b = _mm256_loadu_si256((const __m256i*)(wr + g * 16));
        __m512i lo = _mm512_castsi256_si512(_mm256_and_si256(b, m4));
        __m512i hi = _mm512_castsi256_si512(_mm256_and_si256(_mm256_srli_epi16(b, 4), m4));
        __m512i nib = _mm512_permutex2var_epi64(lo, idx, hi);
        __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), nib, _mm512_loadu_si512(xr + g * 32));
        __m128 sc2 = _mm_mul_ps(_mm_castsi128_ps(_mm_loadl_epi64((const __m128i*)(xsr + g))),
                                _mm_castsi128_ps(_mm_loadl_epi64((const __m128i*)(sr + g))));
        acc16 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_permutexvar_ps(pick, _mm512_castps128_ps512(sc2)), acc16);
      }
      float corr = 0.f;
      for (int64_t j = 0; j < g; ++j) corr += (float)(8 * xsumr[j]) * (xsr[j] * sr[j]);
      __m256 acc = _mm256_add_ps(_mm512_castps512_ps256(acc16), _mm512_extractf32x8_ps(acc16, 1));
      acc = _mm256_sub_ps(acc, _mm256_setr_ps(corr, 0, 0, 0, 0, 0, 0, 0));
      for (; g < G; ++g) {
        __m256i nibv = q4_nibbles(wr + g * 16);
        __m256i dv = _mm256_dpbusd_epi32(_mm256_set_epi32(0, 0, 0, 0, 0, 0, 0, -8 * xsumr[g]), nibv,
                                         _mm256_loadu_si256((const __m256i*)(xr + g * 32)));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dv), _mm256_set1_ps(xsr[g] * sr[g]), acc);
      }
      y[r * ys + n] = hsum8(acc);
#elif defined(ISW_AVX512) || defined(ISW_AVX2)
      __m256 acc = _mm256_setzero_ps();
      for (int64_t g = 0; g < G; ++g) {
        __m256i nib = q4_nibbles(wr + g * 16);
        __m256i xv = _mm256_loadu_si256((const __m256i*)(xr + g * 32));
        __m256i d = _mm256_set_epi32(0, 0, 0, 0, 0, 0, 0, -8 * xsumr[g]);  // the offset, in lane 0 of the integer sum
        // nibble (unsigned, <= 15) x int8: a pair sums to at most 2 * 15 * 127, no saturation
        d = _mm256_add_epi32(d, _mm256_madd_epi16(_mm256_maddubs_epi16(nib, xv), _mm256_set1_epi16(1)));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(xsr[g] * sr[g]), acc);
      }
      y[r * ys + n] = hsum8(acc);
#else
      float out = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        const uint8_t* wb = wr + g * 16;
        const int8_t* xb = xr + g * 32;
        int32_t t = -8 * xsumr[g];
        for (int j = 0; j < 16; ++j) t += (int32_t)(wb[j] & 15) * xb[j] + (int32_t)(wb[j] >> 4) * xb[16 + j];
        out += (float)t * (xsr[g] * sr[g]);
      }
      y[r * ys + n] = out;
#endif
    }
  }
}

}  // namespace isw
