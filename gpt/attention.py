"""The attention op and the two fixed position encodings (sinusoidal and rotary).

Shape letters: B batch, T query positions, S key positions, N heads, H head dim, D model width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["attend", "sinusoidal_embedding", "apply_rope"]


def sinusoidal_embedding(positions_BT: jax.Array, width: int) -> jax.Array:
    """The fixed table of "Attention is all you need": sin on even channels, cos on odd ones.

    Args:
      positions_BT: int32 positions, [B, T].
      width: the embedding width D (even).
    Returns:
      float32 [B, T, D].
    """
    inverse_freq = 1.0 / (10000.0 ** (jnp.arange(0, width, 2, dtype=jnp.float32) / width))
    angles_BTK = positions_BT.astype(jnp.float32)[..., None] * inverse_freq
    # Interleave so that channel 2i is sin and 2i+1 is cos of the same frequency.
    return jnp.stack([jnp.sin(angles_BTK), jnp.cos(angles_BTK)], axis=-1).reshape(*positions_BT.shape, width)


def apply_rope(x_BTNH: jax.Array, positions_BT: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding, rotating the two halves of each head as pairs (GPT-NeoX layout).

    Args:
      x_BTNH: queries or keys, [B, T, N, H] with H even.
      positions_BT: int32 positions, [B, T]; rows may differ (ragged batches).
      theta: base frequency.
    Returns:
      [B, T, N, H] in x's dtype; the rotation itself is computed in float32.
    """
    half = x_BTNH.shape[-1] // 2
    inverse_freq = 1.0 / (theta ** (jnp.arange(half, dtype=jnp.float32) / half))
    angles_BTK = positions_BT.astype(jnp.float32)[..., None] * inverse_freq
    cos_BT1K = jnp.cos(angles_BTK)[:, :, None, :]
    sin_BT1K = jnp.sin(angles_BTK)[:, :, None, :]
    x1, x2 = jnp.split(x_BTNH.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos_BT1K - x2 * sin_BT1K, x2 * cos_BT1K + x1 * sin_BT1K], axis=-1)
    return rotated.astype(x_BTNH.dtype)


def attend(q_BTNH: jax.Array, k_BSNH: jax.Array, v_BSNH: jax.Array, mask_BTS: jax.Array | None) -> jax.Array:
    """Scaled dot-product attention through `jax.nn.dot_product_attention`.

    Args:
      q_BTNH: queries [B, T, N, H]; k_BSNH, v_BSNH: keys and values [B, S, N, H].
      mask_BTS: bool [B, T, S], True where a query may see a key; None means plainly causal with T == S,
        which lets XLA (and cuDNN on GPU) use its fused causal kernel.
    Returns:
      [B, T, N, H] in q's dtype.
    """
    if mask_BTS is None:
        return jax.nn.dot_product_attention(q_BTNH, k_BSNH, v_BSNH, is_causal=True)
    return jax.nn.dot_product_attention(q_BTNH, k_BSNH, v_BSNH, mask=mask_BTS[:, None, :, :])
