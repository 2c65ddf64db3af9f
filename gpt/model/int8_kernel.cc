// The int8 product of decoding on CPU, as an XLA FFI custom call: a few rows of int8 activations times an
// output-major int8 matrix, accumulated exactly in int32.
//
//   y[m, k] = sum_d x[m, d] * w[k, d]      x [M, D] int8, w [K, D] int8, y [M, K] int32, M in 1..16
//
// A decode step is bound by reading the weights, so the loop reads each output's row of w once and
// multiplies it into all M rows of x while it is in registers; XLA's own int8 dot does not stream at the
// memory's speed for so few rows. Two instruction sets, picked at run time (the library is compiled for
// plain x86-64):
//   AVX-512 VNNI: vpdpbusd multiplies unsigned by signed bytes, so x is shifted to x + 128 (unsigned) and
//     the shift taken back with the row sums of w: sum (x + 128) w = sum x w + 128 sum w.
//   AVX2: vpmaddubsw on |w| and x with w's sign, then vpmaddwd into int32; each pair of products is at
//     most 2 * 127 * 127 < 2^15, so the 16-bit step never saturates (both operands lie in [-127, 127]).
// The outputs are split over XLA's own CPU thread pool. `Int8MatmulIsa` says which set runs (2 = AVX-512
// VNNI, 1 = AVX2, 0 = neither, when the caller keeps to XLA's dot); `Int8MatmulLimitIsa` caps it, so that
// the AVX2 path can be run and tested on a CPU that has both.

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kMaxRows = 16;

// ---------------------------------------------------------------- AVX-512 VNNI

// y[m, k] for k in [k_begin, k_end): x_shifted [M, D] holds x + 128 as unsigned bytes.
template <int M>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void RowsVnni(
    const uint8_t* x_shifted, const int8_t* w, int64_t D, int64_t K, int64_t k_begin, int64_t k_end, int32_t* y) {
  const __m512i ones = _mm512_set1_epi8(1);
  const int64_t full = D / 64 * 64;
  const __mmask64 tail = D == full ? 0 : (~0ULL >> (64 - (D - full)));
  for (int64_t k = k_begin; k < k_end; ++k) {
    const int8_t* w_row = w + k * D;
    __m512i acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_si512();
    __m512i w_sum = _mm512_setzero_si512();
    for (int64_t d = 0; d < full; d += 64) {
      const __m512i w_chunk = _mm512_loadu_si512(w_row + d);
      w_sum = _mm512_dpbusd_epi32(w_sum, ones, w_chunk);
      for (int m = 0; m < M; ++m)
        acc[m] = _mm512_dpbusd_epi32(acc[m], _mm512_loadu_si512(x_shifted + m * D + d), w_chunk);
    }
    if (tail) {  // masked loads read zeros past D: they add nothing
      const __m512i w_chunk = _mm512_maskz_loadu_epi8(tail, w_row + full);
      w_sum = _mm512_dpbusd_epi32(w_sum, ones, w_chunk);
      for (int m = 0; m < M; ++m)
        acc[m] = _mm512_dpbusd_epi32(acc[m], _mm512_maskz_loadu_epi8(tail, x_shifted + m * D + full), w_chunk);
    }
    const int32_t shift = 128 * _mm512_reduce_add_epi32(w_sum);
    for (int m = 0; m < M; ++m) y[m * K + k] = _mm512_reduce_add_epi32(acc[m]) - shift;
  }
}

// ---------------------------------------------------------------- AVX2

__attribute__((target("avx2"))) inline __m256i TailLoad(const int8_t* p, int64_t n) {
  alignas(32) int8_t buffer[32] = {0};
  std::memcpy(buffer, p, n);
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(buffer));
}

__attribute__((target("avx2"))) inline int32_t Sum8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

template <int M>
__attribute__((target("avx2"))) void RowsAvx2(const int8_t* x, const int8_t* w, int64_t D, int64_t K,
                                              int64_t k_begin, int64_t k_end, int32_t* y) {
  const __m256i ones16 = _mm256_set1_epi16(1);
  const int64_t full = D / 32 * 32;
  for (int64_t k = k_begin; k < k_end; ++k) {
    const int8_t* w_row = w + k * D;
    __m256i acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_si256();
    for (int64_t d = 0; d < D; d += 32) {
      const bool whole = d < full;
      const __m256i w_chunk = whole ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w_row + d))
                                    : TailLoad(w_row + d, D - d);
      const __m256i w_abs = _mm256_sign_epi8(w_chunk, w_chunk);
      for (int m = 0; m < M; ++m) {
        const __m256i x_chunk = whole ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + m * D + d))
                                      : TailLoad(x + m * D + d, D - d);
        const __m256i pairs = _mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(x_chunk, w_chunk));
        acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(pairs, ones16));
      }
    }
    for (int m = 0; m < M; ++m) y[m * K + k] = Sum8(acc[m]);
  }
}

// ---------------------------------------------------------------- dispatch

std::atomic<int> isa_limit{2};

int Isa() {
  static const int detected = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vnni"))
      return 2;
    return __builtin_cpu_supports("avx2") ? 1 : 0;
  }();
  return std::min(detected, isa_limit.load());
}

using RowsFn = void (*)(const void* x, const int8_t* w, int64_t D, int64_t K, int64_t k_begin, int64_t k_end,
                        int32_t* y);

template <int M>
void RowsVnniErased(const void* x, const int8_t* w, int64_t D, int64_t K, int64_t b, int64_t e, int32_t* y) {
  RowsVnni<M>(static_cast<const uint8_t*>(x), w, D, K, b, e, y);
}
template <int M>
void RowsAvx2Erased(const void* x, const int8_t* w, int64_t D, int64_t K, int64_t b, int64_t e, int32_t* y) {
  RowsAvx2<M>(static_cast<const int8_t*>(x), w, D, K, b, e, y);
}

template <int... Ms>
RowsFn Pick(int isa, int rows, std::integer_sequence<int, Ms...>) {
  RowsFn fn = nullptr;
  ((rows == Ms + 1 ? (fn = isa == 2 ? &RowsVnniErased<Ms + 1> : &RowsAvx2Erased<Ms + 1>) : fn), ...);
  return fn;
}

// The work one call shares between threads: outputs in blocks, each claimed by whichever thread is free.
// Held by a shared_ptr so that a pool task starting after the call has returned finds nothing left to do.
struct Work {
  RowsFn fn;
  const void* x;
  const int8_t* w;
  int32_t* y;
  int64_t D, K, block;
  int64_t blocks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Drain() {
    for (int64_t b; (b = next.fetch_add(1)) < blocks;) {
      fn(x, w, D, K, b * block, std::min(K, (b + 1) * block), y);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error Int8MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> x, ffi::Buffer<ffi::S8> w,
                          ffi::ResultBuffer<ffi::S32> y) {
  const auto x_dims = x.dimensions();
  const auto w_dims = w.dimensions();
  if (x_dims.size() != 2 || w_dims.size() != 2 || x_dims[1] != w_dims[1])
    return ffi::Error::InvalidArgument("int8_matmul: x must be [M, D] and w [K, D]");
  const int64_t M = x_dims[0], D = x_dims[1], K = w_dims[0];
  const int isa = Isa();
  if (M < 1 || M > kMaxRows || isa == 0)
    return ffi::Error::InvalidArgument("int8_matmul: 1 to 16 rows on a CPU with AVX2");

  // VNNI's unsigned operand: x + 128, made once per call (M * D bytes, a few KB).
  std::vector<uint8_t> shifted;
  const void* x_operand = x.typed_data();
  if (isa == 2) {
    shifted.resize(M * D);
    const int8_t* src = x.typed_data();
    for (int64_t i = 0; i < M * D; ++i) shifted[i] = static_cast<uint8_t>(src[i] + 128);
    x_operand = shifted.data();
  }

  auto work = std::make_shared<Work>();
  work->fn = Pick(isa, static_cast<int>(M), std::make_integer_sequence<int, kMaxRows>{});
  work->x = x_operand;
  work->w = w.typed_data();
  work->y = y->typed_data();
  work->D = D;
  work->K = K;
  // Blocks of outputs several times more than the threads, so an uneven pool still finishes together;
  // at least 64 outputs each, so a small matrix is not split into pieces smaller than a task's cost.
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  work->block = std::max<int64_t>(64, (K + 4 * threads - 1) / (4 * threads));
  work->blocks = (K + work->block - 1) / work->block;
  for (int64_t t = 1; t < std::min(threads, work->blocks); ++t) pool.Schedule([work] { work->Drain(); });
  work->Drain();  // this thread works too, so the call finishes even if no pool thread is free
  while (work->done.load(std::memory_order_acquire) < work->blocks) _mm_pause();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(Int8Matmul, Int8MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

extern "C" int Int8MatmulIsa() { return Isa(); }

extern "C" int Int8MatmulLimitIsa(int limit) {
  isa_limit.store(limit);
  return Isa();
}
