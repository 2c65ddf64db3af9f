// What the CPU kernels share: the instruction set they may use, and XLA's CPU threads to split work over.

#pragma once

#include <cstdint>
#include <functional>

#include "xla/ffi/api/ffi.h"

namespace gpt_kernels {

// 2 = AVX-512 (F and BW, with VNNI), 1 = AVX2 with FMA, 0 = neither (the callers keep to XLA's ops): what the
// CPU has, capped by `CpuKernelsLimitIsa`, so that the AVX2 paths can be run and tested on a CPU with both.
int Isa();

// body(begin, end) over [0, n) in blocks of at least `min_block` items (several blocks a thread, so that an
// uneven pool still finishes together), each claimed by whichever of XLA's CPU threads, or this one, is free;
// returns when every block is done.
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t n, int64_t min_block,
                 std::function<void(int64_t, int64_t)> body);

}  // namespace gpt_kernels
