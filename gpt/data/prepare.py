"""Corpus preparation: inputs -> token shards + `meta.json`, streaming, in parallel, restartable.

    python -m gpt.data --data corpus/ --out_dir out/data [--text_field text] [--workers N]

- **Streaming, flat memory.** `gpt.data.corpus` reads documents as sections of at least 4,096 characters; batches of sections are
  tokenized by `workers` threads (tiktoken releases the GIL) with at most two batches per thread in
  flight, and tokens go straight to the open shard file. Peak memory does not grow with the corpus.
- **Shards.** `train_00000.bin`, ... and `val_00000.bin`, ... of `shard_tokens` tokens each (the last one
  shorter), `uint16` when the vocabulary fits (GPT-2's does), else `uint32`. Every document ends with the
  tokenizer's EOS (GPT-2's `<|endoftext|>`) and begins with its BOS where it adds one (a model's own
  tokenizer, to fine-tune it: `gpt.tokenizer_json`). `meta.json` lists the shards with their token counts
  and SHA-256s (`gpt.data.shards` checks them at every use), every input with its SHA-256, the tokenizer,
  the split rule and what was skipped.
- **One writer.** A preparation holds the data directory's lock (`gpt.run_dir.RunLock`, as a training run
  reading it does): a second preparation, or one beside a run, is refused with one line naming the
  holder. A preparation writes its shards and `progress.json` in `out_dir/.preparing`, and moves them in
  (then `meta.json`, written last) only once the whole corpus is prepared: a failure (a full disk, a bad
  input, a corpus too small to split) removes the shard it was writing and leaves what `out_dir` held
  usable.
- **The validation split** is decided per section by its text alone: a section is validation when the
  first 8 bytes of its BLAKE2b hash, read as a fraction of 2**64, fall below `val_fraction`. The same text
  lands in the same split whatever else the corpus holds, so a corpus that grows keeps its validation
  set (plus a share of the new text), the rule needs one pass, and a corpus of one big file still gets a
  validation split, spread through it.
- **Restartable.** A shard appears (renamed into place) only when whole, and `progress.json` then
  records where each split resumes (section index, token offset) and each finished shard's checksum. A
  preparation killed half way checks those shards on disk, re-reads its inputs up to there (reading is
  cheap) and tokenizes only the rest; the shards equal an uninterrupted run's byte for byte. Inputs whose hashes and settings match `meta.json` are not
  prepared again at all.
- **Conversations** (records with `messages`): each is one section, rendered with the tokenizer's chat template
  (GPT-2's in `gpt.chat_format`'s) to uint32 ids flagged with what the loss is taught (`gpt.data.conversations`).
- **Bad records** (a line that is not JSON, a missing or non-string text field) are skipped, counted in
  `meta.json` and reported with the first file:line of each kind. Preparation stops with an error only
  when no document is left. Binary text files (a NUL byte in the first 8 KiB) are refused.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
import sys
import sysconfig
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from gpt.chat_format import for_conversations
from gpt.chat_template import ChatTemplate
from gpt.data.conversations import encode_conversation
from gpt.data.corpus import (
    SECTION_CHARS,
    BadRecords,
    Section,
    expand_inputs,
    holds_conversations,
    input_format,
    read_sections,
)
from gpt.data.shards import SHARD_SUM_FIELDS, ShardHasher, check_fields, check_meta
from gpt.errors import ConfigError, MissingInput, write_failed
from gpt.progress import Progress, ProgressChoice, Style
from gpt.run_dir import RunLock, make_dir
from gpt.tokenizer import TextTokenizer, get_tokenizer

__all__ = ["prepare", "sources", "in_validation", "default_corpus", "corpus_inputs", "conversation_template", "corpus_identity", "PrepareConfig", "CorpusChoice",
           "TextFieldChoice", "DEFAULT_VAL_FRACTION"]

SPLIT_RULE = "section is val when blake2b-64(text) / 2**64 < val_fraction"
DEFAULT_VAL_FRACTION = 0.05  # prepare's, `python -m gpt.data`'s and train.py's: one corpus, one preparation
_FORMAT_VERSION = 3  # 3: each shard's SHA-256
_BATCH_CHARS = 1 << 20
_BINARY_PROBE = 8192
_WRITE_BUFFER = 4 << 20
_LOSSY_SHARE = 1e-3  # a file with more of its characters replaced than this is named in a warning


def default_corpus() -> list[Path]:
    """The embedded default corpus: the top-level `.py` modules of the running Python's standard library
    (about 7 MB of real, varied text that every machine has offline)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if p.is_file())
    if not files:
        raise MissingInput(f"no standard-library sources found in {stdlib}; pass --data PATHS")
    return files


def corpus_inputs(data: Sequence[str]) -> list:
    """The inputs `--data` names: the embedded default corpus when it names none, the embedded conversations
    (`gpt.data.chat_demo`) for the name `stdlib-chat`, each other path as it is."""
    from gpt.data import chat_demo

    return [chat_demo.demo_path() if item == chat_demo.NAME else item for item in data] or default_corpus()


def in_validation(text: str, val_fraction: float) -> bool:
    """Does a section with this text belong to the validation split? (The rule in this module's docstring.)"""
    digest = hashlib.blake2b(text.encode("utf-8", errors="surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little") < val_fraction * 2.0**64


# ------------------------------------------------------------------------------------------ inputs

def _sha256(path: Path, refuse_binary: bool) -> str:
    """A file's SHA-256 (a saved dataset's: over its files in order); ConfigError for a binary text file:
    a NUL byte in its first 8 KiB (git's rule), which no text the tokenizer is meant for has."""
    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file_path in files:
        with open(file_path, "rb") as file:
            head = file.read(_BINARY_PROBE)
            if refuse_binary and b"\0" in head:
                raise ConfigError(f"data input {str(file_path)!r} is binary (a NUL byte in its first "
                                  f"{_BINARY_PROBE} bytes); pass text files only")
            digest.update(head)
            for chunk in iter(lambda: file.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def sources(inputs: Sequence[str | os.PathLike], exclude: Sequence[str | os.PathLike] = ()) -> list[dict]:
    """Every input named by `inputs` (nothing under `exclude`) with its format and SHA-256: one read of the
    whole corpus, which `corpus_identity` and `prepare` share. Refuses missing, unreadable and binary inputs."""
    found = []
    for path in expand_inputs(inputs, exclude):
        try:
            found.append({"path": str(path), "format": input_format(path),
                          "sha256": _sha256(path, input_format(path) == "text")})
        except OSError as e:
            raise ConfigError(f"data input {str(path)!r} cannot be read: {e.strerror or e}") from None
    return found


def corpus_identity(corpus_sources: list[dict], val_fraction: float, text_field: str = "text") -> dict:
    """What makes a corpus this corpus, independent of where its files are: the number of inputs, one
    SHA-256 over their contents' hashes in order (from `sources`), the text field and the split."""
    hashes = [source["sha256"] for source in corpus_sources]
    return {"files": len(hashes), "sha256": hashlib.sha256("".join(hashes).encode()).hexdigest(),
            "text_field": text_field, "val_fraction": val_fraction}


# ------------------------------------------------------------------------------------------ shards

STAGING = ".preparing"
"""The directory inside out_dir where a preparation writes its shards and progress.json until it is done."""
_WRITER_FIELDS = {"shards": list, "next_section": int, "next_offset": int}  # a writer's state()


class _ShardWriter:
    """Appends one split's tokens to fixed-size shard files; a shard is renamed into place when full."""

    def __init__(self, directory: Path, split: str, dtype, shard_tokens: int, state: dict | None,
                 on_shard: Callable[[], None]):
        self.directory, self.split, self.dtype, self.shard_tokens = directory, split, dtype, shard_tokens
        self.shards: list[dict] = list(state["shards"]) if state else []  # {tokens, sha256} of each finished one
        self.next_section, self.next_offset = (state["next_section"], state["next_offset"]) if state else (0, 0)
        self.on_shard = on_shard
        self.file, self.filled, self.hasher = None, 0, ShardHasher()

    def state(self) -> dict:
        return {"shards": self.shards, "next_section": self.next_section, "next_offset": self.next_offset}

    def _path(self, index: int) -> Path:
        return self.directory / f"{self.split}_{index:05d}.bin"

    def write(self, section_index: int, tokens: np.ndarray) -> None:
        """Append the tokens of section `section_index` (those before the resume point are skipped)."""
        if section_index < self.next_section:
            return
        consumed = self.next_offset if section_index == self.next_section else 0
        tokens = tokens[consumed:]
        while tokens.size:
            if self.file is None:
                # A large buffer: a section's tokens are a few KiB, and a system call per section cost
                # more than the copy.
                self.file = open(self._path(len(self.shards)).with_suffix(".bin.tmp"), "wb", buffering=_WRITE_BUFFER)
            part = tokens[: self.shard_tokens - self.filled]
            self.file.write(memoryview(part))  # no copy: a 1-D slice is contiguous
            self.hasher.update(part)
            self.filled += part.size
            consumed += part.size
            tokens = tokens[part.size:]
            if self.filled == self.shard_tokens:
                self.next_section, self.next_offset = (section_index, consumed) if tokens.size else (section_index + 1, 0)
                self._finish()  # the resume point moves only with a finished shard: a partial one is not kept

    def _finish(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        self._path(len(self.shards)).with_suffix(".bin.tmp").replace(self._path(len(self.shards)))
        self.shards.append({"tokens": self.filled, "sha256": self.hasher.hexdigest()})
        self.file, self.filled, self.hasher = None, 0, ShardHasher()
        self.on_shard()

    def abort(self) -> None:
        """Close and remove the shard being written (after a failure: nothing half-written stays)."""
        if self.file is not None:
            file, self.file = self.file, None
            try:
                file.close()  # its flush of what it buffered fails again on a full disk: the file goes all the same
            except OSError:
                pass
            finally:
                self._path(len(self.shards)).with_suffix(".bin.tmp").unlink(missing_ok=True)

    def close(self) -> list[dict]:
        """Finish the last (shorter) shard; the list of shards for meta.json."""
        if self.file is not None and self.filled:
            self._finish()
        return [{"file": self._path(i).name, **shard} for i, shard in enumerate(self.shards)]

    def on_disk(self) -> bool:
        """Are the finished shards that the resume state lists on disk, whole and unchanged?"""
        for index, shard in enumerate(self.shards):
            path = self._path(index)
            if not path.is_file() or path.stat().st_size != shard["tokens"] * self.dtype.itemsize:
                return False
            hasher = ShardHasher()
            hasher.update(np.fromfile(path, self.dtype))
            if hasher.hexdigest() != shard["sha256"]:
                return False
        return True


# ------------------------------------------------------------------------------------------ prepare

def _numbered_sections(paths: list[Path], text_field: str, bad: BadRecords, conversations: bool
                       ) -> Iterator[tuple[int, Path, Section]]:
    index = 0
    for path in paths:
        for section in read_sections(path, text_field, bad, conversations):
            yield index, path, section
            index += 1


def _encode(batch: list[tuple[int, Section]], val_fraction: float, dtype, tokenizer: TextTokenizer,
            template: ChatTemplate | None) -> list[tuple[int, str, np.ndarray, Section]]:
    """(section index, split, tokens, section) of each section in a batch, a document's BOS (where the tokenizer
    adds one) before its first section and its EOS after its last; a conversation's as `template` renders it
    (`gpt.data.conversations`); runs on a worker thread."""
    out = []
    for index, section in batch:
        if section.messages is not None:
            tokens = encode_conversation(section.messages, template, tokenizer, section.where)
        else:
            tokens = tokenizer.encode_to_numpy(section.text, add_special=section.first)
            if section.last:
                tokens = np.append(tokens, np.uint32(tokenizer.eot_id))
        split = "val" if in_validation(section.text, val_fraction) else "train"
        out.append((index, split, tokens.astype(dtype), section))
    return out


def _matches(record: dict, corpus_sources: list[dict], settings: dict) -> bool:
    return record.get("sources") == corpus_sources and all(record.get(k) == v for k, v in settings.items())


def _read_state(progress_path: Path) -> dict:
    """A JSON record (an interrupted preparation's progress.json, a finished one's meta.json), or {} (none,
    or not JSON: then the preparation starts again)."""
    try:
        state = json.loads(progress_path.read_text()) if progress_path.is_file() else {}
    except (ValueError, UnicodeDecodeError):
        return {}
    return state if isinstance(state, dict) else {}


def _digest(record: dict) -> str:
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def _read_progress(progress_path: Path) -> dict:
    """An interrupted preparation's progress.json, or {} where there is none or it is not one this code
    wrote whole: its digest (over the rest of it) differs, or a writer's state is not a list of shards
    ({tokens, sha256}) and a resume point (next_section, next_offset >= 0). The preparation then starts
    again: the record only saves work, and a resume point changed by hand would drop or repeat text."""
    record = _read_state(progress_path)
    if record.pop("digest", None) != _digest(record):
        return {}
    try:
        for split in ("train", "val"):
            check_fields(record.get(split), _WRITER_FIELDS, f"progress.json's {split!r}")
            for shard in record[split]["shards"]:
                check_fields(shard, SHARD_SUM_FIELDS, "a shard")
            if record[split]["next_section"] < 0 or record[split]["next_offset"] < 0:
                raise ValueError("a resume point below 0")
    except ValueError:
        return {}
    return record


def _is_meta(record: dict) -> bool:
    try:
        check_meta(record)
    except ValueError:
        return False
    return True


def _clear_shards(directory: Path) -> None:
    """Removes a preparation's files (its record first, so that no record outlives its shards)."""
    for pattern in ("meta.json", "progress.json", "*.json.tmp", "train_*.bin*", "val_*.bin*", "train.bin", "val.bin"):
        for path in directory.glob(pattern):
            path.unlink()


def _tokenize(paths: list[Path], text_field: str, val_fraction: float, dtype, writers: dict, workers: int,
              progress: bool | None, tokenizer: TextTokenizer, template: ChatTemplate | None
              ) -> tuple[collections.Counter, BadRecords, dict]:
    """Read the sections of `paths` past those both splits' writers already hold, tokenize them in batches on
    `workers` threads (at most two batches each in flight) and hand each, in order, to its split's writer; a
    corpus of conversations with `template`. Returns the counts of sections, documents and replaced bytes over the
    whole corpus, the bad records, and the longest conversation tokenized ({tokens, where}, or {})."""
    resume_at = min(w.next_section for w in writers.values())
    bad = BadRecords()
    counts = collections.Counter()
    lossy: dict[Path, tuple[int, int]] = collections.defaultdict(lambda: (0, 0))  # (U+FFFD, characters) a file

    def batches() -> Iterator[list[tuple[int, Section]]]:
        batch, size = [], 0
        for index, path, section in _numbered_sections(paths, text_field, bad, template is not None):
            counts["sections"] += 1
            counts["characters"] += len(section.text)
            counts["documents"] += section.last
            replaced = section.text.count("\ufffd")
            counts["replaced_invalid_utf8"] += replaced
            lossy[path] = (lossy[path][0] + replaced, lossy[path][1] + len(section.text))
            if index < resume_at:
                continue  # both splits already hold it in finished shards
            batch.append((index, section))
            size += len(section.text)
            if size >= _BATCH_CHARS:
                yield batch
                batch, size = [], 0
        if batch:
            yield batch

    total_bytes = sum(p.stat().st_size for p in paths if p.is_file())
    longest: dict = {}
    with ThreadPoolExecutor(workers) as pool, Progress("tokenizing", total_bytes, unit="B", style=progress) as bar:
        in_flight: collections.deque = collections.deque()

        def drain_one() -> None:
            for index, split, tokens, section in in_flight.popleft().result():
                writers[split].write(index, tokens)
                if section.messages is not None and tokens.size > longest.get("tokens", 0):
                    longest.update(tokens=int(tokens.size), where=section.where)

        for batch in batches():
            in_flight.append(pool.submit(_encode, batch, val_fraction, dtype, tokenizer, template))
            bar.update(sum(len(section.text) for _, section in batch))
            bar.tick()
            if len(in_flight) >= 2 * workers:
                drain_one()
        while in_flight:
            drain_one()
    for path, (replaced, characters) in lossy.items():
        if replaced > _LOSSY_SHARE * characters:
            print(f"warning: {path}: {replaced:,} of its {characters:,} characters were not valid UTF-8 (or were lone "
                  f"surrogates) and became U+FFFD", file=sys.stderr)
    return counts, bad, longest


def _check_splits(inputs, counts: collections.Counter, bad: BadRecords, totals: dict, val_fraction: float) -> None:
    """ConfigError for a corpus that gave no documents, no tokens, or an empty split."""
    if counts["documents"] == 0:
        detail = f": every record was bad: {bad.describe()}" if bad.total else ""
        raise ConfigError(f"the corpus {[str(i) for i in inputs]} holds no documents{detail}")
    if totals["train"] + totals["val"] == counts["documents"]:  # nothing but the separators
        raise ConfigError(f"the corpus {[str(i) for i in inputs]} is empty: it has no tokens")
    for split, name in (("train", "training"), ("val", "validation")):
        if totals[split] == 0:
            sections = f"{counts['sections']:,} section{'s' * (counts['sections'] != 1)}"
            raise ConfigError(f"the {name} split of {[str(i) for i in inputs]} is empty ({counts['characters']:,} "
                              f"characters in {sections}, the split's unit; val_fraction={val_fraction}): use more "
                              f"text or another val_fraction")


def prepare(inputs: Sequence[str | os.PathLike], out_dir: str | os.PathLike,
            val_fraction: float = DEFAULT_VAL_FRACTION, text_field: str = "text", workers: int | None = None, shard_tokens: int = 100_000_000,
            progress: Style = "auto", corpus_sources: list[dict] | None = None, lock: bool = True,
            tokenizer: TextTokenizer | None = None) -> dict:
    """Tokenize `inputs` (files, directories, globs; text, JSONL, Parquet or saved datasets) into token
    shards in `out_dir` with `tokenizer` (default: GPT-2's; a model's own to fine-tune it), as this module's
    docstring describes.

    `corpus_sources`: `sources(inputs)` when the caller has it already (the inputs are then not read
    again to hash them). `lock`: take `out_dir`'s lock for the preparation (False for a caller that holds
    it: a training run). `progress`: how the tokenizing shows its progress (`gpt.progress`). Returns the metadata (also written to `out_dir/meta.json`), with `train_tokens`
    and `val_tokens`.
    """
    if not 0 < val_fraction < 1:
        raise ConfigError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if shard_tokens < 1:
        raise ConfigError(f"shard_tokens must be >= 1, got {shard_tokens}")
    if workers is not None and workers < 1:
        raise ConfigError(f"workers must be >= 1 (or None for every core), got {workers}")
    workers = workers or os.cpu_count() or 1
    tokenizer = tokenizer or get_tokenizer()
    if tokenizer.eot_id is None:
        raise ConfigError(f"the tokenizer {tokenizer.name} names no end-of-sequence token (tokenizer_config.json's "
                          f"eos_token), which ends each document")
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"out_dir '{out_dir}' is a file, not a directory")
    corpus_sources = corpus_sources if corpus_sources is not None else sources(inputs)
    with RunLock(make_dir(out_dir), enabled=lock, role="corpus preparation",
                 advice="or prepare into another --out_dir"):
        try:
            return _prepare_locked(corpus_sources, inputs, out_dir, val_fraction, text_field, workers, shard_tokens,
                                   progress, tokenizer)
        except MissingInput:
            raise
        except OSError as e:  # a full disk, a directory that cannot be written: nothing half-written is left
            raise write_failed(e, f"preparing the corpus in {out_dir} failed: {e}", ConfigError) from None


def _prepare_locked(corpus_sources, inputs, out_dir: Path, val_fraction, text_field, workers, shard_tokens,
                    progress, tokenizer: TextTokenizer) -> dict:
    paths = [Path(source["path"]) for source in corpus_sources]
    tokenizer, template = conversation_template(paths, text_field, tokenizer)
    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 1 << 16 and template is None else np.uint32)
    settings = {"format": _FORMAT_VERSION, "tokenizer": tokenizer.name, "vocab_size": tokenizer.vocab_size,
                "conversations": template is not None,
                "dtype": dtype.name, "val_fraction": val_fraction, "text_field": text_field,
                "shard_tokens": shard_tokens, "section_chars": SECTION_CHARS, "split_rule": SPLIT_RULE}
    meta_path = out_dir / "meta.json"
    if meta_path.is_file():
        meta = _read_state(meta_path)  # a record that is not a preparation's matches nothing: prepared anew
        if _is_meta(meta) and _matches(meta, corpus_sources, settings) and all(
                (out_dir / s["file"]).is_file() for split in ("train", "val") for s in meta["shards"][split]):
            return meta
    # The new shards are written apart, and replace what out_dir holds only once the whole corpus is
    # prepared: a preparation that fails (a corpus too small to split, a full disk) leaves it usable.
    staging = out_dir / STAGING
    staging.mkdir(exist_ok=True)
    progress_path = staging / "progress.json"
    state = _read_progress(progress_path)
    if not _matches(state, corpus_sources, settings):
        _clear_shards(staging)
        state = {}

    def save_progress() -> None:
        record = {**settings, "sources": corpus_sources, **{split: w.state() for split, w in writers.items()}}
        temporary = progress_path.with_suffix(".json.tmp")
        temporary.write_text(json.dumps({**record, "digest": _digest(record)}))
        temporary.replace(progress_path)

    writers = {split: _ShardWriter(staging, split, dtype, shard_tokens, state.get(split), save_progress)
               for split in ("train", "val")}
    if state and not all(writer.on_disk() for writer in writers.values()):  # a finished shard lost or changed
        _clear_shards(staging)
        writers = {split: _ShardWriter(staging, split, dtype, shard_tokens, None, save_progress)
                   for split in ("train", "val")}
    try:
        counts, bad, longest = _tokenize(paths, text_field, val_fraction, dtype, writers, workers, progress,
                                         tokenizer, template)
        shards = {split: writer.close() for split, writer in writers.items()}
    except BaseException:
        for writer in writers.values():
            writer.abort()
        raise

    totals = {split: sum(s["tokens"] for s in shards[split]) for split in shards}
    _check_splits(inputs, counts, bad, totals, val_fraction)
    if bad.total:
        print(f"warning: skipped {bad.total} bad records: {bad.describe()}", file=sys.stderr)
    meta = {**settings, "sources": corpus_sources, "shards": shards,
            "train_tokens": totals["train"], "val_tokens": totals["val"], "documents": counts["documents"],
            "sections": counts["sections"], "replaced_invalid_utf8": counts["replaced_invalid_utf8"],
            "bad_records": {"counts": bad.counts, "first": bad.first},
            **({"longest_conversation": longest} if longest else {})}
    _move_in(staging, out_dir, meta)
    return meta


def conversation_template(paths: list[Path], text_field: str, tokenizer: TextTokenizer
                          ) -> tuple[TextTokenizer, ChatTemplate | None]:
    """The tokenizer and chat template a corpus of conversations is rendered with
    (`gpt.data.corpus.holds_conversations`): the tokenizer's own, or GPT-2's in this project's chat format
    (`gpt.chat_format.for_conversations`); `tokenizer` and None for a corpus of documents. ConfigError where the
    corpus is of conversations and the tokenizer has no template."""
    if not holds_conversations(paths, text_field):
        return tokenizer, None
    tokenizer, _, _ = for_conversations(tokenizer, tokenizer.vocab_size)
    template = ChatTemplate.of(tokenizer)
    if template is None:
        raise ConfigError(f"the corpus {[str(p) for p in paths][:3]} holds conversations ('messages'), and the "
                          f"tokenizer {tokenizer.name[:40]} has no chat template to render them with: fine-tune an "
                          f"instruct model's directory, or a GPT-2 (its chat format: gpt/chat_format.py)")
    return tokenizer, template


def _move_in(staging: Path, out_dir: Path, meta: dict) -> None:
    """The staged shards into `out_dir`, in place of what it held, and `meta` as its record, written last:
    a directory with a meta.json holds its shards (a stop between leaves none, and is prepared again)."""
    _clear_shards(out_dir)  # meta.json first among them
    for split in ("train", "val"):
        for shard in meta["shards"][split]:
            (staging / shard["file"]).replace(out_dir / shard["file"])
    temporary = out_dir / "meta.json.tmp"
    temporary.write_text(json.dumps(meta, indent=1))
    temporary.replace(out_dir / "meta.json")
    _clear_shards(staging)
    staging.rmdir()


# ------------------------------------------------------------------------------------------ the CLI

@dataclasses.dataclass(frozen=True)
class TextFieldChoice:
    """Where a record's text is: a flag of every command that reads a corpus."""

    text_field: str = "text"
    """The field (JSONL) or column (Parquet, saved datasets) holding each document's text."""


@dataclasses.dataclass(frozen=True)
class CorpusChoice(TextFieldChoice):
    """The corpus a preparation reads and how it is split: `python -m gpt.data`'s and train.py's flags."""

    data: tuple[str, ...] = ()
    """Files, directories or globs: text, .jsonl(.gz/.zst), .parquet, or a saved datasets directory (JSONL, Parquet
    or datasets records with `messages`: conversations, `gpt/data/conversations.py`); empty: the embedded default
    corpus (the Python standard library); `stdlib-chat`: the embedded conversations (`gpt/data/chat_demo.py`)."""
    val_fraction: float = DEFAULT_VAL_FRACTION
    """The share of the corpus held out for evaluation (sections chosen by hash: see gpt/data/prepare.py)."""


@dataclasses.dataclass(frozen=True)
class PrepareConfig(CorpusChoice, ProgressChoice):
    """`python -m gpt.data --help` lists these as flags (the corpus and its split: `CorpusChoice`)."""

    out_dir: str = "out/data"
    """Where the shards and meta.json go (train.py uses OUT_DIR/data)."""
    workers: int | None = None
    """Tokenizer threads (default: every core)."""
    shard_tokens: int = 100_000_000
    """Tokens per shard file."""


def main(config: PrepareConfig) -> None:
    meta = prepare(corpus_inputs(config.data), config.out_dir, config.val_fraction, config.text_field,
                   config.workers, config.shard_tokens, config.progress_style)
    print(f"{meta['documents']:,} documents -> {meta['train_tokens']:,} train / {meta['val_tokens']:,} val tokens "
          f"in {len(meta['shards']['train'])} + {len(meta['shards']['val'])} shards in {config.out_dir}")

