"""The OpenAI-compatible completions API over one `gpt.inference.engine.Engine`, as an ASGI app.

    POST /v1/completions   prompt (a string, strings, token ids, or lists of them), max_tokens,
                           temperature, top_p, n, stop, seed, stream (server-sent events), logprobs,
                           echo (the prompt before the completion, its tokens scored when logprobs is
                           given; with max_tokens 0 the prompt is only scored), and the extras top_k,
                           min_p, repetition_penalty
    POST /v1/chat/completions  messages (system, developer, user, assistant; content as text or text parts)
                           rendered by the model's chat template, max_tokens / max_completion_tokens,
                           temperature, top_p, n, stop, seed, stream (delta chunks), logprobs and
                           top_logprobs, chat_template_kwargs (`gpt.serve.chat_protocol`)
    GET  /v1/models        the one model served (and /v1/models/NAME: it, or 404)
    GET  /tokenizer_info   the tokenizer's special tokens and the context (as vLLM answers it)
    POST /tokenize         {"prompt": text, "add_special_tokens": true} -> {"tokens": ids, "count", "max_model_len"}
    POST /detokenize       {"tokens": ids} -> {"prompt": text}   (all three under /v1 too)
    GET  /health           200 while serving, 503 while shutting down
    GET  /metrics          Prometheus: queue depth, live slots, tokens, tokens/s, time to first token,
                           inter-token latency, completion requests by status
    GET  /                 the playground page (`gpt.serve.playground`), unless playground=False

Text becomes tokens as the engine's tokenizer makes them, Hugging Face's GPT-2 tokenizer's or a model's own
tokenizer.json's (a special token's text in a prompt is the special token: GPT-2's `<|endoftext|>`, 50256),
the same in completions and /tokenize, so that a client that counts tokens (lm-evaluation-harness) counts
what is scored. The engine runs on a thread of its own; each request waits
on an asyncio queue that the engine's thread feeds. Bodies are parsed and prompts tokenized off the event
loop (`gpt.serve.protocol`), so a long prompt holds up no stream. Every error, expected or not, becomes
OpenAI's error JSON in one place (`error_reply`): 400 naming the field, 401 without the API key, 413 for
a body over the limit, 429 for a full queue, 503 while shutting down, 500 only for a bug. A client that
disconnects cancels its requests, waiting or running.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import time
import uuid
from collections.abc import Callable, Sequence

import prometheus_client
from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from gpt.chat_template import ChatTemplate
from gpt.inference.completion import Completion
from gpt.inference.engine import Engine
from gpt.inference.scheduler import EngineStopped, QueueFull
from gpt.serve.chat_protocol import parse_chat
from gpt.serve.metrics import Metrics
from gpt.serve.playground import PAGE_PATHS, add_playground_routes
from gpt.serve.protocol import ApiError, Limits, parse_completion, parse_detokenize, parse_tokenize
from gpt.serve.replies import Choice, choice_json, stream_events, usage, wait_for_update

__all__ = ["create_app", "error_reply", "OPEN_PATHS"]

# Answered without the API key: probes, scrapers, and the playground's files (no model data; its requests
# to the API carry the key).
OPEN_PATHS = ("/health", "/metrics", *PAGE_PATHS)
_ROUTES = ("POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /tokenizer_info, POST /tokenize, "
           "POST /detokenize, "
           "GET /openapi.json, GET /health, GET /metrics and GET / (the playground)")
# Parsing a body this small on the event loop costs less than handing it to a thread.
_INLINE_BODY_BYTES = 16 << 10


def error_reply(error: BaseException) -> JSONResponse:
    """The one mapping from an error, expected or not, to a status and OpenAI's error JSON."""
    if isinstance(error, ApiError):
        api = error
    elif isinstance(error, QueueFull):
        api = ApiError(429, str(error), None, "rate_limit_error")
    elif isinstance(error, EngineStopped):
        api = ApiError(503, str(error), None, "server_error")
    elif isinstance(error, ClientDisconnect):  # nobody reads this reply; the status counts it
        api = ApiError(499, "the client disconnected before the request's body arrived")
    else:  # a bug: logged with its traceback, answered as JSON, and nothing else ends
        logging.getLogger(__name__).error("a request failed on a bug", exc_info=error)
        api = ApiError(500, f"internal error ({type(error).__name__}); the server's log has the details", None,
                       "server_error")
    return JSONResponse(api.json(), status_code=api.status)


class _RequireKey:
    """ASGI middleware: a request without `Authorization: Bearer <key>` gets 401 (OpenAI's error JSON)
    before anything reads its body; OPEN_PATHS stay open. The key is compared in constant time."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._authorized(scope):
            return await self.app(scope, receive, send)
        reply = error_reply(ApiError(401, "a valid API key is required: send the header 'Authorization: Bearer "
                                          "<key>' (the OpenAI clients send their api_key so)", None,
                                     "authentication_error"))
        await reply(scope, receive, send)

    def _authorized(self, scope) -> bool:
        given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
        return hmac.compare_digest(given, self.expected)


async def _read_body(http: HTTPRequest, limit: int) -> bytes:
    """The request's body; ApiError 413 as soon as it is known to pass `limit` bytes (from its declared
    length, or while it arrives), so a huge body is never held in memory."""
    too_large = ApiError(413, f"the request body is over {limit} bytes (the server's max_request_mb)")
    declared = http.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in http.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def _off_the_loop(parse: Callable, raw: bytes, limits: Limits, inline_bytes: int = _INLINE_BODY_BYTES):
    """parse(raw, limits), on a worker thread when the body is larger than `inline_bytes` (a long prompt takes a
    while to tokenize: on the event loop it would hold up every stream and /health)."""
    if len(raw) <= inline_bytes:
        return parse(raw, limits)
    return await asyncio.to_thread(parse, raw, limits)


@dataclasses.dataclass(frozen=True)
class _Served:
    """What the routes share: the engine, the model's name, the request limits, the metrics, the body limit."""

    engine: Engine
    model_name: str
    limits: Limits
    metrics: Metrics
    max_request_bytes: int


def create_app(engine: Engine, model_name: str, *, warmup: bool = True, shutdown_deadline_s: float = 10.0,
               max_request_bytes: int = 8 << 20, api_key: str | None = None, playground: bool = True,
               log: Callable[[str], None] = print, status_interval_s: float = 0.0,
               end_of_turn: Sequence[int] = ()) -> FastAPI:
    """The ASGI app over `engine`. Its lifespan warms the engine up and starts its thread, and at shutdown
    stops it (running requests get up to `shutdown_deadline_s`, then end with finish_reason "abort"). A
    body over `max_request_bytes` gets 413; with `api_key`, a request without it gets 401. `playground`
    serves the page at `/`. With `status_interval_s`, a status line (`Metrics.status_line`) goes to `log` that
    often while anything changes. A chat reply ends at the tokenizer's end of text and at `end_of_turn`'s ids
    (`gpt.loading.end_of_turn_of`: an instruct model's)."""
    tokenizer = engine.tokenizer
    eot = tokenizer.eot_id if tokenizer.eot_id is not None and engine.config.vocab_size > tokenizer.eot_id else None
    stops = tuple(dict.fromkeys([*([] if eot is None else [eot]), *end_of_turn]))
    limits = Limits(model_name, engine.config.vocab_size, engine.cache_length, engine.max_queue,
                    engine.max_stop_tokens, eot, tokenizer, ChatTemplate.of(tokenizer), stops)
    served = _Served(engine, model_name, limits, Metrics(engine), max_request_bytes)
    state = {"serving": False}

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if warmup:
            await asyncio.to_thread(engine.warmup, log)
        engine.start()
        state["serving"] = True
        status = (asyncio.create_task(_status_lines(served.metrics, status_interval_s, log))
                  if status_interval_s else None)
        try:
            yield
        finally:
            state["serving"] = False
            if status is not None:
                status.cancel()
            await asyncio.to_thread(engine.stop, shutdown_deadline_s)

    # No documentation pages: FastAPI's load their scripts from a third-party CDN, on a server built to face
    # untrusted clients. The API's description, /openapi.json, is served as JSON, behind the key if one is set.
    app = FastAPI(title="gpt", lifespan=lifespan, docs_url=None, redoc_url=None)
    if api_key:
        app.add_middleware(_RequireKey, api_key=api_key)
    _add_error_handlers(app)
    _add_info_routes(app, served, state)
    _add_tokenizer_routes(app, served)
    if playground:
        add_playground_routes(app)

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        return await _answered(http, served, parse_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest):
        return await _answered(http, served, parse_chat)

    return app


async def _status_lines(metrics: Metrics, every_s: float, log: Callable[[str], None]) -> None:
    """`metrics.status_line()` to `log` every `every_s` seconds, when it differs from the last one printed (an
    idle server prints nothing)."""
    last = metrics.status_line()
    while True:
        await asyncio.sleep(every_s)
        line = metrics.status_line()
        if line != last:
            log(line)
            last = line


def _add_error_handlers(app: FastAPI) -> None:
    """Errors raised anywhere (ApiError, a route that does not exist, a bug) become `error_reply`'s JSON."""
    @app.exception_handler(Exception)
    async def unexpected(http: HTTPRequest, error: Exception):
        return error_reply(error)

    @app.exception_handler(ApiError)
    async def refused(http: HTTPRequest, error: ApiError):
        return error_reply(error)

    @app.exception_handler(StarletteHTTPException)
    async def no_such_route(http: HTTPRequest, error: StarletteHTTPException):  # an unknown route or method
        message = f"{http.method} {http.url.path}: {error.detail}; this server answers {_ROUTES}"
        reply = error_reply(ApiError(error.status_code, message))
        reply.headers.update(error.headers or {})  # a 405's Allow
        return reply


def _add_info_routes(app: FastAPI, served: _Served, state: dict) -> None:
    """/health, /v1/models and /metrics."""
    engine, model_name = served.engine, served.model_name

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
            raise ApiError(404, f"model {name!r} is not served here; the model is {model_name!r}", "model")
        return card

    @app.get("/metrics")
    async def prometheus():
        return Response(prometheus_client.generate_latest(served.metrics.registry),
                        media_type=prometheus_client.CONTENT_TYPE_LATEST)


def _add_tokenizer_routes(app: FastAPI, served: _Served) -> None:
    """/tokenizer_info, /tokenize and /detokenize (and under /v1), as vLLM answers them."""
    limits, cache_length = served.limits, served.engine.cache_length
    tokenizer = limits.tokenizer
    specials = tokenizer.special_tokens() if limits.eot is not None else dict.fromkeys(("bos_token", "eos_token",
                                                                                          "unk_token"))
    info = {"tokenizer_class": tokenizer.hf_class, **specials, "pad_token": None, "model_max_length": cache_length,
            "vocab_size": limits.vocab_size}

    @app.get("/tokenizer_info")
    @app.get("/v1/tokenizer_info")
    async def tokenizer_info():
        return info

    @app.post("/tokenize")
    @app.post("/v1/tokenize")
    async def tokenize(http: HTTPRequest):
        text, add_special = await _off_the_loop(parse_tokenize, await _read_body(http, served.max_request_bytes),
                                                limits)

        def reply() -> bytes:  # off the event loop: a long text takes a while to tokenize and to write out
            ids = tokenizer.encode(text, True, add_special)
            return json.dumps({"count": len(ids), "max_model_len": cache_length, "tokens": ids,
                               "token_strs": None}).encode()

        return Response(await asyncio.to_thread(reply), media_type="application/json")

    @app.post("/detokenize")
    @app.post("/v1/detokenize")
    async def detokenize(http: HTTPRequest):
        ids = await _off_the_loop(parse_detokenize, await _read_body(http, served.max_request_bytes), limits)
        reply = await asyncio.to_thread(lambda: json.dumps({"prompt": tokenizer.decode(ids)}).encode())
        return Response(reply, media_type="application/json")


async def _answered(http: HTTPRequest, served: _Served, parse) -> Response:
    """A completions or chat request's reply, whatever happens (an error as `error_reply` answers it), counted."""
    try:
        reply = await _complete(http, served, parse)
    except Exception as error:  # every failure, expected or not, answered and counted here
        reply = error_reply(error)
    served.metrics.requests.labels(str(reply.status_code)).inc()
    return reply


async def _complete(http: HTTPRequest, served: _Served, parse) -> Response:
    """A /v1/completions or /v1/chat/completions request, read by `parse`: submitted, then streamed or answered
    whole; raises what `error_reply` answers."""
    arrived = time.monotonic()
    inline = 0 if parse is parse_chat else _INLINE_BODY_BYTES  # a chat template may run up to RENDER_SECONDS
    parsed = await _off_the_loop(parse, await _read_body(http, served.max_request_bytes), served.limits, inline)
    choices = [Choice(i, r.prompt, text) for i, (r, text) in enumerate(zip(parsed.requests, parsed.prompt_texts))]
    updates: asyncio.Queue = asyncio.Queue()
    hook = _updates_hook(served.metrics, arrived, updates, asyncio.get_running_loop())
    try:
        for request, choice in zip(parsed.requests, choices):
            choice.completion = served.engine.submit(request, hook(choice))
    except Exception:
        _cancel(choices)
        raise

    kind = ("chatcmpl", "chat.completion.chunk" if parsed.stream else "chat.completion") if parsed.chat else \
        ("cmpl", "text_completion")
    header = {"id": f"{kind[0]}-{uuid.uuid4().hex}", "object": kind[1], "created": int(time.time()),
              "model": served.model_name}
    next_update = lambda: wait_for_update(updates, http.is_disconnected)  # noqa: E731
    if parsed.stream:
        return StreamingResponse(_cancelling(stream_events(header, choices, parsed, next_update), choices),
                                 media_type="text/event-stream")
    try:
        while not all(c.completion.done.is_set() for c in choices):
            if await next_update() is None:
                return Response(status_code=499)  # nobody is listening; the choices are cancelled below
    finally:
        _cancel(choices)
    cut = sum(c.completion.finish_reason == "abort" for c in choices)
    if cut:
        raise ApiError(503, f"the server shut down before {cut} of the request's {len(choices)} completions "
                            "ended (finish_reason abort); retry on another server", None, "server_error")
    return JSONResponse({**header, "choices": [choice_json(c, parsed) for c in choices],
                         "usage": usage(choices, parsed.prompt_tokens)})


def _cancel(choices: list[Choice]) -> None:
    """Cancel the choices that have not ended (waiting ones leave the queue at once)."""
    for choice in choices:
        if choice.completion is not None and not choice.completion.done.is_set():
            choice.completion.cancel()


async def _cancelling(events, choices: list[Choice]):
    """`events`, and once they end, however they end (the client went away), the choices cancelled."""
    try:
        async for event in events:
            yield event
    finally:
        _cancel(choices)


def _updates_hook(metrics: Metrics, arrived: float, updates: asyncio.Queue, loop: asyncio.AbstractEventLoop):
    """For each choice, the Completion's on_update: counts its new tokens in the metrics (time to first
    token, inter-token latency) and wakes its handler, from the engine's thread."""
    def on_update(choice: Choice):
        def hook(completion: Completion):
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
    return on_update
