"""An OpenAI-compatible completions server over one `gpt.inference.engine.Engine`.

    POST /v1/completions   prompt (a string, strings, token ids, or lists of them), max_tokens,
                           temperature, top_p, n, stop, seed, stream (server-sent events), logprobs,
                           echo (the prompt before the completion, its tokens scored when logprobs is
                           given; with max_tokens 0 the prompt is only scored), and the extras top_k,
                           min_p, repetition_penalty
    GET  /v1/models        the one model served (and /v1/models/NAME: it, or 404)
    GET  /tokenizer_info   the tokenizer's special tokens and the context (as vLLM answers it)
    POST /tokenize         {"prompt": text} -> {"tokens": ids, "count", "max_model_len"}
    POST /detokenize       {"tokens": ids} -> {"prompt": text}   (all three under /v1 too)
    GET  /health           200 while serving, 503 while shutting down
    GET  /metrics          Prometheus: queue depth, live slots, tokens, tokens/s, time to first token,
                           inter-token latency

Text becomes tokens as Hugging Face's GPT-2 tokenizer makes them (`<|endoftext|>` in a prompt is the
special token, 50256), the same in completions and /tokenize, so that a client that counts tokens
(lm-evaluation-harness) counts what is scored. Starlette (through FastAPI) on uvicorn does the HTTP; the engine runs on a thread of its own and each
request waits on an asyncio queue that the engine's thread feeds. A bad request gets OpenAI's error JSON
with status 400 naming the field; a full queue gets 429; a body over the size limit gets 413. A client
that disconnects cancels its requests. SIGTERM: uvicorn stops accepting connections and waits up to the
deadline for running requests, then the engine cancels what is left, and the process exits.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import math
import secrets
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import prometheus_client
from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jax.sharding import Mesh
from starlette.exceptions import HTTPException as StarletteHTTPException

from gpt.errors import ConfigError
from gpt.inference.completion import Completion
from gpt.inference.engine import MIN_PROMPT_BUCKET, Engine
from gpt.inference.request import Request, is_int
from gpt.inference.scheduler import EngineStopped, QueueFull
from gpt.model.config import DType
from gpt.model.sharding import make_mesh, parse_mesh
from gpt.tokenizer import EOT, get_tokenizer

__all__ = ["ServeConfig", "create_app", "serve"]


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """`python serve.py --help` lists these as flags."""

    init_from: str = "out"
    """A training out_dir, a Hugging Face GPT-2 directory, or a hub name (gpt2, ...) in the local cache."""
    host: str = "127.0.0.1"
    port: int = 8000
    """0 picks a free port (the chosen one is printed)."""
    slots: int = 8
    """Requests decoded together."""
    max_queue: int = 64
    """Requests that may wait for a slot; more get HTTP 429."""
    cache_length: int | None = None
    """Positions per slot (prompt + output); default: the model's context."""
    steps_per_call: int = 1
    """Decode steps per device call: more amortize dispatch, fewer stream more smoothly."""
    prefill_chunk: int = 256
    """A longer prompt runs in chunks of this many tokens, one per round, the other slots decoding between
    them (so a long prompt holds up the streams at most one chunk's time); >= 16."""
    prefix_cache_tokens: int = 0
    """Positions of scored prompts (echo + logprobs) to keep, so that one that begins like an earlier one
    (a multiple-choice item's choices) runs only the rest; 0 keeps none. GPT-2 124M keeps 72 KB a position
    in float32: 32768 (2.4 GB) held the contexts of bench/eval_bench.py's 200-item multiple-choice task."""
    model_name: str | None = None
    """The name clients pass as `model`; default: the last part of init_from."""
    dtype: DType = "float32"
    """Compute dtype (bfloat16 on GPUs)."""
    quantize: Literal["none", "int8", "bf16"] = "none"
    """Store the weights for decoding as int8 (a float scale per output channel) or bfloat16."""
    mesh: str = ""
    """Serve sharded over a device mesh, e.g. 'tensor=4' (heads and MLP split over 4 GPUs) or
    'data=2,tensor=4' (the slots split 2 ways too); empty runs on one device."""
    max_request_mb: float = 8.0
    """A larger request body gets HTTP 413, unread (64 prompts of 1024 token ids each are ~0.5 MB)."""
    shutdown_deadline_s: float = 10.0
    """On SIGTERM, how long running requests may take to finish before they are cancelled."""
    compile_cache: bool = True
    """Keep compiled programs in the user's cache directory, so that a restart skips most of the warm-up."""


class _TooLarge(Exception):
    pass


class _BadRequest(Exception):
    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status_code=status)


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


def _number(body: dict, name: str, default, kind=float):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not float(value).is_integer()):
        raise _BadRequest(name, f"{name} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
    return kind(value)


async def _read_body(http: HTTPRequest, limit: int) -> bytes:
    """The request's body; _TooLarge as soon as it is known to pass `limit` bytes (from its declared length,
    or while it arrives), so a huge body is never held in memory."""
    declared = http.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _TooLarge
    chunks, size = [], 0
    async for chunk in http.stream():
        size += len(chunk)
        if size > limit:
            raise _TooLarge
        chunks.append(chunk)
    return b"".join(chunks)


async def _json_body(http: HTTPRequest, limit: int):
    """The request's body parsed as JSON; _TooLarge past `limit` bytes, _BadRequest when it is not JSON."""
    try:
        return json.loads(await _read_body(http, limit))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _BadRequest(None, f"the request body is not valid JSON: {e}") from None
    except RecursionError:  # Python's parser recurses per nesting level
        raise _BadRequest(None, "the request body nests JSON arrays or objects too deeply") from None


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
    raise _BadRequest("prompt", "prompt must be a non-empty string, list of strings, list of token ids, or list "
                                f"of token-id lists, got {json.dumps(prompt)[:80]}")


def _tokenized(prompts: list[str | list[int]]) -> list[list[int]]:
    """Each prompt as token ids (strings through GPT-2's tokenizer, `<|endoftext|>` its special id)."""
    tokenizer = get_tokenizer()
    ids = [tokenizer.encode(p, allow_special=True) if isinstance(p, str) else p for p in prompts]
    if any(len(p) == 0 for p in ids):
        raise _BadRequest("prompt", "prompt is empty: a completion needs at least one prompt token")
    return ids


class _Metrics:
    """The Prometheus series, in a registry of the app's own (so that several apps can live in one process)."""

    def __init__(self, engine: Engine):
        self.registry = registry = prometheus_client.CollectorRegistry()
        prometheus_client.Gauge("gpt_queue_depth", "Requests waiting for a slot", registry=registry
                                ).set_function(lambda: engine.queue_depth)
        prometheus_client.Gauge("gpt_live_slots", "Slots holding a running request", registry=registry
                                ).set_function(lambda: engine.live_slots)
        self.tokens = prometheus_client.Counter("gpt_generated_tokens", "Tokens generated", registry=registry)
        prometheus_client.Gauge("gpt_tokens_per_second", "Tokens generated per second over the last 10 s",
                                registry=registry).set_function(self._rate)
        self.ttft = prometheus_client.Histogram(
            "gpt_time_to_first_token_seconds", "From a request's arrival to its first token", registry=registry,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.itl = prometheus_client.Histogram(
            "gpt_inter_token_latency_seconds", "Between a request's consecutive tokens", registry=registry,
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
        self.requests = prometheus_client.Counter("gpt_requests", "Completion requests by HTTP status",
                                                  ["status"], registry=registry)
        prometheus_client.Gauge("gpt_prompt_tokens_reused", "Prompt positions loaded from the prefix cache, not run",
                                registry=registry).set_function(lambda: engine.prompt_tokens_reused)
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self._lock = threading.Lock()

    def record_tokens(self, count: int) -> None:
        self.tokens.inc(count)
        with self._lock:
            self._recent.append((time.monotonic(), count))

    def _rate(self) -> float:
        with self._lock:
            now = time.monotonic()
            while self._recent and self._recent[0][0] < now - 10:
                self._recent.popleft()
            return sum(n for _, n in self._recent) / 10.0


class _Choice:
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


def _prompt_scores(choice: _Choice) -> list[_Scored]:
    """The prompt's tokens with their scores (`Request.prompt_logprobs`)."""
    c = choice.completion
    return list(zip(choice.prompt, c.prompt_logprobs, c.prompt_top_logprobs))


def _completion_scores(choice: _Choice, start: int, end: int, done: bool) -> list[_Scored]:
    """Tokens start..end of the completion with their scores, and once it is done, the stop token that
    ended it (in no text: as OpenAI and vLLM report it, so that a client scoring the prompt with
    `echo` and one generated token always finds the last token its own)."""
    c = choice.completion
    tops = c.top_logprobs[start:end] if c.request.logprobs else [None] * (end - start)
    scored = list(zip(c.tokens[start:end], c.logprobs[start:end], tops))
    return scored + [c.stop_token] if done and c.stop_token is not None else scored


def _logprobs(scored: list[_Scored], text_offset: int, top: int) -> dict:
    """OpenAI's legacy completions logprobs object for `scored` tokens, the first at `text_offset`."""
    tokenizer = get_tokenizer()
    strings = [tokenizer.decode([t]) for t, _, _ in scored]
    offsets, at = [], text_offset
    for s in strings:
        offsets.append(at)
        at += len(s)
    return {
        "tokens": strings,
        "token_logprobs": [lp for _, lp, _ in scored],
        "top_logprobs": [None if alternatives is None else {tokenizer.decode([t]): lp for t, lp in alternatives}
                         for _, _, alternatives in scored] if top else None,
        "text_offset": offsets,
    }


def create_app(engine: Engine, model_name: str, *, warmup: bool = True, shutdown_deadline_s: float = 10.0,
               max_request_bytes: int = 8 << 20, log: Callable[[str], None] = print) -> FastAPI:
    """The ASGI app over `engine`. Its lifespan warms the engine up and starts its thread, and at shutdown
    stops it (running requests get up to `shutdown_deadline_s`). A body over `max_request_bytes` gets 413."""
    metrics = _Metrics(engine)
    state = {"serving": False}
    eot = get_tokenizer().eot_id if engine.config.vocab_size > get_tokenizer().eot_id else None

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if warmup:
            await asyncio.to_thread(engine.warmup, log)
        engine.start()
        state["serving"] = True
        try:
            yield
        finally:
            state["serving"] = False
            await asyncio.to_thread(engine.stop, shutdown_deadline_s)

    app = FastAPI(title="gpt", lifespan=lifespan)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(http: HTTPRequest, error: StarletteHTTPException):  # an unknown route or method
        routes = ("POST /v1/completions, GET /v1/models, GET /tokenizer_info, POST /tokenize, POST /detokenize, "
                  "GET /health and GET /metrics")
        reply = _error(error.status_code, f"{http.method} {http.url.path}: {error.detail}; this server answers {routes}")
        reply.headers.update(error.headers or {})  # a 405's Allow
        return reply

    @app.get("/health")
    async def health():
        if not state["serving"]:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return {"status": "ok", "live_slots": engine.live_slots, "queue_depth": engine.queue_depth}

    card = {"id": model_name, "object": "model", "created": 0, "owned_by": "gpt"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        if name != model_name:
            return _error(404, f"model {name!r} is not served here; the model is {model_name!r}", "model")
        return card

    @app.get("/metrics")
    async def prometheus():
        return Response(prometheus_client.generate_latest(metrics.registry),
                        media_type=prometheus_client.CONTENT_TYPE_LATEST)

    def refusal(e: Exception) -> JSONResponse:
        """A bad request's reply: 413 for a body over the limit, else 400 naming the field."""
        if isinstance(e, _TooLarge):
            return _error(413, f"the request body is over {max_request_bytes} bytes (the server's max_request_mb)")
        if isinstance(e, _BadRequest):
            return _error(400, str(e), e.param)
        return _error(400, str(e), _field_of(str(e)))

    async def tokenizer_body(http: HTTPRequest, field: str, check: Callable[[object], bool], shape: str):
        """A /tokenize or /detokenize body whose `field` passes `check`; _BadRequest naming it if not."""
        body = await _json_body(http, max_request_bytes)
        if not isinstance(body, dict) or not check(body.get(field)):
            value = json.dumps(body.get(field) if isinstance(body, dict) else body)[:80]
            raise _BadRequest(field, f"{http.url.path} takes {{{json.dumps(field)}: {shape}}}, got {value}")
        if body.get("model") not in (None, model_name):
            raise _BadRequest("model", f"model {body['model']!r} is not served here; the model is {model_name!r}")
        return body

    tokenizer, special = get_tokenizer(), EOT if eot is not None else None
    tokenizer_info = {"tokenizer_class": "GPT2Tokenizer", "bos_token": special, "eos_token": special,
                      "unk_token": special, "pad_token": None, "model_max_length": engine.cache_length,
                      "vocab_size": engine.config.vocab_size}

    @app.get("/tokenizer_info")
    @app.get("/v1/tokenizer_info")
    async def tokenizer_info_():
        return tokenizer_info

    @app.post("/tokenize")
    @app.post("/v1/tokenize")
    async def tokenize(http: HTTPRequest):
        try:
            body = await tokenizer_body(http, "prompt", lambda p: isinstance(p, str), "text")
        except (_TooLarge, _BadRequest) as e:
            return refusal(e)
        ids = await asyncio.to_thread(tokenizer.encode, body["prompt"], True)  # off the event loop: it may be long
        return {"count": len(ids), "max_model_len": engine.cache_length, "tokens": ids, "token_strs": None}

    @app.post("/detokenize")
    @app.post("/v1/detokenize")
    async def detokenize(http: HTTPRequest):
        in_vocabulary = lambda ids: isinstance(ids, list) and all(  # noqa: E731
            is_int(t) and 0 <= t < tokenizer.vocab_size for t in ids)
        try:
            body = await tokenizer_body(http, "tokens", in_vocabulary, f"a list of token ids in [0, {tokenizer.vocab_size})")
        except (_TooLarge, _BadRequest) as e:
            return refusal(e)
        return {"prompt": await asyncio.to_thread(tokenizer.decode, body["tokens"])}

    def parse(body) -> tuple[list[Request], list[_Choice], dict]:
        if not isinstance(body, dict):
            raise _BadRequest(None, "the request body must be a JSON object")
        if body.get("model") != model_name:
            raise _BadRequest("model", f"model {body.get('model')!r} is not served here; the model is {model_name!r}")
        for name, inert in _UNSUPPORTED.items():
            if body.get(name) not in inert:
                raise _BadRequest(name, f"{name} is not supported by this server (got {json.dumps(body[name])[:80]})")
        raw = _prompt_list(body)
        n = _number(body, "n", 1, int)
        if not 1 <= n <= engine.max_queue:
            raise _BadRequest("n", f"n must be in [1, {engine.max_queue}], got {n}")
        if len(raw) * n > engine.max_queue:  # more than the queue holds could never be admitted
            raise _BadRequest("n", f"{len(raw)} prompts x n={n} is {len(raw) * n} completions; at most "
                                   f"{engine.max_queue} (the server's max_queue) fit in one request")
        prompts = _tokenized(raw)  # after the count: a request of many prompts is refused untokenized
        stop = body.get("stop")
        stop = [stop] if isinstance(stop, str) else stop or []
        if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
            raise _BadRequest("stop", f"stop must be a non-empty string or a list of at most 4, got {json.dumps(stop)[:80]}")
        logprobs = _number(body, "logprobs", None, int)  # None: none; 0: the chosen tokens' own; k: and top k
        echo = False if body.get("echo") is None else body["echo"]
        if not isinstance(echo, bool):
            raise _BadRequest("echo", f"echo must be true or false, got {json.dumps(body['echo'])[:80]}")
        max_tokens = _number(body, "max_tokens", 16, int)
        if max_tokens == 0 and not echo:
            raise _BadRequest("max_tokens", "max_tokens must be >= 1, got 0; 0 only with echo: true, which scores "
                                            "the prompt and generates nothing")
        seed = _number(body, "seed", None, int)
        if seed is None:
            seed = secrets.randbits(32)
        knobs = dict(
            max_tokens=max_tokens, temperature=_number(body, "temperature", 1.0),
            top_p=_number(body, "top_p", None), top_k=_number(body, "top_k", None, int),
            min_p=_number(body, "min_p", None), repetition_penalty=_number(body, "repetition_penalty", 1.0),
            seed=seed, stop_strings=tuple(stop), logprobs=logprobs or 0, stop_tokens=(eot,) if eot is not None else (),
            prompt_logprobs=echo and (logprobs is not None or max_tokens == 0))
        if knobs["top_k"] == 0:
            knobs["top_k"] = None  # a common way to say "no top-k"
        stream = False if body.get("stream") is None else body["stream"]
        if not isinstance(stream, bool):
            raise _BadRequest("stream", f"stream must be true or false, got {body.get('stream')!r}")
        stream_options = {} if body.get("stream_options") is None else body["stream_options"]
        if not isinstance(stream_options, dict) or not isinstance(stream_options.get("include_usage", False), bool):
            raise _BadRequest("stream_options", "stream_options must be an object like {\"include_usage\": true}, "
                                                f"got {json.dumps(body.get('stream_options'))[:80]}")
        requests, choices = [], []
        for i, (prompt, sent) in enumerate(zip(prompts, raw)):
            text = sent if isinstance(sent, str) else get_tokenizer().decode(prompt) if echo else ""
            for j in range(n):
                requests.append(Request(prompt, stream=j, **knobs))
                choices.append(_Choice(i * n + j, prompt, text))
        for request in requests:
            engine.check(request)
        options = {"stream": stream, "logprobs": logprobs, "echo": echo, "prompt_tokens": sum(map(len, prompts)),
                   "include_usage": stream_options.get("include_usage", False)}
        return requests, choices, options

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        arrived = time.monotonic()
        try:
            requests, choices, options = parse(await _json_body(http, max_request_bytes))
        except (_TooLarge, _BadRequest, ConfigError) as e:
            reply = refusal(e)
            metrics.requests.labels(str(reply.status_code)).inc()
            return reply

        loop = asyncio.get_running_loop()
        updates: asyncio.Queue = asyncio.Queue()

        def on_update(choice: _Choice):
            def hook(completion: Completion):  # on the engine's thread
                now = time.monotonic()
                new = len(completion.tokens) - choice.seen_tokens
                choice.seen_tokens = len(completion.tokens)
                if new > 0:
                    metrics.record_tokens(new)
                    if choice.first_token_at is None:
                        choice.first_token_at = now
                        metrics.ttft.observe(now - arrived)
                        new -= 1
                    if new > 0:  # tokens that came together share the gap since the last one
                        for _ in range(new):
                            metrics.itl.observe((now - choice.last_token_at) / new)
                    choice.last_token_at = now
                loop.call_soon_threadsafe(updates.put_nowait, choice)
            return hook

        try:
            for request, choice in zip(requests, choices):
                choice.completion = engine.submit(request, on_update(choice))
        except (QueueFull, EngineStopped) as e:
            for choice in choices:
                if choice.completion is not None:
                    choice.completion.cancel()
            status = 429 if isinstance(e, QueueFull) else 503
            metrics.requests.labels(str(status)).inc()
            return _error(status, str(e), None, "rate_limit_error" if status == 429 else "server_error")
        metrics.requests.labels("200").inc()

        ident, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        header = {"id": ident, "object": "text_completion", "created": created, "model": model_name}
        if options["stream"]:
            return StreamingResponse(_stream(http, header, choices, updates, options), media_type="text/event-stream")
        try:
            while not all(c.completion.done.is_set() for c in choices):
                if await _next_update(http, updates) is None:
                    return Response(status_code=499)  # nobody is listening; the choices are cancelled below
        finally:
            for choice in choices:
                if not choice.completion.done.is_set():
                    choice.completion.cancel()
        out, echo = [], options["echo"]
        for choice in choices:
            c = choice.completion
            scored = (_prompt_scores(choice) if echo else []) + _completion_scores(choice, 0, len(c.tokens), True)
            out.append({"text": (choice.prompt_text if echo else "") + c.text.finish(), "index": choice.index,
                        "finish_reason": c.finish_reason,
                        "logprobs": _logprobs(scored, 0, options["logprobs"]) if options["logprobs"] is not None else None})
        return {**header, "choices": out, "usage": _usage(choices, options["prompt_tokens"])}

    return app


def _usage(choices: list[_Choice], prompt_tokens: int) -> dict:
    completion_tokens = sum(len(c.completion.tokens) for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def _next_update(http: HTTPRequest, updates: asyncio.Queue) -> _Choice | None:
    """The next choice with news, or None once the client has gone away. Starlette cancels a stream whose
    client left, but a plain request's handler is never told: it asks, before each wait and every quarter
    second while waiting."""
    while True:
        if await http.is_disconnected():
            return None
        try:
            return await asyncio.wait_for(updates.get(), timeout=0.25)
        except asyncio.TimeoutError:
            pass


async def _stream(http: HTTPRequest, header: dict, choices: list[_Choice], updates: asyncio.Queue, options: dict):
    """Server-sent events: a chunk per choice per batch of new text, a last chunk per choice with its
    finish_reason, a chunk with the usage and no choices if the client asked for it, then [DONE]. Leaving
    early (the client went away) cancels every choice."""
    logprobs, echo = options["logprobs"], options["echo"]
    finished: set[int] = set()
    offsets = {c.index: 0 for c in choices}
    echoed: set[int] = set()  # the choices whose prompt went out (with `echo`, in their first chunk)
    try:
        while len(finished) < len(choices):
            choice = await _next_update(http, updates)
            if choice is None:
                return
            if choice.index in finished:
                continue
            c = choice.completion
            done = c.done.is_set()
            end = len(c.tokens)
            text = c.text.finish() if done else c.text.take()
            scored = _completion_scores(choice, choice.sent_tokens, end, done)
            if echo and choice.index not in echoed:
                echoed.add(choice.index)
                text, scored = choice.prompt_text + text, (_prompt_scores(choice) if logprobs is not None else []) + scored
            if text or done:
                chunk = {"text": text, "index": choice.index, "finish_reason": c.finish_reason if done else None,
                         "logprobs": _logprobs(scored, offsets[choice.index], logprobs) if logprobs is not None else None}
                choice.sent_tokens = end
                offsets[choice.index] += len(text)
                yield f"data: {json.dumps({**header, 'choices': [chunk]})}\n\n"
            if done:
                finished.add(choice.index)
        if options["include_usage"]:
            yield f"data: {json.dumps({**header, 'choices': [], 'usage': _usage(choices, options['prompt_tokens'])})}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        for choice in choices:
            if not choice.completion.done.is_set():
                choice.completion.cancel()


def _listen(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), for uvicorn to listen on; ConfigError naming the flags when the
    address cannot be had (taken, not this machine's, not an address)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except (socket.gaierror, UnicodeError) as e:
        raise ConfigError(f"--host {host!r} is not an address to listen on: {e}") from None
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: a restart reuses the port
    # Connections accepted from it inherit TCP_NODELAY. Without it, on the asyncio loop serve.py runs, a reply
    # written in two pieces (headers, then body) waited for the client's delayed ACK: 40 ms per request.
    listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        listener.bind((host, port))
    except OSError as e:
        listener.close()
        raise ConfigError(f"cannot listen on --host {host} --port {port}: {e.strerror}") from None
    return listener


def serve(config: ServeConfig) -> None:
    """Load the model, build and warm up the engine, and serve until SIGINT or SIGTERM. Settings are checked
    before anything loads or compiles. The port is taken and the engine warmed up before uvicorn handles
    the signals: until then a signal stops serve.py at once (`gpt.errors.cli_main`)."""
    for name in ("slots", "max_queue", "steps_per_call"):
        if getattr(config, name) < 1:
            raise ConfigError(f"ServeConfig.{name} must be >= 1, got {getattr(config, name)}")
    if config.prefix_cache_tokens < 0:
        raise ConfigError(f"--prefix_cache_tokens must be >= 0, got {config.prefix_cache_tokens}")
    if config.prefill_chunk < MIN_PROMPT_BUCKET:
        raise ConfigError(f"--prefill_chunk must be >= {MIN_PROMPT_BUCKET}, got {config.prefill_chunk}")
    if not 0 <= config.port <= 65535:
        raise ConfigError(f"--port must be in [0, 65535], got {config.port}")
    if not config.shutdown_deadline_s >= 0:
        raise ConfigError(f"--shutdown_deadline_s must be >= 0, got {config.shutdown_deadline_s}")
    if not 0 < config.max_request_mb < math.inf:
        raise ConfigError(f"--max_request_mb must be positive and finite, got {config.max_request_mb}")
    mesh = make_mesh(**parse_mesh(config.mesh)) if config.mesh else None
    with _listen(config.host, config.port) as listener:  # a taken port fails now, not after the warm-up
        _load_and_serve(config, listener, mesh)


def _load_and_serve(config: ServeConfig, listener: socket.socket, mesh: Mesh | None) -> None:
    import uvicorn

    from gpt.compilation_cache import enable_compilation_cache
    from gpt.loading import load

    enable_compilation_cache(config.compile_cache)
    log = lambda line: print(line, flush=True)  # noqa: E731
    # Loading and warm-up run before uvicorn takes the signals (a GPT-2 warm-up takes 20-40 s on a CPU), so
    # that one stops serve.py at once (`cli_main`), not after the warm-up.
    model = load(config.init_from, config.dtype)
    engine = Engine(model, slots=config.slots, cache_length=config.cache_length, max_queue=config.max_queue,
                    steps_per_call=config.steps_per_call, prefill_chunk=config.prefill_chunk,
                    prefix_cache_tokens=config.prefix_cache_tokens,
                    quantize=config.quantize, mesh=mesh)
    engine.warmup(log)
    name = config.model_name or Path(config.init_from.rstrip("/")).name
    app = create_app(engine, name, warmup=False, shutdown_deadline_s=config.shutdown_deadline_s,
                     max_request_bytes=int(config.max_request_mb * 2**20), log=log)
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                                           timeout_graceful_shutdown=config.shutdown_deadline_s))

    async def main():
        task = asyncio.create_task(server.serve(sockets=[listener]))
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            port = listener.getsockname()[1]
            over = f", over a mesh {' x '.join(f'{k}={v}' for k, v in mesh.shape.items())}" if mesh is not None else ""
            print(f"serving {name!r} on http://{config.host}:{port}/v1 ({engine.num_slots} slots{over})", flush=True)
        await task

    asyncio.run(main())
