"""What a run fine-tunes (`--init_from`), found once before anything is prepared or compiled: a Hugging Face
checkpoint (`gpt.model.pretrained.Checkpoint`), or the newest checkpoint of a run trained here (`RunCheckpoint`),
each read through the same three methods: its config, its tokenizer and its weights."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from gpt.model import pretrained
from gpt.model.config import GPTConfig
from gpt.model.hf_files import check_weight_files
from gpt.model.transformer import GPT
from gpt.run_dir import has_checkpoint
from gpt.run_tokenizer import DIRECTORY as TOKENIZER_DIRECTORY
from gpt.run_tokenizer import run_tokenizer
from gpt.tokenizer import TextTokenizer

__all__ = ["initial_checkpoint", "RunCheckpoint", "with_vocabulary"]


@dataclasses.dataclass(frozen=True)
class RunCheckpoint:
    """A training run's newest intact checkpoint, read as `pretrained.Checkpoint` is: to fine-tune a model trained
    here (on conversations, say) straight from its out_dir."""

    directory: Path

    def config(self, **overrides) -> GPTConfig:
        """Its GPTConfig (the checkpoint's record; no weights read), with `overrides` (dtype, dropout, ...)."""
        from gpt.train.checkpoint import newest_model_config

        return newest_model_config(self.directory).replace(**overrides)

    def load(self, dtype: str = "float32", param_dtype: str | None = None) -> GPT:
        """Its GPT, checksums and finiteness verified (`gpt.train.checkpoint.load_model`), its weights stored in
        `param_dtype` (default: dtype)."""
        import jax
        import jax.numpy as jnp
        from flax import nnx

        from gpt.train.checkpoint import load_model

        model = load_model(self.directory, dtype=dtype)
        stored = jnp.dtype(param_dtype or dtype)
        graphdef, state = nnx.split(model)
        state = jax.tree.map(lambda a: a.astype(stored) if jnp.issubdtype(a.dtype, jnp.floating) else a, state)
        return nnx.merge(graphdef, state)

    def tokenizer(self) -> TextTokenizer:
        """The tokenizer the run was trained with (`gpt.run_tokenizer`)."""
        return run_tokenizer(self.directory)

    def end_of_turn(self) -> tuple[int, ...]:
        """The ids beside its tokenizer's end of text that end a reply, as the run keeps them (() for none)."""
        return pretrained.end_of_turn_in(self.directory / TOKENIZER_DIRECTORY, self.config().vocab_size)


def initial_checkpoint(init_from: str) -> pretrained.Checkpoint | RunCheckpoint | None:
    """The checkpoint `--init_from` names, found once: a training run's out_dir with a checkpoint, else a Hugging
    Face checkpoint (its config.json read, its weight files' headers checked: before the corpus is prepared, not
    after); None for 'scratch'."""
    if init_from == "scratch":
        return None
    located = pretrained.located(init_from)
    if has_checkpoint(located):
        return RunCheckpoint(Path(located))
    checkpoint = pretrained.Checkpoint.at(located)
    check_weight_files(checkpoint.directory)
    return checkpoint


def with_vocabulary(model: GPT, vocab_size: int) -> GPT:
    """`model` with `vocab_size` rows in its embedding (and its untied head), each new row the mean of the old ones
    (a chat format's new tokens: `gpt.chat_format`); itself where it has them."""
    import jax.numpy as jnp

    rows = model.wte.shape[0]
    if rows >= vocab_size:
        return model
    for table in (model.wte, model.lm_head):
        if table is not None:
            old = table[...]
            mean = old.mean(axis=0, keepdims=True, dtype=jnp.float32).astype(old.dtype)
            table.set_value(jnp.concatenate([old, jnp.repeat(mean, vocab_size - rows, axis=0)]))
    model.config = model.config.replace(vocab_size=vocab_size)
    return model
