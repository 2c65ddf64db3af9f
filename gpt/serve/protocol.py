"""The completions API's requests, parsed: a body's bytes in, the engine's Requests out, or an `ApiError`
that says which status and which field. Pure functions with no I/O, so that every hostile body is a unit
test (tests/test_serve_protocol.py); the app runs them off the event loop, since a long prompt takes a
while to tokenize.

Everything a client sends is bounded before it costs anything: the body's size (the app, while reading),
its nesting depth, each prompt's length in characters before it is tokenized (a prompt of more characters
than the cache length times the longest token's bytes cannot fit), the stop strings' number and size,
and every number's range (a float that overflows, a NaN, an integer too long for Python's reader).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import secrets

from gpt.errors import ConfigError
from gpt.inference.request import Request, check_request, is_int
from gpt.inference.sampling import Sampling
from gpt.tokenizer import get_tokenizer

__all__ = ["ApiError", "Limits", "Parsed", "Knobs", "parse_json", "parse_completion", "parse_tokenize",
           "parse_detokenize", "describe", "read_body", "read_knobs", "checked", "number"]

MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256  # longer than any stop string a client means


class ApiError(Exception):
    """A request the server refuses: the HTTP status, the message, the request field it is about (OpenAI's
    `param`) and OpenAI's error type."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def json(self) -> dict:
        """OpenAI's error object."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the served engine and model accept.

    model_name: the name clients must send; vocab_size, cache_length, max_queue, max_stop_tokens: the
    engine's; eot: the end-of-text id every completion stops at (None when the vocabulary has none);
    tokenizer: what reads and writes the text (the engine's: GPT-2's, or a model's own); chat, end_of_turn: the
    chat template and where a reply ends (chat requests); max_depth: how deeply
    JSON arrays and objects may nest; max_prompt_chars (derived): the most characters a prompt string can
    have and still fit the cache in tokens, found from the vocabulary's longest token when the limits are
    made (at start-up, not on a request's clock).
    """

    model_name: str
    vocab_size: int
    cache_length: int
    max_queue: int
    max_stop_tokens: int
    eot: int | None
    tokenizer: object = dataclasses.field(default_factory=get_tokenizer, compare=False)
    chat: object = None
    """The model's chat template (`gpt.chat_template.ChatTemplate`); None where it has none."""
    end_of_turn: tuple[int, ...] = ()
    """The ids a chat reply stops at: the end of the assistant's turn and the end of the text."""
    max_depth: int = 32
    max_prompt_chars: int = dataclasses.field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "max_prompt_chars", self.cache_length * _longest_token_bytes(self.tokenizer))


@dataclasses.dataclass(frozen=True)
class Parsed:
    """A completions request, parsed: the engine's requests (n per prompt, prompt after prompt), what
    `echo` puts before each completion, and how to answer (stream, logprobs: None or how many
    alternatives, echo, prompt_tokens for the usage, include_usage, the tokenizer that spells its tokens)."""

    requests: list[Request]
    prompt_texts: list[str]
    stream: bool
    logprobs: int | None
    echo: bool
    prompt_tokens: int
    include_usage: bool
    tokenizer: object
    chat: bool = False
    """A chat request: answered in the chat completions' shape."""


@functools.cache
def _longest_token_bytes(tokenizer) -> int:
    return max(len(tokenizer.token_bytes(i)) for i in range(tokenizer.vocab_size))


def describe(value, limit: int = 80) -> str:
    """`value` as JSON, cut to `limit` characters, for an error message (bounded: `parse_json` has checked
    the depth)."""
    text = json.dumps(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _depth_within(value, limit: int) -> bool:
    """Whether JSON arrays and objects nest at most `limit` deep in `value` (iteratively: Python's own
    recursion is what a deep value would exhaust)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node
        nested = [child for child in children if isinstance(child, (list, dict))]
        if nested and depth >= limit:
            return False
        stack.extend((child, depth + 1) for child in nested)
    return True


def parse_json(raw: bytes, max_depth: int = 32):
    """The body parsed as JSON; ApiError 400 when it is not JSON, or nests deeper than `max_depth`."""
    try:
        body = json.loads(raw)
    except RecursionError:  # Python's reader recurses per nesting level
        raise ApiError(400, "the request body nests JSON arrays or objects too deeply") from None
    except ValueError as e:  # not JSON, not UTF-8, or an integer too long for Python's reader
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    if isinstance(body, (list, dict)) and not _depth_within(body, max_depth):
        raise ApiError(400, f"the request body nests JSON arrays or objects too deeply (at most {max_depth} levels)")
    return body


_FIELDS = ("model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "n",
           "stop", "seed", "stream", "logprobs", "stop_tokens", "echo")
# OpenAI's fields this server does not implement, with the values that ask for nothing: any other value is
# refused (a 400 naming the field), not silently ignored.
_UNSUPPORTED = {"best_of": (None, 1), "suffix": (None, ""), "presence_penalty": (None, 0),
                "frequency_penalty": (None, 0), "logit_bias": (None, {})}


def _field_of(message: str) -> str | None:
    """The request field a ConfigError's message is about (the messages name their field)."""
    if "max_tokens" in message:
        return "max_tokens"
    first = message.split()[0].strip(":=")
    return first if first in _FIELDS else "prompt" if message.startswith("prompt") else None


def number(body: dict, name: str, default, kind=float):
    """body[name] as a `kind` (int or float), `default` when absent or null; ApiError 400 naming it when it
    is not a number, not an integer where one is needed, or too large for a float."""
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ApiError(400, f"{name} must be {'an integer' if kind is int else 'a number'}, got {describe(value)}", name)
    if kind is int:
        if isinstance(value, float) and not value.is_integer():  # 2.0 is 2; NaN and infinities are not integers
            raise ApiError(400, f"{name} must be an integer, got {value!r}", name)
        return int(value)
    try:
        return float(value)
    except OverflowError:  # an integer beyond float's range
        raise ApiError(400, f"{name} must be a finite number, got an integer of {len(str(value))} digits", name) from None


def _prompt_list(body: dict) -> list[str | list[int]]:
    """The request's prompts, each a string or a token-id list: from a string, a list of strings, a list of
    ids, or a list of id lists."""
    prompt = body.get("prompt")
    is_ids = lambda p: isinstance(p, list) and all(map(is_int, p))  # noqa: E731
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and is_ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or (is_ids(p) and p) for p in prompt):
        return prompt
    raise ApiError(400, "prompt must be a non-empty string, list of strings, list of token ids, or list of "
                        f"token-id lists, got {describe(prompt)}", "prompt")


def _tokenized(prompts: list[str | list[int]], limits: Limits) -> list[list[int]]:
    """Each prompt as token ids (strings through the tokenizer, a special token's text its id: GPT-2's
    `<|endoftext|>`); a string too long to fit the cache is refused before it is tokenized."""
    tokenizer = limits.tokenizer
    for p in prompts:
        if isinstance(p, str) and len(p) > limits.max_prompt_chars:
            raise ApiError(400, f"prompt has {len(p)} characters; at most {limits.max_prompt_chars} can fit the "
                                f"context of {limits.cache_length} tokens", "prompt")
    ids = [tokenizer.encode(p, allow_special=True) if isinstance(p, str) else p for p in prompts]
    if any(len(p) == 0 for p in ids):
        raise ApiError(400, "prompt is empty: a completion needs at least one prompt token", "prompt")
    return ids


def _stop_strings(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop or []
    if (not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS
            or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop)):
        raise ApiError(400, f"stop must be a non-empty string or a list of at most {MAX_STOP_STRINGS}, each at most "
                            f"{MAX_STOP_CHARS} characters, got {describe(body.get('stop'))}", "stop")
    return tuple(stop)


def _flag(body: dict, name: str) -> bool:
    value = False if body.get(name) is None else body[name]
    if not isinstance(value, bool):
        raise ApiError(400, f"{name} must be true or false, got {describe(value)}", name)
    return value


def _check_model(body: dict, limits: Limits, required: bool = True) -> None:
    name = body.get("model")
    if name != limits.model_name and (required or name is not None):
        shown = repr(name) if isinstance(name, str) and len(name) <= 80 else describe(name)
        raise ApiError(400, f"model {shown} is not served here; the model is {limits.model_name!r}", "model")


def read_body(raw: bytes, limits: Limits, unsupported: dict[str, tuple]) -> dict:
    """The body as a JSON object naming the served model, with none of the `unsupported` fields set to other than
    their inert values; ApiError 400 otherwise."""
    body = parse_json(raw, limits.max_depth)
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _check_model(body, limits)
    for name, inert in unsupported.items():
        if body.get(name) not in inert:
            raise ApiError(400, f"{name} is not supported by this server (got {describe(body[name])})", name)
    return body


@dataclasses.dataclass(frozen=True)
class Knobs:
    """What a completions and a chat request share: n, stop strings, the seed, sampling, streaming."""

    n: int
    stop: tuple[str, ...]
    seed: int
    sampling: Sampling
    stream: bool
    include_usage: bool


def read_knobs(body: dict, limits: Limits, prompts: int = 1) -> Knobs:
    """The shared fields of a body with `prompts` prompts, checked; ApiError 400 naming the first that is wrong."""
    n = number(body, "n", 1, int)
    if not 1 <= n <= limits.max_queue:
        raise ApiError(400, f"n must be in [1, {limits.max_queue}], got {n}", "n")
    if prompts * n > limits.max_queue:  # more than the queue holds could never be admitted
        raise ApiError(400, f"{prompts} prompts x n={n} is {prompts * n} completions; at most "
                            f"{limits.max_queue} (the server's max_queue) fit in one request", "n")
    stop = _stop_strings(body)
    stream = _flag(body, "stream")
    seed = number(body, "seed", None, int)
    if seed is not None and not 0 <= seed < 2**32:  # the sampler's key holds 32 bits: a larger one would alias
        raise ApiError(400, f"seed must be in [0, 2**32), got {describe(seed)}", "seed")
    sampling = Sampling(
        temperature=number(body, "temperature", 1.0), top_p=number(body, "top_p", None),
        top_k=number(body, "top_k", None, int) or None,  # 0 is a common way to say "no top-k"
        min_p=number(body, "min_p", None), repetition_penalty=number(body, "repetition_penalty", 1.0))
    for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
        if getattr(sampling, name) is not None and not math.isfinite(getattr(sampling, name)):
            raise ApiError(400, f"{name} must be finite, got {getattr(sampling, name)}", name)
    stream_options = {} if body.get("stream_options") is None else body["stream_options"]
    if not isinstance(stream_options, dict) or not isinstance(stream_options.get("include_usage", False), bool):
        raise ApiError(400, "stream_options must be an object like {\"include_usage\": true}, got "
                            f"{describe(body.get('stream_options'))}", "stream_options")
    return Knobs(n, stop, secrets.randbits(32) if seed is None else seed, sampling, stream,
                 stream_options.get("include_usage", False))


def checked(requests: list[Request], limits: Limits) -> list[Request]:
    """`requests`, each checked against the engine's bounds; ApiError 400 naming the field of the first out."""
    try:
        for request in requests:
            check_request(request, limits.vocab_size, limits.cache_length, limits.max_stop_tokens)
    except ConfigError as e:
        raise ApiError(400, str(e), _field_of(str(e))) from None
    return requests


def parse_completion(raw: bytes, limits: Limits) -> Parsed:
    """A /v1/completions body, parsed and checked against `limits`; ApiError (400) naming the first field
    that is wrong. Prompts are tokenized here, after every cheaper check."""
    body = read_body(raw, limits, _UNSUPPORTED)
    raw_prompts = _prompt_list(body)
    knobs = read_knobs(body, limits, len(raw_prompts))
    logprobs = number(body, "logprobs", None, int)  # None: none; 0: the chosen tokens' own; k: and top k
    echo = _flag(body, "echo")
    max_tokens = number(body, "max_tokens", 16, int)
    if max_tokens < 0 or max_tokens == 0 and not echo:
        raise ApiError(400, f"max_tokens must be >= 1, got {max_tokens}; 0 only with echo: true, which scores the "
                            f"prompt and generates nothing", "max_tokens")
    each = dict(max_tokens=max_tokens, sampling=knobs.sampling, seed=knobs.seed, stop_strings=knobs.stop,
                logprobs=logprobs or 0, stop_tokens=(limits.eot,) if limits.eot is not None else (),
                prompt_logprobs=echo and (logprobs is not None or max_tokens == 0))
    prompts = _tokenized(raw_prompts, limits)  # after every cheaper check
    requests, texts = [], []
    for prompt, sent in zip(prompts, raw_prompts):
        text = sent if isinstance(sent, str) else limits.tokenizer.decode(prompt) if echo else ""
        requests += [Request(prompt, stream=j, **each) for j in range(knobs.n)]
        texts += [text] * knobs.n
    return Parsed(checked(requests, limits), texts, knobs.stream, logprobs, echo, sum(map(len, prompts)),
                  knobs.include_usage, limits.tokenizer)


def parse_tokenize(raw: bytes, limits: Limits) -> tuple[str, bool]:
    """A /tokenize body's text and whether the tokenizer's special tokens go around it ({"prompt": text,
    "add_special_tokens": true by default, as vLLM's}); ApiError 400 naming the field otherwise."""
    body = _tokenizer_body(raw, limits, "prompt", lambda p: isinstance(p, str), "text")
    return body["prompt"], body.get("add_special_tokens") is None or _flag(body, "add_special_tokens")


def parse_detokenize(raw: bytes, limits: Limits) -> list[int]:
    """A /detokenize body's ids ({"tokens": ids}, each in the vocabulary); ApiError 400 naming it otherwise."""
    vocab = limits.tokenizer.vocab_size
    in_vocabulary = lambda ids: isinstance(ids, list) and all(is_int(t) and 0 <= t < vocab for t in ids)  # noqa: E731
    return _tokenizer_body(raw, limits, "tokens", in_vocabulary, f"a list of token ids in [0, {vocab})")["tokens"]


def _tokenizer_body(raw: bytes, limits: Limits, field: str, check, shape: str) -> dict:
    body = parse_json(raw, limits.max_depth)
    if not isinstance(body, dict) or not check(body.get(field)):
        value = body.get(field) if isinstance(body, dict) else body
        raise ApiError(400, f"this endpoint takes {{{json.dumps(field)}: {shape}}}, got {describe(value)}", field)
    _check_model(body, limits, required=False)
    return body
