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

from gpt.data.conversations import ID_BITS
from gpt.errors import ConfigError, MissingInput, first_line

__all__ = ["ShardHasher", "read_meta", "check_meta", "check_fields", "is_json_type", "verify_shards", "shards_digest",
           "SHARD_NAME", "SHARD_SUM_FIELDS"]

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


# meta.json's fields and their JSON types, written once: the reader checks each (`check_meta`).
_META_FIELDS = {"format": int, "tokenizer": str, "vocab_size": int, "dtype": str, "val_fraction": float,
                "text_field": str, "shard_tokens": int, "section_chars": int, "split_rule": str, "sources": list,
                "shards": dict, "train_tokens": int, "val_tokens": int, "documents": int, "sections": int,
                "replaced_invalid_utf8": int, "bad_records": dict, "conversations": bool}
SHARD_SUM_FIELDS = {"tokens": int, "sha256": str}
"""What a finished shard's record holds of it (meta.json's, and a preparation's progress.json's)."""
_SHARD_FIELDS = {"file": str, **SHARD_SUM_FIELDS}
_DTYPES = ("uint16", "uint32")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_LARGEST = 2**63  # no count on a disk reaches it


def is_json_type(value, kind: type) -> bool:
    """Whether a value read from JSON is of `kind` (a bool is no int; an int is a float)."""
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, kind)


def check_fields(record, fields: dict[str, type], where: str) -> None:
    """ValueError naming the first of `fields` that `record` (a dict read from JSON) lacks or holds as
    another type; `where` names the record in the message."""
    if not isinstance(record, dict):
        raise ValueError(f"{where} is {type(record).__name__}, not an object")
    for name, kind in fields.items():
        if name not in record:
            raise ValueError(f"{where} has no field {name!r}")
        if not is_json_type(record[name], kind):
            raise ValueError(f"{where}'s {name!r} is {record[name]!r}, not {kind.__name__}")


def check_meta(meta) -> None:
    """ValueError naming the first field of a parsed meta.json that is missing, of another type or out of its
    bounds: every field, each count in [0, 2**63), val_fraction in (0, 1), each shard's file (a shard of this
    directory, of its split) and SHA-256 (64 hex digits), the dtype (uint16 or uint32) and each split's token
    total (its shards')."""
    check_fields(meta, _META_FIELDS, "the record")
    for name, kind in _META_FIELDS.items():
        if kind is int and not 0 <= meta[name] < _LARGEST:
            raise ValueError(f"its {name!r} is {meta[name]}, outside [0, 2**63)")
    if not 0 < meta["val_fraction"] < 1:
        raise ValueError(f"its 'val_fraction' is {meta['val_fraction']}, outside (0, 1)")
    if meta["dtype"] not in _DTYPES:
        raise ValueError(f"its 'dtype' is {meta['dtype']!r}, not one of {', '.join(_DTYPES)}")
    for split in ("train", "val"):
        shards = meta["shards"].get(split)
        if not isinstance(shards, list):
            raise ValueError(f"its 'shards' has no list {split!r}")
        for index, shard in enumerate(shards):
            where = f"shards.{split}[{index}]"
            check_fields(shard, _SHARD_FIELDS, where)
            if not SHARD_NAME.match(shard["file"]) or not shard["file"].startswith(split):
                raise ValueError(f"{where} names {shard['file']!r}: not a shard file of the directory's {split} split")
            if not 0 <= shard["tokens"] < _LARGEST:
                raise ValueError(f"{where}'s 'tokens' is {shard['tokens']}, outside [0, 2**63)")
            if not _SHA256.match(shard["sha256"]):
                raise ValueError(f"{where}'s 'sha256' is {shard['sha256'][:80]!r}, not 64 hex digits")
        if meta[f"{split}_tokens"] != sum(shard["tokens"] for shard in shards):
            raise ValueError(f"its '{split}_tokens' is {meta[f'{split}_tokens']}, not the sum of its {split} shards'")


def read_meta(data_dir: str | os.PathLike) -> dict:
    """`data_dir/meta.json`, parsed and checked (`check_meta`); MissingInput when absent, ConfigError naming
    the field when it is not a preparation's record."""
    data_dir = Path(data_dir)
    path = data_dir / "meta.json"
    if not path.is_file():
        raise MissingInput(f"{path} is missing: prepare the corpus first (python -m gpt.data)")
    try:
        meta = json.loads(path.read_text())
        check_meta(meta)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        reason = first_line(e)
        raise ConfigError(f"{path} is not a prepared corpus's record ({reason}); {_again(data_dir)}") from None
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
    id_bits = int(ID_BITS) if meta.get("conversations") else None  # a conversation's tokens carry flags above
    for shard in shards:
        _check_contents(data_dir / shard["file"], shard["sha256"], dtype, vocab_size, data_dir, id_bits)
    return shards_digest(meta)


def _check_contents(path: Path, sha256: str, dtype: np.dtype, vocab_size: int, data_dir: Path,
                    id_bits: int | None) -> None:
    hasher = ShardHasher()
    with open(path, "rb") as file:
        position = 0
        while block := file.read(_BLOCK_TOKENS * dtype.itemsize):
            ids = np.frombuffer(block, dtype)
            hasher.update(ids)
            if id_bits is not None:
                ids = ids & dtype.type(id_bits)
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
    checksums = [shard["sha256"] for split in ("train", "val") for shard in meta["shards"][split]]
    return hashlib.sha256("".join(checksums).encode()).hexdigest()
