// The instruction set the kernels use, the split of a call's work over XLA's CPU threads, and the rows of x
// quantized to int8 (runtime.h).

#include "runtime.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <utility>

namespace gpt_kernels {

namespace {

std::atomic<int> isa_limit{2};

// The blocks of one call. Held by a shared_ptr so that a pool task starting after the call has returned
// finds nothing left to do (and never calls the body, whose captures are gone).
struct Work {
  std::function<void(int64_t, int64_t)> body;
  int64_t n, block, blocks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Drain() {
    for (int64_t b; (b = next.fetch_add(1)) < blocks;) {
      body(b * block, std::min(n, (b + 1) * block));
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

}  // namespace

int Isa() {
  static const int detected = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vnni"))
      return 2;
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 1 : 0;
  }();
  return std::min(detected, isa_limit.load());
}

void ParallelFor(xla::ffi::ThreadPool& pool, int64_t n, int64_t min_block,
                 std::function<void(int64_t, int64_t)> body) {
  auto work = std::make_shared<Work>();
  work->body = std::move(body);
  work->n = n;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  work->block = std::max<int64_t>(min_block, (n + 4 * threads - 1) / (4 * threads));
  work->blocks = (n + work->block - 1) / work->block;
  for (int64_t t = 1; t < std::min(threads, work->blocks); ++t) pool.Schedule([work] { work->Drain(); });
  work->Drain();  // this thread works too, so the call finishes even if no pool thread is free
  while (work->done.load(std::memory_order_acquire) < work->blocks) _mm_pause();
}

// A few thousand values a call, in loops the compiler vectorizes for each instruction set (the clone for the CPU
// picked when the library loads).
__attribute__((noinline, target_clones("avx512f", "avx2", "default"))) void QuantizeRows(
    const float* __restrict x, int64_t M, int64_t D, int offset, float* __restrict scale, uint8_t* __restrict q) {
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding and taking it away rounds to an integer
  for (int64_t m = 0; m < M; ++m, x += D, q += D) {
    uint32_t largest = 0;  // of |x|'s bits, whose order as integers is that of the floats
    for (int64_t d = 0; d < D; ++d) {
      uint32_t bits;
      std::memcpy(&bits, x + d, sizeof bits);
      bits &= 0x7fffffffu;
      largest = bits > largest ? bits : largest;
    }
    float row_max;
    std::memcpy(&row_max, &largest, sizeof row_max);
    const float row_scale = row_max / 127.0f > 0.0f ? row_max / 127.0f : 1.0f;
    scale[m] = row_scale;
    for (int64_t d = 0; d < D; ++d) {
      float rounded = (x[d] / row_scale + kRound) - kRound;
      rounded = rounded > -127.0f ? rounded : -127.0f;  // a no-op but for NaN, which becomes -127
      rounded = rounded < 127.0f ? rounded : 127.0f;
      q[d] = static_cast<uint8_t>(static_cast<int32_t>(rounded) + offset);
    }
  }
}

}  // namespace gpt_kernels

extern "C" int CpuKernelsIsa() { return gpt_kernels::Isa(); }

extern "C" int CpuKernelsLimitIsa(int limit) {
  gpt_kernels::isa_limit.store(limit);
  return gpt_kernels::Isa();
}
