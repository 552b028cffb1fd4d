// The GEMV kernels engine/quant_kernels.py calls (through ctypes) for the eager paths' decode-sized linears: each
// entry point splits the output rows over `threads` OpenMP threads (the runtime torch uses, so one thread pool) and
// runs the row kernels of gemv.h. Arguments are raw pointers to contiguous tensors the caller owns.
#include "gemv.h"
#include <omp.h>
#include <cstring>
#include <vector>

namespace {
// At least min_bytes of weight per thread: an OpenMP region costs a barrier, and on a loaded machine a descheduled
// thread stalls it for a whole time slice
int threads_for(int64_t weight_bytes, int64_t min_bytes, int threads) {
  int64_t t = std::min<int64_t>(threads, weight_bytes / std::max<int64_t>(1, min_bytes));
  return (int)std::max<int64_t>(1, t);
}

template <typename F>
void split_rows(int64_t N, int nt, F&& body) {
  if (nt <= 1) { body(0, N); return; }
#pragma omp parallel num_threads(nt)
  {
    const int t = omp_get_thread_num(), n = omp_get_num_threads();
    const int64_t chunk = (N + n - 1) / n;
    const int64_t n0 = std::min<int64_t>(N, t * chunk), n1 = std::min<int64_t>(N, n0 + chunk);
    if (n0 < n1) body(n0, n1);
  }
}
}  // namespace

extern "C" {

const char* isw_isa() { return isw::isa_name(); }

// y fp32 [R, N] = x fp32 [R, K] . w[N, K]^T (* s[N]); wtype 0 fp32, 1 bf16, 2 int8 (s required)
void isw_dense_gemv(const float* x, int64_t R, int64_t K, const void* w, int wtype, const float* s, float* y,
                    int64_t N, int64_t min_bytes, int threads) {
  const int64_t bytes = N * K * (wtype == 0 ? 4 : wtype == 1 ? 2 : 1);
  split_rows(N, threads_for(bytes, min_bytes, threads), [&](int64_t n0, int64_t n1) {
    if (wtype == 0) isw::rows_w(x, R, K, (const float*)w, s, y, N, n0, n1);
    else if (wtype == 1) isw::rows_w(x, R, K, (const uint16_t*)w, s, y, N, n0, n1);
    else isw::rows_w(x, R, K, (const int8_t*)w, s, y, N, n0, n1);
  });
}

// INT4 weight-only: x fp32 [R, G*32] (zero-padded), w uint8 [N, G*16], s fp32 [N, G] -> y fp32 [R, N]
void isw_int4_gemv(const float* x, int64_t R, int64_t G, const uint8_t* w, const float* s, float* y, int64_t N,
                   int64_t min_bytes, int threads) {
  split_rows(N, threads_for(N * G * 16, min_bytes, threads), [&](int64_t n0, int64_t n1) {
    isw::rows_i4(x, R, G, w, s, y, N, n0, n1);
  });
}

// W8A8: x fp32 [R, K] quantized per row here (int8, one scale per row), w int8 [N, K], ws fp32 [N] -> y fp32 [R, N].
// xq int8 [R, K] and xs fp32 [R]: the caller's scratch (also what the activation quantized to, for tests)
void isw_w8a8_gemv(const float* x, int64_t R, int64_t K, int8_t* xq, float* xs, const int8_t* w, const float* ws,
                   float* y, int64_t N, int64_t min_bytes, int threads) {
  for (int64_t r = 0; r < R; ++r) xs[r] = isw::quantize_row_i8(x + r * K, K, xq + r * K);
#if defined(ISW_VNNI)
  if (R >= isw::W8A8_TILED_ROWS) {  // many rows: the tiled kernel on activations offset to unsigned (bit-identical)
    std::vector<uint8_t> xu(R * K);
    isw::offset_u8(xq, R * K, xu.data());
    split_rows(N, threads_for(R * N * K, min_bytes, threads), [&](int64_t n0, int64_t n1) {  // work ~ R x weight
      isw::rows_w8a8_tiled(xq, xu.data(), xs, R, K, w, ws, y, N, n0, n1);
    });
    return;
  }
#endif
  split_rows(N, threads_for(N * K, min_bytes, threads), [&](int64_t n0, int64_t n1) {
    isw::rows_w8a8(xq, xs, R, K, w, ws, y, N, n0, n1);
  });
}

// INT4 -> a float weight for many-row calls (prefill, task scoring: one matmul instead of a GEMV per row): w uint8
// [N, G*16], s fp32 [N, G] -> out [N, K] (the first K of each row's G*32), fp32 (otype 0) or bf16 (otype 1, rounded
// to nearest even as torch rounds): (nibble - 8) * scale in fp32, as quant_kernels.dequantize_int4, in one pass
void isw_int4_dequant(const uint8_t* w, const float* s, int64_t N, int64_t G, int64_t K, void* out, int otype,
                      int64_t min_bytes, int threads) {
  split_rows(N, threads_for(N * G * 16, min_bytes, threads), [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      float row[64];
      for (int64_t g = 0; g < G; ++g) {
        const uint8_t* b = w + (n * G + g) * 16;
        const float sc = s[n * G + g];
        for (int j = 0; j < 16; ++j) {
          row[j] = (float)((int)(b[j] & 15) - 8) * sc;
          row[16 + j] = (float)((int)(b[j] >> 4) - 8) * sc;
        }
        const int64_t k0 = g * 32, m = std::min<int64_t>(32, K - k0);
        if (otype == 0) {
          float* o = (float*)out + n * K + k0;
          for (int64_t j = 0; j < m; ++j) o[j] = row[j];
        } else {
          uint16_t* o = (uint16_t*)out + n * K + k0;
          for (int64_t j = 0; j < m; ++j) {
            uint32_t u;
            std::memcpy(&u, &row[j], 4);
            o[j] = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
          }
        }
      }
    }
  });
}

// INT4 x Q8_0: x fp32 [R, G*32] (zero-padded) quantized per block of 32 here (xq int8 [R, G*32], xs fp32 [R, G],
// xsum int32 [R, G]: the caller's scratch), w uint8 [N, G*16], s fp32 [N, G] -> y fp32 [R, N]
void isw_w4a8_gemv(const float* x, int64_t R, int64_t G, int8_t* xq, float* xs, int32_t* xsum, const uint8_t* w,
                   const float* s, float* y, int64_t N, int64_t min_bytes, int threads) {
  for (int64_t r = 0; r < R; ++r) isw::quantize_row_q8_0(x + r * G * 32, G, xq + r * G * 32, xs + r * G, xsum + r * G);
  split_rows(N, threads_for(N * G * 16, min_bytes, threads), [&](int64_t n0, int64_t n1) {
    isw::rows_w4a8(xq, xs, xsum, R, G, w, s, y, N, n0, n1);
  });
}

}  // extern "C"
