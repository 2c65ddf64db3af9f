"""GPT-2's byte-pair encoding through tiktoken, from ranks vendored in the package (no network)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import tiktoken
from tiktoken.load import load_tiktoken_bpe

__all__ = ["Tokenizer", "get_tokenizer", "EOT"]

_RANKS = Path(__file__).parent / "assets" / "gpt2.tiktoken"
_RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
# GPT-2's split pattern (tiktoken's faster equivalent of the original release's).
_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
EOT = "<|endoftext|>"


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

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        return self.encoding.encode(text, **self._special(allow_special))

    def encode_batch(self, texts: Sequence[str], allow_special: bool = False, num_threads: int = 8) -> list[list[int]]:
        return self.encoding.encode_batch(list(texts), num_threads=num_threads, **self._special(allow_special))

    def decode(self, ids: Sequence[int]) -> str:
        """Text for token ids; byte sequences that are not valid UTF-8 become U+FFFD."""
        return self.encoding.decode(list(ids))

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        return self.encoding.decode_bytes(list(ids))

    @staticmethod
    def _special(allow_special: bool) -> dict:
        if allow_special:
            return {"allowed_special": {EOT}}
        return {"allowed_special": set(), "disallowed_special": ()}


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
