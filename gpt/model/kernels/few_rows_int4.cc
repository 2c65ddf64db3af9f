// The int4 product of a decode step's few rows on CPU, an XLA FFI custom call: float32 x [M, D] (M in 1..16)
// times an output-major int4 matrix (`gpt.model.int4`, `gpt.model.layouts.Int4Matrix`):
//
//   FewRowsInt4:  x [M, D] float32, packed [K, D / 2] uint8, block_scale [K, D / 32] int8, output_scale [K]
//                 float32, sums [K] int32  ->  y [M, K] float32
//
// The layout: each pair of blocks of 32 inputs is 32 bytes, byte i holding the first block's input i in its low
// nibble and the second's in its high one, each as q + 8 for q in [-8, 7]; a weight is
// q * block_scale[k, d / 32] * output_scale[k]; sums[k] is the sum of output k's q * block_scale.
//
// The product is `gpt.model.few_rows.xla_int4_product`'s: x's rows quantized to int8 with a scale each, the sum
// of x * q * block_scale over a whole row exact in int32 (`gpt.model.int4.largest_block_scale` keeps it under
// 2^31), then scaled by the output's scale and x's row's. As the int8 kernel (few_rows.cc), it reads each
// output's weights once for all rows: a decode step's bytes, about half of int8's.
//
// AVX2 (which every CPU with AVX-512 also runs): a pair's 32 bytes become a block's 32 bytes of q + 8 by a mask, and
// the next block's by a shift and a mask (no move across the vector's halves), then q (a subtraction); vpmaddubsw multiplies unsigned by signed bytes, so x is shifted to x + 128 and the
// shift taken back with the output's sums: sum (x + 128) q s = sum x q s + 128 sums[k]. Each pair of 16-bit
// products is at most 2 * 255 * 8 = 4080 (no saturation); vpmaddwd multiplies the pairs by the block's scale
// into 8 int32 lanes a row (each at most 2 * 4080 * 127 a block), added in int32, whose wrapping leaves the
// total right wherever the true sum fits (the shifted one may not: unsigned arithmetic takes the shift back).
// A block costs a row two multiplies and an add, as the int8 kernel's; no float until the row's end. The
// outputs are split over XLA's CPU threads (runtime.h).

#include <immintrin.h>

#include <cstdint>
#include <vector>

#include "runtime.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace gpt_kernels {
namespace {

constexpr int kMaxRows = 16;
constexpr int kTileRows = 4;  // rows of x a pass over one output's weights serves

__attribute__((target("avx2"))) inline uint32_t Lanes(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return static_cast<uint32_t>(_mm_cvtsi128_si32(s));
}

struct Operands {
  const uint8_t* x_u;        // [M, D], x quantized to int8 and shifted by 128
  const float* x_scale;      // [M]
  const uint8_t* packed;     // [K, D / 2]
  const int8_t* block_scale; // [K, D / 32]
  const float* output_scale; // [K]
  const int32_t* sums;       // [K]
  int64_t M, D, K;
  float* y;                  // [M, K]
};

// y[r, k] for rows [row, row + R) of x and output k.
template <int R>
__attribute__((target("avx2"))) void Tile(const Operands& o, int64_t row, int64_t k) {
  const __m256i low_nibbles = _mm256_set1_epi8(0x0f);
  const __m256i eight = _mm256_set1_epi8(8);
  const uint8_t* packed = o.packed + k * (o.D / 2);
  const int8_t* block_scale = o.block_scale + k * (o.D / 32);
  const uint8_t* x_u = o.x_u + row * o.D;
  __m256i acc[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_si256();
  for (int64_t pair = 0; pair < o.D / 64; ++pair) {
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed + 32 * pair));
#pragma GCC unroll 2
    for (int half = 0; half < 2; ++half) {
      const int64_t block = 2 * pair + half;
      const __m256i nibbles = half == 0 ? bytes : _mm256_srli_epi16(bytes, 4);
      const __m256i q = _mm256_sub_epi8(_mm256_and_si256(nibbles, low_nibbles), eight);
      const __m256i scale = _mm256_set1_epi16(block_scale[block]);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x_u + r * o.D + 32 * block));
        acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(_mm256_maddubs_epi16(x, q), scale));
      }
    }
  }
  const uint32_t shift = 128u * static_cast<uint32_t>(o.sums[k]);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    const auto total = static_cast<int32_t>(Lanes(acc[r]) - shift);
    o.y[(row + r) * o.K + k] = static_cast<float>(total) * o.output_scale[k] * o.x_scale[row + r];
  }
}

constexpr void (*kTiles[kTileRows])(const Operands&, int64_t, int64_t) = {&Tile<1>, &Tile<2>, &Tile<3>, &Tile<4>};

void Outputs(const Operands& o, int64_t k_begin, int64_t k_end) {
  for (int64_t k = k_begin; k < k_end; ++k)
    for (int64_t row = 0; row < o.M; row += kTileRows)
      kTiles[(o.M - row < kTileRows ? o.M - row : kTileRows) - 1](o, row, k);
}

ffi::Error FewRowsInt4Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> packed,
                           ffi::Buffer<ffi::S8> block_scale, ffi::Buffer<ffi::F32> output_scale,
                           ffi::Buffer<ffi::S32> sums, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), pd = packed.dimensions(), bd = block_scale.dimensions();
  if (xd.size() != 2 || pd.size() != 2 || bd.size() != 2 || xd[1] % 64 != 0 || xd[1] != 2 * pd[1] ||
      bd[0] != pd[0] || bd[1] != xd[1] / 32 || output_scale.element_count() != static_cast<size_t>(pd[0]) ||
      sums.element_count() != static_cast<size_t>(pd[0]))
    return ffi::Error::InvalidArgument(
        "few_rows_int4: x must be [M, D] with D a multiple of 64, packed [K, D / 2], block_scale [K, D / 32], "
        "output_scale and sums [K]");
  if (xd[0] < 1 || xd[0] > kMaxRows || Isa() == 0)
    return ffi::Error::InvalidArgument("few_rows_int4: 1 to 16 rows on a CPU with AVX2 and FMA");
  const int64_t M = xd[0], D = xd[1], K = pd[0];
  float x_scale[kMaxRows];
  thread_local std::vector<uint8_t> x_u;  // kept from call to call (a decode step makes dozens)
  x_u.resize(M * D);
  QuantizeRows(x.typed_data(), M, D, 128, x_scale, x_u.data());
  const Operands o{x_u.data(), x_scale, packed.typed_data(), block_scale.typed_data(), output_scale.typed_data(),
                   sums.typed_data(), M, D, K, y->typed_data()};
  ParallelFor(pool, K, 64, [&o](int64_t begin, int64_t end) { Outputs(o, begin, end); });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace gpt_kernels

XLA_FFI_DEFINE_HANDLER_SYMBOL(FewRowsInt4, gpt_kernels::FewRowsInt4Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
