"""A Hugging Face model's own tokenizer (its `tokenizer.json`) through the `tokenizers` library, with GPT-2's
methods (`gpt.tokenizer.TextTokenizer`): the byte-level BPEs of Llama 3, Qwen2/3 and SmolLM2, and the
SentencePiece-style ones of Gemma, Mistral and Llama 2 (a `▁` for a space, `<0xNN>` byte-fallback tokens).

Ids are those transformers' `AutoTokenizer` gives: the file's normalizer, pre-tokenizer, model and
post-processor (which adds a BOS where the model's tokenizer does), and `add_bos_token` of
tokenizer_config.json where it is set. A special token's text inside the text is ordinary text unless
`allow_special` (GPT-2's rule: a corpus that contains the string does not inject document breaks).

Text comes back from each token's bytes (`token_bytes`), read off the file's decoder (`_TokenSpelling`), so
that a stream of tokens becomes text one whole character at a time, never splitting a character or a run of
byte-fallback tokens (`gpt.inference.text_stream`), and equals the whole sequence's decode.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import tokenizers

from gpt.errors import ConfigError, MissingInput, first_line
from gpt.tokenizer import UNKNOWN_ID_BYTES, byte_to_unicode

__all__ = ["TokenizerJson", "FILES"]

FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json")
"""What it reads of a directory (all but the first where there is one): its chat template (`gpt.chat_template`)
travels with it."""

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a byte-fallback token's spelling


class _TokenSpelling:
    """The bytes each token stands for, from a tokenizer.json's decoder (a step or a `Sequence` of them).

    Per token, in the decoder's order: `ByteLevel` (GPT-2's byte alphabet undone), `Replace` of a string
    (SentencePiece's `▁` to a space), `ByteFallback` (`<0xNN>` to that byte), `Strip` (before a `Fuse`: of
    each token), `Metaspace` (its replacement to a space). Of the whole sequence: a `Strip` after a `Fuse`,
    and `Metaspace`'s prepended space, remove the first token's leading space (`lead`, what `decode` drops
    at a sequence's start and a stream of a continuation keeps). Any other step is refused in one line.
    """

    def __init__(self, decoder: dict | None, where: str):
        steps = (decoder or {}).get("decoders", [decoder]) if (decoder or {}).get("type") == "Sequence" else [decoder]
        self.steps, self.byte_level, self.lead, fused = [], False, "", False
        for step in steps:
            kind = (step or {}).get("type")
            if kind == "ByteLevel":
                self.byte_level = True
            elif kind == "Replace" and isinstance(step.get("pattern"), dict) and "String" in step["pattern"]:
                self.steps.append(("replace", step["pattern"]["String"], step.get("content", "")))
            elif kind == "ByteFallback":
                self.steps.append(("bytes", None, None))
            elif kind == "Fuse":
                fused = True
            elif kind == "Strip" and not fused:
                self.steps.append(("strip", step.get("content", " "), (step.get("start", 0), step.get("stop", 0))))
            elif kind == "Strip" and step.get("stop", 0) == 0 and step.get("start", 0) <= 1:
                self.lead = step.get("content", " ") if step.get("start", 0) else ""
            elif kind == "Metaspace":
                self.steps.append(("replace", step.get("replacement", "▁"), " "))
                self.lead = " " if step.get("prepend_scheme", "always") != "never" else ""
            else:
                raise ConfigError(f"{where}: decoder step {json.dumps(step)[:120]} is not supported; this reader "
                                  f"decodes byte-level BPE (ByteLevel) and SentencePiece-style tokens (Replace, "
                                  f"ByteFallback, Fuse, Strip, Metaspace)")
        if self.byte_level and self.steps:
            raise ConfigError(f"{where}: a decoder of ByteLevel and other steps is not supported")
        self._unspell = {char: byte for byte, char in byte_to_unicode().items()}

    def bytes_of(self, piece: str) -> bytes:
        """The bytes of one (non-special) token spelled `piece` in the vocabulary."""
        if self.byte_level:
            return bytes(self._unspell[char] for char in piece)
        for kind, a, b in self.steps:
            if kind == "bytes" and (match := _BYTE_TOKEN.fullmatch(piece)):
                return bytes([int(match.group(1), 16)])  # a byte, not text: no later step changes it
            if kind == "replace":
                piece = piece.replace(a, b)
            elif kind == "strip":
                start, stop = b
                piece = piece[start if piece[:start] == a * start else 0:]
                piece = piece[:len(piece) - stop] if stop and piece.endswith(a * stop) else piece
        return piece.encode("utf-8")


_MAX_FILE_BYTES = 256 << 20  # the largest hub tokenizer.json is tens of MB


def _read_text(path: Path) -> str:
    """A tokenizer file's text: a regular file of at most 256 MiB in UTF-8; ConfigError in one line otherwise."""
    if not path.is_file():
        raise ConfigError(f"{path} is not a regular file (a FIFO, a device or a directory is never read)")
    if path.stat().st_size > _MAX_FILE_BYTES:
        raise ConfigError(f"{path} is {path.stat().st_size:,} bytes, more than a tokenizer's {_MAX_FILE_BYTES:,}")
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"{path} is not UTF-8 text: {first_line(error)}") from None


def _json_object(text: str, where: str) -> dict:
    """`text` as a JSON object; ConfigError in one line naming `where` otherwise."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise ConfigError(f"{where} is nested too deep to be a tokenizer's file") from None
    except ValueError as error:
        raise ConfigError(f"{where} is not valid JSON: {first_line(error)}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{where} is not a JSON object")
    return value


def _tokenizer(text: str, where: str) -> tokenizers.Tokenizer:
    """The `tokenizers` library's tokenizer of a tokenizer.json; ConfigError in one line where it reads none."""
    try:
        return tokenizers.Tokenizer.from_str(text)
    except Exception as error:  # the library raises a bare Exception for a file it cannot read
        raise ConfigError(f"{where} is not a tokenizer the `tokenizers` library reads: {first_line(error)}") from None


class TokenizerJson:
    """Encode text to a Hugging Face tokenizer's ids and back.

    Args:
      directory: a model directory with tokenizer.json (and tokenizer_config.json, where the BOS and EOS
        tokens are named), or those files' texts by name (`files`).
    """

    def __init__(self, directory: str | Path | dict[str, str]):
        where = "the tokenizer's files" if isinstance(directory, dict) else str(directory)
        if isinstance(directory, dict):  # the files themselves, by name
            self.files = {name: directory[name] for name in FILES if name in directory}
        else:
            directory = Path(directory)
            if not (directory / "tokenizer.json").is_file():
                raise MissingInput(f"{directory} has no tokenizer.json")
            self.files = {name: _read_text(directory / name) for name in FILES if (directory / name).exists()}
        """The files it was made from, by name: a training run keeps them, an export writes them."""
        digest = hashlib.sha256(json.dumps(self.files, sort_keys=True).encode()).hexdigest()
        self.name = f"tokenizer.json sha256:{digest}"
        """What a prepared corpus's meta.json records of the tokenizer that made its ids."""
        spec = _json_object(self.files["tokenizer.json"], f"{where}/tokenizer.json")
        self.tokenizer = _tokenizer(self.files["tokenizer.json"], f"{where}/tokenizer.json")
        self._spelling = _TokenSpelling(spec.get("decoder"), f"{where}/tokenizer.json")
        self._as_text = _tokenizer(self.files["tokenizer.json"], f"{where}/tokenizer.json")  # special tokens as
        self._as_text.encode_special_tokens = True  # text: two objects, so that no thread changes one under another
        config = _json_object(self.files.get("tokenizer_config.json", "{}"), f"{where}/tokenizer_config.json")
        self._named = {name: self._text_of(config.get(name)) for name in ("bos_token", "eos_token", "unk_token")}
        self._bos = self._id_of(config.get("bos_token")) if config.get("add_bos_token") else None
        self._eos = self._id_of(config.get("eos_token"))
        self.hf_class = config.get("tokenizer_class", "PreTrainedTokenizerFast")  # transformers' class for it
        self._specials = {i: t.content for i, t in self.tokenizer.get_added_tokens_decoder().items()}
        self._bytes: dict[int, bytes] = {}  # each token's bytes, spelled once

    @staticmethod
    def _text_of(token) -> str | None:
        """A token named in tokenizer_config.json (a string, or {"content": ...}): its text; None if unnamed."""
        text = token.get("content") if isinstance(token, dict) else token
        return text if isinstance(text, str) else None

    def _id_of(self, token) -> int | None:
        text = self._text_of(token)
        return None if text is None else self.tokenizer.token_to_id(text)

    def special_tokens(self) -> dict[str, str | None]:
        """Its BOS, EOS and unknown tokens' text, as tokenizer_config.json names them (None where it does not)."""
        return dict(self._named)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def config_ids(self) -> dict[str, int]:
        """Its BOS and EOS ids as a model's config.json holds them (`bos_token_id`, `eos_token_id`: where
        transformers' `generate` stops), those that tokenizer_config.json names."""
        ids = {"bos_token_id": self._id_of(self._named["bos_token"]), "eos_token_id": self._eos}
        return {name: i for name, i in ids.items() if i is not None}

    @property
    def eot_id(self) -> int | None:
        """The id of the end-of-sequence token (tokenizer_config.json's eos_token); None where it names none."""
        return self._eos

    def encode(self, text: str, allow_special: bool = False, add_special: bool = True) -> list[int]:
        """Its ids, with the special tokens the model's tokenizer adds around a text (its BOS) unless not
        `add_special` (a document's later pieces)."""
        ids = (self.tokenizer if allow_special else self._as_text).encode(text, add_special_tokens=add_special).ids
        return ids if not add_special or self._bos is None or ids[:1] == [self._bos] else [self._bos, *ids]

    def encode_to_numpy(self, text: str, add_special: bool = True) -> np.ndarray:
        """`encode(text, add_special=add_special)` as uint32 [T]."""
        return np.asarray(self.encode(text, add_special=add_special), np.uint32)

    def encode_batch(self, texts: Sequence[str], allow_special: bool = False) -> list[list[int]]:
        """Each text's ids (a list of its own), each distinct text encoded once."""
        encoded = {text: self.encode(text, allow_special) for text in dict.fromkeys(texts)}
        return [list(encoded[text]) for text in texts]

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token stands for (a special token: its text; a SentencePiece word's `▁`: its space);
        U+FFFD's for an id outside the vocabulary."""
        spelled = self._bytes.get(token)
        if spelled is None:
            if token in self._specials:
                spelled = self._specials[token].encode("utf-8")
            else:
                piece = self.tokenizer.id_to_token(token) if 0 <= token else None
                spelled = UNKNOWN_ID_BYTES if piece is None else self._spelling.bytes_of(piece)
            self._bytes[token] = spelled
        return spelled

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        """The bytes of a sequence's tokens, one after another (a continuation's: the first token's space kept)."""
        return b"".join(self.token_bytes(token) for token in ids)

    def decode(self, ids: Sequence[int]) -> str:
        """Text for token ids, as transformers' `decode` gives it: a sequence's leading space removed where the
        decoder removes it (SentencePiece's prefix space); byte sequences that are not valid UTF-8 become
        U+FFFD (one per invalid part, where `tokenizers` writes one per byte-fallback token)."""
        text = self.decode_bytes(ids).decode("utf-8", errors="replace")
        lead = self._spelling.lead
        if lead and text.startswith(lead):
            return text[len(lead):]
        return text
