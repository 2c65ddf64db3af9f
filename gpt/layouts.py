"""Weight layouts: how a matrix of the forward is stored, and the one matmul every layout goes through.

The model's parameters are plain arrays whose leading axes are a map's inputs ([D, ...]); training uses
them as they are. A decoder may store the same weights differently (`gpt.decoding`), and the forward runs
either unchanged because every matmul is `dense(x, kernel)`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

__all__ = ["OutputMajor", "dense"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OutputMajor:
    """A matrix stored [K, D] for a map from D inputs to K outputs, so that each output's weights are
    contiguous. The tied LM head is one by nature (the embedding table is [V, D]); XLA on CPU also runs the
    matrix-vector products of decoding faster over this layout (`gpt.decoding`)."""

    matrix_KD: jax.Array

    def astype(self, dtype) -> OutputMajor:
        return OutputMajor(self.matrix_KD.astype(dtype))

    def matmul(self, x_MD: jax.Array) -> jax.Array:
        """x [M, D] -> [M, K]. Contracting D of both operands directly: spelled `x @ matrix.T`, XLA on CPU
        would copy the transposed matrix first."""
        return jax.lax.dot_general(x_MD, self.matrix_KD.astype(x_MD.dtype), (((1,), (1,)), ((), ())))


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
