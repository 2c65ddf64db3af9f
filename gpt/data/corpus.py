"""Reading a corpus: input paths -> documents -> sections of text, streamed, in a fixed order.

Formats (by file name):
- text (`.txt`, `.md`, `.py`, ... and any file named directly): one document per file, read in 8 MiB
  pieces, so a file of any size streams;
- JSON Lines (`.jsonl`, `.jsonl.gz`, `.jsonl.zst`): one document per line, its `text_field`;
- Parquet (`.parquet`): one document per row of the `text_field` column, read a batch at a time;
- a Hugging Face `datasets` directory written by `save_to_disk` (its `state.json` names Arrow files): one
  document per row, read with pyarrow (the `datasets` package is not needed).

Every document is cut into **sections** of about `SECTION_CHARS` characters, at a newline that has an
ASCII non-space character on both sides. GPT-2's pre-tokenizer always ends a piece there, so tokenizing
the sections one by one gives exactly the tokens of the whole document (the tests check it against
tiktoken). Sections are the unit of the validation split and of restarting.

Bad records (a line that is not JSON, a missing or non-string field) are skipped and counted in
`BadRecords`, which keeps the first file:line of each kind. A lone surrogate in a JSON string (valid JSON,
not text) becomes U+FFFD, as invalid UTF-8 does, and is counted with it. An input that cannot be read (a
truncated or damaged .gz, .zst or Parquet file, a saved dataset missing a file, no permission) is one
line naming it, never a traceback, and never half read: a .zst must end at the end of a frame.

Inputs are resolved once, by real path: a file reached twice (through a symlink, or named twice) is read
once, a directory that links back to one above it is not entered again, an unreadable directory is an
error, and the paths under `exclude` (a run's own out_dir) are never part of the corpus.
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import io
import json
import os
import re
import zlib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from gpt.errors import ConfigError, MissingInput
from gpt.run_dir import LOCK_NAME

__all__ = ["Section", "BadRecords", "expand_inputs", "input_format", "read_sections", "holds_conversations",
           "SECTION_CHARS", "TEXT_SUFFIXES"]

TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".tex", ".html", ".c", ".h")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
SECTION_CHARS = 4096
_PIECE_BYTES = 8 << 20
# A newline between two ASCII non-space characters; the cut goes after it (the match's end). Spelled with
# the newline first so that the regex engine scans for that literal: 11x faster than leading with the
# lookbehind, which tries every position (it was the costliest step of reading a JSONL corpus).
_SAFE_BREAK = re.compile(r"\n(?<=[!-~]\n)(?=[!-~])")
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclasses.dataclass(frozen=True)
class Section:
    """A piece of one document's text; `first` marks the document's start (the tokenizer's BOS goes before it,
    where it has one), `last` its end (the EOS, GPT-2's <|endoftext|>, follows it). A conversation is one section:
    its `messages` (`gpt.data.conversations`), its text their JSON, and `where` its file:line."""

    text: str
    first: bool
    last: bool
    messages: list[dict] | None = None
    where: str = ""


@dataclasses.dataclass
class BadRecords:
    """Records skipped while reading: a count per kind and where each kind was first seen."""

    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    first: dict[str, str] = dataclasses.field(default_factory=dict)

    def add(self, kind: str, where: str) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        self.first.setdefault(kind, where)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def describe(self) -> str:
        return "; ".join(f"{n} {kind} (first at {self.first[kind]})" for kind, n in sorted(self.counts.items()))


def input_format(path: Path) -> str:
    """'jsonl', 'parquet', 'hf_dataset' or 'text', by the path's name (a directory with state.json is a
    saved Hugging Face dataset)."""
    name = path.name.lower()
    if path.is_dir():
        return "hf_dataset"
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    return "text"


def _is_hf_dataset(path: Path) -> bool:
    return (path / "state.json").is_file() and (path / "dataset_info.json").is_file()


def expand_inputs(inputs: Sequence[str | os.PathLike], exclude: Sequence[str | os.PathLike] = ()) -> list[Path]:
    """Files (and saved datasets) named by `inputs`, each once: files as given, directories searched
    recursively for text, JSONL and Parquet files (in name order), globs expanded; nothing under `exclude`.
    Raises MissingInput / ConfigError."""
    found: dict[str, Path] = {}  # by real path: a file reached twice is read once
    excluded = [os.path.realpath(path) for path in exclude]

    def add(path: Path) -> None:
        real = os.path.realpath(path)
        if not any(real == e or real.startswith(e.rstrip(os.sep) + os.sep) for e in excluded):
            found.setdefault(real, path)

    for item in inputs:
        path = Path(item)
        if path.is_dir() and _is_hf_dataset(path):
            add(path)
        elif path.is_file():
            add(path)
        elif path.is_dir():
            for file in _corpus_files(path):
                add(file)
        else:
            matches = sorted(Path(m) for m in glob.glob(str(item), recursive=True) if Path(m).is_file())
            if not matches:
                raise MissingInput(f"data input {str(item)!r} is not a file, a directory or a matching glob")
            for match in matches:
                add(match)
    if not found:
        raise ConfigError(f"no corpus files found in {[str(i) for i in inputs]} (directories are searched for "
                          f"{', '.join(TEXT_SUFFIXES + JSONL_SUFFIXES)}, .parquet"
                          + (f"; {', '.join(map(str, exclude))} excluded" if exclude else "") + ")")
    return list(found.values())


def _corpus_files(directory: Path) -> list[Path]:
    """The corpus files under `directory`, in name order, each directory entered once (a symlink back to
    one above it is not followed again), none from a training run's or a preparation's directory (one that
    holds `LOCK_NAME`: its checkpoint markers, metrics and shards are no one's text); ConfigError for a
    directory that cannot be read."""
    suffixes = TEXT_SUFFIXES + JSONL_SUFFIXES + (".parquet",)
    files, seen = [], set()

    def unreadable(error: OSError) -> None:
        raise ConfigError(f"data directory {error.filename!r} cannot be read: {error.strerror}")

    for root, dirs, names in os.walk(directory, onerror=unreadable, followlinks=True):
        real = os.path.realpath(root)
        if real in seen or (Path(root) / LOCK_NAME).exists():  # a run's or a preparation's directory: never text
            dirs[:] = []
            continue
        seen.add(real)
        files += [Path(root) / name for name in names if name.lower().endswith(suffixes)
                  and (Path(root) / name).is_file()]
    return sorted(files)


def split_sections(pieces: Iterable[str], size: int = SECTION_CHARS) -> Iterator[Section]:
    """One document, given as consecutive pieces of text, cut at the first safe newline after every `size`
    characters. The cuts depend on the document's text alone, not on how it was split into pieces (a
    break is only taken once the characters on both of its sides have arrived). The last section carries
    `last`, the first `first`."""
    buffer, first = "", True
    for piece in pieces:
        buffer += piece
        start = 0
        while len(buffer) - start > size:
            match = _SAFE_BREAK.search(buffer, start + size - 1)  # a cut at >= start + size
            if match is None:
                break
            yield Section(buffer[start:match.end()], first=first, last=False)
            start, first = match.end(), False
        buffer = buffer[start:]
    yield Section(buffer, first=first, last=True)


# ------------------------------------------------------------------------------------------ documents

def _text_pieces(path: Path) -> Iterator[str]:
    """A text file in pieces of about 8 MiB, each cut after a newline (never inside a UTF-8 character),
    decoded with U+FFFD for invalid bytes."""
    with open(path, "rb") as file:
        carry = b""
        for block in iter(lambda: file.read(_PIECE_BYTES), b""):
            data = carry + block
            cut = data.rfind(b"\n") + 1
            if cut == 0:
                carry = data  # no newline yet: keep reading
                continue
            yield data[:cut].decode("utf-8", errors="replace")
            carry = data[cut:]
        yield carry.decode("utf-8", errors="replace")


def _text_documents(path: Path, bad: BadRecords) -> Iterator[Iterable[str]]:
    yield _text_pieces(path)  # one document per file


class _ZstdFrames(io.RawIOBase):
    """A .zst file's decompressed bytes, frame after frame; OSError when it ends inside a frame (a truncated
    file: zstandard's own reader stops there as if at the end)."""

    def __init__(self, path: Path):
        import zstandard

        self.file, self.zstandard = open(path, "rb"), zstandard
        self.frame, self.pending = zstandard.ZstdDecompressor().decompressobj(), b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self.pending:
            block = self.file.read(1 << 20)
            if not block:
                if not self.frame.eof and self.started:
                    raise OSError("the file ends inside a zstd frame: it is truncated")
                return 0
            self.pending = self._decompress(block)
        size = min(len(buffer), len(self.pending))
        buffer[:size], self.pending = self.pending[:size], self.pending[size:]
        return size

    started = False

    def _decompress(self, block: bytes) -> bytes:
        out = []
        while block:
            self.started = True
            out.append(self.frame.decompress(block))
            block = self.frame.unused_data if self.frame.eof else b""
            if block:  # the next frame
                self.frame = self.zstandard.ZstdDecompressor().decompressobj()
        return b"".join(out)

    def close(self) -> None:
        self.file.close()
        super().close()


def _open_jsonl(path: Path):
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.open(path, "rb")
    if name.endswith(".zst"):
        return _ZstdFrames(path)
    return open(path, "rb")


def _jsonl_records(path: Path, field: str, bad: BadRecords) -> Iterator[tuple[str, object]]:
    """(file:line, the record's `field`) of each JSON line that has one; the others counted in `bad`."""
    with _open_jsonl(path) as raw:
        for number, line in enumerate(io.BufferedReader(raw, buffer_size=_PIECE_BYTES), start=1):
            if line.isspace():  # (not strip(): that copies every line)
                continue
            try:
                record = json.loads(line)
            except ValueError:
                bad.add("lines that are not JSON", f"{path}:{number}")
                continue
            if not isinstance(record, dict) or field not in record:
                bad.add(f"records without a {field!r} field", f"{path}:{number}")
                continue
            yield f"{path}:{number}", record[field]


def _arrow_records(batches, field: str, where: str) -> Iterator[tuple[str, object]]:
    row = 0
    for batch in batches:
        if field not in batch.schema.names:
            raise ConfigError(f"{where} has no column {field!r} (columns: {batch.schema.names}); pass --text_field")
        for value in batch.column(field).to_pylist():
            row += 1
            yield f"{where} row {row}", value


def _parquet_records(path: Path, field: str, bad: BadRecords) -> Iterator[tuple[str, object]]:
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    if field not in parquet.schema_arrow.names:
        raise ConfigError(f"{path} has no column {field!r} (columns: {parquet.schema_arrow.names}); pass --text_field")
    yield from _arrow_records(parquet.iter_batches(batch_size=1024, columns=[field]), field, str(path))


def _hf_dataset_records(path: Path, field: str, bad: BadRecords) -> Iterator[tuple[str, object]]:
    import pyarrow as pa

    state = json.loads((path / "state.json").read_text())
    for entry in state.get("_data_files", []):
        with pa.memory_map(str(path / entry["filename"])) as source:
            yield from _arrow_records(pa.ipc.open_stream(source), field, f"{path}/{entry['filename']}")


_RECORD_READERS = {"jsonl": _jsonl_records, "parquet": _parquet_records, "hf_dataset": _hf_dataset_records}


def _documents(path: Path, field: str, bad: BadRecords) -> Iterator[Iterable[str]]:
    """Each document of a structured input: its `field`, a string (the others counted in `bad`)."""
    for where, text in _RECORD_READERS[input_format(path)](path, field, bad):
        if not isinstance(text, str):
            bad.add(f"records whose {field!r} is not a string", where)
            continue
        yield (_SURROGATE.sub("\ufffd", text),)  # a lone surrogate: JSON, but no text


def _conversations(path: Path, bad: BadRecords) -> Iterator[Section]:
    """Each conversation of a structured input, one section each (the malformed counted in `bad`)."""
    from gpt.data.conversations import FIELD, messages_of

    if input_format(path) == "text":
        raise ConfigError(f"data input {str(path)!r} is a text file in a corpus of conversations: pass JSONL, "
                          f"Parquet or saved datasets whose records hold {FIELD!r}")
    for where, value in _RECORD_READERS[input_format(path)](path, FIELD, bad):
        messages, problem = messages_of(value)
        if messages is None:
            bad.add(problem, where)
            continue
        text = _SURROGATE.sub("\ufffd", json.dumps(messages, ensure_ascii=False))
        yield Section(text, first=True, last=True, messages=json.loads(text), where=where)


def read_sections(path: Path, text_field: str, bad: BadRecords, conversations: bool = False) -> Iterator[Section]:
    """The sections of every document in one input, in order (of every conversation, with `conversations`)."""
    if conversations:
        sections = _conversations(path, bad)
    else:
        documents = _text_documents(path, bad) if input_format(path) == "text" else _documents(path, text_field, bad)
        sections = (section for pieces in documents for section in split_sections(pieces))
    try:
        yield from sections
    except _READ_ERRORS as e:  # a damaged, truncated or unreadable input: one line naming it
        raise ConfigError(f"data input {str(path)!r} cannot be read: {_reason(e)}") from None


def holds_conversations(paths: Sequence[Path], text_field: str) -> bool:
    """Whether a corpus is one of conversations: its first structured input's first record (a JSONL line, a
    Parquet or saved-dataset row) holds a `messages` list and no `text_field`. Text files are documents; an input
    that cannot be read is no conversation (reading it for the corpus then says why in one line)."""
    for path in paths:
        if input_format(path) != "text":
            try:
                return _first_record_is_a_conversation(path, text_field)
            except (*_READ_ERRORS, ConfigError):
                return False
    return False


def _first_record_is_a_conversation(path: Path, text_field: str) -> bool:
    from gpt.data.conversations import FIELD

    if input_format(path) == "jsonl":
        with _open_jsonl(path) as raw:
            for line in io.BufferedReader(raw, buffer_size=_PIECE_BYTES):
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                return isinstance(record, dict) and isinstance(record.get(FIELD), list) and text_field not in record
        return False
    first = next(_RECORD_READERS[input_format(path)](path, FIELD, BadRecords()), (None, None))[1]
    return isinstance(first, list)  # (a text corpus has no messages column: ConfigError)


def _reason(error: BaseException) -> str:
    return error.strerror if isinstance(error, OSError) and error.strerror else str(error) or type(error).__name__


def _read_errors() -> tuple[type[BaseException], ...]:
    """What the readers raise on a damaged or unreadable input (not the bugs: TypeError and the like)."""
    import pyarrow
    import zstandard

    return OSError, EOFError, zlib.error, ValueError, KeyError, zstandard.ZstdError, pyarrow.ArrowException


_READ_ERRORS = _read_errors()
