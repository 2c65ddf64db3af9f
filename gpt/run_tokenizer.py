"""The tokenizer of a training run: GPT-2's, or the model's own that it fine-tunes (a Llama's, a Qwen's), whose
files the run keeps in `out_dir/tokenizer`, so that sampling, serving, scoring and exporting the run read and
write its text as it was trained, whatever became of the directory it came from."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from gpt.tokenizer import TextTokenizer, get_tokenizer, hf_tokenizer_files
from gpt.tokenizer_json import TokenizerJson

__all__ = ["DIRECTORY", "run_tokenizer", "keep_tokenizer", "hf_files"]

DIRECTORY = "tokenizer"  # in a run's out_dir


def run_tokenizer(out_dir: str | os.PathLike) -> TextTokenizer:
    """The tokenizer the run in `out_dir` was trained with."""
    kept = Path(out_dir) / DIRECTORY
    return TokenizerJson(kept) if (kept / "tokenizer.json").is_file() else get_tokenizer()


def keep_tokenizer(out_dir: str | os.PathLike, tokenizer: TextTokenizer) -> None:
    """Keep `tokenizer`'s files in `out_dir/tokenizer` (GPT-2's needs none), appearing whole or not at all; the
    same files already there are left as they are. The caller holds the run's lock."""
    if not isinstance(tokenizer, TokenizerJson):
        return
    kept = Path(out_dir) / DIRECTORY
    if (kept / "tokenizer.json").is_file() and TokenizerJson(kept).files == tokenizer.files:
        return
    staging = Path(out_dir) / f".{DIRECTORY}.partial"  # the run's lock is held: no other writer
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        for name, text in tokenizer.files.items():
            (staging / name).write_text(text, encoding="utf-8")
        if kept.exists():
            shutil.rmtree(kept)
        staging.rename(kept)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def hf_files(out_dir: str | os.PathLike, model_max_length: int) -> dict[str, str]:
    """The run's tokenizer as the files transformers' `AutoTokenizer` reads, by name (an export writes them):
    its own tokenizer.json's, or GPT-2's (`gpt.tokenizer.hf_tokenizer_files`). A generation_config.json among them
    (an instruct model's end of turn) gets the tokenizer's BOS and EOS ids where it names none: transformers reads
    that file instead of config.json's ids."""
    tokenizer = run_tokenizer(out_dir)
    if not isinstance(tokenizer, TokenizerJson):
        return hf_tokenizer_files(model_max_length)
    files = dict(tokenizer.files)
    if "generation_config.json" in files:
        try:
            record = json.loads(files["generation_config.json"])
        except ValueError:
            record = None
        if isinstance(record, dict):
            files["generation_config.json"] = json.dumps({**tokenizer.config_ids, **record}, indent=2) + "\n"
        else:  # not a record: the model's config.json's ids serve
            del files["generation_config.json"]
    return files
