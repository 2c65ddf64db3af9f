"""A model from wherever it is: a training run's out_dir, a Hugging Face directory of a family it reads
(`gpt.model.families`: GPT-2, Llama, Mistral, Qwen2, Qwen3, Gemma 3), or a
hub name in the local Hugging Face cache (what sample.py, serve.py and gpt.eval take as --init_from), and the
tokenizer that reads its text."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

from gpt.errors import ConfigError, MissingInput
from gpt.inference.speculation import DRAFTS, names_a_model
from gpt.model import gpt2, pretrained
from gpt.model.config import DType, GPTConfig, check_dtype
from gpt.model.families import titles
from gpt.model.transformer import GPT
from gpt.run_dir import has_checkpoint
from gpt.run_tokenizer import DIRECTORY as TOKENIZER_DIRECTORY
from gpt.run_tokenizer import run_tokenizer
from gpt.tokenizer import TextTokenizer, get_tokenizer

__all__ = ["load", "load_draft", "model_config_of", "tokenizer_of", "end_of_turn_of", "ModelChoice"]


@dataclasses.dataclass(frozen=True)
class ModelChoice:
    """Which model a script runs and how: the settings sample.py, serve.py and gpt.eval share (their configs
    are this one with their own fields after it), each a flag."""

    init_from: str = "out"
    """A training out_dir, a Hugging Face GPT-2, Llama, Mistral, Qwen2, Qwen3 or Gemma 3 directory, or a hub name
    in the local Hugging Face cache (gpt2, gpt2-medium, gpt2-large, gpt2-xl; HuggingFaceTB/SmolLM2-135M, ...)."""
    dtype: DType = "float32"
    """Compute dtype (bfloat16 on GPUs)."""
    quantize: Literal["none", "int8", "int4", "bf16"] = "none"
    """Store the weights for decoding as int8 (a float scale per output channel), int4 (a float scale per group
    of 32 inputs; the embedding and head int8) or bfloat16 (gpt.eval: what that costs in perplexity)."""
    mesh: str = ""
    """Run sharded over a device mesh, e.g. 'tensor=4' (heads and MLP split over 4 devices) or
    'data=2,tensor=4'; empty runs on one device."""


def load(init_from: str, dtype: str = "float32", flag: str = "init_from", also: str = "") -> GPT:
    """A GPT from a training out_dir, a Hugging Face directory of a family it reads, or a cached hub name
    (MissingInput naming `flag`, and the `also` it could have been, when it is none of them)."""
    check_dtype(dtype)  # before looking at init_from: a bad dtype is the caller's, not the checkpoint's
    init_from = pretrained.located(init_from, flag)
    if has_checkpoint(init_from):
        # Imported here: the trainer's packages (Orbax, optax) are a quarter of a second of imports that
        # GPT-2 weights never need.
        from gpt.train.checkpoint import load_model

        return load_model(init_from, dtype=dtype)
    if pretrained.is_pretrained(init_from):
        return pretrained.Checkpoint.at(init_from).load(dtype=dtype)
    raise _not_a_model(init_from, flag, also)


def tokenizer_of(init_from: str) -> TextTokenizer:
    """The tokenizer of what `load(init_from)` loads: a training run's (GPT-2's, or the fine-tuned model's own
    that it keeps), a Llama's or Qwen's own (its tokenizer.json), GPT-2's for a GPT-2."""
    init_from = pretrained.located(init_from)
    if has_checkpoint(init_from):
        return run_tokenizer(init_from)
    if pretrained.is_pretrained(init_from):
        return pretrained.Checkpoint.at(init_from).tokenizer()
    return get_tokenizer()  # nothing to read here: `load` says so, naming its flag


def end_of_turn_of(init_from: str) -> tuple[int, ...]:
    """The ids beside its tokenizer's end of text where what `load(init_from)` loads ends a reply: a Hugging Face
    directory's generation_config.json's (an instruct model's end of turn), or that of the tokenizer a training run
    keeps (a run fine-tuned on conversations: `gpt.chat_format`'s `<|end|>`, or the instruct model's); () where
    there is none."""
    init_from = pretrained.located(init_from)
    if has_checkpoint(init_from):
        return pretrained.end_of_turn_in(Path(init_from) / TOKENIZER_DIRECTORY, model_config_of(init_from).vocab_size)
    if pretrained.is_pretrained(init_from):
        return pretrained.Checkpoint.at(init_from).end_of_turn()
    return ()


def _not_a_model(init_from: str, flag: str = "init_from", also: str = "") -> MissingInput:
    return MissingInput(f"--{flag} {init_from!r} is not {also}a training out_dir with checkpoints, a Hugging Face "
                        f"directory ({titles()}), or a GPT-2 hub name ({', '.join(gpt2.HUB_NAMES)})")


def model_config_of(init_from: str, dtype: str = "float32") -> GPTConfig:
    """The GPTConfig of what `load(init_from)` would load, with no weights read: a training run's newest
    checkpoint's record, a Hugging Face directory's config.json, or a GPT-2 hub name's shape (its preset)."""
    check_dtype(dtype)
    init_from = pretrained.located(init_from)
    if has_checkpoint(init_from):
        from gpt.train.checkpoint import newest_model_config

        return newest_model_config(init_from).replace(dtype=dtype)
    if (Path(init_from) / "config.json").is_file():
        return pretrained.Checkpoint.at(init_from).config(dtype=dtype)
    if init_from in gpt2.HUB_NAMES:  # its shape, whether or not the local cache holds its weights (--compile_only)
        return GPTConfig.preset(init_from, dtype=dtype)
    raise _not_a_model(init_from)


def load_draft(draft: str, dtype: str = "float32", tokenizer: TextTokenizer | None = None) -> str | GPT:
    """A script's --draft as the engine takes it: a kind of draft (none, ngram, int8) as it is, else the
    smaller GPT that it names, loaded as `load` loads one; ConfigError when its tokenizer is not `tokenizer`
    (the model's), whose ids it must guess."""
    if not names_a_model(draft):
        return draft
    model = load(draft, dtype, flag="draft", also=f"none, {', '.join(DRAFTS)}, ")
    if tokenizer is not None and tokenizer_of(draft).name != tokenizer.name:
        raise ConfigError(f"--draft {draft}'s tokenizer ({tokenizer_of(draft).name}) is not the model's "
                          f"({tokenizer.name}): a draft guesses the model's ids in the model's tokenizer")
    return model
