"""Weight layouts: how a matrix of the forward is stored, and the one matmul every layout goes through.

The model's parameters are plain arrays whose leading axes are a map's inputs ([D, ...]); training uses
them as they are. A decoder may store the same weights differently (`gpt.inference.decoding`): output-major in
float32, int8 with a scale per output, int4 with a scale per block of 32 inputs, or bfloat16; the forward runs any
of them unchanged because every matmul is `dense(x, kernel)`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from gpt.model import int4
from gpt.model.few_rows import at_least_two_rows, int4_product, int8_product, product, quantize_rows
from gpt.model.fp8 import fp8_matmul

__all__ = ["OutputMajor", "Int8Matrix", "Int4Matrix", "Bf16Matrix", "Fp8Kernel", "QUANTIZED_LAYOUTS", "dense"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OutputMajor:
    """A matrix stored [K, D] for a map from D inputs to K outputs, so that each output's weights are
    contiguous. The tied LM head is one by nature (the embedding table is [V, D]); XLA on CPU also runs the
    matrix-vector products of decoding faster over this layout (`gpt.inference.decoding`)."""

    matrix_KD: jax.Array

    def astype(self, dtype) -> OutputMajor:
        return OutputMajor(self.matrix_KD.astype(dtype))

    def matmul(self, x_MD: jax.Array) -> jax.Array:
        """x [M, D] -> [M, K]. Contracting D of both operands directly: spelled `x @ matrix.T`, XLA on CPU
        would copy the transposed matrix first. A decode step's few rows take `gpt.model.few_rows`."""
        return product(x_MD, self.matrix_KD.astype(x_MD.dtype))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Kernel:
    """A training kernel [D, ...] whose product with x runs in FP8 (`gpt.model.fp8.fp8_matmul`): both operands
    rounded to e4m3 forward, the gradient to e5m2 backward."""

    kernel: jax.Array

    def matmul(self, x_MD: jax.Array) -> jax.Array:
        return fp8_matmul(x_MD, self.kernel.reshape(x_MD.shape[1], -1))


def dense(x_BTD: jax.Array, kernel) -> jax.Array:
    """x [B, T, D] times a kernel: [B, T, K], as one 2-D matmul over B*T rows.

    `kernel` is an array whose leading axes are the D inputs ([D, ...], flattened to [D, K]), or a layout
    object with a `matmul(x_MD) -> [M, K]` method (`OutputMajor`). XLA on CPU runs a dot that contracts two
    axes (the kernel gradient of a 3-D matmul contracts B and T) ~3x slower than the same 2-D GEMM; the
    reshapes are free.
    """
    B, T, D = x_BTD.shape
    x_MD = x_BTD.reshape(B * T, D)
    y_MK = kernel.matmul(x_MD) if hasattr(kernel, "matmul") else x_MD @ kernel.reshape(D, -1).astype(x_MD.dtype)
    return y_MK.reshape(B, T, -1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int8Matrix:
    """An output-major matrix [K, D] stored as int8 with one float32 scale per output (symmetric):
    matrix ~= values * scale[:, None]. A quarter of float32's bytes, which is what a decode step streams.

    `matmul` quantizes each row of x to int8 with its own scale (max |x| / 127), takes the exact
    int8 x int8 -> int32 product and rescales it by both scales (`gpt.model.few_rows.int8_product`: one
    compiled kernel for a decode step's few rows on a CPU, XLA's ops otherwise): the float matrix is never
    made. Its `astype` keeps it int8 (the block casts kernels to the compute dtype; this one stays as stored).
    """

    values_KD: jax.Array
    scale_K: jax.Array

    @classmethod
    def quantize(cls, matrix_KD: jax.Array) -> Int8Matrix:
        return cls(*quantize_rows(matrix_KD.astype(jnp.float32)))  # an output's weights are a row

    def dequantize(self) -> jax.Array:
        """The float32 matrix [K, D] this one stands for (for tests and quality checks)."""
        return self.values_KD.astype(jnp.float32) * self.scale_K[:, None]

    def astype(self, dtype) -> Int8Matrix:
        return self

    def matmul(self, x_MD: jax.Array) -> jax.Array:
        return int8_product(x_MD.astype(jnp.float32), self.values_KD, self.scale_K).astype(x_MD.dtype)

    def rows(self, ids: jax.Array) -> jax.Array:
        """Rows `ids` of the matrix as float32 (an embedding lookup of a tied table): [..., D]."""
        return self.values_KD[ids].astype(jnp.float32) * self.scale_K[ids][..., None]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int4Matrix:
    """An output-major matrix [K, D] stored as int4 levels, each block of 32 inputs with an int8 scale of its own
    times its output's float32 scale (`gpt.model.int4`): 4.25 bits a weight, what a decode step streams.

    `matmul` quantizes x's rows to int8 as `Int8Matrix`'s does and multiplies them by the int4 weights
    (`gpt.model.few_rows.int4_product`: one compiled kernel for a decode step's few rows on a CPU, exact in
    integers; XLA's ops otherwise); the kernel never makes the float matrix. Its `astype` keeps it int4.

    Attributes:
      packed_KH: uint8 [K, D' / 2], two levels a byte (`gpt.model.int4.pack`); D' is D padded to whole pairs of
        blocks (64 inputs).
      block_scale_KB: int8 [K, D' / 32].
      output_scale_K: float32 [K].
      sums_K: int32 [K], each output's levels times their block scales, summed (the kernel's shifted x needs it).
      inputs: D, the matrix's own input count (static).
    """

    packed_KH: jax.Array
    block_scale_KB: jax.Array
    output_scale_K: jax.Array
    sums_K: jax.Array
    inputs: int = dataclasses.field(metadata=dict(static=True))

    @classmethod
    def quantize(cls, matrix_KD: jax.Array) -> Int4Matrix:
        K, D = matrix_KD.shape
        padded = jnp.pad(matrix_KD.astype(jnp.float32), ((0, 0), (0, -D % int4.PAIR)))
        levels, block_scale, output_scale = int4.quantize(padded)
        packed = int4.pack(levels)
        return cls(packed, block_scale, output_scale, int4.integer_weights(packed, block_scale).sum(axis=1), D)

    def dequantize(self) -> jax.Array:
        """The float32 matrix [K, D] this one stands for."""
        return int4.dequantize(self.packed_KH, self.block_scale_KB, self.output_scale_K)[:, :self.inputs]

    def astype(self, dtype) -> Int4Matrix:
        return self

    def matmul(self, x_MD: jax.Array) -> jax.Array:
        padded = jnp.pad(x_MD.astype(jnp.float32), ((0, 0), (0, 2 * self.packed_KH.shape[1] - self.inputs)))
        return int4_product(padded, self.packed_KH, self.block_scale_KB, self.output_scale_K,
                            self.sums_K).astype(x_MD.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Bf16Matrix:
    """An output-major matrix [K, D] stored in bfloat16: half of float32's bytes. `matmul` runs a bfloat16
    dot accumulating in float32; `astype` keeps it bfloat16."""

    values_KD: jax.Array

    @classmethod
    def quantize(cls, matrix_KD: jax.Array) -> Bf16Matrix:
        return cls(matrix_KD.astype(jnp.bfloat16))

    def dequantize(self) -> jax.Array:
        return self.values_KD.astype(jnp.float32)

    def astype(self, dtype) -> Bf16Matrix:
        return self

    def matmul(self, x_MD: jax.Array) -> jax.Array:
        M = x_MD.shape[0]
        y_MK = jax.lax.dot_general(at_least_two_rows(x_MD).astype(jnp.bfloat16), self.values_KD,
                                   (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        return y_MK[:M].astype(x_MD.dtype)

    def rows(self, ids: jax.Array) -> jax.Array:
        return self.values_KD[ids].astype(jnp.float32)


# --quantize: how a decoder stores its matrices (`gpt.inference.decoder.decoding_weights`).
QUANTIZED_LAYOUTS = {"int8": Int8Matrix, "int4": Int4Matrix, "bf16": Bf16Matrix}
