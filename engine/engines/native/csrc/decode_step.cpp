// The native engine's decode step in C++ (engine.compile_mode=cpp, engine/engines/native/cpp_step.py): the whole
// layer loop of one token of each of B sequences -- embedding, RMSNorm, the QKV / output / MLP GEMVs through the
// kernels of engine/kernels/gemv.h (the same ones the Python path calls; each weight row read once for the B rows),
// RoPE, attention over the engine's KV cache (the contiguous cache or the paged pool the Python path writes, through
// KVLayout), residuals, final norm and LM head -- in one call, one OpenMP parallel region, no Python and no torch
// dispatch inside. Prefill stays in torch and fills the same cache.
//
// Numerics follow the eager native path (model.py): in bf16, every value torch rounds to bf16 is rounded here at the
// same point (norm outputs, GEMV outputs, RoPE products and sums, residual sums, attention output; eager attention's
// scores and probabilities, sdpa's unnormalized probabilities), so greedy tokens match the eager engine's.
//
// Threads: a step is a sequence of phases (QKV, attention, o_proj, gate/up, down, head; Gemma's post-norms), each
// cut into chunks -- ranges of a GEMV's output rows, parts of a KV group's query heads -- and a phase ends when all
// its chunks are done (one counter per phase, not an OpenMP barrier). Each thread takes its own home chunks first,
// in order (quiet, every thread streams the contiguous rows the static split gave it), then any another thread has
// not reached: a thread the OS has descheduled costs the others at most the chunk it holds, and nobody waits for it
// to be scheduled again to pass a barrier. A thread with nothing left spins briefly, then sleeps on a futex until
// the phase's last chunk is done (on a loaded machine it gives its core back instead of spinning a time slice away);
// after the last phase only the region's end waits. With one thread, a phase is one chunk. isw_set_sync(1) restores
// the static split with OpenMP barriers between phases (the step before issue 42: kept for side-by-side benchmarks,
// benchmarks/bench_cpp_step_load.py).
// Norms run redundantly on every thread into a thread-private buffer (cheaper than a phase).
#include "gemv.h"
#include <omp.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <atomic>
#include <chrono>
#include <climits>
#include <memory>
#include <cstddef>
#include <string>
#include <type_traits>
#include <vector>

namespace {

enum Kind : int64_t { F32 = 0, BF16 = 1, I8 = 2, I4 = 3, W8A8 = 4, W4A8 = 5 };

struct Lin {                     // one linear layer in one of gemv.h's layouts
  int64_t kind, N, K, G;         // kind (Kind), outputs, inputs, INT4 groups of 32 inputs
  const void* w;                 // weight
  const float* s;                // scales (int8: [N], int4: [N, G]), or null
  const float* bias;             // fp32 [N] or null
};

struct Layer {
  Lin q, k, v, o, gate, up, down;
  const void* in_norm;           // input_layernorm
  const void* post_attn_norm;    // Llama: the MLP's input norm; Gemma: the attention output's norm
  const void* pre_ff_norm;       // Gemma only
  const void* post_ff_norm;      // Gemma only
  const void* q_norm;            // Gemma only: per-head norms of q and k
  const void* k_norm;
  void* k_cache;                 // [Hkv, max_len, D] of the sequence (batch row 0), fp32 or bf16 (Model.kv_bf16)
  void* v_cache;
  int64_t window;                // sliding window (0: global attention)
  int64_t rope;                  // which RoPE table
};

struct Model {
  int64_t num_layers, hidden, inter, hq, hkv, head_dim, vocab, max_len;
  int64_t bf16;                  // activations, norm weights, embedding and cache in bf16 (else fp32)
  int64_t gemma;                 // Gemma 3's block
  int64_t eager_attention;       // round as eager attention does (bf16 scores and probabilities); else as sdpa
  int64_t kv_bf16;               // the K/V cache in bf16 (always with bf16 activations; fp32 activations: the
                                 // new key and value rounded to bf16 as the cache stores them, kv_cache.dtype)
  double eps, attn_scale, softcap, embed_scale;  // softcap, embed_scale: 0 = none
  const void* embed;             // [vocab, hidden]
  const void* final_norm;
  Lin head;
  const float* cos[2];            // [max_len, D] per RoPE table, as rope_cos_sin computes them (sin signed)
  const float* sin[2];
  const Layer* layers;
};

inline int64_t pad32(int64_t n) { return (n + 31) / 32 * 32; }

// Where a token's time goes (wall time on thread 0 between the region's barriers, summed over steps): the per-token
// profile of BENCHMARKS.md. Phases: qkv, attention, o_proj, gate_up, down, head, outside (embedding, allocation,
// the region's start and end).
constexpr int PHASES = 7;
double g_prof[PHASES] = {0};
int64_t g_prof_steps = 0;
inline double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

struct Act {  // how values are stored and rounded: fp32, or bf16 (uint16) rounded at torch's points
  bool bf;
  float rnd(float v) const { return bf ? isw::round_bf16(v) : v; }
  float ld(const void* p, int64_t i) const {
    return bf ? isw::bf16_to_f(((const uint16_t*)p)[i]) : ((const float*)p)[i];
  }
  void st(void* p, int64_t i, float v) const {
    if (bf) ((uint16_t*)p)[i] = isw::f_to_bf16(v); else ((float*)p)[i] = v;
  }
};

// RMSNorm of x [n] into out [n]. Llama: fp32 -> x * r * w (F.rms_norm); bf16 -> rnd(w * rnd(x * r)).
// Gemma: rnd(x * r * (1 + w)) in fp32, one rounding (transformers' Gemma3RMSNorm).
inline void rms_norm(const Act& a, bool gemma, const float* x, int64_t n, const void* w, double eps, float* out) {
  float ss = 0.f;
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float r = 1.0f / std::sqrt(ss / (float)n + (float)eps);
  if (gemma) {
    for (int64_t i = 0; i < n; ++i) out[i] = a.rnd(x[i] * r * (1.0f + a.ld(w, i)));
  } else if (a.bf) {
    for (int64_t i = 0; i < n; ++i) out[i] = a.rnd(a.ld(w, i) * a.rnd(x[i] * r));
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = x[i] * r * a.ld(w, i);
  }
}

// The input of a linear layer in every form its kernels read: R rows of K values, each row zero-padded to pad32(K)
// (the INT4 kernels' stride, and the step's buffers'); packed at stride K for the dense kernels where R > 1 and K is
// not a multiple of 32; int8 per row (W8A8); Q8_0 per block (INT4 x Q8_0)
struct Input {
  const float* x = nullptr;
  int64_t K = 0, R = 1;
  std::vector<float> dense_rows;
  std::vector<float> xt;  // the rows transposed [K, Rp] (isw::transpose_rows), for the outer-product kernels
  int64_t Rp = 0;
  bool have_t = false;
  std::vector<int8_t> q;
  std::vector<uint8_t> qu;  // W8A8 at 4+ rows: q + 128 (the tiled VNNI kernel's unsigned operand)
  std::vector<float> row_scale;
  std::vector<float> bs;
  std::vector<int32_t> bsum;
  bool have_dense = false, have_row = false, have_blocks = false;

  void set(const float* x_, int64_t K_, int64_t R_ = 1) {
    x = x_; K = K_; R = R_; have_dense = have_row = have_blocks = have_t = false;
  }
#if defined(ISW_AVX512)
  const float* transposed() {
    if (!have_t) {
      Rp = (R + 63) / 64 * 64;
      xt.resize(K * Rp);
      isw::transpose_rows(x, R, K, pad32(K), xt.data(), Rp);
      have_t = true;
    }
    return xt.data();
  }
#endif
  const float* dense() {  // the rows at stride K
    if (R == 1 || K % 32 == 0) return x;
    if (!have_dense) {
      dense_rows.resize(R * K);
      for (int64_t r = 0; r < R; ++r) std::memcpy(dense_rows.data() + r * K, x + r * pad32(K), K * sizeof(float));
      have_dense = true;
    }
    return dense_rows.data();
  }
  void need(int64_t kind) {
    if (kind == W8A8 && !have_row) {
      q.resize(R * K + 32); row_scale.resize(R);
      for (int64_t r = 0; r < R; ++r) row_scale[r] = isw::quantize_row_i8(x + r * pad32(K), K, q.data() + r * K);
#if defined(ISW_VNNI)
      if (R >= isw::W8A8_TILED_ROWS) {
        qu.resize(R * K);
        isw::offset_u8(q.data(), R * K, qu.data());
      }
#endif
      have_row = true; have_blocks = false;
    } else if (kind == W4A8 && !have_blocks) {
      const int64_t G = pad32(K) / 32;
      q.resize(R * G * 32); bs.resize(R * G); bsum.resize(R * G);
      for (int64_t r = 0; r < R; ++r)
        isw::quantize_row_q8_0(x + r * G * 32, G, q.data() + r * G * 32, bs.data() + r * G, bsum.data() + r * G);
      have_blocks = true; have_row = false;
    }
  }
};

// Where the K/V of (sequence b, KV group g, position j) sit in a layer's cache, in elements: one layout for both of
// the engine's caches -- contiguous [B, Hkv, max_len, D] (block b of max_len tokens per sequence, head-major) and the
// paged pool [blocks, block_size, Hkv, D] (a block table per sequence, token-major)
struct KVLayout {
  const int32_t* blocks;        // [B, max_blocks] block ids
  int64_t max_blocks, block_size, blk_stride, tok_stride, head_stride;
  // f(j, offset) for keys j in [j0, j1), block by block (no division per key)
  template <class F> void each(int64_t b, int64_t g, int64_t j0, int64_t j1, F&& f) const {
    for (int64_t j = j0; j < j1;) {
      const int64_t end = std::min(j1, (j / block_size + 1) * block_size);
      for (int64_t off = at(b, g, j); j < end; ++j, off += tok_stride) f(j, off);
    }
  }
  int64_t at(int64_t b, int64_t g, int64_t j) const {
    const int64_t blk = j / block_size;
    return (int64_t)blocks[b * max_blocks + blk] * blk_stride + (j - blk * block_size) * tok_stride + g * head_stride;
  }
};

// rows [n0, n1) of y [R, N] = L(x) for the input's R rows, rounded as the Python modules round (bias after the
// activation-dtype cast, except W8A8 which adds it in fp32 first)
inline void lin_rows(const Act& a, const Lin& L, Input& in, float* y, int64_t n0, int64_t n1) {
  if (n0 >= n1) return;
  in.need(L.kind);
  const int64_t R = in.R, N = L.N;
#if defined(ISW_AVX512)
  if (R >= isw::OUTER_ROWS && (L.kind == F32 || L.kind == BF16 || L.kind == I8)) {  // a prompt's rows: compute-bound
    const float* xt = in.transposed();
    if (L.kind == F32) isw::rows_w_outer(xt, R, in.Rp, L.K, (const float*)L.w, nullptr, y, N, n0, n1);
    else if (L.kind == BF16) isw::rows_w_outer(xt, R, in.Rp, L.K, (const uint16_t*)L.w, nullptr, y, N, n0, n1);
    else isw::rows_w_outer(xt, R, in.Rp, L.K, (const int8_t*)L.w, L.s, y, N, n0, n1);
  } else
#endif
  switch (L.kind) {
    case F32: isw::rows_w(in.dense(), R, L.K, (const float*)L.w, nullptr, y, N, n0, n1); break;
    case BF16: isw::rows_w(in.dense(), R, L.K, (const uint16_t*)L.w, nullptr, y, N, n0, n1); break;
    case I8: isw::rows_w(in.dense(), R, L.K, (const int8_t*)L.w, L.s, y, N, n0, n1); break;
    case I4: isw::rows_i4(in.x, R, L.G, (const uint8_t*)L.w, L.s, y, N, n0, n1); break;
    case W8A8:
#if defined(ISW_VNNI)
      if (R >= isw::W8A8_TILED_ROWS) {  // 4 x 4 tiles (bit-identical to rows_w8a8)
        isw::rows_w8a8_tiled(in.q.data(), in.qu.data(), in.row_scale.data(), R, L.K, (const int8_t*)L.w, L.s, y, N, n0, n1);
        break;
      }
#endif
      isw::rows_w8a8(in.q.data(), in.row_scale.data(), R, L.K, (const int8_t*)L.w, L.s, y, N, n0, n1);
      break;
    case W4A8: isw::rows_w4a8(in.q.data(), in.bs.data(), in.bsum.data(), R, L.G, (const uint8_t*)L.w, L.s, y, N, n0, n1); break;
  }
  for (int64_t r = 0; r < R; ++r) {
    float* yr = y + r * N;
    for (int64_t n = n0; n < n1; ++n) {
      float v = yr[n];
      if (L.bias) v = L.kind == W8A8 ? a.rnd(v + L.bias[n]) : a.rnd(a.rnd(v) + L.bias[n]);
      else v = a.rnd(v);
      yr[n] = v;
    }
  }
}

// How the threads meet between phases: 0 = chunks from a counter, spin then futex (default); 1 = the static split and
// OpenMP barriers (isw_set_sync)
int g_sync = 0;
constexpr int CHUNKS_PER_THREAD = 4;  // a GEMV phase's chunks per thread: small enough for one thread to take over
// Attention over a long span (flash-decoding): from g_split_min positions on, a layer's attention is cut along the sequence
// too, one chunk per (KV group, block of >= g_split_block positions), each a partial softmax (its max, its sum, its
// weighted values) that the next phase combines; every key and value is read once per group, by one thread, and
// both threads share a long sequence even where there is one KV group (Gemma 3 270M). Below it the exact
// path (heads of a group together, probabilities rounded where torch rounds them) is kept.
// (isw_set_split changes both: tests split tiny models' short sequences, benchmarks compare the two paths)
int64_t g_split_min = 256;
int64_t g_split_block = 64;
constexpr double SPIN_S = 10e-6;      // how long a thread with nothing left spins before it sleeps (a phase: 30-100 us;
                                      // 10 us kept SmolLM2 W8A8 at x0.46 of quiet under load, 50 us x0.44, quiet the same)

static_assert(sizeof(std::atomic<int>) == sizeof(int) && std::atomic<int>::is_always_lock_free,
              "the futex waits on an atomic<int>'s own word");

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

inline long futex(std::atomic<int>* word, int op, int val) {
  return syscall(SYS_futex, reinterpret_cast<int*>(word), op, val, nullptr, nullptr, 0);
}

// One step's phase counters: taken[p * nt + u] (how many of thread u's home chunks of phase p were handed out, to it
// or to a thread that ran out of its own), done[p] (chunks finished), and how many threads sleep.
struct alignas(64) Counter {  // one cache line each: a thread claiming its own chunks does not bounce the other's
  std::atomic<int> v{0};
};

struct Phases {
  int nt;
  std::unique_ptr<Counter[]> taken_, done_;
  std::atomic<int> sleepers{0};
  Phases(int64_t n, int nt_) : nt(nt_), taken_(new Counter[n * nt_]), done_(new Counter[n]) {}
  std::atomic<int>& taken(int64_t i) { return taken_[i].v; }
  std::atomic<int>& done(int64_t p) { return done_[p].v; }
  // the next chunk of phase p for thread t, its phase cut into nt home ranges of k chunks each: its own home
  // chunks first, in order (quiet, each thread streams the contiguous rows the static split gave it), then those
  // another thread has not reached; -1 when none is left
  int next(int64_t p, int t, int chunks) {
    const int k = (chunks + nt - 1) / nt;
    for (int i = 0; i < nt; ++i) {
      const int u = (t + i) % nt, home = std::min(k, chunks - u * k);  // the last range may be short or empty
      std::atomic<int>& c = taken(p * nt + u);
      if (c.load(std::memory_order_relaxed) >= home) continue;
      const int j = c.fetch_add(1, std::memory_order_acq_rel);
      if (j < home) return u * k + j;
    }
    return -1;
  }
  void finished(int64_t p, int chunks) {  // one chunk of phase p done: the last one wakes the sleepers
    if (done(p).fetch_add(1, std::memory_order_seq_cst) + 1 == chunks && sleepers.load(std::memory_order_seq_cst) > 0)
      futex(&done(p), FUTEX_WAKE_PRIVATE, INT_MAX);
  }
  void wait(int64_t p, int chunks) {  // until every chunk of phase p is done: spin, then sleep on the futex
    std::atomic<int>& d = done(p);
    if (d.load(std::memory_order_acquire) >= chunks) return;
    const double until = std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count() + SPIN_S;
    for (int i = 1;; ++i) {
      if (d.load(std::memory_order_acquire) >= chunks) return;
      cpu_relax();
      if ((i & 63) == 0 && std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count() > until)
        break;
    }
    for (;;) {
      sleepers.fetch_add(1, std::memory_order_seq_cst);
      const int v = d.load(std::memory_order_seq_cst);
      if (v < chunks) futex(&d, FUTEX_WAIT_PRIVATE, v);  // returns at once if done[p] moved on since the load
      sleepers.fetch_sub(1, std::memory_order_seq_cst);
      if (d.load(std::memory_order_acquire) >= chunks) return;
    }
  }
};

inline void split(int64_t n, int t, int nt, int64_t& n0, int64_t& n1) {
  n0 = n * t / nt;
  n1 = n * (t + 1) / nt;
}

// rows of several linears over one input as one list of rows, split evenly over the threads
inline void lin_group(const Act& a, const Lin* const* ls, float* const* ys, int count, Input& in, int t, int nt) {
  int64_t total = 0;
  for (int i = 0; i < count; ++i) total += ls[i]->N;
  int64_t r0, r1;
  split(total, t, nt, r0, r1);
  int64_t base = 0;
  for (int i = 0; i < count; ++i) {
    const int64_t lo = std::max(r0, base), hi = std::min(r1, base + ls[i]->N);
    if (lo < hi) lin_rows(a, *ls[i], in, ys[i], lo - base, hi - base);
    base += ls[i]->N;
  }
}

// RoPE of one head x [D] at table row (cos, signed sin) [D]: x * cos + roll(x, D/2) * sin (bf16: each product and
// the sum rounded, as apply_rope does for 16-bit tensors)
inline void rope(const Act& a, float* x, int64_t D, const float* c, const float* s, float* tmp) {
  const int64_t h = D / 2;
  for (int64_t i = 0; i < D; ++i) {
    const float rolled = x[(i + h) % D];
    tmp[i] = a.bf ? a.rnd(a.rnd(x[i] * a.rnd(c[i])) + a.rnd(rolled * a.rnd(s[i]))) : x[i] * c[i] + rolled * s[i];
  }
  std::memcpy(x, tmp, D * sizeof(float));
}

inline float gelu_tanh(float x) {
  const float k = 0.7978845608028654f;  // sqrt(2 / pi)
  return 0.5f * x * (1.0f + std::tanh(k * (x + 0.044715f * x * x * x)));
}

}  // namespace

#if defined(ISW_AVX512)
// e^x for x <= 0 (a softmax's shifted scores; -inf and anything below -87 give 0): 2^n * p(r), x = n ln2 + r, |r| <=
// ln2 / 2, p a degree-6 Taylor polynomial (relative error ~2e-7, a float's rounding)
inline __m512 exp_le0(__m512 x) {
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln2 in two parts (Cody-Waite)
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_mov_ps(~tiny, _mm512_scalef_ps(p, n));
}
#endif
// a run of consecutive rows of one sequence attends tile by tile: QB rows x the group's heads against KB keys at once
constexpr int64_t QB = 16, KB = 64, KV16 = KB / 16;

extern "C" {

// One decode step of B sequences: token tokens[b] at position pos[b] of sequence b (its cache already holds the
// positions before) -> logits fp32 [B, vocab]. The new K/V are written into each layer's cache at pos[b], where
// `kv` says (the contiguous cache of a static batch, or the paged pool through block tables: continuous batching).
// Every linear reads each weight row once for all B rows (the kernels' R rows); attention runs per sequence and
// KV group. One sequence past g_split_min positions splits its attention along the sequence (flash-decoding).
// B rows through the model: row b is token tokens[b] at position pos[b] of the sequence its KVLayout row b addresses
// (its block table). `rows_share`: rows may belong to one sequence (a prompt's positions, a chunk of prefill beside
// decode rows): every row's new key and value are stored in a phase of their own before any row attends, and each row
// then reads keys [lo, pos] from the cache (causal by position); otherwise (one row per sequence: decode) each row's
// own key is used where it is computed and stored after attention. Logits for the n_out rows out_rows (all B in order
// when out_rows is null) into logits [n_out, V].
static void run_rows(const Model* m, int64_t B, const int64_t* tokens, const int64_t* pos, const KVLayout* kv,
                     float* logits, int threads, bool rows_share, int64_t n_out, const int64_t* out_rows) {
  const Act a{m->bf16 != 0};
  const int64_t H = m->hidden, I = m->inter, D = m->head_dim, Hq = m->hq, Hkv = m->hkv, S = m->max_len;
  const int64_t qn = Hq * D, kvn = Hkv * D, V = m->head.N;
  const int64_t Hs = pad32(H), Is = pad32(I), Qs = pad32(qn);  // row strides of the buffers linears read
  const bool gemma = m->gemma != 0;
  const bool kvbf = a.bf || m->kv_bf16 != 0;  // K/V stored as bf16
  const bool kv_round = kvbf && !a.bf;  // fp32 activations, bf16 cache: the new K/V rounded as stored
  const float scale = (float)m->attn_scale;
  // shared buffers, B rows each (zero-padded to 32 inputs: the INT4 kernels read whole groups)
  std::vector<float> x(B * Hs, 0.f), q(B * qn), k(B * kvn), v(B * kvn), att(B * Qs, 0.f), mid(B * Is, 0.f);
  std::vector<float> y(B * std::max(H, I), 0.f);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < H; ++i) {
      float e = a.ld(m->embed, tokens[b] * H + i);
      x[b * Hs + i] = m->embed_scale != 0.0 ? a.rnd(e * (float)m->embed_scale) : e;
    }
  const int nt = std::max(1, threads);
  const bool chunked = g_sync == 0 && nt > 1;
  const int64_t group = Hq / Hkv;
  // chunks a phase is cut into: GEMV rows CHUNKS_PER_THREAD per thread; attention whole query heads, each KV group
  // of each sequence in up to `att_s` parts (a part's heads read their shared keys and values once)
  const int lin_C = chunked ? CHUNKS_PER_THREAD * nt : nt;
  const int64_t att_s = chunked ? std::min<int64_t>(group, std::max<int64_t>(1, (CHUNKS_PER_THREAD / 2 * nt + B * Hkv - 1) / (B * Hkv))) : 1;
  const int att_C = chunked ? (int)(B * Hkv * att_s) : nt;
  Phases ph(chunked ? m->num_layers * 8 + 2 : 0, nt);
  // rows_share, fp32 activations, AVX-512: the attention is tiled -- runs of consecutive positions of one sequence
  // (one block table) cut into blocks of up to QB rows, one chunk per (block, KV group)
  std::vector<int64_t> qblk{0};
#if defined(ISW_AVX512)
  const bool tiled = rows_share && !a.bf && D % 16 == 0 && D <= 256;
  if (tiled)
    for (int64_t r = 1; r < B; ++r) {
      const bool same = pos[r] == pos[r - 1] + 1 && r - qblk.back() < QB &&
                        std::memcmp(kv->blocks + r * kv->max_blocks, kv->blocks + (r - 1) * kv->max_blocks,
                                    kv->max_blocks * sizeof(int32_t)) == 0;
      if (!same) qblk.push_back(r);
    }
#else
  const bool tiled = false;
#endif
  qblk.push_back(B);
  const int64_t n_qblk = (int64_t)qblk.size() - 1;
  // the split attention's blocks per KV group (enough chunks for two per thread) and their partials, per query head
  const int64_t nb_max = chunked && B == 1 ? std::min<int64_t>(64, std::max<int64_t>(2, (2 * nt + Hkv - 1) / Hkv)) : 1;
  std::vector<float> part_m(chunked && B == 1 ? Hq * nb_max : 0), part_l(part_m.size()), part_o(part_m.size() * D);
  const double t_start = now();
  double inside = 0.0;
#pragma omp parallel num_threads(nt)
  {
    const int t = omp_get_thread_num(), n_t = omp_get_num_threads();
    const bool chunks = chunked && n_t == nt;  // this region's threads take chunks (else: the static split)
    double mark = now(), region0 = mark;
    auto lap = [&](int phase) {  // thread 0 only: the time since the last mark to `phase`
      if (t == 0) { const double x_ = now(); g_prof[phase] += x_ - mark; mark = x_; }
    };
    std::vector<float> h(B * Hs, 0.f), kh(D), qh(4 * D), tmp(D), scores(4 * S), outh(4 * D);
    std::vector<float> gate(B * I), up(B * I), attp(chunked && B == 1 ? Qs : 0, 0.f);
    // the tile's queries [QB * group, D], keys transposed [D, KB], values [KB, D], outputs, running max and sum
    // (queries padded to a multiple of 4 with zeros: the kernel takes 4 at a time, its accumulators in registers)
    const int64_t tqn = (QB * group + 3) / 4 * 4;
    std::vector<float> tq(tiled ? tqn * D : 0), tkt(tiled ? D * KB : 0), tv(tiled ? KB * D : 0);
    std::vector<float> to(tiled ? tqn * D : 0), tm(tiled ? tqn : 0), tl(tiled ? tqn : 0);
    Input in;
    int64_t p = 0;  // this thread's phase
    const int64_t n_phases = m->num_layers * ((gemma ? 7 : 5) + (rows_share ? 1 : 0)) + 1;
    // One phase: `enter()` once on this thread before its first chunk (its private norm), `body(c, C)` for each chunk
    // it takes; returns when every chunk of the phase is done. Static: chunk t of n_t, then an OpenMP barrier.
    auto phase = [&](int C, auto&& enter, auto&& body) {
      if (!chunks) {
        enter();
        body(t, n_t);
#pragma omp barrier
        return;
      }
      bool entered = false;
      for (int c; (c = ph.next(p, t, C)) >= 0;) {
        if (!entered) { enter(); entered = true; }
        body(c, C);
        ph.finished(p, C);
      }
      if (p + 1 < n_phases) ph.wait(p, C);  // the last phase: the region's end waits for every thread
      ++p;
    };
    auto none = [] {};
    // A phase of n work items, each done by whoever takes it: with chunks, item c is chunk c; in the static split,
    // thread t does items t, t + n_t, ... (a phase whose items are not one per thread must not read c as its only one)
    auto each = [&](int64_t n, auto&& item) {
      phase(chunks ? (int)n : n_t, none, [&](int c0, int C) {
        for (int64_t c = c0; c < (chunks ? c0 + 1 : n); c += C) item(c);
      });
    };
    auto rows = [](int64_t n, int c, int C, int64_t& n0, int64_t& n1) { split(n, c, C, n0, n1); };
    // the norm of each of the B rows of src (row stride ss) into h (stride Hs)
    auto norm_rows = [&](bool gem, const float* src, int64_t ss, const void* w) {
      for (int64_t b = 0; b < B; ++b) rms_norm(a, gem, src + b * ss, H, w, m->eps, h.data() + b * Hs);
    };
    for (int64_t l = 0; l < m->num_layers; ++l) {
      const Layer& L = m->layers[l];
      const float* ctab = m->cos[L.rope];
      const float* stab = m->sin[L.rope];
      auto new_key = [&](int64_t b, int64_t g) {  // sequence b's new key of KV group g into kh: normed (Gemma), rotated
        std::memcpy(kh.data(), k.data() + b * kvn + g * D, D * sizeof(float));
        if (gemma) rms_norm(a, true, kh.data(), D, L.k_norm, m->eps, kh.data());
        rope(a, kh.data(), D, ctab + pos[b] * D, stab + pos[b] * D, tmp.data());
        if (kv_round) for (int64_t i = 0; i < D; ++i) kh[i] = isw::round_bf16(kh[i]);
      };
      // query heads [hh, hh + cnt) of sequence b (KV group g) rotated into qh; their scaled scores against keys
      // [j0, j1) into `scores` (kh: the key at pos[b]) and each row's maximum into mx -- the vector dot of gemv.h, cnt
      // query rows against one key (fp32 accumulation; bf16 keys widened exactly)
      auto score = [&](int64_t b, int64_t g, int64_t hh, int cnt, int64_t j0, int64_t j1, float* mx) {
        const int64_t P = pos[b];
        for (int r = 0; r < cnt; ++r) {
          float* qr = qh.data() + r * D;
          std::memcpy(qr, q.data() + b * qn + (hh + r) * D, D * sizeof(float));
          if (gemma) rms_norm(a, true, qr, D, L.q_norm, m->eps, qr);
          rope(a, qr, D, ctab + P * D, stab + P * D, tmp.data());
        }
        float d[4];
        for (int r = 0; r < cnt; ++r) mx[r] = -INFINITY;
        kv->each(b, g, j0, j1, [&](int64_t j, int64_t off) {
          auto dots = [&](auto rb) {
            constexpr int RB = decltype(rb)::value;
            if (j == P) isw::dot_w<RB>(qh.data(), D, kh.data(), d);
            else if (kvbf) isw::dot_w<RB>(qh.data(), D, (const uint16_t*)L.k_cache + off, d);
            else isw::dot_w<RB>(qh.data(), D, (const float*)L.k_cache + off, d);
          };
          switch (cnt) {
            case 1: dots(std::integral_constant<int, 1>{}); break;
            case 2: dots(std::integral_constant<int, 2>{}); break;
            case 3: dots(std::integral_constant<int, 3>{}); break;
            default: dots(std::integral_constant<int, 4>{}); break;
          }
          for (int r = 0; r < cnt; ++r) {
            const float v_ = m->eager_attention && a.bf ? a.rnd(a.rnd(d[r]) * scale) : d[r] * scale;
            scores[r * S + j] = v_;
            mx[r] = std::max(mx[r], v_);
          }
        });
      };
      // f(j, value row j in fp32) for values [j0, j1) of sequence b, KV group g (bf16: widened into tmp)
      auto values = [&](int64_t b, int64_t g, int64_t j0, int64_t j1, auto&& f) {
        const int64_t P = pos[b];
        kv->each(b, g, j0, j1, [&](int64_t j, int64_t off) {
          const float* vf;
          if (j == P && !kv_round) {
            vf = v.data() + b * kvn + g * D;
          } else if (j == P) {  // the new value as the bf16 cache will hold it
            for (int64_t i = 0; i < D; ++i) tmp[i] = isw::round_bf16(v[b * kvn + g * D + i]);
            vf = tmp.data();
          } else if (!kvbf) {
            vf = (const float*)L.v_cache + off;
          } else {
            const uint16_t* vr = (const uint16_t*)L.v_cache + off;
            for (int64_t i = 0; i < D; ++i) tmp[i] = isw::bf16_to_f(vr[i]);
            vf = tmp.data();
          }
          f(j, vf);
        });
      };
      auto store_kv = [&](int64_t b, int64_t g) {  // sequence b's new key (in kh) and value of group g into the cache
        const Act kva{kvbf};
        const int64_t at = kv->at(b, g, pos[b]);
        for (int64_t i = 0; i < D; ++i) {
          kva.st(L.k_cache, at + i, kh[i]);
          kva.st(L.v_cache, at + i, v[b * kvn + g * D + i]);
        }
      };
      // --- attention ---
      phase(lin_C, [&] { norm_rows(gemma, x.data(), Hs, L.in_norm); in.set(h.data(), H, B); },
            [&](int c, int C) {
              const Lin* ls[3] = {&L.q, &L.k, &L.v};
              float* ys[3] = {q.data(), k.data(), v.data()};
              lin_group(a, ls, ys, 3, in, c, C);
            });
      if (rows_share)  // every row's key (normed, rotated) and value into the cache before any row attends
        each(B * Hkv, [&](int64_t c) {  // item c: row c / Hkv, KV group c % Hkv
          new_key(c / Hkv, c % Hkv);
          store_kv(c / Hkv, c % Hkv);
        });
      lap(0);
      // the first key position P's query sees (Gemma 3's sliding layers drop the older ones)
      auto window_lo = [&](int64_t P) { return L.window > 0 ? std::max<int64_t>(0, P - L.window + 1) : (int64_t)0; };
      const int64_t lo0 = window_lo(pos[0]);
      const int64_t nb = B == 1 && !rows_share && chunks && pos[0] - lo0 + 1 >= g_split_min
                             ? std::min<int64_t>(nb_max, (pos[0] - lo0 + 1) / g_split_block) : 0;
      if (nb > 1) {  // flash-decoding (one sequence): chunk c = block c % nb of KV group c / nb, each a partial softmax
        phase((int)(Hkv * nb), none, [&](int c, int) {
          const int64_t g = c / nb, bl = c % nb;
          int64_t j0, j1;
          split(pos[0] - lo0 + 1, (int)bl, (int)nb, j0, j1);
          j0 += lo0, j1 += lo0;
          new_key(0, g);
          for (int64_t hh = g * group; hh < (g + 1) * group;) {
            const int cnt = (int)std::min<int64_t>((g + 1) * group - hh, 4);
            float mx[4];
            score(0, g, hh, cnt, j0, j1, mx);
            std::fill(outh.begin(), outh.begin() + cnt * D, 0.f);
            float sum[4] = {0.f, 0.f, 0.f, 0.f};
            values(0, g, j0, j1, [&](int64_t j, const float* vf) {
              for (int r = 0; r < cnt; ++r) {
                const float e = std::exp(scores[r * S + j] - mx[r]);
                sum[r] += e;
                const float p_ = a.rnd(e);
                float* o = outh.data() + r * D;
                for (int64_t i = 0; i < D; ++i) o[i] += p_ * vf[i];
              }
            });
            for (int r = 0; r < cnt; ++r) {
              const int64_t at = (hh + r) * nb_max + bl;
              part_m[at] = mx[r];
              part_l[at] = sum[r];
              std::memcpy(part_o.data() + at * D, outh.data() + r * D, D * sizeof(float));
            }
            hh += cnt;
          }
          if (bl == 0) store_kv(0, g);  // the new K/V into the cache (no chunk reads position pos from it)
        });
      }
#if defined(ISW_AVX512)
      else if (tiled) {  // item c: block c / Hkv of rows, KV group c % Hkv; every key of the block's span read once
        each(n_qblk * Hkv, [&](int64_t c) {
          const int64_t r0 = qblk[c / Hkv], r1 = qblk[c / Hkv + 1], g = c % Hkv, nr = r1 - r0;
          const int64_t nq = nr * group;  // query (row, head) pairs, row-major
          for (int64_t r = r0; r < r1; ++r)
            for (int64_t hi = 0; hi < group; ++hi) {
              float* qr = tq.data() + ((r - r0) * group + hi) * D;
              std::memcpy(qr, q.data() + r * qn + (g * group + hi) * D, D * sizeof(float));
              if (gemma) rms_norm(a, true, qr, D, L.q_norm, m->eps, qr);
              rope(a, qr, D, ctab + pos[r] * D, stab + pos[r] * D, tmp.data());
            }
          const int64_t nq4 = (nq + 3) / 4 * 4;  // padded with zero queries (their outputs dropped)
          std::fill(tq.begin() + nq * D, tq.begin() + nq4 * D, 0.f);
          std::fill(to.begin(), to.begin() + nq4 * D, 0.f);
          std::fill(tm.begin(), tm.begin() + nq4, -INFINITY);
          std::fill(tl.begin(), tl.begin() + nq4, 0.f);
          int64_t jlo = pos[r0], jhi = pos[r1 - 1];  // the keys any row reads: [min lo, max P]
          for (int64_t r = r0; r < r1; ++r) jlo = std::min(jlo, window_lo(pos[r]));
          const int64_t DV = D / 16;
          for (int64_t j0 = jlo; j0 <= jhi; j0 += KB) {
            const int64_t nk = std::min<int64_t>(KB, jhi + 1 - j0);
            for (int64_t jj = 0; jj < KB; ++jj) {  // keys transposed, values as rows (zeros past the span)
              if (jj >= nk) {
                for (int64_t i = 0; i < D; ++i) tkt[i * KB + jj] = 0.f;
                std::memset(tv.data() + jj * D, 0, D * sizeof(float));
                continue;
              }
              const int64_t off = kv->at(r0, g, j0 + jj);
              if (kvbf) {
                const uint16_t* kr = (const uint16_t*)L.k_cache + off;
                const uint16_t* vr = (const uint16_t*)L.v_cache + off;
                for (int64_t i = 0; i < D; ++i) tkt[i * KB + jj] = isw::bf16_to_f(kr[i]);
                for (int64_t i = 0; i < D; ++i) tv[jj * D + i] = isw::bf16_to_f(vr[i]);
              } else {
                const float* kr = (const float*)L.k_cache + off;
                for (int64_t i = 0; i < D; ++i) tkt[i * KB + jj] = kr[i];
                std::memcpy(tv.data() + jj * D, (const float*)L.v_cache + off, D * sizeof(float));
              }
            }
            const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
            for (int64_t qi = 0; qi < nq4; qi += 4) {
              constexpr int cq = 4;
              __m512 s[4][KV16];
              for (int u = 0; u < 4; ++u)
                for (int w = 0; w < KV16; ++w) s[u][w] = _mm512_setzero_ps();
              const float* qp = tq.data() + qi * D;
              for (int64_t i = 0; i < D; ++i) {  // KB keys' scores per query, 4 queries at once
                __m512 kt[KV16];
                for (int w = 0; w < KV16; ++w) kt[w] = _mm512_loadu_ps(tkt.data() + i * KB + 16 * w);
                for (int u = 0; u < cq; ++u) {
                  const __m512 qb = _mm512_set1_ps(qp[u * D + i]);
                  for (int w = 0; w < KV16; ++w) s[u][w] = _mm512_fmadd_ps(qb, kt[w], s[u][w]);
                }
              }
              alignas(64) float pj[4][KB];
              for (int u = 0; u < cq; ++u) {
                const int64_t row = std::min(r1 - 1, r0 + (qi + u) / group), P = pos[row];
                const int64_t lo = window_lo(P);
                __m512 mx = _mm512_set1_ps(-INFINITY);
                for (int w = 0; w < KV16; ++w) {
                  const __m512i jv = _mm512_add_epi32(_mm512_set1_epi32((int)(j0 + 16 * w)), iota);
                  const __mmask16 ok = _mm512_cmp_epi32_mask(jv, _mm512_set1_epi32((int)lo), _MM_CMPINT_NLT) &
                                       _mm512_cmp_epi32_mask(jv, _mm512_set1_epi32((int)P), _MM_CMPINT_LE);
                  s[u][w] = _mm512_mask_blend_ps(ok, _mm512_set1_ps(-INFINITY), _mm512_mul_ps(s[u][w], _mm512_set1_ps(scale)));
                  mx = _mm512_max_ps(mx, s[u][w]);
                }
                const float mold = tm[qi + u], mnew = std::max(mold, _mm512_reduce_max_ps(mx));
                if (mnew == -INFINITY) {  // no key of this block for this row yet
                  std::fill(pj[u], pj[u] + KB, 0.f);
                  continue;
                }
                __m512 sum = _mm512_setzero_ps();
                for (int w = 0; w < KV16; ++w) {
                  const __m512 p = exp_le0(_mm512_sub_ps(s[u][w], _mm512_set1_ps(mnew)));
                  sum = _mm512_add_ps(sum, p);
                  _mm512_store_ps(pj[u] + 16 * w, p);
                }
                const float alpha = mold == -INFINITY ? 0.f : std::exp(mold - mnew);
                tl[qi + u] = tl[qi + u] * alpha + _mm512_reduce_add_ps(sum);
                tm[qi + u] = mnew;
                if (alpha != 1.f) {
                  float* o = to.data() + (qi + u) * D;
                  for (int64_t i = 0; i < D; i += 16)
                    _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_loadu_ps(o + i), _mm512_set1_ps(alpha)));
                }
              }
              for (int64_t dv = 0; dv < DV; ++dv) {  // o += sum_j p_j v_j: each value vector read once for 4 queries
                __m512 o[4];
                for (int u = 0; u < cq; ++u) o[u] = _mm512_loadu_ps(to.data() + (qi + u) * D + dv * 16);
                for (int64_t jj = 0; jj < nk; ++jj) {
                  const __m512 vv = _mm512_loadu_ps(tv.data() + jj * D + dv * 16);
                  for (int u = 0; u < cq; ++u) o[u] = _mm512_fmadd_ps(_mm512_set1_ps(pj[u][jj]), vv, o[u]);
                }
                for (int u = 0; u < cq; ++u) _mm512_storeu_ps(to.data() + (qi + u) * D + dv * 16, o[u]);
              }
            }
          }
          for (int64_t qi = 0; qi < nq; ++qi) {
            const int64_t row = r0 + qi / group, hh = g * group + qi % group;
            const float inv = 1.0f / tl[qi];
            float* ao = att.data() + row * Qs + hh * D;
            for (int64_t i = 0; i < D; ++i) ao[i] = to[qi * D + i] * inv;
          }
        });
      }
#endif
      else
      phase(chunks ? att_C : n_t, none, [&](int c, int C) {
        int64_t h0, h1;  // over the B * Hq (sequence, query head) pairs
        if (chunks) {  // part c % att_s of (sequence, KV group) c / att_s
          const int64_t bg = c / att_s, b = bg / Hkv, g = bg % Hkv;
          int64_t a0, a1;
          split(group, (int)(c % att_s), (int)att_s, a0, a1);
          h0 = b * Hq + g * group + a0, h1 = b * Hq + g * group + a1;
        } else {
          split(B * Hq, c, C, h0, h1);
        }
        // a run of up to 4 of this chunk's query heads sharing one KV head reads each key and value once
        for (int64_t fh = h0; fh < h1;) {
          const int64_t b = fh / Hq, hh = fh % Hq, g = hh / group, P = pos[b];
          const int64_t lo = window_lo(P);
          const int cnt = (int)std::min<int64_t>({h1 - fh, (g + 1) * group - hh, (int64_t)4});
          new_key(b, g);
          float mx[4];
          score(b, g, hh, cnt, lo, P + 1, mx);
          float inv[4];
          for (int r = 0; r < cnt; ++r) {
            float sum = 0.f;
            for (int64_t j = lo; j <= P; ++j) {
              const float e = std::exp(scores[r * S + j] - mx[r]);
              sum += e;
              scores[r * S + j] = e;
            }
            inv[r] = 1.0f / sum;
          }
          std::fill(outh.begin(), outh.begin() + cnt * D, 0.f);
          values(b, g, lo, P + 1, [&](int64_t j, const float* vf) {  // bf16 values widened once for the run
            for (int r = 0; r < cnt; ++r) {
              // eager: probabilities normalized, then rounded (bf16); sdpa: unnormalized exp rounded, divided at the end
              const float p_ = m->eager_attention ? a.rnd(scores[r * S + j] * inv[r]) : a.rnd(scores[r * S + j]);
              float* o = outh.data() + r * D;
              for (int64_t i = 0; i < D; ++i) o[i] += p_ * vf[i];
            }
          });
          float* ao = att.data() + b * Qs;
          for (int r = 0; r < cnt; ++r)
            for (int64_t i = 0; i < D; ++i)
              ao[(hh + r) * D + i] = a.rnd(m->eager_attention ? outh[r * D + i] : outh[r * D + i] * inv[r]);
          fh += cnt;
        }
        // the new K/V into the cache, each (sequence, head group) by one chunk (no one reads position pos from the cache)
        for (int64_t bg = rows_share ? B * Hkv : chunks ? (c % att_s == 0 ? c / att_s : B * Hkv) : c; bg < B * Hkv;
             bg += chunks ? B * Hkv : C) {
          new_key(bg / Hkv, bg % Hkv);
          store_kv(bg / Hkv, bg % Hkv);
        }
      });
      lap(1);
      phase(lin_C, [&] {
        if (nb <= 1) {
          in.set(att.data(), qn, B);
          return;
        }
        for (int64_t hq = 0; hq < Hq; ++hq) {  // the split attention's partials combined, on this thread
          const int64_t at = hq * nb_max;
          float M = -INFINITY, Lsum = 0.f, w[64];
          for (int64_t bl = 0; bl < nb; ++bl) M = std::max(M, part_m[at + bl]);
          for (int64_t bl = 0; bl < nb; ++bl) Lsum += (w[bl] = std::exp(part_m[at + bl] - M)) * part_l[at + bl];
          const float inv = 1.0f / Lsum;
          for (int64_t i = 0; i < D; ++i) {
            float o = 0.f;
            for (int64_t bl = 0; bl < nb; ++bl) o += w[bl] * part_o[(at + bl) * D + i];
            attp[hq * D + i] = a.rnd(o * inv);
          }
        }
        in.set(attp.data(), qn, 1);
      }, [&](int c, int C) {
        int64_t n0, n1;
        rows(L.o.N, c, C, n0, n1);
        lin_rows(a, L.o, in, y.data(), n0, n1);
        if (!gemma) {
          for (int64_t b = 0; b < B; ++b)
            for (int64_t n = n0; n < n1; ++n) x[b * Hs + n] = a.rnd(x[b * Hs + n] + y[b * H + n]);
        }
      });
      lap(2);
      if (gemma) {  // x += post_attention_layernorm(attn): the norm needs every row of the output
        phase(lin_C, [&] { norm_rows(true, y.data(), H, L.post_attn_norm); }, [&](int c, int C) {
          int64_t n0, n1;
          rows(H, c, C, n0, n1);
          for (int64_t b = 0; b < B; ++b)
            for (int64_t n = n0; n < n1; ++n) x[b * Hs + n] = a.rnd(x[b * Hs + n] + h[b * Hs + n]);
        });
      }
      // --- MLP ---
      phase(lin_C, [&] {
        norm_rows(gemma, x.data(), Hs, gemma ? L.pre_ff_norm : L.post_attn_norm);
        in.set(h.data(), H, B);
      }, [&](int c, int C) {
        int64_t n0, n1;
        rows(I, c, C, n0, n1);
        lin_rows(a, L.gate, in, gate.data(), n0, n1);
        lin_rows(a, L.up, in, up.data(), n0, n1);
#if defined(ISW_AVX512)
        if (!gemma && !a.bf && B >= isw::OUTER_ROWS) {  // a prompt's rows: SiLU(gate) * up 16 at a time
          for (int64_t b = 0; b < B; ++b) {
            int64_t n = n0;
            for (; n + 16 <= n1; n += 16) {
              const __m512 gv = _mm512_loadu_ps(gate.data() + b * I + n);
              // sigmoid(g) from e = exp(-|g|) <= 1: 1 / (1 + e) for g >= 0, e / (1 + e) below
              const __m512 e = exp_le0(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(gv)));
              const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_add_ps(_mm512_set1_ps(1.0f), e));
              const __mmask16 neg = _mm512_cmp_ps_mask(gv, _mm512_setzero_ps(), _CMP_LT_OQ);
              const __m512 sig = _mm512_mask_mul_ps(inv, neg, inv, e);
              _mm512_storeu_ps(mid.data() + b * Is + n,
                               _mm512_mul_ps(_mm512_mul_ps(gv, sig), _mm512_loadu_ps(up.data() + b * I + n)));
            }
            for (; n < n1; ++n) {
              const float gv = gate[b * I + n];
              mid[b * Is + n] = gv / (1.0f + std::exp(-gv)) * up[b * I + n];
            }
          }
          return;
        }
#endif
        for (int64_t b = 0; b < B; ++b)
          for (int64_t n = n0; n < n1; ++n) {
            const float gv = gate[b * I + n];
            const float act = gemma ? gelu_tanh(gv) : gv / (1.0f + std::exp(-gv));
            mid[b * Is + n] = a.rnd(a.rnd(act) * up[b * I + n]);
          }
      });
      lap(3);
      phase(lin_C, [&] { in.set(mid.data(), I, B); }, [&](int c, int C) {
        int64_t n0, n1;
        rows(H, c, C, n0, n1);
        lin_rows(a, L.down, in, y.data(), n0, n1);
        if (!gemma) {
          for (int64_t b = 0; b < B; ++b)
            for (int64_t n = n0; n < n1; ++n) x[b * Hs + n] = a.rnd(x[b * Hs + n] + y[b * H + n]);
        }
      });
      lap(4);
      if (gemma) {
        phase(lin_C, [&] { norm_rows(true, y.data(), H, L.post_ff_norm); }, [&](int c, int C) {
          int64_t n0, n1;
          rows(H, c, C, n0, n1);
          for (int64_t b = 0; b < B; ++b)
            for (int64_t n = n0; n < n1; ++n) x[b * Hs + n] = a.rnd(x[b * Hs + n] + h[b * Hs + n]);
        });
      }
    }
    // --- final norm and LM head ---
    phase(lin_C, [&] {
            if (out_rows == nullptr) {
              norm_rows(gemma, x.data(), Hs, m->final_norm);
            } else {  // only the rows whose logits are asked for
              for (int64_t o = 0; o < n_out; ++o)
                rms_norm(a, gemma, x.data() + out_rows[o] * Hs, H, m->final_norm, m->eps, h.data() + o * Hs);
            }
            in.set(h.data(), H, n_out);
          },
          [&](int c, int C) {
            int64_t n0, n1;
            rows(V, c, C, n0, n1);
            lin_rows(a, m->head, in, logits, n0, n1);
            if (m->softcap != 0.0) {
              const float cap = (float)m->softcap;
              for (int64_t b = 0; b < n_out; ++b)
                for (int64_t n = n0; n < n1; ++n) logits[b * V + n] = std::tanh(logits[b * V + n] / cap) * cap;
            }
          });
    lap(5);
    if (t == 0) inside = now() - region0;
  }
  g_prof[6] += (now() - t_start) - inside;
  ++g_prof_steps;
}

// One decode token for each of B sequences (row b: sequence b's token at pos[b]) -> logits [B, V]
void isw_decode_batch(const Model* m, int64_t B, const int64_t* tokens, const int64_t* pos, const KVLayout* kv,
                      float* logits, int threads) {
  run_rows(m, B, tokens, pos, kv, logits, threads, false, B, nullptr);
}

// R rows that may share sequences (a prompt's positions, prefill chunks beside decode rows: see run_rows), their K/V
// written into the cache at their positions -> logits [n_out, V] of rows out_rows only
void isw_step_rows(const Model* m, int64_t R, const int64_t* tokens, const int64_t* pos, const KVLayout* kv,
                   int64_t n_out, const int64_t* out_rows, float* logits, int threads) {
  run_rows(m, R, tokens, pos, kv, logits, threads, true, n_out, out_rows);
}

// How the threads meet between phases (0: chunks and futex waits, the default; 1: static split, OpenMP barriers);
// returns the previous mode
int isw_set_sync(int mode) {
  const int was = g_sync;
  g_sync = mode == 1 ? 1 : 0;
  return was;
}

// From how many positions a layer's attention is split along the sequence, and its smallest block (flash-decoding;
// a span of 0 never splits); returns the previous span
int64_t isw_set_split(int64_t min_span, int64_t min_block) {
  const int64_t was = g_split_min;
  g_split_min = min_span > 0 ? min_span : INT64_MAX;
  g_split_block = std::max<int64_t>(1, min_block);
  return was;
}

// The summed phase times (seconds) and the number of steps since the last call, then reset: out[PHASES]
int64_t isw_step_profile(double* out) {
  for (int i = 0; i < PHASES; ++i) { out[i] = g_prof[i]; g_prof[i] = 0.0; }
  const int64_t n = g_prof_steps;
  g_prof_steps = 0;
  return n;
}

const char* isw_step_isa() { return isw::isa_name(); }

// The layout cpp_step.py writes its ctypes copies of these structs into, and the codes it passes, as
// "name=value ..." (sizes, the offsets of fields after each kind of member, Kind, PHASES): the binding compares
// its own at load, so a struct or code changed on one side only is an error naming it, not memory read wrongly.
const char* isw_step_layout() {
  static const std::string layout = [] {
    std::string o;
    auto put = [&o](const char* name, long long v) { o += name; o += '='; o += std::to_string(v); o += ' '; };
    put("sizeof(Lin)", sizeof(Lin));
    put("sizeof(Layer)", sizeof(Layer));
    put("sizeof(Model)", sizeof(Model));
    put("sizeof(KVLayout)", sizeof(KVLayout));
    put("Lin.w", offsetof(Lin, w));
    put("Lin.bias", offsetof(Lin, bias));
    put("Layer.in_norm", offsetof(Layer, in_norm));
    put("Layer.k_cache", offsetof(Layer, k_cache));
    put("Layer.window", offsetof(Layer, window));
    put("Layer.rope", offsetof(Layer, rope));
    put("Model.eager_attention", offsetof(Model, eager_attention));
    put("Model.kv_bf16", offsetof(Model, kv_bf16));
    put("Model.eps", offsetof(Model, eps));
    put("Model.embed", offsetof(Model, embed));
    put("Model.head", offsetof(Model, head));
    put("Model.cos", offsetof(Model, cos));
    put("Model.sin", offsetof(Model, sin));
    put("Model.layers", offsetof(Model, layers));
    put("KVLayout.max_blocks", offsetof(KVLayout, max_blocks));
    put("KVLayout.head_stride", offsetof(KVLayout, head_stride));
    put("F32", F32);
    put("BF16", BF16);
    put("I8", I8);
    put("I4", I4);
    put("W8A8", W8A8);
    put("W4A8", W4A8);
    put("PHASES", PHASES);
    return o;
  }();
  return layout.c_str();
}

}  // extern "C"
