"""Scored prompts' keys and values kept for later prompts that begin the same: the device's
`PrefixCacheBlocks` and the host's `PrefixCacheIndex` of it, kept in step.

A scored prompt (`Request.prompt_logprobs`) leaves its whole blocks in the cache after its prefill
(`keep`); a later one loads what the cache holds of its beginning, with those tokens' scores, and runs only
the rest (`load`). The choices of a multiple-choice item pay for their shared context once.
"""

from __future__ import annotations

import numpy as np

from gpt.inference.completion import Completion
from gpt.inference.decoding import (
    PREFIX_BLOCK,
    Prefix,
    compiled_init_prefix_cache,
    compiled_load_prefix,
    compiled_save_blocks,
)
from gpt.inference.device_slots import DeviceSlots
from gpt.inference.prefix_cache_index import PrefixCacheIndex

__all__ = ["PrefixCache"]


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
        held, count = self.index.match(request.prompt, request.logprobs)
        done = min(count - 1, len(request.prompt) - 1) if held else 0
        if done <= 0:
            return self.device.fresh_prefix(length), 0
        self.tokens_reused += done
        completion.add_prompt_scores([score for _, scores in held for score in scores][1: done + 1])
        ids = np.zeros((_blocks(length),), np.int32)
        ids[: len(held)] = [block for block, _ in held]
        tokens = np.zeros((length,), np.int32)
        tokens[: len(request.prompt)] = request.prompt
        with self.device.on_mesh():
            return compiled_load_prefix(self.device.config, self.cached, ids, tokens, np.int32(done)), done

    def keep(self, completion: Completion, prefix: Prefix) -> None:
        """Put a scored prompt's whole blocks (row 0 of `prefix`, run to its end) in the cache."""
        request = completion.request
        scores = list(zip(completion.prompt_logprobs, completion.prompt_top_logprobs))
        added = self.index.add(request.prompt, request.logprobs, scores)
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
