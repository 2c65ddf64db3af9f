"""The key/value cache: an explicit pytree that the forward takes and returns, never hidden module state.

Each row (an engine slot) has its own length: a forward writes a row's new keys and values at that row's
own positions, and a query attends to every slot at or before its position. So a new request can enter
one row while the others are mid-sequence, and no row is ever padded on the left.

    slot:      0   1   2   3   4   5   6   7
    row 0:     a   b   c   d   e   .   .   .     length 5: the next token is written at slot 5
    row 1:     p   q   .   .   .   .   .   .     length 2
    row 2:     x   y   z   ~   ~   .   .   .     length 3: slots 3-4 hold a prefill's right padding,
                                                 overwritten before any query can see them
             |--- page 0 ---|--- page 1 ---|

Each layer's slots may be split into pages, each its own buffer, so that a decode step reads only the
pages its rows have reached (`gpt.model.attention.attend_paged`): XLA on CPU copies any slice of a buffer
before a dot reads it, so a read of part of one buffer costs about three reads of that part, while a
whole page is read in place.

A local layer (a sliding window of W positions) may hold a ring of R < S slots instead: position p in slot
p mod R. A forward that writes T positions a row needs R >= W + T - 1: its queries' windows reach back W - 1
positions before its first, and its writes overwrite R - T older ones, none of which a later query sees
(nor those of guesses that did not stand, rolled back by the lengths alone). Slot s then holds, for a query
at position p, position p - ((p - s) mod R), or a later one of the same forward or an older one it must not
see: both fall outside [p - W + 1, p], so one rule masks every slot (`gpt.model.attention.seen_slots`).

    ring of R = 6 slots, W = 4, a row of length 9 (positions 0..8):
    slot:      0   1   2   3   4   5
    holds:     6   7   8   3   4   5     a query at 8 sees 5, 6, 7, 8

A cache may also be a view of some of another's rows (`select`): it shares the buffers, and its batch
row b reads and writes buffer row `rows[b]`. A decode step over a few live slots of many runs so, on
those rows alone (`gpt.inference.decoding.decode`), and `merge` puts its lengths back.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from gpt.model.attention import seen_slots
from gpt.model.config import GPTConfig
from gpt.model.sharding import constrain

__all__ = ["KVCache"]



@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Keys and values of every layer for a batch of sequences.

    Attributes:
      k, v: per layer, a tuple of pages, each [B * K, P, H] (rows major, then key heads) in the compute
        dtype; the pages hold slots 0..P-1, P..2P-1, ... of the preallocated length S (the last page may
        be shorter), or a local layer's one ring of R < S slots (`ring`). Each (row, head) is one contiguous
        [P, H] block for a decode step's attention; each page is its own buffer, so a step neither copies a
        page out of a larger array nor rewrites more than its own slots; and the buffer is 3-D, so that for a
        batch of one XLA has no size-1 axis to reshape it around (which had it copy the buffer every step).
      lengths: int32 [B], how many positions of each row hold its tokens (where its next token goes).
      length: S, the positions a row may hold (static).
      rows: int32 [B], the buffer row that each batch row is, in a view (`select`); None when batch row b
        is buffer row b.
    """

    k: tuple[tuple[jax.Array, ...], ...]
    v: tuple[tuple[jax.Array, ...], ...]
    lengths: jax.Array
    length: int = dataclasses.field(metadata=dict(static=True))
    rows: jax.Array | None = None

    @classmethod
    def init(cls, config: GPTConfig, batch: int, length: int, page_length: int | None = None,
             writes: int | None = None) -> KVCache:
        """An empty cache of `length` positions for `batch` rows, in pages of `page_length` slots (None: one
        page of all `length`). Where every forward over it writes at most `writes` positions a row, a local
        layer of window W holds a ring of W + writes - 1 slots (`ring_slots`); None: every layer all `length`."""

        def pages(layer):
            ring = ring_slots(config.layer_window(layer), writes, length)
            size = length if page_length is None or ring is not None else page_length
            shape = lambda slots: (batch * config.kv_heads, slots, config.head_dim)  # noqa: E731
            total = length if ring is None else ring
            return tuple(jnp.zeros(shape(min(size, total - start)), config.compute_dtype)
                         for start in range(0, total, size))

        layers = range(config.n_layer)
        return cls(k=tuple(pages(layer) for layer in layers), v=tuple(pages(layer) for layer in layers),
                   lengths=jnp.zeros((batch,), jnp.int32), length=length).laid_out()

    def laid_out(self) -> KVCache:
        """This cache pinned to one layout under a mesh (a no-op without one): its pages' rows x heads over every
        axis, rows major (rows over data, heads over tensor, like the attention it serves), its lengths' rows
        over the data axes."""
        page = lambda a: constrain(a, ("batch_heads", None, None))  # noqa: E731
        return dataclasses.replace(self, k=jax.tree.map(page, self.k), v=jax.tree.map(page, self.v),
                                   lengths=constrain(self.lengths, ("batch",)))

    def ring(self, layer: int) -> int | None:
        """R, the slots of layer `layer`'s ring (position p in slot p mod R); None where slot s holds position s."""
        slots = sum(page.shape[1] for page in self.k[layer])
        return slots if slots < self.length else None

    @property
    def heads(self) -> int:
        assert self.rows is None, "a view's buffers hold more rows than its batch"
        return self.k[0][0].shape[0] // self.lengths.shape[0]

    def select(self, rows_R: jax.Array) -> KVCache:
        """A view of rows `rows_R` (int32 [R], distinct) of this cache: the same buffers, R rows."""
        assert self.rows is None, "select from the whole cache"
        return KVCache(self.k, self.v, self.lengths[rows_R], self.length, rows_R)

    def merge(self, view: KVCache) -> KVCache:
        """This cache after `view` (from `select`) has run: its buffers, and its rows' lengths."""
        return KVCache(view.k, view.v, self.lengths.at[view.rows].set(view.lengths, unique_indices=True), self.length)

    def head_rows(self, heads: int) -> jax.Array | None:
        """int32 [B * K]: the buffer row of each batch row's heads, or None when they are rows 0..B*K-1."""
        if self.rows is None:
            return None
        return (self.rows[:, None] * heads + jnp.arange(heads, dtype=jnp.int32)).reshape(-1)

    def page_starts(self, layer: int) -> list[int]:
        """The first slot of each of layer `layer`'s pages."""
        starts = [0]
        for page in self.k[layer][:-1]:
            starts.append(starts[-1] + page.shape[1])
        return starts

    def next_positions(self, num_tokens: int) -> jax.Array:
        """int32 [B, T]: each row's next T positions."""
        return self.lengths[:, None] + jnp.arange(num_tokens, dtype=jnp.int32)

    def mask(self, positions_BT: jax.Array, layer: int, window: int | None = None) -> jax.Array:
        """bool [B, T, slots]: which of layer `layer`'s slots a query at position p sees: positions 0..p (its
        own included, so the softmax is never over an empty set), or with a `window` (a local layer's)
        p - window + 1..p (`seen_slots`)."""
        ring = self.ring(layer)
        slots = self.length if ring is None else ring
        return seen_slots(jnp.arange(slots, dtype=jnp.int32), positions_BT, window, ring)

    def write(self, layer: int, k_BTKH: jax.Array, v_BTKH: jax.Array, positions_BT: jax.Array) -> KVCache:
        """This cache with layer `layer`'s new keys and values written at each row's `positions_BT`
        (positions past the end are dropped; a ring's slot is the position mod its slots)."""
        B, T, K, H = k_BTKH.shape
        rows_M = self.head_rows(K)
        rows_M = jnp.arange(B * K, dtype=jnp.int32) if rows_M is None else rows_M
        rows_MT = jnp.broadcast_to(rows_M[:, None], (B * K, T))
        slots_MT = jnp.repeat(positions_BT, K, axis=0)  # row b's positions for each of its K key heads
        ring = self.ring(layer)
        if ring is not None:
            slots_MT = jnp.where(slots_MT < self.length, slots_MT % ring, ring)  # past the end: dropped

        def put(buffers, new_BTKH):
            new_MTH = new_BTKH.transpose(0, 2, 1, 3).reshape(B * K, T, H)
            pages = []
            for start, page in zip(self.page_starts(layer), buffers[layer]):
                # Slots outside this page become an index past its end, which "drop" skips.
                in_page_MT = jnp.where(slots_MT >= start, slots_MT - start, page.shape[1])
                pages.append(page.at[rows_MT, in_page_MT].set(new_MTH.astype(page.dtype), mode="drop",
                                                              unique_indices=True))
            return buffers[:layer] + (tuple(pages),) + buffers[layer + 1:]

        return dataclasses.replace(self, k=put(self.k, k_BTKH), v=put(self.v, v_BTKH))

    def layer(self, layer: int) -> tuple[jax.Array, jax.Array]:
        """One layer's keys and values, each [B * K, S, H] (a copy when the cache has several pages)."""
        assert self.rows is None, "a view is read by pages"
        return tuple(pages[0] if len(pages) == 1 else jnp.concatenate(pages, axis=1)
                     for pages in (self.k[layer], self.v[layer]))

    def pages(self, layer: int) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
        """One layer's key pages and value pages, each [rows * K, P, H]: all the buffers' rows, in a view
        too (`head_rows` says which are the view's)."""
        return self.k[layer], self.v[layer]

    def advance(self, positions_BT: jax.Array) -> KVCache:
        """This cache with each row's length set past its last written position."""
        return dataclasses.replace(self, lengths=positions_BT[:, -1] + 1)

    def insert(self, other: KVCache, rows_b: jax.Array, lengths_b: jax.Array) -> KVCache:
        """This cache with `other`'s b rows (a prefill's, of S' <= S slots, none a ring) copied into rows `rows_b`
        at slots 0..S'-1 (a ring: the positions it holds at length `lengths_b`), and those rows' lengths set to
        `lengths_b`. Rows >= B are dropped (padding)."""
        K, S2 = self.heads, other.length
        rows_M = (rows_b[:, None] * K + jnp.arange(K, dtype=jnp.int32)).reshape(-1)  # each row's K key heads
        rows_M = jnp.where(jnp.repeat(rows_b, K) < self.lengths.shape[0], rows_M, self.k[0][0].shape[0])

        def put(layer, pages, new_MSH):
            ring = self.ring(layer)
            if ring is not None:  # slot s: the latest position p < length with p = s mod R (negative: none yet)
                last_M1 = jnp.repeat(lengths_b, K)[:, None] - 1
                held_MR = last_M1 - (last_M1 - jnp.arange(ring, dtype=jnp.int32)) % ring
                new_MSH = jnp.take_along_axis(new_MSH, jnp.maximum(held_MR, 0)[:, :, None], axis=1)
                return (pages[0].at[rows_M].set(new_MSH.astype(pages[0].dtype), mode="drop"),)
            return tuple(page.at[rows_M, :S2 - start].set(new_MSH[:, start:start + page.shape[1]].astype(page.dtype),
                                                          mode="drop") if start < S2 else page
                         for start, page in zip(self.page_starts(layer), pages))

        news = [other.layer(layer) for layer in range(len(self.k))]
        return KVCache(k=tuple(put(layer, pages, new[0]) for layer, (pages, new) in enumerate(zip(self.k, news))),
                       v=tuple(put(layer, pages, new[1]) for layer, (pages, new) in enumerate(zip(self.v, news))),
                       lengths=self.lengths.at[rows_b].set(lengths_b, mode="drop"), length=self.length)


def ring_slots(window: int | None, writes: int | None, length: int) -> int | None:
    """The slots of a local layer's ring (`KVCache`) for a `window` when a forward writes at most `writes`
    positions a row: W + writes - 1, its queries' windows and its own writes; None (every position its own
    slot) for a global layer, for writes of any number, or where the ring would be no shorter than `length`."""
    if window is None or writes is None or window + writes - 1 >= length:
        return None
    return window + writes - 1
