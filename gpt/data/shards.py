"""Prepared shards have an identity, as checkpoints do: `meta.json` records each shard's token count and
SHA-256, and every use checks them before the first step.

`verify_shards(data_dir, vocab_size)` checks, for each shard of the splits asked for: that `meta.json` is
JSON and names it as a plain file of the data directory; that its size is its token count's (at once, for
every shard); then, streamed a block at a time in flat memory, that its SHA-256 is the recorded one and
that every id is inside the vocabulary. The first problem is one line naming the shard, what was expected,
what is there, and how to prepare again. It returns the digest of the shards' checksums: the prepared
data's identity, which each checkpoint records, so that a resume on other shards is refused like a resume
on another corpus. Its cost on a 1 GB corpus is in bench/RESULTS.md ("Shards with an identity").
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import numpy as np

from gpt.errors import ConfigError, MissingInput

__all__ = ["ShardHasher", "read_meta", "verify_shards", "shards_digest", "SHARD_NAME"]

SHARD_NAME = re.compile(r"^(train|val)_\d{5}\.bin$")
_BLOCK_TOKENS = 1 << 23  # 16 MiB of uint16 ids a read


class ShardHasher:
    """The running SHA-256 of a shard as it is written."""

    def __init__(self):
        self.digest = hashlib.sha256()

    def update(self, tokens: np.ndarray) -> None:
        self.digest.update(memoryview(np.ascontiguousarray(tokens)).cast("B"))

    def hexdigest(self) -> str:
        return self.digest.hexdigest()


def _again(data_dir: Path) -> str:
    return (f"delete {data_dir} and run again to prepare the corpus anew (train.py prepares it; or python -m "
            f"gpt.data --out_dir {data_dir})")


def read_meta(data_dir: str | os.PathLike) -> dict:
    """`data_dir/meta.json`, parsed; MissingInput when absent, ConfigError when it is not a preparation's."""
    data_dir = Path(data_dir)
    path = data_dir / "meta.json"
    if not path.is_file():
        raise MissingInput(f"{path} is missing: prepare the corpus first (python -m gpt.data)")
    try:
        meta = json.loads(path.read_text())
        shards = meta["shards"]
        listed = [(split, shard["file"], int(shard["tokens"])) for split in ("train", "val") for shard in shards[split]]
        np.dtype(meta["dtype"])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not a prepared corpus's record ({type(e).__name__}: {e}); "
                          f"{_again(data_dir)}") from None
    for split, name, _ in listed:
        if not isinstance(name, str) or not SHARD_NAME.match(name) or not name.startswith(split):
            raise ConfigError(f"{path} names {name!r} as a {split} shard, not a shard file of {data_dir}; "
                              f"{_again(data_dir)}")
    return meta


def verify_shards(data_dir: str | os.PathLike, vocab_size: int, splits: tuple[str, ...] = ("train", "val")) -> str:
    """Check the shards of `splits` against `meta.json` (sizes, then checksums and ids); the digest of
    every shard's checksum (the prepared data's identity). ConfigError naming the first problem."""
    data_dir = Path(data_dir)
    meta = read_meta(data_dir)
    dtype = np.dtype(meta["dtype"])
    shards = [shard for split in splits for shard in meta["shards"][split]]
    for shard in shards:  # every size first: a truncated or swapped file is refused at once
        path = data_dir / shard["file"]
        expected = shard["tokens"] * dtype.itemsize
        if not path.is_file():
            raise ConfigError(f"shard {path} is missing (meta.json lists it with {shard['tokens']:,} tokens); "
                              f"{_again(data_dir)}")
        if path.stat().st_size != expected:
            raise ConfigError(f"shard {path} has {path.stat().st_size:,} bytes where meta.json records "
                              f"{shard['tokens']:,} tokens ({expected:,} bytes); {_again(data_dir)}")
        if "sha256" not in shard:
            raise ConfigError(f"{data_dir / 'meta.json'} records no checksum for {path} (an older preparation); "
                              f"{_again(data_dir)}")
    for shard in shards:
        _check_contents(data_dir / shard["file"], shard["sha256"], dtype, vocab_size, data_dir)
    return shards_digest(meta)


def _check_contents(path: Path, sha256: str, dtype: np.dtype, vocab_size: int, data_dir: Path) -> None:
    hasher = ShardHasher()
    with open(path, "rb") as file:
        position = 0
        while block := file.read(_BLOCK_TOKENS * dtype.itemsize):
            ids = np.frombuffer(block, dtype)
            hasher.update(ids)
            if ids.size and ids.max() >= vocab_size:
                bad = int(np.argmax(ids >= vocab_size))
                raise ConfigError(f"shard {path} holds token id {int(ids[bad])} at position {position + bad:,}, "
                                  f"outside the vocabulary [0, {vocab_size}); {_again(data_dir)}")
            position += ids.size
    if hasher.hexdigest() != sha256:
        raise ConfigError(f"shard {path} does not hold what was prepared: its SHA-256 is {hasher.hexdigest()[:16]}... "
                          f"where meta.json records {sha256[:16]}...; {_again(data_dir)}")


def shards_digest(meta: dict) -> str:
    """One SHA-256 over every shard's, in order: the prepared data's identity."""
    checksums = [shard.get("sha256", "") for split in ("train", "val") for shard in meta["shards"][split]]
    return hashlib.sha256("".join(checksums).encode()).hexdigest()
