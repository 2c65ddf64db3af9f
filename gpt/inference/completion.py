"""A request's progress as the engine makes it: its tokens, their log-probabilities, its text and how it
ended. Written on the engine's thread, only through its own methods, and read by anyone; no JAX."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import numpy as np

from gpt.inference.request import Request
from gpt.inference.text_stream import TextStream

__all__ = ["Completion", "deliver_prompt_scores"]


class Completion:
    """A request's progress, written by the engine's thread and read by anyone.

    tokens, logprobs: the emitted tokens and their log-probabilities; top_logprobs: per token, a list of
    (id, logprob) for the request's `logprobs` most likely alternatives. prompt_logprobs,
    prompt_top_logprobs: the same for the prompt's tokens when the request asked (`Request.prompt_logprobs`),
    None for its first token (nothing comes before it); complete once the first token is (or, with
    max_tokens 0, once the request is done). stop_token: (id, logprob, alternatives) of the stop token
    that ended it, which is in neither `tokens` nor `text`; else None. text: a `TextStream` of the
    output (stop strings applied). finish_reason: None while running, then "stop" (a stop token or
    string), "length" (max_tokens reached), "cancelled" (`cancel`) or "abort" (cut by the engine's
    shutdown). `done` is set when it ends. `on_update`, when given, is called on the engine's thread after
    each batch of new tokens and at the end (and on the cancelling thread, for a request cancelled while
    it waited). `tokenizer` decodes the text (GPT-2's by default).
    """

    def __init__(self, request: Request, on_update: Callable[[Completion], None] | None = None, settings=None,
                 tokenizer=None):
        self.request, self.on_update = request, on_update
        self.settings = settings  # the request's knobs as host values (`Engine.check`)
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] = []
        self.stop_token: tuple[int, float, list[tuple[int, float]]] | None = None
        self.prompt_logprobs: list[float | None] = [None] if request.prompt_logprobs else []
        self.prompt_top_logprobs: list[list[tuple[int, float]] | None] = [None] if request.prompt_logprobs else []
        self.text = TextStream(request.stop_strings, tokenizer)
        self.finish_reason: str | None = None
        self.done = threading.Event()
        self.cancel_requested = False
        self.cancel_reason = "cancelled"  # the finish_reason a cancel ends it with
        self._withdraw: Callable[[Completion], None] | None = None  # the queue it waits in (`waits_in`)

    def cancel(self, reason: str = "cancelled") -> None:
        """Ask the engine to stop this request, ending it with `reason`: waiting, it leaves the queue now;
        running, its slot is freed at the engine's next round."""
        if not self.cancel_requested:
            self.cancel_reason = reason
        self.cancel_requested = True
        if self._withdraw is not None:
            self._withdraw(self)

    def waits_in(self, withdraw: Callable[[Completion], None] | None) -> None:
        """Waiting in a queue that `withdraw(self)` takes it out of at a cancel; None once it has left."""
        self._withdraw = withdraw

    def add(self, token: int, logprob: float, top: list[tuple[int, float]]) -> bool:
        """Record one token; True if it completed a stop string."""
        self.tokens.append(token)
        self.logprobs.append(logprob)
        if self.request.logprobs:
            self.top_logprobs.append(top[: self.request.logprobs])
        return self.text.push(token) and bool(self.request.stop_strings)

    def stopped_by(self, token: int, logprob: float, top: list[tuple[int, float]]) -> None:
        """Record the stop token that ends it (in neither `tokens` nor `text`)."""
        self.stop_token = (token, logprob, top[: self.request.logprobs])

    def add_prompt_scores(self, scores: Sequence[tuple[float, list[tuple[int, float]]]]) -> None:
        """Record the next prompt tokens' (logprob, alternatives), as a prefix cache held them."""
        for logprob, top in scores:
            self.prompt_logprobs.append(logprob)
            self.prompt_top_logprobs.append(top)

    def score_prompt(self, start: int, logprob_P: np.ndarray, top_ids_PJ: np.ndarray | None,
                      top_logprobs_PJ: np.ndarray | None) -> None:
        """Record the scores of the prompt's tokens start+1 .. (a piece of `PromptScores`, from position
        `start` on: position p scored the token after it)."""
        end = min(len(self.request.prompt), start + 1 + len(logprob_P))
        for p in range(end - start - 1):
            self.prompt_logprobs.append(float(logprob_P[p]))
            if self.request.logprobs:
                top = zip(top_ids_PJ[p, : self.request.logprobs], top_logprobs_PJ[p, : self.request.logprobs])
                self.prompt_top_logprobs.append([(int(t), float(lp)) for t, lp in top])
            else:
                self.prompt_top_logprobs.append([])

    def end(self, reason: str) -> None:
        """End it with `reason` and tell its listener."""
        self.finish_reason = reason
        self.done.set()
        self.notify()

    def notify(self) -> None:
        """Tell its listener (`on_update`) of new tokens or its end."""
        if self.on_update is not None:
            self.on_update(self)


def deliver_prompt_scores(completions: Sequence[Completion], start: int, scores) -> None:
    """Hand each completion that asked its prompt's scores for a piece from token `start` on (row i of
    `scores`, a `gpt.inference.decoding.PromptScores`, is completions[i]); read from the device only when
    one asked."""
    asked = [(row, c) for row, c in enumerate(completions) if c.request.prompt_logprobs]
    if not asked:
        return
    logprob = np.asarray(scores.logprob)
    top = any(c.request.logprobs for _, c in asked)
    top_ids, top_lps = (np.asarray(scores.top_ids), np.asarray(scores.top_logprobs)) if top else (None, None)
    for row, c in asked:
        c.score_prompt(start, logprob[row], top_ids[row] if top else None, top_lps[row] if top else None)

