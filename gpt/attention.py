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


def attend(q_BTNH: jax.Array, k_MSH: jax.Array, v_MSH: jax.Array, mask_BTS: jax.Array | None) -> jax.Array:
    """Scaled dot-product attention.

    On GPUs this is `jax.nn.dot_product_attention`, which picks cuDNN's fused (flash) kernel. Elsewhere
    it is the plain softmax(q k^T / sqrt(H)) v over rows x heads as one batch axis, which XLA on CPU runs
    about 1.7x faster (forward + backward) than the fallback inside `jax.nn.dot_product_attention`.

    Args:
      q_BTNH: queries [B, T, N, H].
      k_MSH, v_MSH: keys and values [B * N, S, H], rows major (the KV cache's layout: one 3-D buffer,
        so that a batch of 1 adds no degenerate axis for XLA to reshape the cache around).
      mask_BTS: bool [B, T, S], True where a query may see a key; None means plainly causal with T == S.
        Every query must see at least one key.
    Returns:
      [B, T, N, H] in q's dtype; the softmax is computed in float32.
    """
    B, T, N, H = q_BTNH.shape
    S = k_MSH.shape[1]
    if jax.default_backend() == "gpu":
        k_BSNH, v_BSNH = (x.reshape(B, N, S, H).transpose(0, 2, 1, 3) for x in (k_MSH, v_MSH))
        if mask_BTS is None:
            return jax.nn.dot_product_attention(q_BTNH, k_BSNH, v_BSNH, is_causal=True)
        return jax.nn.dot_product_attention(q_BTNH, k_BSNH, v_BSNH, mask=mask_BTS[:, None, :, :])
    q_MTH = (q_BTNH * jnp.asarray(H ** -0.5, q_BTNH.dtype)).transpose(0, 2, 1, 3).reshape(B * N, T, H)
    # Contract H of both directly: `q @ k.swapaxes(-1, -2)` makes XLA on CPU copy a transposed k.
    scores_MTS = jnp.einsum("MTH,MSH->MTS", q_MTH, k_MSH, preferred_element_type=jnp.float32)
    mask_MTS = (jnp.tril(jnp.ones((1, T, S), jnp.bool_)) if mask_BTS is None
                else jnp.repeat(mask_BTS, N, axis=0))  # row b's mask for each of its N heads
    scores_MTS = jnp.where(mask_MTS, scores_MTS, jnp.finfo(jnp.float32).min)
    # softmax; the max is a constant for the gradient (the result does not depend on it)
    exp_MTS = jnp.exp(scores_MTS - jax.lax.stop_gradient(scores_MTS.max(-1, keepdims=True)))
    weights_MTS = (exp_MTS / exp_MTS.sum(-1, keepdims=True)).astype(v_MSH.dtype)
    return jnp.einsum("MTS,MSH->MTH", weights_MTS, v_MSH).reshape(B, N, T, H).transpose(0, 2, 1, 3)


def attend_cached(q_B1NH: jax.Array, k_MSH: jax.Array, v_MSH: jax.Array, positions_B1: jax.Array,
                  chunk: int = 128) -> jax.Array:
    """One query per row over a KV cache, reading only as far as the rows have got.

    A decode step's cost is streaming the weights and the cache; a cache sized for the model's whole
    context but holding short sequences would be read in full by plain attention. While the rows hold at
    most a quarter of it, this reads it in chunks of `chunk` positions up to the furthest row's position
    (a traced bound: one compiled program for any lengths), with the online softmax of flash attention,
    so a step costs what the sequences hold. Beyond that it reads the whole cache at once: XLA on CPU
    copies each chunk out before its dot, so a position read in chunks costs about three read whole
    (8 rows of GPT-2 over 1024 slots, one layer: 1 chunk 0.8 ms, 3 chunks 2.5 ms, 8 chunks 7.1 ms;
    the whole cache 1.3-1.8 ms).

    Args:
      q_B1NH: queries [B, 1, N, H].
      k_MSH, v_MSH: the cache's keys and values [B * N, S, H].
      positions_B1: int32 [B, 1], each row's query position; it sees cache slots 0..position.
      chunk: positions per chunk; a cache of fewer than four chunks is always read whole.
    Returns:
      [B, 1, N, H] in q's dtype; the softmax is computed in float32.
    """
    B, _, N, H = q_B1NH.shape
    M, S, _ = k_MSH.shape

    def whole():
        return attend(q_B1NH, k_MSH, v_MSH, jnp.arange(S)[None, None, :] <= positions_B1[:, :, None])

    if S < 4 * chunk:  # the condition below can never hold: do not compile the chunked read at all
        return whole()
    num_chunks = jnp.max(positions_B1) // chunk + 1
    return jax.lax.cond(4 * chunk * num_chunks <= S, lambda: _attend_in_chunks(q_B1NH, k_MSH, v_MSH, positions_B1,
                                                                                 num_chunks, chunk), whole)


def _attend_in_chunks(q_B1NH: jax.Array, k_MSH: jax.Array, v_MSH: jax.Array, positions_B1: jax.Array,
                      num_chunks: jax.Array, chunk: int) -> jax.Array:
    """`attend_cached`'s chunked read: the first `num_chunks` chunks, each with the online softmax."""
    B, _, N, H = q_B1NH.shape
    M, S, _ = k_MSH.shape
    q_MH = (q_B1NH[:, 0] * jnp.asarray(H ** -0.5, q_B1NH.dtype)).reshape(M, H)
    position_M = jnp.repeat(positions_B1[:, 0], N)

    def one_chunk(c, carry):
        max_M, sum_M, acc_MH = carry
        start = c * chunk  # num_chunks * chunk <= S: a chunk never runs past the cache
        k_MCH = jax.lax.dynamic_slice_in_dim(k_MSH, start, chunk, axis=1)
        v_MCH = jax.lax.dynamic_slice_in_dim(v_MSH, start, chunk, axis=1)
        seen_MC = start + jnp.arange(chunk)[None, :] <= position_M[:, None]
        scores_MC = jnp.einsum("MH,MCH->MC", q_MH, k_MCH, preferred_element_type=jnp.float32)
        scores_MC = jnp.where(seen_MC, scores_MC, -jnp.inf)
        new_max_M = jnp.maximum(max_M, scores_MC.max(-1))
        weights_MC = jnp.exp(scores_MC - new_max_M[:, None])
        rescale_M = jnp.exp(max_M - new_max_M)
        acc_MH = acc_MH * rescale_M[:, None] + jnp.einsum("MC,MCH->MH", weights_MC.astype(v_MCH.dtype), v_MCH,
                                                           preferred_element_type=jnp.float32)
        return new_max_M, sum_M * rescale_M + weights_MC.sum(-1), acc_MH

    # Slot 0 is always seen, so the first chunk makes every row's max finite.
    init = (jnp.full((M,), -jnp.inf), jnp.zeros((M,)), jnp.zeros((M, H)))
    _, sum_M, acc_MH = jax.lax.fori_loop(0, num_chunks, one_chunk, init)
    return (acc_MH / sum_M[:, None]).astype(q_B1NH.dtype).reshape(B, N, 1, H).transpose(0, 2, 1, 3)
