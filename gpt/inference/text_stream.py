"""Incremental detokenization with stop strings: each new token costs its own bytes, never the row's.

GPT-2's tokens are byte sequences, and one character may span several tokens. An incremental UTF-8
decoder keeps the undecoded tail between tokens, so text is released one whole character at a time. Text
that could still become a stop string is held back until it cannot, so a streamed reply never shows the
start of a stop string that then ends it.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from gpt.tokenizer import get_tokenizer

__all__ = ["TextStream"]


class TextStream:
    """The text of a growing token sequence, cut before the first stop string.

    `push(token)` adds a token and says whether a stop string has now appeared; `take()` returns the text
    that is safe to show and not shown yet; `finish()` returns the rest. `tokenizer` says what bytes a token
    is (its `token_bytes`): GPT-2's by default.
    """

    def __init__(self, stop_strings: Sequence[str] | str = (), tokenizer=None):
        stop_strings = (stop_strings,) if isinstance(stop_strings, str) else stop_strings  # one, not its characters
        self.stop_strings = tuple(s for s in stop_strings if s)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._token_bytes = (tokenizer or get_tokenizer()).token_bytes
        self.text = ""  # everything decoded so far, cut at the stop string once one appears
        self.stopped = False
        self._shown = 0

    def push(self, token: int) -> bool:
        """Add one token; True once a stop string has appeared (the text is then cut before it)."""
        if self.stopped:
            return True
        before = len(self.text)
        self.text += self._decoder.decode(self._token_bytes(token))
        if self.stop_strings:
            longest = max(map(len, self.stop_strings))
            window_start = max(0, before - longest + 1)  # a stop string may end in the new text only
            found = [i for s in self.stop_strings if (i := self.text.find(s, window_start)) >= 0]
            if found:
                self.text, self.stopped = self.text[: min(found)], True
        return self.stopped

    def take(self) -> str:
        """The text not handed out yet, less any tail that could still grow into a stop string."""
        end = len(self.text) if self.stopped else len(self.text) - self._held_back()
        piece, self._shown = self.text[self._shown:end], max(self._shown, end)
        return piece

    def finish(self) -> str:
        """All the text not handed out yet (the sequence has ended)."""
        if not self.stopped:
            self.text += self._decoder.decode(b"", final=True)
        piece, self._shown = self.text[self._shown:], len(self.text)
        return piece

    def _held_back(self) -> int:
        for k in range(min(len(self.text), max(map(len, self.stop_strings), default=1) - 1), 0, -1):
            if any(s.startswith(self.text[-k:]) for s in self.stop_strings):
                return k
        return 0
