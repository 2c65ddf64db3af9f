"""Which prompt prefixes the prefix cache holds (`gpt.inference.prefix_cache.PrefixCacheBlocks`): the host's index
of its blocks, with no JAX in it.

A scored prompt (`Request.prompt_logprobs`), or one that asks (`Request.reuse_prefix`), leaves its whole blocks of
PREFIX_BLOCK tokens in the cache,
each keyed by every token from the prompt's start to the block's end (so a block is found only after
the very same tokens), with the scores of its tokens. A later scored prompt that begins with the same
blocks loads their keys and values and runs only the rest: the choices of a multiple-choice item, sent by
lm-evaluation-harness as separate requests in an order of its own, pay for their shared context once.
Past its whole blocks, a prompt also takes the block stored after the same beginning that agrees with it
longest, as far as it agrees: a position's keys and values depend only on the tokens up to it, so a
context that ends inside a block is loaded to its last token, not to the block before.
When the cache is full the least recently used block goes.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import numpy as np

__all__ = ["PrefixCacheIndex", "TokenScore"]

# A prompt token's score: (logprob given the tokens before it, its top alternatives as (id, logprob)); the
# prompt's first token has (None, None).
TokenScore = tuple[float | None, list[tuple[int, float]] | None]


class PrefixCacheIndex:
    """The blocks of a prefix cache of `blocks` blocks of `block` positions: which prompt prefix each holds.

    `variant` separates what differs between requests with the same tokens but not in the keys and values
    (the number of top alternatives their scores carry).
    """

    def __init__(self, blocks: int, block: int):
        self.block, self.blocks = block, blocks
        self._free = list(range(blocks - 1, -1, -1))
        self._entries: collections.OrderedDict[bytes, tuple[int, list[TokenScore]]] = collections.OrderedDict()
        self._children: dict[bytes, set[bytes]] = {}  # a key of k blocks -> the keys of k + 1 blocks after it

    def _key(self, prompt: np.ndarray, blocks: int, variant: int) -> bytes:
        return variant.to_bytes(2, "little") + prompt[: blocks * self.block].tobytes()

    def match(self, prompt: Sequence[int], variant: int) -> tuple[list[tuple[int, list[TokenScore]]], int]:
        """The cache blocks (id, scores of its tokens) that hold the longest run of `prompt` from its start,
        and how many of its tokens they hold: its whole blocks, then the block after them that agrees with
        it longest (see the module's docstring). Each becomes the most recently used."""
        prompt = np.asarray(prompt, np.int32)
        found = []
        for k in range(1, len(prompt) // self.block + 1):
            key = self._key(prompt, k, variant)
            if key not in self._entries:
                break
            self._entries.move_to_end(key)
            found.append(self._entries[key])
        held = len(found) * self.block
        rest = prompt[held: held + self.block]
        best, agreed = None, 0
        for child in self._children.get(self._key(prompt, len(found), variant), ()):
            tokens = np.frombuffer(child[-4 * self.block:], np.int32)[: len(rest)]
            differ = np.flatnonzero(tokens != rest)
            same = int(differ[0]) if differ.size else len(rest)
            if same > agreed:
                best, agreed = child, same
        if best is not None:
            self._entries.move_to_end(best)
            found.append(self._entries[best])
        return found, held + agreed

    def add(self, prompt: Sequence[int], variant: int, scores: Sequence[TokenScore]) -> list[tuple[int, int]]:
        """Index `prompt`'s whole blocks (its tokens' `scores` beside them), taking the least recently used
        blocks when none is free; returns (first position, cache block) of each block to copy in. A prompt
        with more blocks than the cache holds adds none."""
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
                gone, (block, _) = self._entries.popitem(last=False)
                self._free.append(block)
                siblings = self._children[gone[: -4 * self.block]]
                siblings.discard(gone)
                if not siblings:
                    del self._children[gone[: -4 * self.block]]
            block = self._free.pop()
            self._entries[key] = (block, list(scores[(k - 1) * self.block: k * self.block]))
            self._children.setdefault(key[: -4 * self.block], set()).add(key)
            added.append(((k - 1) * self.block, block))
        return added
