"""The matmuls of a decode step's few rows: compiled CPU kernels where they run, XLA's dots elsewhere.

A decode step multiplies 1-16 rows by every weight matrix once, so its speed is the speed at which the
weights are read. XLA's CPU dots fall short of that for so few rows: its int8 dot reads at half the
memory's speed, and its float32 GEMM for 2-16 rows is far from it. `kernels/few_rows.cc` holds two XLA FFI
custom calls that read each output's weights once for all rows with AVX-512 (VNNI for int8) or AVX2, picked
at run time, over XLA's own CPU threads (where they run: `gpt.model.cpu_kernels`): float32, and int8 with
scales (x's rows quantized, the exact int8 x int8 -> int32 product, rescaled: the whole of
`Int8Matrix.matmul` in one call, where XLA runs it as several small programs); `kernels/few_rows_int4.cc` the
int4 product (`Int4Matrix.matmul`) in AVX2. Elsewhere every product is XLA's: for 2-16 float32 rows on a CPU a
multiply and a sum (`xla_few_rows`), otherwise a dot; int8 as `xla_int8_product`, int4 as `xla_int4_product`. Figures: bench/RESULTS.md, "CPU decoding".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gpt.model import cpu_kernels, int4
from gpt.model.backend import choices

__all__ = ["MAX_KERNEL_ROWS", "product", "kernel_product", "xla_product", "xla_few_rows", "at_least_two_rows",
           "int8_product", "kernel_int8_product", "xla_int8_product", "quantize_rows", "int4_product",
           "kernel_int4_product", "xla_int4_product"]

MAX_KERNEL_ROWS = 16  # more rows (a prefill) make a GEMM, which XLA's dot runs well


def _kernel_runs(x_MD: jax.Array) -> bool:
    return x_MD.shape[0] <= MAX_KERNEL_ROWS and cpu_kernels.isa() is not None


def kernel_product(x_MD: jax.Array, matrix_KD: jax.Array) -> jax.Array:
    """float32 x [M, D] times matrix [K, D] contracting D, in the compiled kernel: float32 [M, K]. 1 <= M <= 16;
    only where `cpu_kernels.isa()` is not None."""
    result = jax.ShapeDtypeStruct((x_MD.shape[0], matrix_KD.shape[0]), jnp.float32)
    return cpu_kernels.call("gpt_few_rows_float32", result)(x_MD, matrix_KD)


def kernel_int8_product(x_MD: jax.Array, values_KD: jax.Array, scale_K: jax.Array) -> jax.Array:
    """`xla_int8_product` in the compiled kernel, equal to it: float32 [M, K]. 1 <= M <= 16; only where
    `cpu_kernels.isa()` is not None."""
    result = jax.ShapeDtypeStruct((x_MD.shape[0], values_KD.shape[0]), jnp.float32)
    return cpu_kernels.call("gpt_few_rows_int8", result)(x_MD, values_KD, scale_K)


def quantize_rows(x_MD: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each row of float32 x [M, D] as int8 with its own scale (symmetric: max |x| / 127; 1 for a row of
    zeros), rounded half to even: (int8 [M, D], float32 scales [M]); x ~= values * scale[:, None]."""
    scale_M = jnp.abs(x_MD).max(axis=1) / 127.0
    scale_M = jnp.where(scale_M > 0, scale_M, 1.0)
    return jnp.round(x_MD / scale_M[:, None]).astype(jnp.int8), scale_M


def xla_int8_product(x_MD: jax.Array, values_KD: jax.Array, scale_K: jax.Array) -> jax.Array:
    """float32 x [M, D] times the int8 matrix values [K, D] * scale [K] (per output), contracting D: x's rows
    quantized (`quantize_rows`), the exact int8 x int8 -> int32 product, then scaled by x's row's scale and
    the output's, in that order: float32 [M, K]."""
    x_int8_MD, x_scale_M = quantize_rows(x_MD)
    return xla_product(x_int8_MD, values_KD).astype(jnp.float32) * x_scale_M[:, None] * scale_K[None, :]


def int8_product(x_MD: jax.Array, values_KD: jax.Array, scale_K: jax.Array) -> jax.Array:
    """`xla_int8_product`, by the kernel for 1-16 rows where it runs: float32 [M, K]."""
    if _kernel_runs(x_MD):
        return kernel_int8_product(x_MD, values_KD, scale_K)
    return xla_int8_product(x_MD, values_KD, scale_K)


def kernel_int4_product(x_MD: jax.Array, packed_KH: jax.Array, block_scale_KB: jax.Array, output_scale_K: jax.Array,
                        sums_K: jax.Array) -> jax.Array:
    """`xla_int4_product` in the compiled kernel, the integer sums exact: float32 [M, K]. 1 <= M <= 16; only where
    `cpu_kernels.isa()` is not None. sums_K: `Int4Matrix.sums_K` (the kernel's shifted x takes it back)."""
    result = jax.ShapeDtypeStruct((x_MD.shape[0], packed_KH.shape[0]), jnp.float32)
    return cpu_kernels.call("gpt_few_rows_int4", result)(x_MD, packed_KH, block_scale_KB, output_scale_K, sums_K)


def xla_int4_product(x_MD: jax.Array, packed_KH: jax.Array, block_scale_KB: jax.Array,
                     output_scale_K: jax.Array) -> jax.Array:
    """float32 x [M, D] times the int4 matrix (`gpt.model.int4`: packed [K, D / 2], block scales [K, D / 32],
    output scales [K]), contracting D: x's rows quantized to int8 (`quantize_rows`, as the int8 product's) times
    each weight's level and block scale, then scaled by the output's scale and x's row's: float32 [M, K]. The
    sums in float32 (exact where they stay under 2^24; the kernel's in int32 always are). On a GPU or a TPU XLA
    fuses the unpacking into the dot's operand."""
    x_int8_MD, x_scale_M = quantize_rows(x_MD)
    weights_KD = int4.integer_weights(packed_KH, block_scale_KB).astype(jnp.float32)
    return xla_product(x_int8_MD.astype(jnp.float32), weights_KD) * output_scale_K[None, :] * x_scale_M[:, None]


def int4_product(x_MD: jax.Array, packed_KH: jax.Array, block_scale_KB: jax.Array, output_scale_K: jax.Array,
                 sums_K: jax.Array) -> jax.Array:
    """`xla_int4_product`, by the kernel where it runs: float32 [M, K]. More than 16 rows (a prefill) go through it
    16 at a time, each row's products the same as alone: on a CPU, XLA's alternative makes a float copy of every
    matrix, several times slower than the kernel's passes (bench/RESULTS.md, "int4 decoding at 1B")."""
    operands = (packed_KH, block_scale_KB, output_scale_K, sums_K)
    M, D = x_MD.shape
    if cpu_kernels.isa() is None:
        return xla_int4_product(x_MD, *operands[:3])
    if M <= MAX_KERNEL_ROWS:
        return kernel_int4_product(x_MD, *operands)
    chunks = -(-M // MAX_KERNEL_ROWS)
    padded = jnp.pad(x_MD, ((0, chunks * MAX_KERNEL_ROWS - M), (0, 0))).reshape(chunks, MAX_KERNEL_ROWS, D)
    return jax.lax.map(lambda x: kernel_int4_product(x, *operands), padded).reshape(-1, packed_KH.shape[0])[:M]


def xla_few_rows(x_MD: jax.Array, matrix_KD: jax.Array) -> jax.Array:
    """x [M, D] times matrix [K, D] contracting D, for small M: one elementwise multiply and a sum over D,
    which XLA fuses into one loop that reads each output's weights once for all M rows: [M, K]."""
    return (matrix_KD[:, None, :] * x_MD[None, :, :]).sum(axis=-1).T


# XLA's CPU dot runs 1 float32 row as a matrix-vector product at the memory's speed, but 2 to 16 rows as a
# GEMM far from it, which `xla_few_rows` beats (`python bench/decode_parts.py` times the two on a machine;
# bench/RESULTS.md, "The two parts of a step, each against its alternatives", under "Serving"). From 64 rows
# the GEMM wins again.
_XLA_FEW_ROWS = range(2, 17)


def at_least_two_rows(x_MD: jax.Array) -> jax.Array:
    """XLA's CPU dot for int8 or bfloat16 operands falls off its fast path for a single row (about 10x
    slower than two: bench/RESULTS.md, "Quantized decoding"), so one row runs as two (the second all zeros)."""
    return jnp.concatenate([x_MD, jnp.zeros_like(x_MD)]) if x_MD.shape[0] == 1 else x_MD


def xla_product(x_MD: jax.Array, matrix_KD: jax.Array) -> jax.Array:
    """The same product through XLA: [M, K], int32 for int8 operands (exact), else x's dtype."""
    M = x_MD.shape[0]
    if x_MD.dtype == jnp.int8:
        return jax.lax.dot_general(at_least_two_rows(x_MD), matrix_KD, (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.int32)[:M]
    if M in _XLA_FEW_ROWS and x_MD.dtype == jnp.float32 and choices().few_rows_matmul:
        return xla_few_rows(x_MD, matrix_KD)
    return jax.lax.dot_general(x_MD, matrix_KD, (((1,), (1,)), ((), ())))


def product(x_MD: jax.Array, matrix_KD: jax.Array) -> jax.Array:
    """x [M, D] times an output-major matrix [K, D] of x's dtype, contracting D: [M, K] in x's dtype; by the
    kernel for 1-16 float32 rows where it runs, by XLA otherwise."""
    if x_MD.dtype == jnp.float32 and _kernel_runs(x_MD):
        return kernel_product(x_MD, matrix_KD)
    return xla_product(x_MD, matrix_KD)
