// What the CPU kernels share: the instruction set they may use, XLA's CPU threads to split work over, and x's rows
// quantized to int8.

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

// x's rows [M, D] to int8 as `gpt.model.few_rows.quantize_rows` quantizes them in XLA: each row's scale max |x| /
// 127 (1 for a row of zeros), each value x / scale rounded half to even; plus `offset` (128 where the product
// wants an unsigned operand: VNNI's int8, the int4 kernel's). scale [M], q [M, D].
void QuantizeRows(const float* __restrict x, int64_t M, int64_t D, int offset, float* __restrict scale,
                  uint8_t* __restrict q);

}  // namespace gpt_kernels
