"""The methods every tokenizer has (`TextTokenizer`), and GPT-2's byte-pair encoding through tiktoken, from ranks
vendored in the package (no network). A model's own tokenizer.json is `gpt.tokenizer_json.TokenizerJson`."""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import tiktoken
from tiktoken.load import load_tiktoken_bpe

__all__ = ["TextTokenizer", "Tokenizer", "get_tokenizer", "EOT", "hf_tokenizer_files"]

_RANKS = Path(__file__).parent / "assets" / "gpt2.tiktoken"
_RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
# GPT-2's split pattern (tiktoken's faster equivalent of the original release's).
_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
EOT = "<|endoftext|>"
UNKNOWN_ID_BYTES = "\ufffd".encode()  # what an id outside a tokenizer's vocabulary reads as (`token_bytes`)


class TextTokenizer(Protocol):
    """What the library asks of a tokenizer, GPT-2's (`Tokenizer`) or a model's own (`TokenizerJson`).

    Text is a token's bytes one after another (`token_bytes`), so that a stream of tokens is decoded a whole
    character at a time (`gpt.inference.text_stream`); `decode` is a whole sequence's text as transformers'
    `decode` gives it.
    """

    name: str  # what a prepared corpus's meta.json records of the tokenizer that made its ids
    hf_class: str  # transformers' class for it (the server's /tokenizer_info says it)

    @property
    def vocab_size(self) -> int: ...

    @property
    def eot_id(self) -> int | None:
        """The end-of-sequence token's id (None where the tokenizer names none)."""

    def special_tokens(self) -> dict[str, str | None]:
        """Its BOS, EOS and unknown tokens' text, as transformers names them."""

    def encode(self, text: str, allow_special: bool = False, add_special: bool = True) -> list[int]:
        """A text's ids: special tokens' text as text unless `allow_special`; the tokens the tokenizer adds
        around a text (a BOS) unless not `add_special`."""

    def encode_to_numpy(self, text: str, add_special: bool = True) -> np.ndarray:
        """`encode` as uint32 [T]."""

    def encode_batch(self, texts: Sequence[str], allow_special: bool = False) -> list[list[int]]:
        """Each text's ids."""

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token stands for; U+FFFD's for an id outside the vocabulary (a model's table may have
        more rows than its tokenizer has tokens: Qwen2.5's 151,936 over 151,665)."""

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        """The tokens' bytes, one after another."""

    def decode(self, ids: Sequence[int]) -> str:
        """A sequence's text; bytes that are not valid UTF-8 become U+FFFD."""


class Tokenizer:
    """Encode text to GPT-2 token ids and back.

    `<|endoftext|>` inside text is ordinary text by default (a corpus that contains the string does not
    inject document breaks); pass `allow_special=True` to map it to its id, 50256.
    """

    def __init__(self):
        ranks = load_tiktoken_bpe(str(_RANKS), expected_hash=_RANKS_SHA256)
        self.encoding = tiktoken.Encoding(
            name="gpt2", pat_str=_PATTERN, mergeable_ranks=ranks, special_tokens={EOT: len(ranks)},
            explicit_n_vocab=len(ranks) + 1,
        )

    @property
    def vocab_size(self) -> int:
        return self.encoding.n_vocab

    @property
    def eot_id(self) -> int:
        """The id of `<|endoftext|>` (50256)."""
        return self.encoding.eot_token

    hf_class = "GPT2Tokenizer"  # transformers' class for it (the server's /tokenizer_info says it)
    name = "gpt2"  # what a prepared corpus's meta.json records of the tokenizer that made its ids

    def special_tokens(self) -> dict[str, str | None]:
        """Its BOS, EOS and unknown tokens' text, as transformers names them: all three `<|endoftext|>`."""
        return dict.fromkeys(("bos_token", "eos_token", "unk_token"), EOT)

    def encode(self, text: str, allow_special: bool = False, add_special: bool = True) -> list[int]:
        """Its ids; GPT-2 adds no special tokens around a text (`add_special`, for a model's own tokenizer's
        BOS, changes nothing here)."""
        return self.encoding.encode(text, **self._special(allow_special))

    def encode_to_numpy(self, text: str, add_special: bool = True) -> np.ndarray:
        """`encode(text)` as uint32 [T] (`add_special` changes nothing), written straight into a numpy buffer: a
        corpus's preparation, where a Python list of ints would cost ~40 ns a token, a fifth of tiktoken's time."""
        return self.encoding.encode_to_numpy(text, **self._special(False))

    def encode_batch(self, texts: Sequence[str], allow_special: bool = False) -> list[list[int]]:
        """Each text's ids (a list of its own), each distinct text encoded once.

        One after another on purpose: tiktoken's threaded batch pays a thread pool's task per text (more than
        encoding a short prompt costs), and its pool's exit waits for every queued text, so a signal raised
        inside it did not stop a million prompts for minutes."""
        encoded = {text: self.encode(text, allow_special) for text in dict.fromkeys(texts)}
        return [list(encoded[text]) for text in texts]

    def decode(self, ids: Sequence[int]) -> str:
        """Text for token ids; byte sequences that are not valid UTF-8 become U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        ids = list(ids)
        if all(0 <= token < self.vocab_size for token in ids):
            return self.encoding.decode_bytes(ids)
        return b"".join(map(self.token_bytes, ids))

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token stands for; U+FFFD's for an id outside the vocabulary (a model's padded rows)."""
        return self.encoding.decode_single_token_bytes(token) if 0 <= token < self.vocab_size else UNKNOWN_ID_BYTES

    @staticmethod
    def _special(allow_special: bool) -> dict:
        if allow_special:
            return {"allowed_special": {EOT}}
        return {"allowed_special": set(), "disallowed_special": ()}


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as a printable character (printable Latin-1 bytes as
    themselves, the others as the characters from U+0100 on, in byte order), as its vocab.json spells tokens."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def _split(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """The two tokens whose merge made `token`: byte-pair encoding of its bytes with only the merges
    ranked before it ends in exactly two parts."""
    parts, rank = [bytes([b]) for b in token], ranks[token]
    while len(parts) > 2:
        pairs = [(ranks.get(a + b, rank), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
        best, i = min(pairs)
        if best >= rank:
            break
        parts[i: i + 2] = [parts[i] + parts[i + 1]]
    assert len(parts) == 2, f"token {token!r} is not one merge of two earlier tokens"
    return parts[0], parts[1]


def hf_tokenizer_files(model_max_length: int) -> dict[str, str]:
    """GPT-2's tokenizer as the files Hugging Face's `GPT2Tokenizer(Fast)` reads (vocab.json, merges.txt,
    tokenizer_config.json), made from the vendored ranks: an exported directory then loads with
    `AutoTokenizer.from_pretrained` offline, and tokenizes as tiktoken does."""
    ranks = load_tiktoken_bpe(str(_RANKS), expected_hash=_RANKS_SHA256)
    spell = byte_to_unicode()
    text = lambda token: "".join(spell[b] for b in token)  # noqa: E731
    vocab = {text(token): rank for token, rank in ranks.items()} | {EOT: len(ranks)}
    merges = [_split(token, ranks) for token, _ in sorted(ranks.items(), key=lambda item: item[1]) if len(token) > 1]
    config = {"tokenizer_class": "GPT2Tokenizer", "model_max_length": model_max_length, "bos_token": EOT,
              "eos_token": EOT, "unk_token": EOT, "add_prefix_space": False}
    return {"vocab.json": json.dumps(vocab, ensure_ascii=False),
            "merges.txt": "#version: 0.2\n" + "".join(f"{text(a)} {text(b)}\n" for a, b in merges),
            "tokenizer_config.json": json.dumps(config, indent=2) + "\n"}


_shared: Tokenizer | None = None
_shared_lock = threading.Lock()


def get_tokenizer() -> Tokenizer:
    """The shared GPT-2 tokenizer, built once per process even when many threads ask at once (building
    it takes ~0.1 s of the GIL; `functools.cache` would let each of them build its own)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = Tokenizer()
        return _shared
