"""A model from wherever it is: a training run's out_dir, a Hugging Face GPT-2 directory, or a GPT-2 hub
name in the local cache (what sample.py, serve.py and gpt.eval take as --init_from)."""

from __future__ import annotations

from pathlib import Path

from gpt.errors import MissingInput
from gpt.model import gpt2
from gpt.model.config import check_dtype
from gpt.model.transformer import GPT
from gpt.run_dir import has_checkpoint

__all__ = ["load"]


def load(init_from: str, dtype: str = "float32") -> GPT:
    """A GPT from a training out_dir, a Hugging Face GPT-2 directory, or a cached hub name."""
    check_dtype(dtype)  # before looking at init_from: a bad dtype is the caller's, not the checkpoint's
    if has_checkpoint(init_from):
        # Imported here: the trainer's packages (Orbax, optax) are a quarter of a second of imports that
        # GPT-2 weights never need.
        from gpt.train.checkpoint import load_model

        return load_model(init_from, dtype=dtype)
    if (Path(init_from) / "config.json").is_file() or init_from in gpt2.HUB_NAMES:
        return gpt2.load(init_from, dtype=dtype)
    raise MissingInput(
        f"--init_from {init_from!r} is not a training out_dir with checkpoints, a Hugging Face GPT-2 "
        f"directory, or a GPT-2 hub name ({', '.join(gpt2.HUB_NAMES)})"
    )
