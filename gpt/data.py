"""Corpus preparation (text files -> uint16 token files + meta.json) and a deterministic batch loader.

The loader draws random `block_size + 1` windows. Batch `step` is a pure function of (seed, step), so
the loader's whole state is the step number: it is saved with every checkpoint, a resumed run sees
exactly the batches an uninterrupted one would, and memory stays flat (the tokens are memory-mapped).
Each process of a multi-host run takes its own rows of the same global batch.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from tqdm import tqdm

from gpt.errors import ConfigError, MissingInput
from gpt.tokenizer import get_tokenizer

__all__ = ["prepare", "Batches", "default_corpus", "corpus_identity", "unigram_loss"]

SUFFIXES = (".txt", ".md", ".py", ".rst", ".tex", ".html", ".json", ".csv", ".c", ".h")


def default_corpus() -> list[Path]:
    """The embedded default corpus: the top-level `.py` modules of the running Python's standard library
    (about 7 MB of real, varied text that every machine has offline)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if p.is_file())
    if not files:
        raise MissingInput(f"no standard-library sources found in {stdlib}; pass --data PATHS")
    return files


def _expand(inputs: Sequence[str | os.PathLike]) -> list[Path]:
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files.extend(sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES))
        else:
            matches = sorted(Path(m) for m in glob.glob(str(item), recursive=True) if Path(m).is_file())
            if not matches:
                raise MissingInput(f"data input {str(item)!r} is not a file, a directory or a matching glob")
            files.extend(matches)
    if not files:
        raise ConfigError(f"no text files found in {[str(i) for i in inputs]} (directories are searched for {SUFFIXES})")
    return files


def _read(path: Path) -> tuple[str, int]:
    """The file's text; bytes that are not UTF-8 become U+FFFD (counted, so prepare can report them)."""
    text = path.read_bytes().decode("utf-8", errors="replace")
    return text, text.count("\ufffd")


_BINARY_PROBE = 8192


def _sha256_of_text_file(path: Path) -> str:
    """The file's SHA-256; ConfigError if it is binary: a NUL byte in its first 8 KiB (git's rule), which
    text in any encoding that GPT-2's tokenizer is meant for never has."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        head = file.read(_BINARY_PROBE)
        if b"\0" in head:
            raise ConfigError(f"data input {str(path)!r} is binary (a NUL byte in its first {_BINARY_PROBE} bytes); "
                              f"pass text files only")
        digest.update(head)
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _sources(inputs: Sequence[str | os.PathLike]) -> list[dict]:
    return [{"path": str(p), "sha256": _sha256_of_text_file(p)} for p in _expand(inputs)]


def corpus_identity(inputs: Sequence[str | os.PathLike], val_fraction: float) -> dict:
    """What makes a corpus this corpus, independent of where its files are: the number of files, one
    SHA-256 over their contents' hashes in order, and the split. Refuses missing and binary inputs."""
    hashes = [source["sha256"] for source in _sources(inputs)]
    return {"files": len(hashes), "sha256": hashlib.sha256("".join(hashes).encode()).hexdigest(),
            "val_fraction": val_fraction}


def prepare(inputs: Sequence[str | os.PathLike], out_dir: str | os.PathLike, val_fraction: float = 0.1) -> dict:
    """Tokenize text files, directories or globs into `out_dir/{train,val}.bin` (uint16) + `meta.json`.

    Documents are joined with `<|endoftext|>`; the last `val_fraction` of the tokens is the validation
    split. If `meta.json` already describes the same inputs (by SHA-256) and split, nothing is redone.
    Returns the metadata.
    """
    if not 0 < val_fraction < 1:
        raise ConfigError(f"val_fraction must be in (0, 1), got {val_fraction}")
    out_dir = Path(out_dir)
    sources = _sources(inputs)
    files = [Path(source["path"]) for source in sources]
    meta_path = out_dir / "meta.json"
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if meta.get("sources") == sources and meta.get("val_fraction") == val_fraction and all(
            (out_dir / name).is_file() for name in ("train.bin", "val.bin")
        ):
            return meta

    tokenizer = get_tokenizer()
    with ThreadPoolExecutor() as pool:  # tiktoken releases the GIL, so threads tokenize in parallel
        read = list(pool.map(_read, files))
        encoded = list(tqdm(pool.map(tokenizer.encode, [text for text, _ in read]), total=len(files),
                            desc="tokenizing", unit="file", disable=None))
    ids = np.fromiter((t for doc in encoded for t in (*doc, tokenizer.eot_id)), dtype=np.uint16)
    if ids.size <= len(files):  # nothing but the separators
        raise ConfigError(f"the corpus {[str(i) for i in inputs]} is empty: it has no tokens")
    split = int(ids.size * (1 - val_fraction))
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, part in (("train.bin", ids[:split]), ("val.bin", ids[split:])):
        staging = out_dir / f".{name}.tmp"
        part.tofile(staging)
        staging.replace(out_dir / name)  # atomic: a reader never sees half a file
    meta = {
        "tokenizer": "gpt2", "vocab_size": tokenizer.vocab_size, "dtype": "uint16",
        "train_tokens": int(split), "val_tokens": int(ids.size - split), "val_fraction": val_fraction,
        "replaced_invalid_utf8": int(sum(n for _, n in read)), "sources": sources,
    }
    meta_path.write_text(json.dumps(meta, indent=1))
    return meta


class Batches:
    """Random windows of a token file, deterministic in (seed, step).

    `batches[step]` -> int32 [rows, block_size + 1] for this process's rows of the global batch.
    """

    def __init__(self, path: str | os.PathLike, block_size: int, batch_size: int, seed: int,
                 process_index: int = 0, process_count: int = 1):
        self.tokens = np.memmap(path, dtype=np.uint16, mode="r")
        if self.tokens.size < block_size + 1:
            raise ConfigError(
                f"{path} has {self.tokens.size} tokens, fewer than block_size + 1 = {block_size + 1}: "
                f"use more text or a smaller block_size"
            )
        if batch_size % process_count:
            raise ConfigError(f"batch_size={batch_size} must be divisible by the process count {process_count}")
        self.block_size, self.batch_size, self.seed = block_size, batch_size, seed
        rows = batch_size // process_count
        self.rows = slice(process_index * rows, (process_index + 1) * rows)

    def __getitem__(self, step: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, step])
        starts = rng.integers(0, self.tokens.size - self.block_size, self.batch_size)[self.rows]
        return np.stack([self.tokens[s : s + self.block_size + 1] for s in starts]).astype(np.int32)


def unigram_loss(train_path: str | os.PathLike, val_path: str | os.PathLike, vocab_size: int = 50257) -> float:
    """Nats per token of the best model that ignores context: the training split's unigram frequencies
    (add-one smoothed), scored on the validation split. A model below it has learned from context."""
    train = np.bincount(np.memmap(train_path, dtype=np.uint16, mode="r"), minlength=vocab_size) + 1.0
    log_p = np.log(train / train.sum())
    val = np.memmap(val_path, dtype=np.uint16, mode="r")
    return float(-log_p[val].mean())
