"""The training loader: random `block_size + 1` windows of a split's token shards, deterministic in the step.

Batch `step` is a pure function of (seed, step), so the loader's whole state is the step number: it is
saved with every checkpoint, and a resumed run sees exactly the batches an uninterrupted one would.
Every window lies inside one shard (a shard is drawn in proportion to the windows it holds), the shards
are memory-mapped (memory stays flat at any corpus size), and each process of a multi-host run takes its
own rows of the same global batch.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from gpt.data.conversations import ConversationBatches
from gpt.data.shards import read_meta
from gpt.errors import ConfigError

__all__ = ["Batches", "shard_paths", "unigram_loss"]


def shard_paths(data_dir: str | os.PathLike, split: str) -> tuple[list[Path], np.dtype]:
    """The token shards of `split` ('train' or 'val') listed in `data_dir/meta.json`, and their dtype."""
    meta = read_meta(data_dir)
    return [Path(data_dir) / shard["file"] for shard in meta["shards"][split]], np.dtype(meta["dtype"])


class Batches:
    """`batches[step]` -> int32 [rows, block_size + 1]: this process's rows of global batch `step`."""

    def __init__(self, shards: list[str | os.PathLike], block_size: int, batch_size: int, seed: int,
                 process_index: int = 0, process_count: int = 1, dtype=np.uint16):
        self.shards = [np.memmap(path, dtype=dtype, mode="r") for path in shards]
        windows = np.array([max(0, shard.size - block_size) for shard in self.shards], dtype=np.int64)
        if windows.sum() == 0:
            longest = max((shard.size for shard in self.shards), default=0)
            raise ConfigError(
                f"the shards {[str(p) for p in shards][:3]} have at most {longest} tokens each, fewer than "
                f"block_size + 1 = {block_size + 1}: use more text or a smaller block_size"
            )
        if batch_size % process_count:
            raise ConfigError(f"batch_size={batch_size} must be divisible by the process count {process_count}")
        self.first_window = np.concatenate([[0], np.cumsum(windows)])  # shard i holds windows [first[i], first[i+1])
        self.block_size, self.batch_size, self.seed = block_size, batch_size, seed
        rows = batch_size // process_count
        self.rows = slice(process_index * rows, (process_index + 1) * rows)

    @classmethod
    def of_split(cls, data_dir: str | os.PathLike, split: str, block_size: int, batch_size: int, seed: int,
                 process_index: int = 0, process_count: int = 1) -> Batches | ConversationBatches:
        """The loader of a prepared split: its windows, or for a corpus of conversations, one conversation a row
        (`gpt.data.conversations.ConversationBatches`)."""
        paths, dtype = shard_paths(data_dir, split)
        kind = ConversationBatches if read_meta(data_dir).get("conversations") else cls
        return kind(paths, block_size, batch_size, seed, process_index, process_count, dtype)

    def __getitem__(self, step: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, step])
        windows = rng.integers(0, self.first_window[-1], self.batch_size)[self.rows]
        shards = np.searchsorted(self.first_window, windows, side="right") - 1
        starts = windows - self.first_window[shards]
        return np.stack([self.shards[i][s : s + self.block_size + 1] for i, s in zip(shards, starts)]).astype(np.int32)


def unigram_loss(data_dir: str | os.PathLike, vocab_size: int = 50257) -> float:
    """Nats per token of the best model that ignores context: the training split's unigram frequencies
    (add-one smoothed), scored on the validation split. A model below it has learned from context."""
    counts = np.ones(vocab_size)
    train, dtype = shard_paths(data_dir, "train")
    for path in train:
        counts += np.bincount(np.memmap(path, dtype=dtype, mode="r"), minlength=vocab_size)
    log_p = np.log(counts / counts.sum())
    val, _ = shard_paths(data_dir, "val")
    total, tokens = 0.0, 0
    for path in val:
        ids = np.memmap(path, dtype=dtype, mode="r")
        total, tokens = total - log_p[ids].sum(), tokens + ids.size
    return float(total / tokens)
