// The products of a decode step's few rows on CPU, as XLA FFI custom calls: x [M, D] times an output-major
// matrix w [K, D], contracting D, for M in 1..16.
//
//   FewRowsInt8:    float32 x [M, D], int8 w with float32 scales w_scale [K]         y [M, K] float32
//                   x's rows quantized to int8 (each with its scale), int8 x int8 accumulated exactly in
//                   int32, then scaled by x's row's scale and w's output's: `Int8Matrix.matmul` in one call
//   FewRowsFloat32: float32 x float32, accumulated in float32                          y [M, K] float32
//
// A decode step is bound by reading the weights, so the loop reads each output's row of w once and
// multiplies it into all M rows of x while it is in registers; XLA's own dots do not stream at the
// memory's speed for so few rows (its int8 dot at half of it; its float32 GEMM for 2-16 rows far from it).
// Two instruction sets, picked at run time (the library is compiled for plain x86-64):
//   AVX-512 (int8: with VNNI): vpdpbusd multiplies unsigned by signed bytes, so x is shifted to x + 128
//     (unsigned) and the shift taken back with the row sums of w: sum (x + 128) w = sum x w + 128 sum w.
//   AVX2 (float32: with FMA): int8 by vpmaddubsw on |w| and x with w's sign, then vpmaddwd into int32;
//     each pair of products is at most 2 * 127 * 127 < 2^15, so the 16-bit step never saturates (both
//     operands lie in [-127, 127], as `Int8Matrix` makes them).
// The outputs are split over XLA's own CPU thread pool (runtime.h, which also says which set runs).

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include "float_lanes.h"
#include "runtime.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace gpt_kernels {
namespace {

constexpr int kMaxRows = 16;

// The int8 product's scales: x's rows' [M] and w's outputs' [K] (y = x w * x_scale * w_scale); none for float32.
struct Scales {
  const float* x = nullptr;
  const float* w = nullptr;
};

// y[m, k] for every row m and the outputs k in [k_begin, k_end); x [M, D], w [K, D], y [M, K].
using Kernel = void (*)(const void* x, const void* w, Scales scales, int64_t D, int64_t K, int64_t k_begin,
                        int64_t k_end, void* y);

// ---------------------------------------------------------------- AVX-512 (int8 with VNNI)
//
// Outputs in tiles of Ops::TileOutputs(M), rows in groups of at most Ops::kTileRows: each vector of x loaded
// is used for the tile's outputs and each vector of w for the group's rows, with the tile's sums in registers
// (at most 32 accumulators and w vectors). One vector per output and row, summed at the end. The tile sizes
// were chosen by timing each on a chain of GPT-2 124M's matrices on 2-core AMD EPYCs, in probes not kept in
// bench/. float32 (a Zen 4): 1 output for 1-2 rows (one stream of w) and 4 from 3 rows (1 output: 35 ms at
// 8 rows, 4: 25 ms), in groups of 6 rows. int8 (a Zen 5, CPU family 26): 8 outputs for 1-2 rows and 4 from
// 3, in groups of 4 rows, w's row sums taken in the same pass; one row streamed the 124 MB in 3.2-4.9 ms,
// where 2 outputs a tile with the sums in a second pass took 8.3-9.7 ms, slower than XLA's own dot (5.7-6.4
// ms): with two sums in flight each vpdpbusd waited on the one before.

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vnni")

namespace avx512 {

// int8: x arrives shifted to unsigned (x + 128, as vpdpbusd wants), corrected by the row sums of w, which the
// tile takes in the same pass as its products (one more vpdpbusd per vector of w, against a vector of ones).
struct Int8 {
  using X = uint8_t;
  using W = int8_t;
  using Acc = int32_t;
  using Out = float;
  using Vec = __m512i;
  using Mask = __mmask64;
  static constexpr bool kShifted = true;
  static constexpr int64_t kLanes = 64;
  static constexpr int kTileRows = 4;
  static constexpr int TileOutputs(int rows) { return rows <= 2 ? 8 : 4; }
  static Mask Lanes(int64_t n) { return n >= kLanes ? ~Mask{0} : (Mask{1} << n) - 1; }
  static Vec Zero() { return _mm512_setzero_si512(); }
  static Vec Ones() { return _mm512_set1_epi8(1); }
  static Vec Load(const void* p, Mask m) { return _mm512_maskz_loadu_epi8(m, p); }
  static Vec Madd(Vec acc, Vec x, Vec w) { return _mm512_dpbusd_epi32(acc, x, w); }
  static Acc Total(Vec v) { return _mm512_reduce_add_epi32(v); }
};

struct Float32 : gpt_kernels::avx512::FloatLanes {
  using X = float;
  using W = float;
  using Acc = float;
  using Out = float;
  static Acc Total(Vec v) { return Sum(v); }
  static constexpr bool kShifted = false;
  static constexpr int kTileRows = 6;
  static constexpr int TileOutputs(int rows) { return rows <= 2 ? 1 : 4; }  // 1-2 rows: one stream of w
};

// y[r, j] for R rows of x and `Outputs` rows of w (masked loads read zeros past D: they add nothing). With
// Ops::kShifted (int8), `shift[j]` is 128 times row j's sum: the first group of rows computes it, the others
// take it; the exact integer sum is then scaled by the row's and the output's scales, in that order (as
// `Int8Matrix.matmul` does in XLA).
// Each load of w is preceded by a prefetch of one line of the next tile, whose `Outputs` rows are one block of
// memory ([K, D] is row-major): the steps walk that block in address order, `Outputs` lines a step, so the
// next tile is in the cache when it starts (past the last tile they read nothing: a prefetch never faults).
// The tile's own loads jump between `Outputs` short rows (GPT-2's 768 bytes in int8), too many streams, each
// too short, for the hardware's prefetchers to run ahead of. On a 2-core AMD EPYC (Zen 5) the int8 chain of
// GPT-2 124M's 49 matrices took 2.3-3.2 ms for 1 row against 2.7-3.5 with the prefetches at the same place
// in each of the next tile's rows, and 4.0-4.3 with none; 3.4-3.5 against 3.7-4.1 for 8 rows (alternating
// processes).
template <class Ops, int R, int Outputs, bool First>
void Tile(const typename Ops::X* x, const typename Ops::W* w, Scales scales, int64_t D, int64_t K,
          typename Ops::Out* y, typename Ops::Acc* shift) {
  constexpr bool kSums = Ops::kShifted && First;
  typename Ops::Vec acc[R][Outputs];
  typename Ops::Vec sums[Outputs];
#pragma GCC unroll 16
  for (int j = 0; j < Outputs; ++j) {
    sums[j] = Ops::Zero();
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) acc[r][j] = Ops::Zero();
  }
  const auto step = [&](int64_t d, typename Ops::Mask lanes) {
    typename Ops::Vec w_chunk[Outputs];
#pragma GCC unroll 16
    for (int j = 0; j < Outputs; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(w + Outputs * D + d * Outputs + j * Ops::kLanes), _MM_HINT_T0);
      w_chunk[j] = Ops::Load(w + j * D + d, lanes);
      if constexpr (kSums) sums[j] = Ops::Madd(sums[j], Ops::Ones(), w_chunk[j]);
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const auto x_chunk = Ops::Load(x + r * D + d, lanes);
#pragma GCC unroll 16
      for (int j = 0; j < Outputs; ++j) acc[r][j] = Ops::Madd(acc[r][j], x_chunk, w_chunk[j]);
    }
  };
  const int64_t full = D / Ops::kLanes * Ops::kLanes;
  for (int64_t d = 0; d < full; d += Ops::kLanes) step(d, Ops::Lanes(Ops::kLanes));
  if (D > full) step(full, Ops::Lanes(D - full));
#pragma GCC unroll 16
  for (int j = 0; j < Outputs; ++j) {
    if constexpr (kSums) shift[j] = 128 * Ops::Total(sums[j]);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      if constexpr (Ops::kShifted)
        y[r * K + j] = static_cast<float>(Ops::Total(acc[r][j]) - shift[j]) * scales.x[r] * scales.w[j];
      else
        y[r * K + j] = Ops::Total(acc[r][j]);
    }
  }
}

// All M rows in groups of at most Ops::kTileRows, against `Outputs` rows of w. Only int8's later groups differ
// from its first (they take the row sums it made): float32's share one instantiation.
template <class Ops, int M, int Outputs, bool First = true>
void Groups(const typename Ops::X* x, const typename Ops::W* w, Scales scales, int64_t D, int64_t K,
            typename Ops::Out* y, typename Ops::Acc* shift) {
  constexpr int R = M < Ops::kTileRows ? M : Ops::kTileRows;
  Tile<Ops, R, Outputs, First>(x, w, scales, D, K, y, shift);
  if constexpr (M > R) {
    const Scales rest{scales.x == nullptr ? nullptr : scales.x + R, scales.w};
    Groups<Ops, M - R, Outputs, !Ops::kShifted>(x + R * D, w, rest, D, K, y + R * K, shift);
  }
}

template <class Ops, int M>
void Rows(const void* x_void, const void* w_void, Scales scales, int64_t D, int64_t K, int64_t k_begin,
          int64_t k_end, void* y_void) {
  const auto* x = static_cast<const typename Ops::X*>(x_void);
  const auto* w = static_cast<const typename Ops::W*>(w_void);
  auto* y = static_cast<typename Ops::Out*>(y_void);
  constexpr int outputs = Ops::TileOutputs(M);
  typename Ops::Acc shift[outputs];
  const auto at = [&](int64_t k) { return Scales{scales.x, scales.w == nullptr ? nullptr : scales.w + k}; };
  int64_t k = k_begin;
  for (; k + outputs <= k_end; k += outputs) Groups<Ops, M, outputs>(x, w + k * D, at(k), D, K, y + k, shift);
  for (; k < k_end; ++k) Groups<Ops, M, 1>(x, w + k * D, at(k), D, K, y + k, shift);
}

}  // namespace avx512

#pragma GCC pop_options

// ---------------------------------------------------------------- int8, AVX2

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
__attribute__((target("avx2"))) void Int8Avx2(const void* x_void, const void* w_void, Scales scales, int64_t D,
                                              int64_t K, int64_t k_begin, int64_t k_end, void* y_void) {
  const auto* x = static_cast<const int8_t*>(x_void);
  const auto* w = static_cast<const int8_t*>(w_void);
  auto* y = static_cast<float*>(y_void);
  const __m256i ones16 = _mm256_set1_epi16(1);
  const int64_t full = D / 32 * 32;
  for (int64_t k = k_begin; k < k_end; ++k) {
    const int8_t* w_row = w + k * D;
    __m256i acc[M];
    #pragma GCC unroll 16
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_si256();
    for (int64_t d = 0; d < D; d += 32) {
      const bool whole = d < full;
      const __m256i w_chunk = whole ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w_row + d))
                                    : TailLoad(w_row + d, D - d);
      const __m256i w_abs = _mm256_sign_epi8(w_chunk, w_chunk);
      #pragma GCC unroll 16
      for (int m = 0; m < M; ++m) {
        const __m256i x_chunk = whole ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + m * D + d))
                                      : TailLoad(x + m * D + d, D - d);
        const __m256i pairs = _mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(x_chunk, w_chunk));
        acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(pairs, ones16));
      }
    }
    #pragma GCC unroll 16
    for (int m = 0; m < M; ++m) y[m * K + k] = static_cast<float>(Sum8(acc[m])) * scales.x[m] * scales.w[k];
  }
}

// ---------------------------------------------------------------- float32, AVX2 with FMA

template <int M>
__attribute__((target("avx2,fma"))) void Float32Avx2(const void* x_void, const void* w_void, Scales, int64_t D,
                                                     int64_t K, int64_t k_begin, int64_t k_end, void* y_void) {
  const auto* x = static_cast<const float*>(x_void);
  const auto* w = static_cast<const float*>(w_void);
  auto* y = static_cast<float*>(y_void);
  const int64_t full = D / 8 * 8;
  const __m256i tail = avx2::FloatLanes::Lanes(D - full);
  for (int64_t k = k_begin; k < k_end; ++k) {
    const float* w_row = w + k * D;
    __m256 acc[M];
    #pragma GCC unroll 16
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t d = 0; d < full; d += 8) {
      const __m256 w_chunk = _mm256_loadu_ps(w_row + d);
      #pragma GCC unroll 16
      for (int m = 0; m < M; ++m) acc[m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * D + d), w_chunk, acc[m]);
    }
    if (D > full) {
      const __m256 w_chunk = _mm256_maskload_ps(w_row + full, tail);
      #pragma GCC unroll 16
      for (int m = 0; m < M; ++m)
        acc[m] = _mm256_fmadd_ps(_mm256_maskload_ps(x + m * D + full, tail), w_chunk, acc[m]);
    }
    #pragma GCC unroll 16
    for (int m = 0; m < M; ++m) y[m * K + k] = avx2::FloatLanes::Sum(acc[m]);
  }
}

// ---------------------------------------------------------------- dispatch

// The kernels of one (dtype, instruction set), one per row count M: Table::At<M>.
struct Int8Avx512Table {
  template <int M>
  static constexpr Kernel At = &avx512::Rows<avx512::Int8, M>;
};
struct Float32Avx512Table {
  template <int M>
  static constexpr Kernel At = &avx512::Rows<avx512::Float32, M>;
};
struct Int8Avx2Table {
  template <int M>
  static constexpr Kernel At = &Int8Avx2<M>;
};
struct Float32Avx2Table {
  template <int M>
  static constexpr Kernel At = &Float32Avx2<M>;
};

template <class Table, int... Ms>
Kernel Pick(int rows, std::integer_sequence<int, Ms...>) {
  Kernel kernel = nullptr;
  ((rows == Ms + 1 ? (kernel = Table::template At<Ms + 1>) : kernel), ...);
  return kernel;
}

// The outputs split over XLA's CPU threads, at least 64 each, so that a small matrix is not split into pieces
// smaller than a task's cost.
void RunOnPool(ffi::ThreadPool& pool, Kernel kernel, const void* x, const void* w, Scales scales, void* y, int64_t D,
               int64_t K) {
  ParallelFor(pool, K, 64, [=](int64_t begin, int64_t end) { kernel(x, w, scales, D, K, begin, end, y); });
}

// [M, D] and [K, D] with 1 <= M <= 16 on a CPU the kernels run on, or the error to return.
std::optional<ffi::Error> CheckShapes(ffi::AnyBuffer::Dimensions x, ffi::AnyBuffer::Dimensions w) {
  if (x.size() != 2 || w.size() != 2 || x[1] != w[1])
    return ffi::Error::InvalidArgument("few_rows: x must be [M, D] and w [K, D]");
  if (x[0] < 1 || x[0] > kMaxRows || Isa() == 0)
    return ffi::Error::InvalidArgument("few_rows: 1 to 16 rows on a CPU with AVX2 and FMA");
  return std::nullopt;
}

ffi::Error FewRowsInt8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w,
                           ffi::Buffer<ffi::F32> w_scale, ffi::ResultBuffer<ffi::F32> y) {
  if (auto error = CheckShapes(x.dimensions(), w.dimensions())) return *error;
  const int64_t M = x.dimensions()[0], D = x.dimensions()[1], K = w.dimensions()[0];
  if (w_scale.element_count() != static_cast<size_t>(K))
    return ffi::Error::InvalidArgument("few_rows: w's scales must be [K]");
  const auto rows = std::make_integer_sequence<int, kMaxRows>{};
  const bool vnni = Isa() == 2;
  float x_scale[kMaxRows];
  thread_local std::vector<uint8_t> x_int8;  // int8, or with VNNI x + 128 (its unsigned operand); kept from call
  x_int8.resize(M * D);                      // to call (a decode step makes dozens)
  QuantizeRows(x.typed_data(), M, D, vnni ? 128 : 0, x_scale, x_int8.data());
  const Kernel kernel = vnni ? Pick<Int8Avx512Table>(M, rows) : Pick<Int8Avx2Table>(M, rows);
  RunOnPool(pool, kernel, x_int8.data(), w.typed_data(), Scales{x_scale, w_scale.typed_data()}, y->typed_data(), D,
            K);
  return ffi::Error::Success();
}

ffi::Error FewRowsFloat32Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                              ffi::ResultBuffer<ffi::F32> y) {
  if (auto error = CheckShapes(x.dimensions(), w.dimensions())) return *error;
  const int64_t M = x.dimensions()[0], D = x.dimensions()[1], K = w.dimensions()[0];
  const auto rows = std::make_integer_sequence<int, kMaxRows>{};
  const Kernel kernel = Isa() == 2 ? Pick<Float32Avx512Table>(M, rows) : Pick<Float32Avx2Table>(M, rows);
  RunOnPool(pool, kernel, x.typed_data(), w.typed_data(), Scales{}, y->typed_data(), D, K);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace gpt_kernels

XLA_FFI_DEFINE_HANDLER_SYMBOL(FewRowsInt8, gpt_kernels::FewRowsInt8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(FewRowsFloat32, gpt_kernels::FewRowsFloat32Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
