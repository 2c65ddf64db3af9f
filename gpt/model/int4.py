"""int4 weights: each block of 32 inputs of an output-major matrix rounded to 16 levels of a scale of its own, two
levels a byte, in the order the CPU kernel reads (`kernels/few_rows_int4.cc`).

A block's scale is an int8 multiple of its output's one float32 scale (two levels, as llama.cpp's K-quants
keep theirs), so that the kernel's sums stay exact integers over a whole row: 4.25 bits a weight. Within a
block, the weight of largest magnitude m sets the scale: levels q in [-8, 7], the scale among a few candidates
near m / -8 (m itself a level, as llama.cpp's Q4_0 makes it) chosen, after rounding to its int8 multiple, for
the least squared error of the block. Packing: each pair of blocks is 32 bytes, byte i holding the first block's
input i in its low nibble and the second's in its high one, each as q + 8 (a mask, or a shift and a mask, unpacks
a block into a vector of 32 bytes). A matrix whose input count 64 does not divide is padded with zero weights (x
is padded alike where it meets them: `gpt.model.layouts.Int4Matrix`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["BLOCK", "PAIR", "quantize", "pack", "unpack", "integer_weights", "dequantize", "largest_block_scale"]

BLOCK = 32  # inputs that share a scale
PAIR = 2 * BLOCK  # inputs packed together: 32 bytes, one block in the low nibbles and the next in the high ones

# The scale's candidates, as divisors of the block's signed extreme m: -8 maps m to the level -8 exactly; the
# others spend the extreme's precision on the rest of the block (a smaller step, m rounded to -7 or -8).
_DIVISORS = (-8.0, -7.5, -7.0, -6.5)


def largest_block_scale(inputs: int) -> int:
    """The largest int8 block scale a matrix of `inputs` inputs may have: 127, or less where the exact sum of a
    row's products, at most 127 (x's int8) x 8 (a level) x that scale x `inputs`, would pass 2^31 (the kernel
    adds them in int32)."""
    return min(127, (2**31 - 1) // (127 * 8 * inputs))


def quantize(matrix_KD: jax.Array, block: int = BLOCK) -> tuple[jax.Array, jax.Array, jax.Array]:
    """float32 matrix [K, D] (D a multiple of `block`) -> (levels int8 [K, D] in [-8, 7], block scales int8
    [K, D / block], output scales float32 [K]); matrix ~= levels * block scale * output scale. The layout's block is
    BLOCK; another is for measuring (bench/quantize_quality.py)."""
    K, D = matrix_KD.shape
    blocks = matrix_KD.reshape(K, D // block, block)
    extreme = jnp.take_along_axis(blocks, jnp.abs(blocks).argmax(axis=-1, keepdims=True), axis=-1)  # [K, B, 1]
    top = largest_block_scale(D)
    output_scale = jnp.abs(extreme).max(axis=1, keepdims=True) / (-min(_DIVISORS, key=abs) * top)  # [K, 1, 1]
    output_scale = jnp.where(output_scale > 0, output_scale, 1.0)
    best = None
    for divisor in _DIVISORS:
        block_scale = jnp.clip(jnp.round(extreme / divisor / output_scale), -top, top)
        scale = block_scale * output_scale
        levels = jnp.clip(jnp.round(blocks / jnp.where(scale == 0, 1.0, scale)), -8, 7)
        error = jnp.square(levels * scale - blocks).sum(axis=-1, keepdims=True)
        if best is None:
            best = (error, levels, block_scale)
        else:
            better = error < best[0]
            best = tuple(jnp.where(better, new, old) for new, old in zip((error, levels, block_scale), best))
    _, levels, block_scale = best
    return (levels.reshape(K, D).astype(jnp.int8), block_scale[..., 0].astype(jnp.int8),
            output_scale[:, 0, 0].astype(jnp.float32))


def pack(levels_KD: jax.Array) -> jax.Array:
    """int8 levels [K, D] in [-8, 7] (D a multiple of PAIR) -> uint8 [K, D / 2], two levels a byte."""
    K, D = levels_KD.shape
    nibbles = (levels_KD.astype(jnp.int32) + 8).reshape(K, D // PAIR, 2, BLOCK)
    return (nibbles[:, :, 0] | (nibbles[:, :, 1] << 4)).astype(jnp.uint8).reshape(K, D // 2)


def unpack(packed_KH: jax.Array) -> jax.Array:
    """uint8 [K, D / 2] -> int8 levels [K, D] in [-8, 7] (`pack` undone)."""
    K, H = packed_KH.shape
    pairs = packed_KH.reshape(K, H * 2 // PAIR, BLOCK).astype(jnp.int32)
    nibbles = jnp.stack([pairs & 0xF, pairs >> 4], axis=2)  # [K, pairs, 2, 32]
    return (nibbles - 8).astype(jnp.int8).reshape(K, H * 2)


def integer_weights(packed_KH: jax.Array, block_scale_KB: jax.Array) -> jax.Array:
    """Each weight as its level times its block's scale: int32 [K, D] (the matrix over its output scales)."""
    levels = unpack(packed_KH)
    K, D = levels.shape
    blocks = levels.reshape(K, D // BLOCK, BLOCK).astype(jnp.int32) * block_scale_KB[..., None].astype(jnp.int32)
    return blocks.reshape(K, D)


def dequantize(packed_KH: jax.Array, block_scale_KB: jax.Array, output_scale_K: jax.Array) -> jax.Array:
    """The float32 matrix [K, D] that packed levels and their scales stand for."""
    return integer_weights(packed_KH, block_scale_KB).astype(jnp.float32) * output_scale_K[:, None]
