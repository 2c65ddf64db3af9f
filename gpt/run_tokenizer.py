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

__all__ = ["DIRECTORY", "END_OF_TURN", "run_tokenizer", "keep_tokenizer", "hf_files"]

DIRECTORY = "tokenizer"  # in a run's out_dir


def run_tokenizer(out_dir: str | os.PathLike) -> TextTokenizer:
    """The tokenizer the run in `out_dir` was trained with."""
    kept = Path(out_dir) / DIRECTORY
    return TokenizerJson(kept) if (kept / "tokenizer.json").is_file() else get_tokenizer()


END_OF_TURN = "generation_config.json"
"""The file beside a run's kept tokenizer that names the ids ending a reply (`eos_token_id`, as a Hugging Face
directory's does): an instruct model's end of turn, or `gpt.chat_format`'s."""


def keep_tokenizer(out_dir: str | os.PathLike, tokenizer: TextTokenizer, end_of_turn: tuple[int, ...] = ()) -> None:
    """Keep `tokenizer`'s files in `out_dir/tokenizer` (GPT-2's needs none), with `end_of_turn` (the ids beside its
    end of text that end a reply) in END_OF_TURN where there are any, appearing whole or not at all; the same files
    already there are left as they are. The caller holds the run's lock."""
    if not isinstance(tokenizer, TokenizerJson):
        return
    kept = Path(out_dir) / DIRECTORY
    files = dict(tokenizer.files)
    if end_of_turn:
        ids = [*([] if tokenizer.eot_id is None else [tokenizer.eot_id]), *end_of_turn]
        files[END_OF_TURN] = json.dumps({"eos_token_id": list(dict.fromkeys(ids))}, indent=2) + "\n"
    if {path.name: path.read_text(encoding="utf-8") for path in kept.glob("*") if path.is_file()} == files:
        return
    staging = Path(out_dir) / f".{DIRECTORY}.partial"  # the run's lock is held: no other writer
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        for name, text in files.items():
            (staging / name).write_text(text, encoding="utf-8")
        if kept.exists():
            shutil.rmtree(kept)
        staging.rename(kept)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def hf_files(out_dir: str | os.PathLike, model_max_length: int) -> dict[str, str]:
    """The run's tokenizer as the files transformers' `AutoTokenizer` reads, by name (an export writes them):
    its own tokenizer.json's, or GPT-2's (`gpt.tokenizer.hf_tokenizer_files`); and the run's end of turn
    (END_OF_TURN, with the tokenizer's BOS id: transformers' `generate` then stops where a reply here does)."""
    tokenizer = run_tokenizer(out_dir)
    if not isinstance(tokenizer, TokenizerJson):
        return hf_tokenizer_files(model_max_length)
    files = dict(tokenizer.files)
    kept = Path(out_dir) / DIRECTORY / END_OF_TURN
    if kept.is_file():
        files[END_OF_TURN] = json.dumps({**tokenizer.config_ids, **json.loads(kept.read_text())}, indent=2) + "\n"
    return files
