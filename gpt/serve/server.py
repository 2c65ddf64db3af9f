"""`serve.py`: load a model, warm its engine up, and serve the app on uvicorn with the limits a server
facing untrusted clients needs.

- **Connections are bounded** (`LimitedHTTP`): at most `max_connections` open (one more is answered 503
  and closed at once, so that no client can take the process's file descriptors), each must send a
  request's headers within `header_timeout_s` of opening (or of its last reply), and an idle keep-alive
  connection closes after `keep_alive_s`. Should the process run out of descriptors all the same, the
  listening socket sheds each new connection at once with one warning a second (`_SheddingSocket`),
  where asyncio's accept loop would retry in a burst and log a traceback per try.
- **Shutdown ends every request** (`GracefulServer`): on SIGTERM or SIGINT the engine admits nothing new;
  what runs or waits gets `shutdown_deadline_s` to finish, then ends at once (a stream's last event says
  finish_reason "abort", then `[DONE]`; a plain request gets 503) before uvicorn closes the connections,
  and the process exits 143 (SIGTERM) or 130 (SIGINT).
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import ipaddress
import json
import logging
import math
import os
import resource
import socket
import time
from pathlib import Path

import uvicorn
from jax.sharding import Mesh
from uvicorn.protocols.http.h11_impl import H11Protocol

from gpt.errors import ConfigError
from gpt.inference.device_slots import FIT_ADVICE
from gpt.inference.engine import Engine
from gpt.model.sharding import devices_of, make_mesh, parse_mesh
from gpt.serve.app import create_app
from gpt.serve.config import ServeConfig
from gpt.serve.protocol import ApiError

__all__ = ["serve", "LimitedHTTP", "GracefulServer", "uvicorn_config"]

API_KEY_VARIABLE = "GPT_API_KEY"


def _busy_reply() -> bytes:
    body = json.dumps(ApiError(503, "the server has as many connections open as it takes (--max_connections); "
                                    "retry later", None, "server_error").json()).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body))


class LimitedHTTP(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a cap on open connections and a deadline for each request's
    headers (uvicorn has neither: a client that never finishes its headers would hold its connection
    forever). Made per server by `limited_http`."""

    max_connections = 256
    header_timeout_s = 10.0

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._header_deadline = None
        if len(self.connections) > self.max_connections:
            transport.write(_busy_reply())
            transport.close()
            return
        self._await_headers()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._in_request():
            self._cancel_deadline()
        else:  # part of a request's headers: the deadline runs from the connection's start or last reply
            self._await_headers()

    def connection_lost(self, exc) -> None:
        self._cancel_deadline()
        super().connection_lost(exc)

    def _in_request(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _await_headers(self) -> None:
        if self._header_deadline is None:
            self._header_deadline = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _cancel_deadline(self) -> None:
        if getattr(self, "_header_deadline", None) is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_late(self) -> None:
        self._header_deadline = None
        if not self._in_request():
            self.transport.close()


def limited_http(max_connections: int, header_timeout_s: float) -> type[LimitedHTTP]:
    """`LimitedHTTP` with these limits."""
    return type("LimitedHTTP", (LimitedHTTP,), {"max_connections": max_connections,
                                                "header_timeout_s": header_timeout_s})


class GracefulServer(uvicorn.Server):
    """uvicorn's server, whose shutdown ends every request by the deadline instead of cutting them: the
    engine drains at once and aborts what is left at `shutdown_deadline_s`, before uvicorn's own graceful
    timeout (a few seconds later) would cancel the handlers mid-reply."""

    def __init__(self, config: uvicorn.Config, engine: Engine, shutdown_deadline_s: float):
        super().__init__(config)
        self.engine, self.shutdown_deadline_s = engine, shutdown_deadline_s

    async def shutdown(self, sockets=None) -> None:
        self.engine.drain()
        loop = asyncio.get_running_loop()
        abort = loop.call_later(self.shutdown_deadline_s, self.engine.abort)
        try:
            await super().shutdown(sockets)
        finally:
            abort.cancel()


def uvicorn_config(app, config: ServeConfig) -> uvicorn.Config:
    """uvicorn's settings for `config`: its limits, a graceful timeout past the shutdown deadline (the
    engine ends the requests first), and warnings only."""
    return uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                          http=limited_http(config.max_connections, config.header_timeout_s),
                          timeout_keep_alive=config.keep_alive_s,
                          timeout_graceful_shutdown=config.shutdown_deadline_s + 5)


class _SheddingSocket(socket.socket):
    """A listening socket that, when the process is out of file descriptors, sheds the connection it cannot
    take: a spare descriptor is freed to accept it and close it at once (its client sees the connection
    reset), with one warning line a second at most. Without it asyncio's accept loop, which keeps
    retrying (and re-arming a retry per attempt) while the descriptors stay short, filled the log with
    tracebacks and kept a core busy."""

    spare: int | None = None
    warned_at = -math.inf

    def accept(self):
        try:
            return super().accept()
        except OSError as error:
            if error.errno not in (errno.EMFILE, errno.ENFILE) or self.spare is None:
                raise
            self._shed(error)
            raise BlockingIOError(errno.EAGAIN, "shed a connection: out of file descriptors") from None

    def _shed(self, error: OSError) -> None:
        os.close(self.spare)
        try:
            connection, _ = super().accept()
            connection.close()
        except OSError:
            pass
        try:
            self.spare = os.open(os.devnull, os.O_RDONLY)
        except OSError:
            self.spare = None  # taken meanwhile: from now on asyncio's own handling
        if time.monotonic() - self.warned_at >= 1:
            self.warned_at = time.monotonic()
            logging.getLogger(__name__).warning("out of file descriptors (%s): closing new connections at once",
                                                error.strerror)

    def close(self) -> None:
        if self.spare is not None:
            os.close(self.spare)
            self.spare = None
        super().close()


def _listen(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), for uvicorn to listen on; ConfigError naming the flags when the
    address cannot be had (taken, not this machine's, not an address)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except (socket.gaierror, UnicodeError) as e:
        raise ConfigError(f"--host {host!r} is not an address to listen on: {e}") from None
    listener = _SheddingSocket(family, socket.SOCK_STREAM)
    listener.spare = os.open(os.devnull, os.O_RDONLY)
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


def _file_descriptors(max_connections: int) -> None:
    """Raise the process's descriptor limit to its hard limit, and refuse a --max_connections it could not
    hold (with room for the model's files and the engine's own)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    room = soft - 128
    if max_connections > room:
        raise ConfigError(f"--max_connections {max_connections} is more than this process's {soft} file "
                          f"descriptors hold (at most {room})")


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def serve(config: ServeConfig) -> None:
    """Load the model, build and warm up the engine, and serve until SIGINT or SIGTERM. Settings are checked
    before anything loads or compiles. The port is taken and the engine warmed up before uvicorn handles
    the signals: until then a signal stops serve.py at once (`gpt.errors.cli_main`)."""
    config.check()
    if config.compile_only:
        _compile_only(config)
        return
    if config.api_key is None and os.environ.get(API_KEY_VARIABLE):
        config = dataclasses.replace(config, api_key=os.environ[API_KEY_VARIABLE])
    _file_descriptors(config.max_connections)
    mesh = make_mesh(**parse_mesh(config.mesh)) if config.mesh else None
    with _listen(config.host, config.port) as listener:  # a taken port fails now, not after the warm-up
        _check_state_fits(config, mesh)
        _load_and_serve(config, listener, mesh)


def _check_state_fits(config: ServeConfig, mesh: Mesh | None) -> None:
    """The engine's keys and values against the devices' memory from the model's config alone, before anything
    loads (`EngineSettings.check_state_fits`; the engine checks again as it is made)."""
    from gpt.loading import model_config_of

    model_config = model_config_of(config.init_from, config.dtype)
    devices = devices_of(mesh)
    settings = dataclasses.replace(config.engine, draft="none")  # a draft named by path is loaded later
    settings.checked(model_config).check_state_fits(model_config, devices, FIT_ADVICE)


def _compile_only(config: ServeConfig) -> None:
    """The engine's largest programs compiled for the topology `config.compile_only` names, reported; ConfigError
    when one does not fit a chip."""
    from gpt.hardware import parse_topology
    from gpt.inference.compile_only import FIT_ADVICE, compile_engine
    from gpt.inference.speculation import names_a_model
    from gpt.loading import model_config_of
    from gpt.model.transformer import model_summary
    from gpt.program_report import compiling_line

    model_config = model_config_of(config.init_from, config.dtype)
    draft = config.engine.draft
    draft_config = model_config_of(draft, config.dtype) if names_a_model(draft) else None
    mesh = make_mesh(**parse_mesh(config.mesh), devices=parse_topology(config.compile_only).devices())
    setting = f"--compile_only {config.compile_only}"
    weights = f"{config.quantize} weights" if config.quantize != "none" else "its weights"
    drafting = f", drafting with {config.engine.draft}" if config.engine.draft != "none" else ""
    print(compiling_line(setting, f"the engine's prefill and decode for {model_summary(model_config)}: {weights}, compute {config.dtype}, "
                                  f"{config.engine.slots} slots{drafting}", list(mesh.devices.flat), dict(mesh.shape)),
          flush=True)
    for report in compile_engine(model_config, config.engine, config.quantize, mesh, setting, draft_config):
        print("\n".join(report.lines(config.verbose)), flush=True)
        report.check_fits(setting, FIT_ADVICE)


def _load_and_serve(config: ServeConfig, listener: socket.socket, mesh: Mesh | None) -> None:
    from gpt.compilation_cache import enable_compilation_cache
    from gpt.loading import end_of_turn_of, load, load_draft, tokenizer_of

    enable_compilation_cache(config.compile_cache)
    log = lambda line: print(line, flush=True)  # noqa: E731
    # Loading and warm-up run before uvicorn takes the signals (a GPT-2 warm-up takes 20-40 s on a CPU), so
    # that one stops serve.py at once (`cli_main`), not after the warm-up.
    tokenizer = tokenizer_of(config.init_from)  # the model's own where it has one (Llama's, Qwen's), else GPT-2's
    draft = load_draft(config.engine.draft, config.dtype, tokenizer)
    model = load(config.init_from, config.dtype)
    engine = Engine(model, config.engine, quantize=config.quantize, mesh=mesh, draft=draft, tokenizer=tokenizer)
    engine.warmup(log)
    name = config.model_name or Path(config.init_from.rstrip("/")).name
    app = create_app(engine, name, warmup=False, shutdown_deadline_s=config.shutdown_deadline_s,
                     max_request_bytes=int(config.max_request_mb * 2**20), api_key=config.api_key,
                     playground=not config.no_playground, log=log, status_interval_s=config.status_interval_s,
                     end_of_turn=end_of_turn_of(config.init_from))
    server = GracefulServer(uvicorn_config(app, config), engine, config.shutdown_deadline_s)

    async def main():
        task = asyncio.create_task(server.serve(sockets=[listener]))
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            for line in startup_lines(config, name, listener.getsockname()[1], engine.num_slots, mesh):
                print(line, flush=True)
        await task

    asyncio.run(main())  # uvicorn re-raises the signal that stopped it: `cli_main` exits 128 + its number


def startup_lines(config: ServeConfig, name: str, port: int, slots: int, mesh: Mesh | None) -> list[str]:
    """What serve.py prints once it serves: where, a warning when an address beyond this machine is served
    with no API key, and the playground's address."""
    over = f", over a mesh {' x '.join(f'{k}={v}' for k, v in mesh.shape.items())}" if mesh is not None else ""
    key = ", API key required" if config.api_key else ""
    lines = [f"serving {name!r} on http://{config.host}:{port}/v1 ({slots} slots{over}{key})"]
    if not config.api_key and not _is_loopback(config.host):
        lines.append(f"warning: serving {config.host} beyond this machine with no API key: anyone who can reach the "
                     f"port gets completions (--api_key, or {API_KEY_VARIABLE})")
    if not config.no_playground:
        lines.append(f"playground (in a browser): http://{config.host}:{port}/")
    return lines
