"""A Hugging Face model's own tokenizer (its `tokenizer.json`) through the `tokenizers` library, with the same
methods as GPT-2's `gpt.tokenizer.Tokenizer`: the byte-level BPEs of Llama 3, Qwen2/3 and SmolLM2.

Ids are those transformers' `AutoTokenizer` gives: the file's normalizer, pre-tokenizer, model and
post-processor (which adds a BOS where the model's tokenizer does), and `add_bos_token` of
tokenizer_config.json where it is set. A special token's text inside the text is ordinary text unless
`allow_special` (GPT-2's rule: a corpus that contains the string does not inject document breaks).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import tokenizers

from gpt.errors import ConfigError, MissingInput
from gpt.tokenizer import byte_to_unicode

__all__ = ["TokenizerJson", "FILES"]

FILES = ("tokenizer.json", "tokenizer_config.json")  # what it reads of a directory (the second where there is one)


class TokenizerJson:
    """Encode text to a Hugging Face tokenizer's ids and back.

    Args:
      directory: a model directory with tokenizer.json (and tokenizer_config.json, where the BOS and EOS
        tokens are named), or those files' texts by name (`files`).
    """

    def __init__(self, directory: str | Path | dict[str, str]):
        if isinstance(directory, dict):  # the files themselves, by name
            self.files = {name: directory[name] for name in FILES if name in directory}
        else:
            directory = Path(directory)
            if not (directory / "tokenizer.json").is_file():
                raise MissingInput(f"{directory} has no tokenizer.json")
            self.files = {name: (directory / name).read_text(encoding="utf-8") for name in FILES
                          if (directory / name).is_file()}
        """The files it was made from, by name: a training run keeps them, an export writes them."""
        digest = hashlib.sha256(json.dumps(self.files, sort_keys=True).encode()).hexdigest()
        self.name = f"tokenizer.json sha256:{digest}"
        """What a prepared corpus's meta.json records of the tokenizer that made its ids."""
        spec = json.loads(self.files["tokenizer.json"])
        decoder = (spec.get("decoder") or {}).get("type")
        if decoder != "ByteLevel":
            raise ConfigError(f"{directory}/tokenizer.json: decoder {decoder!r} is not supported; this reader "
                              f"decodes byte-level BPE (decoder 'ByteLevel': Llama 3, Qwen, SmolLM2)")
        self.tokenizer = tokenizers.Tokenizer.from_str(self.files["tokenizer.json"])
        self._as_text = tokenizers.Tokenizer.from_str(self.files["tokenizer.json"])  # special tokens as text:
        self._as_text.encode_special_tokens = True  # two objects, so that no thread changes one under another
        config = json.loads(self.files.get("tokenizer_config.json", "{}"))
        self._named = {name: self._text_of(config.get(name)) for name in ("bos_token", "eos_token", "unk_token")}
        self._bos = self._id_of(config.get("bos_token")) if config.get("add_bos_token") else None
        self._eos = self._id_of(config.get("eos_token"))
        self.hf_class = config.get("tokenizer_class", "PreTrainedTokenizerFast")  # transformers' class for it
        self._specials = {i: t.content for i, t in self.tokenizer.get_added_tokens_decoder().items()}
        self._unspell = {char: byte for byte, char in byte_to_unicode().items()}  # GPT-2's byte alphabet, undone

    @staticmethod
    def _text_of(token) -> str | None:
        """A token named in tokenizer_config.json (a string, or {"content": ...}): its text; None if unnamed."""
        return token.get("content") if isinstance(token, dict) else token

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
        """The bytes one token stands for (a special token: its text)."""
        if token in self._specials:
            return self._specials[token].encode("utf-8")
        spelled = self.tokenizer.id_to_token(token)
        if spelled is None:
            raise ConfigError(f"token id {token} is outside the tokenizer's vocabulary of {self.vocab_size}")
        return bytes(self._unspell[char] for char in spelled)

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        return b"".join(self.token_bytes(token) for token in ids)

    def decode(self, ids: Sequence[int]) -> str:
        """Text for token ids; byte sequences that are not valid UTF-8 become U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")
