"""Conversations as training data: each rendered with the model's chat template to token ids, every id flagged with
whether the loss is taught it (the assistant's turns), stored in the token shards, and read back one a row.

- **Records**: a JSONL line (or a Parquet or saved-dataset row) with `messages`, a list of `{"role", "content"}`
  (the OpenAI and Hugging Face convention): roles system (or developer), user and assistant, a content a string or
  a list of text parts (`gpt.chat_template.message_text`), and at least one assistant message. A record that is
  not one is skipped and counted as a corpus's bad records are (`gpt.data.corpus.BadRecords`).
- **What is taught**: the tokens each assistant turn adds after the generation prompt that opens it (the ids of
  `render(messages[:i + 1])` past those of `render(messages[:i], add_generation_prompt=True)`): its content and its
  end of turn (`<|end|>`; ChatML's `<|im_end|>` and the newline after it). Everything else (the system prompt, the
  user's turns, the markers that open each turn) is read but not scored. A template must render each turn as an
  extension of the ones before it; one that rewrites an earlier turn (Qwen3's drops its reasoning) is refused,
  naming the record.
- **Shards**: uint32 ids, the id in the low 30 bits, `SCORED` (bit 31) set on a token the loss is taught and
  `START` (bit 30) on each conversation's first token; a conversation is one section of the split rule.
- **Batches** (`ConversationBatches`): one conversation a row, from position 0, padded after its end with the
  token 0 unscored (which no earlier position attends to), so that no token attends to another conversation; an
  entry is the token's id where
  it is scored and `~id` (below 0) where it is not, which `gpt.train.step.loss_fn` reads with `scored_only`. A
  conversation longer than a row (block_size + 1 tokens) is cut to its first block_size + 1 tokens: its later turns
  are not taught (the trainer says how many were cut, naming the longest).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from gpt.chat_template import ROLES, ChatTemplate, message_text
from gpt.errors import ConfigError
from gpt.tokenizer import TextTokenizer

__all__ = ["SCORED", "START", "ID_BITS", "FIELD", "messages_of", "encode_conversation", "ConversationBatches",
           "is_conversation_record"]

SCORED = np.uint32(1 << 31)
START = np.uint32(1 << 30)
ID_BITS = np.uint32(START - 1)
FIELD = "messages"


def is_conversation_record(record) -> bool:
    """Whether a record read from a corpus is a conversation (it has a `messages` list)."""
    return isinstance(record, dict) and isinstance(record.get(FIELD), list)


def messages_of(value) -> tuple[list[dict] | None, str]:
    """A record's `messages` as the template reads them ([{"role", "content"}] with content as text, developer as
    system), or None and the kind of bad record it is."""
    if not isinstance(value, list) or not value:
        return None, f"records whose {FIELD!r} is not a non-empty list"
    messages = []
    for message in value:
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            return None, f"conversations with a role other than {', '.join(ROLES)}"
        text = message_text(message.get("content"))
        if text is None:
            return None, "conversations with a content that is not text"
        messages.append({"role": ROLES[message["role"]], "content": text})
    if not any(message["role"] == "assistant" for message in messages):
        return None, "conversations with no assistant message"
    return messages, ""


def encode_conversation(messages: Sequence[dict], template: ChatTemplate, tokenizer: TextTokenizer,
                        where: str) -> np.ndarray:
    """uint32 [T]: the conversation's ids (those of `template.ids(messages, add_generation_prompt=False)`), flagged
    `SCORED` on each assistant turn's tokens and `START` on the first. ConfigError naming `where` (file:line) when the
    template refuses the conversation or does not render its turns as extensions of the ones before."""
    ids = np.asarray(template.ids(tokenizer, messages, add_generation_prompt=False), np.uint32)
    if ids.size == 0 or ids.max() > ID_BITS:
        raise ConfigError(f"{where}: the conversation renders to {ids.size} tokens with ids up to "
                          f"{int(ids.max()) if ids.size else 0}; conversations need ids below {int(ID_BITS) + 1:,}")
    flagged = ids.copy()
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = template.ids(tokenizer, messages[:i], add_generation_prompt=True)
        turn = template.ids(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if turn[: len(prompt)] != prompt or list(ids[: len(turn)]) != turn:
            raise ConfigError(f"{where}: the chat template does not render message {i} (an assistant turn) as an "
                              f"extension of the turns before it, so its tokens cannot be told apart to train on")
        flagged[len(prompt): len(turn)] |= SCORED
    flagged[0] |= START
    return flagged


class ConversationBatches:
    """`batches[step]` -> int32 [rows, block_size + 1]: this process's rows of global batch `step`, one conversation
    each (this module's docstring), drawn uniformly by a pure function of (seed, step), as `gpt.data.loader.Batches`
    draws windows: a resumed run sees exactly the batches an uninterrupted one would."""

    def __init__(self, shards: list[str | os.PathLike], block_size: int, batch_size: int, seed: int,
                 process_index: int = 0, process_count: int = 1, dtype=np.uint32):
        self.shards = [np.memmap(path, dtype=dtype, mode="r") for path in shards]
        offsets = np.cumsum([0] + [shard.size for shard in self.shards])
        starts = [offset + np.flatnonzero(shard & START) for offset, shard in zip(offsets, self.shards)]
        self.starts = np.concatenate([*starts, [offsets[-1]]]).astype(np.int64)  # conversation i: starts[i:i + 2]
        self.offsets = offsets
        if self.starts.size < 2:
            raise ConfigError(f"the shards {[str(p) for p in shards][:3]} hold no conversation")
        if batch_size % process_count:
            raise ConfigError(f"batch_size={batch_size} must be divisible by the process count {process_count}")
        self.block_size, self.batch_size, self.seed = block_size, batch_size, seed
        rows = batch_size // process_count
        self.rows = slice(process_index * rows, (process_index + 1) * rows)

    @property
    def lengths(self) -> np.ndarray:
        """int64 [conversations]: each conversation's tokens."""
        return np.diff(self.starts)

    def _tokens(self, begin: int, end: int) -> np.ndarray:
        """The flagged tokens at [begin, end) of the shards laid end to end (a conversation may span two)."""
        first = int(np.searchsorted(self.offsets, begin, side="right")) - 1
        pieces = []
        while begin < end:
            stop = min(end, int(self.offsets[first + 1]))
            pieces.append(self.shards[first][begin - self.offsets[first]: stop - self.offsets[first]])
            begin, first = stop, first + 1
        return np.concatenate(pieces)

    def __getitem__(self, step: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, step])
        picks = rng.integers(0, self.starts.size - 1, self.batch_size)[self.rows]
        batch = np.full((len(picks), self.block_size + 1), ~np.int32(0), np.int32)  # token 0, unscored: never read
        for row, pick in enumerate(picks):
            begin = int(self.starts[pick])
            tokens = self._tokens(begin, min(int(self.starts[pick + 1]), begin + self.block_size + 1))
            ids = (tokens & ID_BITS).astype(np.int32)
            batch[row, : ids.size] = np.where(tokens & SCORED, ids, ~ids)
        return batch


def longest_record(meta: dict) -> str:
    """Where a prepared conversation corpus's longest conversation came from, as its meta.json records it."""
    longest = meta.get("longest_conversation") or {}
    return f"{longest.get('where', '?')}, {longest.get('tokens', 0):,} tokens"
