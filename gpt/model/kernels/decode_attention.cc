// A decode step's attention on CPU, as an XLA FFI custom call: one query per (batch row, head) over a paged
// KV cache (gpt/model/kv_cache.py), reading only the slots each query sees.
//
//   DecodeAttention(q [M, H], positions [M] int32, rows [M] int32, k pages..., v pages...; window, ring) -> [M, H]
//
// float32 throughout. Query m sees positions 0..positions[m] of the cache's row rows[m] (with a window W > 0, a
// local layer's: the last W of them, positions[m] - W + 1..positions[m]); the pages are buffers
// [R, P, H] of consecutive slots (each its own length P), the keys' pages first, then as many of the
// values'. Slot s holds position s, or in a ring (ring > 0: one page of that many slots, W <= ring) position
// p in slot p mod ring. The softmax is scale * q.k over the seen slots, its largest score subtracted before exp.
// XLA ran
// the same as about 25 small programs a layer (per page: two dots, the mask, a max, an exp, a sum, and a
// conditional; then their combination), each with its own dispatch; this is one call that reads each
// seen key and value once. Rows are split over XLA's CPU threads; AVX-512 or AVX2 (with FMA) picked at
// run time (runtime.h).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#include "float_lanes.h"
#include "runtime.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace gpt_kernels {

constexpr int64_t kMaxHeadDim = 128;  // its vectors stay in registers; a larger head is XLA's

// One call's operands, as pointers.
struct Attention {
  const float* q;
  const int32_t* positions;
  const int32_t* rows;
  float* out;
  int64_t head_dim, slots;  // slots: all the pages' together
  float scale;
  int64_t window;  // how many positions a query sees, its own the last; 0: all up to its own
  int64_t ring;    // a ring's slots (position p in slot p mod ring); 0: slot s holds position s
  std::vector<const float*> k, v;
  std::vector<int64_t> page_slots;
};

#pragma GCC push_options
#pragma GCC target("avx512f")
namespace avx512 {
#include "attend_rows.inc"
}  // namespace avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
#include "attend_rows.inc"
}  // namespace avx2
#pragma GCC pop_options

namespace {

// The pages' pointers and lengths into `a`, or the error to return: an even number of float32 buffers
// [R, P, H], the keys' and values' alike, every query's row below R.
std::optional<ffi::Error> TakePages(const ffi::RemainingArgs& pages, int64_t M, Attention& a) {
  const int64_t count = static_cast<int64_t>(pages.size()) / 2;
  if (count == 0 || pages.size() % 2 != 0)
    return ffi::Error::InvalidArgument("decode_attention: as many value pages as key pages, at least one");
  int64_t buffer_rows = -1;
  for (int64_t i = 0; i < 2 * count; ++i) {
    auto page = pages.get<ffi::AnyBuffer>(i);
    if (!page.has_value()) return page.error();
    const auto dims = page->dimensions();
    if (page->element_type() != ffi::DataType::F32 || dims.size() != 3 || dims[2] != a.head_dim ||
        (buffer_rows >= 0 && dims[0] != buffer_rows) || (i >= count && dims[1] != a.page_slots[i - count]))
      return ffi::Error::InvalidArgument("decode_attention: pages must be float32 [R, P, H], keys' and values' alike");
    buffer_rows = dims[0];
    const auto* data = static_cast<const float*>(page->untyped_data());
    if (i < count) {
      a.k.push_back(data);
      a.page_slots.push_back(dims[1]);
      a.slots += dims[1];
    } else {
      a.v.push_back(data);
    }
  }
  for (int64_t m = 0; m < M; ++m)
    if (a.rows[m] < 0 || a.rows[m] >= buffer_rows)
      return ffi::Error::InvalidArgument("decode_attention: a query's row is outside the pages' rows");
  return std::nullopt;
}

ffi::Error DecodeAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::S32> positions,
                               ffi::Buffer<ffi::S32> rows, ffi::RemainingArgs pages, int64_t window,
                               int64_t ring, ffi::ResultBuffer<ffi::F32> out) {
  const auto dims = q.dimensions();
  const size_t M = dims.size() == 2 ? dims[0] : 0;
  if (dims.size() != 2 || positions.element_count() != M || rows.element_count() != M)
    return ffi::Error::InvalidArgument("decode_attention: q must be [M, H], positions and rows [M]");
  if (Isa() == 0) return ffi::Error::InvalidArgument("decode_attention: a CPU with AVX2 and FMA");
  if (dims[1] < 1 || dims[1] > kMaxHeadDim) return ffi::Error::InvalidArgument("decode_attention: heads of 1 to 128");
  Attention a{q.typed_data(), positions.typed_data(), rows.typed_data(), out->typed_data(), dims[1], 0,
              static_cast<float>(1.0 / std::sqrt(static_cast<double>(dims[1]))), window, ring, {}, {}, {}};
  if (window < 0) return ffi::Error::InvalidArgument("decode_attention: a window of 0 (none) or more slots");
  if (auto error = TakePages(pages, M, a)) return *error;
  if (ring < 0 || (ring > 0 && (a.page_slots.size() != 1 || a.page_slots[0] != ring || window < 1 || window > ring)))
    return ffi::Error::InvalidArgument("decode_attention: a ring is one page of its slots, a window of 1 to them");
  const bool wide = Isa() == 2;
  ParallelFor(pool, M, 1, [&a, wide](int64_t begin, int64_t end) {
    thread_local std::vector<float> scores;  // a row's scores, kept from call to call (a decode step makes dozens)
    scores.resize(a.ring > 0 ? a.window : a.slots);  // a row's scores, from its first seen position
    wide ? avx512::AttendRowsOfHead(a, begin, end, scores.data())
         : avx2::AttendRowsOfHead(a, begin, end, scores.data());
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace gpt_kernels

XLA_FFI_DEFINE_HANDLER_SYMBOL(DecodeAttention, gpt_kernels::DecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .Attr<int64_t>("window")
                                  .Attr<int64_t>("ring")
                                  .Ret<ffi::Buffer<ffi::F32>>());
