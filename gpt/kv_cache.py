"""The key/value cache: an explicit pytree that the forward takes and returns, never hidden module state.

Each row (an engine slot) has its own length: a forward writes a row's new keys and values at that row's
own positions, and a query attends to every slot at or before its position. So a new request can enter
one row while the others are mid-sequence, and no row is ever padded on the left.

    slot:      0   1   2   3   4   5   6   7
    row 0:     a   b   c   d   e   .   .   .     length 5: the next token is written at slot 5
    row 1:     p   q   .   .   .   .   .   .     length 2
    row 2:     x   y   z   ~   ~   .   .   .     length 3: slots 3-4 hold a prefill's right padding,
                                                 overwritten before any query can see them
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
        array nor rewrites more than its own slots; and the buffer is 3-D, so that for a batch of one XLA
        has no size-1 axis to reshape it around (which had it copy the buffer every step).
      lengths: int32 [B], how many slots of each row hold its tokens (where its next token goes).
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array

    @classmethod
    def init(cls, config: GPTConfig, batch: int, length: int) -> KVCache:
        """An empty cache of `length` slots for `batch` rows."""
        shape = (batch * config.n_head, length, config.head_dim)

        def zeros():  # under a mesh: rows over data, heads over tensor, like the attention it serves
            return constrain(jnp.zeros(shape, config.compute_dtype), ("batch_heads", None, None))

        return cls(k=tuple(zeros() for _ in range(config.n_layer)), v=tuple(zeros() for _ in range(config.n_layer)),
                   lengths=jnp.zeros((batch,), jnp.int32))

    @property
    def length(self) -> int:
        return self.k[0].shape[1]

    @property
    def heads(self) -> int:
        return self.k[0].shape[0] // self.lengths.shape[0]

    def next_positions(self, num_tokens: int) -> jax.Array:
        """int32 [B, T]: each row's next T positions."""
        return self.lengths[:, None] + jnp.arange(num_tokens, dtype=jnp.int32)

    def mask(self, positions_BT: jax.Array) -> jax.Array:
        """bool [B, T, S]: a query at position p sees the cached slots 0..p (its own included, so the
        softmax is never over an empty set)."""
        return jnp.arange(self.length, dtype=jnp.int32) <= positions_BT[:, :, None]

    def write(self, layer: int, k_BTNH: jax.Array, v_BTNH: jax.Array, positions_BT: jax.Array) -> KVCache:
        """This cache with layer `layer`'s new keys and values written at each row's `positions_BT`
        (positions past the end are dropped)."""
        B, T, N, H = k_BTNH.shape
        rows_MT = jnp.broadcast_to(jnp.arange(B * N, dtype=jnp.int32)[:, None], (B * N, T))
        slots_MT = jnp.repeat(positions_BT, N, axis=0)  # row b's positions for each of its N heads

        def put(buffers, new_BTNH):
            new_MTH = new_BTNH.transpose(0, 2, 1, 3).reshape(B * N, T, H).astype(buffers[layer].dtype)
            updated = buffers[layer].at[rows_MT, slots_MT].set(new_MTH, mode="drop", unique_indices=True)
            return buffers[:layer] + (updated,) + buffers[layer + 1:]

        return dataclasses.replace(self, k=put(self.k, k_BTNH), v=put(self.v, v_BTNH))

    def layer(self, layer: int) -> tuple[jax.Array, jax.Array]:
        """One layer's keys and values, each [B * N, S, H]."""
        return self.k[layer], self.v[layer]

    def advance(self, positions_BT: jax.Array) -> KVCache:
        """This cache with each row's length set past its last written position."""
        return dataclasses.replace(self, lengths=positions_BT[:, -1] + 1)

    def insert(self, other: KVCache, rows_b: jax.Array, lengths_b: jax.Array) -> KVCache:
        """This cache with `other`'s b rows (a prefill's, of S' <= S slots) copied into rows `rows_b` at
        slots 0..S'-1, and those rows' lengths set to `lengths_b`. Rows >= B are dropped (padding)."""
        N, S2 = self.heads, other.length
        rows_M = (rows_b[:, None] * N + jnp.arange(N, dtype=jnp.int32)).reshape(-1)  # each row's N heads
        rows_M = jnp.where(jnp.repeat(rows_b, N) < self.lengths.shape[0], rows_M, self.k[0].shape[0])

        def put(buffers, news):
            return tuple(buf.at[rows_M, :S2].set(new.astype(buf.dtype), mode="drop") for buf, new in zip(buffers, news))

        return KVCache(k=put(self.k, other.k), v=put(self.v, other.v),
                       lengths=self.lengths.at[rows_b].set(lengths_b, mode="drop"))
