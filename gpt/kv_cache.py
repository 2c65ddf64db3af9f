"""The key/value cache: an explicit pytree that the forward takes and returns, never hidden module state.

Rows of a batch are left-padded to one length, so every row writes its new keys at the same slot
(`index`) with one `dynamic_update_slice`; `start` remembers where each row's real tokens begin, which
gives each row its own positions and hides its padding from attention.

    slot:      0   1   2   3   4   5   6   7
    row 0:     .   .   a   b   c | d   e   f     start[0] = 2
    row 1:     p   q   r   s   t | u   v   w     start[1] = 0
                                 ^ index after a prefill of 5 slots
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from gpt.config import GPTConfig
from gpt.sharding import constrain

__all__ = ["KVCache"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Keys and values of every layer for a batch of sequences.

    Attributes:
      k, v: one array per layer, each [B * N, S, H] (rows major, then heads) in the compute dtype; S is
        the preallocated length. Each (row, head) is one contiguous [S, H] block for a decode step's
        attention; each layer is its own buffer, so a step neither copies a layer out of a stacked
        array nor rewrites more than its own slot; and the buffer is 3-D, so that for a batch of one XLA
        has no size-1 axis to reshape it around (which had it copy the buffer every step).
      index: int32 scalar, the next slot to write (shared by all rows).
      start: int32 [B], the first slot of each row that holds a real token.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    index: jax.Array
    start: jax.Array

    @classmethod
    def init(cls, config: GPTConfig, start_B: jax.Array, length: int) -> KVCache:
        """An empty cache of `length` slots for len(start_B) rows whose real tokens begin at start_B."""
        shape = (start_B.shape[0] * config.n_head, length, config.head_dim)

        def zeros():  # under a mesh: rows over data, heads over tensor, like the attention it serves
            return constrain(jnp.zeros(shape, config.compute_dtype), ("batch_heads", None, None))

        return cls(k=tuple(zeros() for _ in range(config.n_layer)), v=tuple(zeros() for _ in range(config.n_layer)),
                   index=jnp.zeros((), jnp.int32), start=jnp.asarray(start_B, jnp.int32))

    @property
    def length(self) -> int:
        return self.k[0].shape[1]

    def positions(self, num_tokens: int) -> jax.Array:
        """int32 [B, T]: each row's position for the next T slots (padding slots get negative values)."""
        slots_T = self.index + jnp.arange(num_tokens, dtype=jnp.int32)
        return slots_T[None, :] - self.start[:, None]

    def mask(self, num_tokens: int) -> jax.Array:
        """bool [B, T, S]: which cached slots each of the next T slots may attend to.

        A slot sees the real (non-padding) slots at or before it. A padding slot also sees itself, so its
        softmax is never over an empty set (which would make NaNs that leak into real rows).
        """
        query_T = self.index + jnp.arange(num_tokens, dtype=jnp.int32)
        key_S = jnp.arange(self.length, dtype=jnp.int32)
        causal_TS = key_S[None, :] <= query_T[:, None]
        real_BS = key_S[None, :] >= self.start[:, None]
        itself_TS = key_S[None, :] == query_T[:, None]
        return (causal_TS[None] & real_BS[:, None, :]) | itself_TS[None]

    def write(self, layer: int, k_BTNH: jax.Array, v_BTNH: jax.Array) -> KVCache:
        """This cache with layer `layer`'s new keys and values written at slots [index, index + T)."""
        at = (0, self.index, 0)

        def put(buffers, new_BTNH):
            B, T, N, H = new_BTNH.shape
            new_MTH = new_BTNH.transpose(0, 2, 1, 3).reshape(B * N, T, H).astype(buffers[layer].dtype)
            updated = jax.lax.dynamic_update_slice(buffers[layer], new_MTH, at)
            return buffers[:layer] + (updated,) + buffers[layer + 1:]

        return dataclasses.replace(self, k=put(self.k, k_BTNH), v=put(self.v, v_BTNH))

    def layer(self, layer: int) -> tuple[jax.Array, jax.Array]:
        """One layer's keys and values, each [B * N, S, H]."""
        return self.k[layer], self.v[layer]

    def advance(self, num_tokens: int) -> KVCache:
        return dataclasses.replace(self, index=self.index + num_tokens)
