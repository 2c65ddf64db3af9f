"""Which prompt prefixes a `gpt.inference.decoding.PrefixPool` holds: the host's index of its blocks, with no JAX in it.

A scored prompt (`Request.prompt_logprobs`) leaves its whole blocks of PREFIX_BLOCK tokens in the pool,
each keyed by every token from the prompt's start to the block's end (so a block is found only after
the very same tokens), with the scores of its tokens. A later scored prompt that begins with the same
blocks loads their keys and values and runs only the rest: the choices of a multiple-choice item, sent by
lm-evaluation-harness as separate requests in an order of its own, pay for their shared context once.
When the pool is full the least recently used block goes.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import numpy as np

__all__ = ["PrefixIndex", "TokenScore"]

# A prompt token's score: (logprob given the tokens before it, its top alternatives as (id, logprob)); the
# prompt's first token has (None, None).
TokenScore = tuple[float | None, list[tuple[int, float]] | None]


class PrefixIndex:
    """The blocks of a pool of `blocks` blocks of `block` positions: which prompt prefix each holds.

    `variant` separates what differs between requests with the same tokens but not in the keys and values
    (the number of top alternatives their scores carry).
    """

    def __init__(self, blocks: int, block: int):
        self.block, self.blocks = block, blocks
        self._free = list(range(blocks - 1, -1, -1))
        self._entries: collections.OrderedDict[bytes, tuple[int, list[TokenScore]]] = collections.OrderedDict()

    def _key(self, prompt: np.ndarray, blocks: int, variant: int) -> bytes:
        return variant.to_bytes(2, "little") + prompt[: blocks * self.block].tobytes()

    def match(self, prompt: Sequence[int], variant: int) -> list[tuple[int, list[TokenScore]]]:
        """The pool blocks (id, scores of its tokens) that hold the longest run of `prompt`'s whole blocks
        from its start; each becomes the most recently used."""
        prompt = np.asarray(prompt, np.int32)
        found = []
        for k in range(1, len(prompt) // self.block + 1):
            key = self._key(prompt, k, variant)
            if key not in self._entries:
                break
            self._entries.move_to_end(key)
            found.append(self._entries[key])
        return found

    def add(self, prompt: Sequence[int], variant: int, scores: Sequence[TokenScore]) -> list[tuple[int, int]]:
        """Index `prompt`'s whole blocks (its tokens' `scores` beside them), taking the least recently used
        blocks when none is free; returns (first position, pool block) of each block to copy in. A prompt
        with more blocks than the pool holds adds none."""
        prompt = np.asarray(prompt, np.int32)
        count = len(prompt) // self.block
        if count > len(self._free) + len(self._entries):
            return []
        added = []
        for k in range(1, count + 1):
            key = self._key(prompt, k, variant)
            if key in self._entries:
                self._entries.move_to_end(key)
                continue
            if not self._free:
                self._free.append(self._entries.popitem(last=False)[1][0])
            block = self._free.pop()
            self._entries[key] = (block, list(scores[(k - 1) * self.block: k * self.block]))
            added.append(((k - 1) * self.block, block))
        return added
