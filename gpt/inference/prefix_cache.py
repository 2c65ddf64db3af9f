"""Scored prompts' keys and values kept for later prompts that begin the same: the device's
`PrefixCacheBlocks` (its programs here) and the host's `PrefixCacheIndex` of it, kept in step.

A scored prompt (`Request.prompt_logprobs`), or one that asks (`Request.reuse_prefix`: a conversation's turns),
leaves its whole blocks in the cache after its prefill (`keep`); a later one loads what the cache holds of its
beginning, with those tokens' scores where it is scored, and runs only the rest (`load`). The choices of a
multiple-choice item pay for their shared context once, and so does a conversation's history at each turn.
Scored and unscored prompts keep their blocks apart (an unscored prompt's blocks have no scores to give).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from gpt.inference.completion import Completion
from gpt.inference.decoding import Prefix
from gpt.inference.device_slots import DeviceSlots
from gpt.inference.prefix_cache_index import PrefixCacheIndex
from gpt.model.config import GPTConfig
from gpt.model.kv_cache import KVCache

__all__ = ["PrefixCache", "PrefixCacheBlocks", "PREFIX_BLOCK", "init_prefix_cache", "save_blocks", "load_prefix",
           "COMPILED"]

PREFIX_BLOCK = 16  # positions per block of the prefix cache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefixCacheBlocks:
    """Keys and values of prompts' blocks of PREFIX_BLOCK positions, kept after their prefills so that a
    prompt that begins with the same tokens (a multiple-choice item's choices, one context each) runs
    only the rest. Which block holds what is the host's business (`gpt.inference.prefix_cache_index`).

    k, v: per layer, [blocks * K, PREFIX_BLOCK, H] in the compute dtype (K key heads): block i is rows
    i*K .. i*K+K-1.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]


def init_prefix_cache(config: GPTConfig, blocks: int) -> PrefixCacheBlocks:
    """An empty prefix cache of `blocks` blocks."""
    def layers():
        return tuple(jnp.zeros((blocks * config.kv_heads, PREFIX_BLOCK, config.head_dim), config.compute_dtype)
                     for _ in range(config.n_layer))
    return PrefixCacheBlocks(k=layers(), v=layers())


def save_blocks(cached: PrefixCacheBlocks, prefix: Prefix, starts_M: jax.Array, ids_M: jax.Array) -> PrefixCacheBlocks:
    """The prefix cache with blocks of row 0 of `prefix` (a one-row Prefix of one page) copied in: the block at
    position starts_M[m] into cache block ids_M[m] (int32 [M]; an id past the cache's end is skipped)."""
    heads = prefix.cache.k[0][0].shape[0]  # one row: its K key heads
    rows_MN = (ids_M[:, None] * heads + jnp.arange(heads, dtype=jnp.int32)).reshape(-1)

    def put(cached_layer, page_NCH):
        blocks_MNBH = jax.vmap(lambda start: jax.lax.dynamic_slice_in_dim(page_NCH, start, PREFIX_BLOCK, axis=1))(starts_M)
        return cached_layer.at[rows_MN].set(blocks_MNBH.reshape(-1, PREFIX_BLOCK, page_NCH.shape[-1]), mode="drop")

    return PrefixCacheBlocks(k=tuple(put(p, c[0]) for p, c in zip(cached.k, prefix.cache.k)),
                      v=tuple(put(p, c[0]) for p, c in zip(cached.v, prefix.cache.v)))


def load_prefix(config: GPTConfig, cached: PrefixCacheBlocks, ids_M: jax.Array, tokens_C: jax.Array,
                length: jax.Array) -> Prefix:
    """A one-row Prefix of C = len(tokens_C) positions whose first `length` hold a prompt's keys and values
    from prefix cache blocks ids_M (int32 [ceil(C / PREFIX_BLOCK)], block m for positions 16m..16m+15; ids of
    blocks past `length` may be anything in the cache). tokens_C: int32 [C], the prompt (its first `length`
    tokens are what the prefix has seen)."""
    C, heads = tokens_C.shape[0], config.kv_heads
    rows_MN = (ids_M[:, None] * heads + jnp.arange(heads, dtype=jnp.int32)).reshape(-1)

    def page(cached_layer):
        blocks_MNBH = cached_layer[rows_MN].reshape(ids_M.shape[0], heads, PREFIX_BLOCK, -1)
        return blocks_MNBH.transpose(1, 0, 2, 3).reshape(heads, -1, blocks_MNBH.shape[-1])[:, :C]

    cache = KVCache(k=tuple((page(p),) for p in cached.k), v=tuple((page(p),) for p in cached.v),
                    lengths=jnp.reshape(length, (1,)).astype(jnp.int32), length=C)
    seen = jnp.zeros((1, config.vocab_size), jnp.bool_).at[0, tokens_C].max(jnp.arange(C) < length)
    return Prefix(cache=cache, seen=seen, last_hidden=jnp.zeros((1, config.n_embd), config.compute_dtype))


compiled_init_prefix_cache = jax.jit(init_prefix_cache, static_argnums=(0, 1))
compiled_save_blocks = jax.jit(save_blocks, donate_argnames="cached")
compiled_load_prefix = jax.jit(load_prefix, static_argnames="config")
COMPILED = (compiled_save_blocks, compiled_load_prefix)  # the ones a request runs


_UNSCORED = 0xFFFF  # the index's variant of unscored prompts' blocks (a scored one's is its number of alternatives)


def _variant(request) -> int:
    """What separates the cache's blocks of prompts with the same tokens (`PrefixCacheIndex`'s variant)."""
    return request.logprobs if request.prompt_logprobs else _UNSCORED


def _blocks(length: int) -> int:
    """How many cache blocks cover `length` positions (a load or a save of a prefix that long)."""
    return -(-length // PREFIX_BLOCK)


class PrefixCache:
    """A cache of `tokens // PREFIX_BLOCK` blocks on `device`'s mesh (one row per prefill: not over a
    data axis).

    Attributes:
      tokens_reused: prompt positions loaded from the cache instead of run (a running total).
    """

    def __init__(self, device: DeviceSlots, tokens: int):
        self.device, self.index = device, PrefixCacheIndex(tokens // PREFIX_BLOCK, PREFIX_BLOCK)
        with device.on_mesh():
            self.cached = compiled_init_prefix_cache(device.config, self.index.blocks)
        self.tokens_reused = 0

    def load(self, completion: Completion, length: int) -> tuple[Prefix, int]:
        """A one-row prefix of `length` positions for `completion`'s prompt and how many of its tokens it
        holds: what the cache holds of the prompt's beginning (`PrefixCacheIndex.match`), except the last token
        held or the prompt's last (that one runs again: what follows it needs its output); those tokens'
        scores go to the completion. (A fresh prefix and 0 when the cache holds none of it.)"""
        request = completion.request
        held, count = self.index.match(request.prompt, _variant(request))
        done = min(count - 1, len(request.prompt) - 1) if held else 0
        if done <= 0:
            return self.device.fresh_prefix(length), 0
        self.tokens_reused += done
        if request.prompt_logprobs:
            completion.add_prompt_scores([score for _, scores in held for score in scores][1: done + 1])
        ids = np.zeros((_blocks(length),), np.int32)
        ids[: len(held)] = [block for block, _ in held]
        tokens = np.zeros((length,), np.int32)
        tokens[: len(request.prompt)] = request.prompt
        with self.device.on_mesh():
            return compiled_load_prefix(self.device.config, self.cached, ids, tokens, np.int32(done)), done

    def keep(self, completion: Completion, prefix: Prefix) -> None:
        """Put a prompt's whole blocks (row 0 of `prefix`, run to its end) in the cache, with its scores where it
        is scored."""
        request = completion.request
        if request.prompt_logprobs:
            scores = list(zip(completion.prompt_logprobs, completion.prompt_top_logprobs))
        else:
            scores = [(None, None)] * len(request.prompt)
        added = self.index.add(request.prompt, _variant(request), scores)
        if not added:
            return
        blocks = _blocks(prefix.cache.length)
        starts, ids = np.zeros((blocks,), np.int32), np.full((blocks,), self.index.blocks, np.int32)  # past the end: skipped
        starts[: len(added)], ids[: len(added)] = zip(*added)
        with self.device.on_mesh():
            self.cached = compiled_save_blocks(self.cached, prefix, starts, ids)

    def warm(self, length: int) -> None:
        """Run once a load from the cache and a save to it (of no block) of a prefix of `length` positions."""
        blocks = _blocks(length)
        with self.device.on_mesh():
            prefix = compiled_load_prefix(self.device.config, self.cached, np.zeros((blocks,), np.int32),
                                          np.zeros((length,), np.int32), np.int32(1))
            self.cached = compiled_save_blocks(self.cached, prefix, np.zeros((blocks,), np.int32),
                                             np.full((blocks,), self.index.blocks, np.int32))  # skips them all
