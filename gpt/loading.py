"""A model from wherever it is: a training run's out_dir, a Hugging Face GPT-2, Llama or Qwen directory, or a
hub name in the local Hugging Face cache (what sample.py, serve.py and gpt.eval take as --init_from), and the
tokenizer that reads its text."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Literal

from gpt.errors import MissingInput, UserError
from gpt.inference.speculation import DRAFTS
from gpt.model import gpt2, llama
from gpt.model.config import DType, GPTConfig, check_dtype
from gpt.model.hf_files import hub_snapshot, read_config_json
from gpt.model.transformer import GPT
from gpt.run_dir import has_checkpoint
from gpt.tokenizer import Tokenizer, get_tokenizer
from gpt.tokenizer_json import TokenizerJson

__all__ = ["load", "load_draft", "model_config_of", "tokenizer_of", "ModelChoice"]


@dataclasses.dataclass(frozen=True)
class ModelChoice:
    """Which model a script runs and how: the settings sample.py, serve.py and gpt.eval share (their configs
    are this one with their own fields after it), each a flag."""

    init_from: str = "out"
    """A training out_dir, a Hugging Face GPT-2, Llama, Qwen2 or Qwen3 directory, or a hub name in the local
    Hugging Face cache (gpt2, gpt2-medium, gpt2-large, gpt2-xl; HuggingFaceTB/SmolLM2-135M, ...)."""
    dtype: DType = "float32"
    """Compute dtype (bfloat16 on GPUs)."""
    quantize: Literal["none", "int8", "bf16"] = "none"
    """Store the weights for decoding as int8 (a float scale per output channel) or bfloat16 (gpt.eval: what
    that costs in perplexity)."""
    mesh: str = ""
    """Run sharded over a device mesh, e.g. 'tensor=4' (heads and MLP split over 4 devices) or
    'data=2,tensor=4'; empty runs on one device."""


def load(init_from: str, dtype: str = "float32", flag: str = "init_from", also: str = "") -> GPT:
    """A GPT from a training out_dir, a Hugging Face GPT-2, Llama or Qwen directory, or a cached hub name
    (MissingInput naming `flag`, and the `also` it could have been, when it is none of them)."""
    check_dtype(dtype)  # before looking at init_from: a bad dtype is the caller's, not the checkpoint's
    init_from = located(init_from, flag)
    if has_checkpoint(init_from):
        # Imported here: the trainer's packages (Orbax, optax) are a quarter of a second of imports that
        # GPT-2 weights never need.
        from gpt.train.checkpoint import load_model

        return load_model(init_from, dtype=dtype)
    if (Path(init_from) / "config.json").is_file() or init_from in gpt2.HUB_NAMES:
        return _family(init_from).load(init_from, dtype=dtype)
    raise _not_a_model(init_from, flag, also)


def located(init_from: str, flag: str = "init_from") -> str:
    """`init_from` as a path: itself, or for a Hugging Face hub name ("HuggingFaceTB/SmolLM2-135M") that is no
    path here, its snapshot in the local cache (offline; MissingInput saying how to get it when absent)."""
    if not _HUB_NAME.fullmatch(init_from) or Path(init_from).exists():
        return init_from
    try:
        return str(hub_snapshot(init_from))
    except MissingInput as error:
        raise MissingInput(f"--{flag} {init_from!r} is no directory here, and {error}") from None


_HUB_NAME = re.compile(r"[\w.-]+/[\w.-]+")  # owner/model, as the hub names a model


def _family(init_from: str):
    """The module that reads a Hugging Face directory or hub name: `llama` for a Llama, Qwen2 or Qwen3
    config.json, `gpt2` for the rest (which refuses what is not a GPT-2)."""
    try:
        model_type = read_config_json(Path(init_from)).get("model_type")
    except UserError:
        model_type = None  # no or no readable config.json: gpt2's reader says what is wrong
    return llama if model_type in llama.FAMILIES else gpt2


def tokenizer_of(init_from: str) -> Tokenizer | TokenizerJson:
    """The tokenizer of what `load(init_from)` loads: a Llama's or Qwen's own (its directory's tokenizer.json),
    else GPT-2's."""
    init_from = located(init_from)
    if has_checkpoint(init_from) or _family(init_from) is gpt2:
        return get_tokenizer()
    if not (Path(init_from) / "tokenizer.json").is_file():
        raise MissingInput(f"{init_from} has no tokenizer.json: put the model's tokenizer files beside its weights "
                           f"(they come with it from the Hugging Face hub)")
    return TokenizerJson(init_from)


def _not_a_model(init_from: str, flag: str = "init_from", also: str = "") -> MissingInput:
    return MissingInput(f"--{flag} {init_from!r} is not {also}a training out_dir with checkpoints, a Hugging Face "
                        f"GPT-2, Llama or Qwen directory, or a GPT-2 hub name ({', '.join(gpt2.HUB_NAMES)})")


def model_config_of(init_from: str, dtype: str = "float32") -> GPTConfig:
    """The GPTConfig of what `load(init_from)` would load, with no weights read: a training run's newest
    checkpoint's record, a Hugging Face directory's config.json, or a GPT-2 hub name's shape (its preset)."""
    check_dtype(dtype)
    init_from = located(init_from)
    if has_checkpoint(init_from):
        from gpt.train.checkpoint import CheckpointManager

        manager = CheckpointManager(init_from, async_save=False)
        try:
            newest = manager.newest_metadata()
        finally:
            manager.close()
        if newest is None:
            raise MissingInput(f"no finished checkpoint in {manager.directory}")
        return GPTConfig(**newest[1]["model_config"]).replace(dtype=dtype)
    if (Path(init_from) / "config.json").is_file():
        return _family(init_from).read_config(init_from, dtype=dtype)
    if init_from in gpt2.HUB_NAMES:
        return GPTConfig.preset(init_from, dtype=dtype)
    raise _not_a_model(init_from)


def load_draft(draft: str, dtype: str = "float32") -> str | GPT:
    """A script's --draft as the engine takes it: a kind of draft (none, ngram, int8) as it is, else the
    smaller GPT that it names, loaded as `load` loads one."""
    if draft == "none" or draft in DRAFTS:
        return draft
    return load(draft, dtype, flag="draft", also=f"none, {', '.join(DRAFTS)}, ")
