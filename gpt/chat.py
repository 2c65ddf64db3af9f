"""A conversation in the terminal (`sample.py --chat`): each line read is a user's message, the model's reply is
streamed as it comes, and the history is kept and rendered by the model's chat template for every turn, as
`llama-cli -cnv` and `ollama run` hold a conversation.

Commands: `/reset` starts a new conversation (the system message kept), `/exit` (or end of input, Ctrl-D) ends
it. Ctrl-C during a reply stops that reply (what came of it stays in the history) and the conversation goes on;
at the prompt it ends the program, as elsewhere. A reply ends at the model's end of turn (its tokenizer's end of
text and generation_config.json's ids), at the room the context has left, or at `max_new_tokens`; a
conversation that no longer fits the context says so and asks for `/reset`.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from typing import TextIO

from gpt.chat_template import ChatTemplate, ChatTemplateError
from gpt.generate import generate
from gpt.inference.decoder import Decoder
from gpt.inference.sampling import Sampling
from gpt.inference.text_stream import TextStream
from gpt.signals import StopSignals
from gpt.tokenizer import TextTokenizer

__all__ = ["Conversation", "converse"]

COMMANDS = "/reset starts over, /exit (or Ctrl-D) ends; Ctrl-C stops a reply"


@dataclasses.dataclass
class Conversation:
    """What `converse` needs of the model: its decoder, tokenizer, chat template and the ids a reply ends at;
    how it samples; and an optional draft (`gpt.generate.generate`'s `draft`, `draft_tokens`)."""

    decoder: Decoder
    tokenizer: TextTokenizer
    template: ChatTemplate
    end_of_turn: Sequence[int]
    sampling: Sampling
    seed: int = 0
    max_new_tokens: int | None = None
    draft: object = None
    draft_tokens: int = 4
    messages: list[dict] = dataclasses.field(default_factory=list)

    def reply(self, text: str, out: TextIO, turn: int) -> None:
        """The model's reply to the user's `text`, streamed to `out` and kept in `messages` with it."""
        self.messages.append({"role": "user", "content": text})
        try:
            ids = self.template.ids(self.tokenizer, self.messages, True)
        except ChatTemplateError as e:
            self.messages.pop()
            out.write(f"the chat template refused this conversation: {e}\n")
            return
        room = self.decoder.config.block_size - len(ids)
        if room < 1:
            self.messages.pop()
            out.write(f"the conversation ({len(ids):,} tokens) no longer fits the model's context of "
                      f"{self.decoder.config.block_size:,}: /reset to start over\n")
            return
        stream = TextStream((), self.tokenizer)

        def show(row: int, token: int) -> None:
            stream.push(token)
            if piece := stream.take():
                out.write(piece)
                out.flush()

        with StopSignals(at_once=True) as stop:  # Ctrl-C ends the reply here, not the program
            generate(self.decoder, [ids], min(self.max_new_tokens or room, room), sampling=self.sampling,
                     stop_tokens=tuple(self.end_of_turn), seed=self.seed + turn, on_token=show,
                     tokenizer=self.tokenizer, draft=self.draft, draft_tokens=self.draft_tokens,
                     check_memory=turn == 0)
        if stop.received is None:
            out.write(stream.finish())
        out.write(" [stopped]\n" if stop.received is not None else "\n")
        self.messages.append({"role": "assistant", "content": stream.text})


def converse(conversation: Conversation, read: Callable[[str], str] = input, out: TextIO | None = None) -> list[dict]:
    """Read the user's lines with `read` (it shows the prompt "> "), answer each, until /exit or the end of the
    input; returns the conversation's messages."""
    out = out or sys.stdout
    opening = [m for m in conversation.messages if m["role"] == "system"]
    out.write(f"{COMMANDS}\n")
    out.flush()
    turn = 0
    while True:
        try:
            line = read("> ")
        except EOFError:
            out.write("\n")
            break
        command = line.strip()
        if command == "/exit":
            break
        if command == "/reset":
            conversation.messages[:] = opening
            out.write("(a new conversation)\n")
        elif command:
            conversation.reply(line, out, turn)
            turn += 1
        out.flush()
    return conversation.messages
