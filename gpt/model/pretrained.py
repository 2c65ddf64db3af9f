"""A Hugging Face checkpoint of a family this project reads, wherever it is: a directory, or a hub name in the
local Hugging Face cache (offline), found once as a `Checkpoint` (its directory, its config.json read once,
its family in the registry, `gpt.model.families`), from which its config, its weights and its tokenizer come.
What sample.py, serve.py and gpt.eval run, and train.py fine-tunes."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from gpt.chat_template import ChatTemplate
from gpt.errors import ConfigError, MissingInput
from gpt.model import gpt2, llama
from gpt.model.config import GPTConfig
from gpt.model.families import Family, by_model_type
from gpt.model.hf_files import hub_snapshot, read_config_json, read_json_file
from gpt.model.transformer import GPT
from gpt.tokenizer import TextTokenizer, get_tokenizer
from gpt.tokenizer_json import TokenizerJson

__all__ = ["located", "is_pretrained", "Checkpoint", "end_of_turn_in"]

_HUB_NAME = re.compile(r"[\w.-]+/[\w.-]+")  # owner/model, as the hub names a model


def located(source: str, flag: str = "init_from") -> str:
    """`source` as a path: itself, or for a Hugging Face hub name ("HuggingFaceTB/SmolLM2-135M") that is no path
    here, its snapshot in the local cache (MissingInput naming `--flag` and saying how to get it when absent).
    GPT-2's own hub names ("gpt2") stay names: `Checkpoint.at` finds them."""
    if not _HUB_NAME.fullmatch(source) or Path(source).exists():
        return source
    try:
        return str(hub_snapshot(source))
    except MissingInput as error:
        raise MissingInput(f"--{flag} {source!r} is no directory here, and {error}") from None


def is_pretrained(source: str) -> bool:
    """Whether a located `source` is a checkpoint `Checkpoint.at` reads: a directory with a config.json, or one of
    GPT-2's hub names."""
    return (Path(source) / "config.json").is_file() or source in gpt2.HUB_NAMES


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A Hugging Face checkpoint, found once.

    Attributes:
      directory: where its files are.
      hf_config: its config.json, read once (every use below reads this one).
      family: its family in the registry (`gpt.model.families.by_model_type`).
    """

    directory: Path
    hf_config: dict
    family: Family

    @classmethod
    def at(cls, source: str) -> Checkpoint:
        """The checkpoint of a located `source` (`located`): a directory, or one of GPT-2's hub names in the
        cache; MissingInput or ConfigError in one line when it has no config.json, or one of no known family."""
        directory = gpt2.resolve(source)  # a directory, or GPT-2's hub name in the cache; else one line saying so
        hf_config = read_config_json(directory)
        return cls(directory, hf_config, by_model_type(hf_config, f"{directory}/config.json"))

    @property
    def reader(self):
        """The module that reads its files (`Family.reader`): `gpt.model.gpt2` or `gpt.model.llama`."""
        return gpt2 if self.family.reader == "gpt2" else llama

    def config(self, **overrides) -> GPTConfig:
        """Its GPTConfig (no weights read), with `overrides` (dtype, dropout, ...)."""
        return self.reader.config_from_hf(self.hf_config, **overrides)

    def load(self, dtype: str = "float32", param_dtype: str | None = None) -> GPT:
        """Its GPT: `dtype` to compute in, `param_dtype` to store (default: dtype)."""
        return self.reader.load(self.directory, dtype=dtype, param_dtype=param_dtype, hf_config=self.hf_config)

    def end_of_turn(self) -> tuple[int, ...]:
        """The ids its generation_config.json ends a generation at (`end_of_turn_in`)."""
        return end_of_turn_in(self.directory, self.config().vocab_size)

    def tokenizer(self) -> TextTokenizer:
        """The tokenizer that reads its text: GPT-2's for a GPT-2 (through tiktoken), else its own (its tokenizer.json:
        a GPT-2's too where it carries a chat template, `gpt.chat_format`'s); ConfigError
        naming both sizes where it has more tokens than the model's vocabulary (their ids would index past the
        embedding)."""
        if self.family.reader == "gpt2" and not self._has_chat_format():
            tokenizer = get_tokenizer()
        elif not (self.directory / "tokenizer.json").exists():
            raise MissingInput(f"{self.directory} has no tokenizer.json: put the model's tokenizer files beside its "
                               f"weights (they come with it from the Hugging Face hub)")
        else:
            tokenizer = TokenizerJson(self.directory)
        vocab_size = self.config().vocab_size
        if tokenizer.vocab_size > vocab_size:
            raise ConfigError(f"the tokenizer of {self.directory} has {tokenizer.vocab_size} tokens, more than the "
                              f"model's vocab_size of {vocab_size} (config.json)")
        return tokenizer

    def _has_chat_format(self) -> bool:
        """Whether its tokenizer.json carries a chat template (GPT-2's own, from the hub, does not)."""
        return (self.directory / "tokenizer.json").exists() and ChatTemplate.of(TokenizerJson(self.directory)) is not None


def end_of_turn_in(directory: Path, vocabulary: int) -> tuple[int, ...]:
    """The ids `directory`'s generation_config.json ends a generation at (`eos_token_id`: one id, or a list: an
    instruct model's end of turn beside its end of text), each checked to be below `vocabulary`; () where it has
    none."""
    path = directory / "generation_config.json"
    record = read_json_file(path) if path.exists() else {}
    ids = record.get("eos_token_id") if isinstance(record, dict) else None
    ids = [ids] if _is_id(ids) else ids if ids is not None else []
    if not isinstance(ids, list) or not all(_is_id(i) and i < vocabulary for i in ids):
        raise ConfigError(f"{path}'s eos_token_id must be a token id or a list of them, each in [0, {vocabulary}), "
                          f"got {str(ids)[:80]}")
    return tuple(ids)


def _is_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
