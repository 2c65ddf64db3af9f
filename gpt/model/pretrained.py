"""A Hugging Face checkpoint of a family this project reads, wherever it is: a directory, or a hub name in the
local Hugging Face cache (offline); its family's reader (`gpt2`, or `llama` for the Llama-shaped families), its
config, its weights and its tokenizer. What sample.py, serve.py and gpt.eval run, and train.py fine-tunes."""

from __future__ import annotations

import re
from pathlib import Path

from gpt.errors import MissingInput, UserError
from gpt.model import gpt2, llama
from gpt.model.config import GPTConfig
from gpt.model.families import by_model_type
from gpt.model.hf_files import hub_snapshot, read_config_json
from gpt.model.transformer import GPT
from gpt.tokenizer import TextTokenizer, get_tokenizer
from gpt.tokenizer_json import TokenizerJson

__all__ = ["located", "is_pretrained", "family", "read_config", "load", "tokenizer"]

_HUB_NAME = re.compile(r"[\w.-]+/[\w.-]+")  # owner/model, as the hub names a model


def located(source: str, flag: str = "init_from") -> str:
    """`source` as a path: itself, or for a Hugging Face hub name ("HuggingFaceTB/SmolLM2-135M") that is no path
    here, its snapshot in the local cache (MissingInput naming `--flag` and saying how to get it when absent)."""
    if not _HUB_NAME.fullmatch(source) or Path(source).exists():
        return source
    try:
        return str(hub_snapshot(source))
    except MissingInput as error:
        raise MissingInput(f"--{flag} {source!r} is no directory here, and {error}") from None


def is_pretrained(source: str) -> bool:
    """Whether a located `source` is a checkpoint this module reads: a directory with a config.json, or one of
    GPT-2's hub names (`gpt2.resolve` finds those)."""
    return (Path(source) / "config.json").is_file() or source in gpt2.HUB_NAMES


def family(source: str):
    """The module that reads a located `source` (`Family.reader`): `llama` for a Llama-shaped family's config.json,
    `gpt2` for the rest (which refuses, in one line, what is not a GPT-2)."""
    try:
        return llama if by_model_type(read_config_json(Path(source))).reader == "llama" else gpt2
    except UserError:
        return gpt2  # no, no readable, or no known config.json: gpt2's reader says what is wrong


def read_config(source: str, **overrides) -> GPTConfig:
    """The GPTConfig of a located `source`, from its config.json (no weights read)."""
    return family(source).read_config(source, **overrides)


def load(source: str, dtype: str = "float32", param_dtype: str | None = None) -> GPT:
    """The GPT of a located `source`: `dtype` to compute in, `param_dtype` to store (default: dtype)."""
    return family(source).load(source, dtype=dtype, param_dtype=param_dtype)


def tokenizer(source: str) -> TextTokenizer:
    """The tokenizer of a located `source`: a Llama's or Qwen's own (its tokenizer.json), GPT-2's for a GPT-2."""
    if family(source) is gpt2:
        return get_tokenizer()
    if not (Path(source) / "tokenizer.json").is_file():
        raise MissingInput(f"{source} has no tokenizer.json: put the model's tokenizer files beside its weights "
                           f"(they come with it from the Hugging Face hub)")
    return TokenizerJson(source)
