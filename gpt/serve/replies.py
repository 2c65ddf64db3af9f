"""What the completions and chat completions APIs send back: each choice's text and logprobs (OpenAI's legacy
completions objects, or the chat's message, delta and logprobs objects), the usage, and a streamed reply's
server-sent events. No HTTP framework here: the app turns these into responses."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable

from gpt.inference.completion import Completion
from gpt.serve.protocol import Parsed

__all__ = ["Choice", "choice_json", "usage", "stream_events", "wait_for_update"]


class Choice:
    """One (prompt, sample) pair of a request: its engine Completion and what has been sent of it.
    prompt_text: what `echo` puts before the completion (the prompt as sent, or its ids decoded)."""

    def __init__(self, index: int, prompt: list[int], prompt_text: str):
        self.index, self.prompt, self.prompt_text = index, prompt, prompt_text
        self.completion: Completion | None = None
        self.sent_tokens = 0
        self.seen_tokens = 0  # tokens the metrics have counted
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None


# A scored token: (id, logprob, alternatives as (id, logprob)); the prompt's first has (id, None, None).
_Scored = tuple[int, float | None, list[tuple[int, float]] | None]


def _prompt_scores(choice: Choice) -> list[_Scored]:
    """The prompt's tokens with their scores (`Request.prompt_logprobs`)."""
    c = choice.completion
    return list(zip(choice.prompt, c.prompt_logprobs, c.prompt_top_logprobs))


def _completion_scores(choice: Choice, start: int, end: int, done: bool, chat: bool) -> list[_Scored]:
    """Tokens start..end of the completion with their scores, and once it is done, a completion's stop token
    that ended it (in no text: as OpenAI and vLLM report it, so that a client scoring the prompt with
    `echo` and one generated token always finds the last token its own; a chat reply's end of turn is not
    reported, as OpenAI's chat does not)."""
    c = choice.completion
    tops = c.top_logprobs[start:end] if c.request.logprobs else [None] * (end - start)
    scored = list(zip(c.tokens[start:end], c.logprobs[start:end], tops))
    return scored + [c.stop_token] if done and not chat and c.stop_token is not None else scored


def _logprobs(scored: list[_Scored], text_offset: int, top: int, tokenizer) -> dict:
    """OpenAI's legacy completions logprobs object for `scored` tokens, the first at `text_offset`, spelled by
    `tokenizer`."""
    spell = lambda token: tokenizer.token_bytes(token).decode("utf-8", errors="replace")  # noqa: E731  (its own
    strings = [spell(t) for t, _, _ in scored]  # text: a SentencePiece word's space kept, as the completion has it)
    offsets, at = [], text_offset
    for s in strings:
        offsets.append(at)
        at += len(s)
    return {
        "tokens": strings,
        "token_logprobs": [lp for _, lp, _ in scored],
        "top_logprobs": [None if alternatives is None else {spell(t): lp for t, lp in alternatives}
                         for _, _, alternatives in scored] if top else None,
        "text_offset": offsets,
    }


def _chat_logprobs(scored: list[_Scored], tokenizer) -> dict:
    """OpenAI's chat logprobs object for `scored` tokens: each token's text, log-probability, bytes and top
    alternatives."""
    def entry(token: int, logprob: float) -> dict:
        spelled = tokenizer.token_bytes(token)
        return {"token": spelled.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(spelled)}

    return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, alp) for a, alp in alternatives or []]}
                        for t, lp, alternatives in scored]}


def _entry(parsed: Parsed, choice: Choice, text: str, scored: list[_Scored], finish_reason: str | None,
           offset: int, delta: dict | None = None) -> dict:
    """One choice's entry: a completion's text, or a chat's message (`delta` None) or delta; its logprobs."""
    if parsed.logprobs is None:
        logprobs = None
    elif parsed.chat:
        logprobs = _chat_logprobs(scored, parsed.tokenizer)
    else:
        logprobs = _logprobs(scored, offset, parsed.logprobs, parsed.tokenizer)
    if not parsed.chat:
        return {"text": text, "index": choice.index, "finish_reason": finish_reason, "logprobs": logprobs}
    said = {"message": {"role": "assistant", "content": text}} if delta is None else {"delta": delta}
    return {"index": choice.index, **said, "logprobs": logprobs, "finish_reason": finish_reason}


def choice_json(choice: Choice, parsed: Parsed) -> dict:
    """A finished choice as a plain (not streamed) reply's entry."""
    c = choice.completion
    scored = ((_prompt_scores(choice) if parsed.echo else [])
              + _completion_scores(choice, 0, len(c.tokens), True, parsed.chat))
    return _entry(parsed, choice, (choice.prompt_text if parsed.echo else "") + c.text.finish(), scored,
                  c.finish_reason, 0)


def usage(choices: list[Choice], prompt_tokens: int) -> dict:
    completion_tokens = sum(len(c.completion.tokens) for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def stream_events(header: dict, choices: list[Choice], parsed: Parsed,
                        next_update: Callable[[], Awaitable[Choice | None]]) -> AsyncIterator[str]:
    """Server-sent events: a chunk per choice per batch of new text, a last chunk per choice with its
    finish_reason, a chunk with the usage and no choices if the client asked for it, then [DONE]. A chat's
    choices each open with a chunk whose delta names the assistant's role, as OpenAI's do.
    `next_update` gives the next choice with news, or None once the client has gone (the events end)."""
    logprobs, echo = parsed.logprobs, parsed.echo
    finished: set[int] = set()
    offsets = {c.index: 0 for c in choices}
    echoed: set[int] = set()  # the choices whose prompt went out (with `echo`, in their first chunk)
    if parsed.chat:
        for choice in choices:
            opening = _entry(parsed, choice, "", [], None, 0, {"role": "assistant", "content": ""})
            yield f"data: {json.dumps({**header, 'choices': [opening]})}\n\n"
    while len(finished) < len(choices):
        choice = await next_update()
        if choice is None:
            return
        if choice.index in finished:
            continue
        c = choice.completion
        done = c.done.is_set()
        end = len(c.tokens)
        text = c.text.finish() if done else c.text.take()
        scored = _completion_scores(choice, choice.sent_tokens, end, done, parsed.chat)
        if echo and choice.index not in echoed:
            echoed.add(choice.index)
            text, scored = choice.prompt_text + text, (_prompt_scores(choice) if logprobs is not None else []) + scored
        if text or done:
            chunk = _entry(parsed, choice, text, scored, c.finish_reason if done else None, offsets[choice.index],
                           {"content": text} if text else {})
            choice.sent_tokens = end
            offsets[choice.index] += len(text)
            yield f"data: {json.dumps({**header, 'choices': [chunk]})}\n\n"
        if done:
            finished.add(choice.index)
    if parsed.include_usage:
        yield f"data: {json.dumps({**header, 'choices': [], 'usage': usage(choices, parsed.prompt_tokens)})}\n\n"
    yield "data: [DONE]\n\n"


async def wait_for_update(updates: asyncio.Queue, disconnected: Callable[[], Awaitable[bool]]) -> Choice | None:
    """The next choice with news, or None once the client has gone away. Starlette cancels a stream whose
    client left, but a plain request's handler is never told: it asks, before each wait and every quarter
    second while waiting."""
    while True:
        if await disconnected():
            return None
        try:
            return await asyncio.wait_for(updates.get(), timeout=0.25)
        except asyncio.TimeoutError:
            pass
