"""FP8 matrix products for training (`GPTConfig.fp8`): the MLP's two and the LM head's.

Each operand is scaled by a power of two so that its largest magnitude fits the FP8 format, rounded to it,
and scaled back ("quantize-dequantize"), then multiplied in the compute dtype with float32 accumulation:
forward operands (activations and weights) in e4m3 (3 mantissa bits, up to 448), the backward's incoming
gradient in e5m2 (2 mantissa bits, up to 57344: gradients span a wider range), tensor by tensor with the
scale of the current values, as torchtitan's and modded-nanogpt's FP8 recipes do. The backward products
reuse the forward's rounded operands.

That pattern (rounded to FP8, scaled back, multiplied) is what XLA's GPU compiler turns into one FP8 GEMM
of cuBLASLt on a Hopper GPU; elsewhere it runs as written and computes the same numbers (a power-of-two
scale makes every rounded value exact in bfloat16 and float32), so the CPU tests check the GPU's rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["E4M3", "E5M2", "quantize_dequantize", "fp8_matmul"]

E4M3 = jnp.float8_e4m3fn  # activations and weights
E5M2 = jnp.float8_e5m2  # gradients


def power_of_two_scale(amax: jax.Array, fp8_dtype) -> jax.Array:
    """float32 []: the smallest power of two s with amax / s <= the format's largest finite value (1 for
    amax 0, or a non-finite amax, which the step's finiteness check reports). Exact: from the exponents
    and mantissas of both (a float32 log2 and exp2 are approximations)."""
    largest_mantissa, largest_exponent = np.frexp(float(jnp.finfo(fp8_dtype).max))
    mantissa, exponent = jnp.frexp(amax.astype(jnp.float32))
    power = exponent - int(largest_exponent) + (mantissa > largest_mantissa).astype(exponent.dtype)
    scale = jnp.ldexp(jnp.float32(1), power)
    return jnp.where((amax > 0) & jnp.isfinite(amax), scale, 1.0)


def quantize_dequantize(x: jax.Array, fp8_dtype) -> jax.Array:
    """x rounded to `fp8_dtype` under one power-of-two scale for the whole tensor, in x's dtype and shape."""
    scale = power_of_two_scale(jnp.max(jnp.abs(x)), fp8_dtype)
    largest = jnp.finfo(fp8_dtype).max.astype(jnp.float32)
    rounded = jnp.clip(x.astype(jnp.float32) / scale, -largest, largest).astype(fp8_dtype)
    return (rounded.astype(x.dtype) * scale.astype(x.dtype)).astype(x.dtype)


def _product(a_MK: jax.Array, b_KN: jax.Array, dtype) -> jax.Array:
    return jnp.matmul(a_MK, b_KN, preferred_element_type=jnp.float32).astype(dtype)


@jax.custom_vjp
def fp8_matmul(x_MD: jax.Array, w_DK: jax.Array) -> jax.Array:
    """x [M, D] @ w [D, K] -> [M, K] in x's dtype, both operands rounded to e4m3; backward, the incoming
    gradient rounded to e5m2 and multiplied by the same rounded operands."""
    return _product(quantize_dequantize(x_MD, E4M3), quantize_dequantize(w_DK, E4M3), x_MD.dtype)


def _forward(x_MD, w_DK):
    x8, w8 = quantize_dequantize(x_MD, E4M3), quantize_dequantize(w_DK, E4M3)
    return _product(x8, w8, x_MD.dtype), (x8, w8)


def _backward(residuals, dy_MK):
    x8, w8 = residuals
    dy8 = quantize_dequantize(dy_MK, E5M2)
    return _product(dy8, w8.T, x8.dtype), _product(x8.T, dy8, w8.dtype)


fp8_matmul.defvjp(_forward, _backward)
