"""A server on 127.0.0.1 with an ephemeral port, for the tests that drive it with real clients."""

import socket
import threading
import time

import jax
import openai
from flax import nnx

from gpt import GPT, GPTConfig
from gpt.generate import generate_text
from gpt.inference.engine import Engine
from gpt.inference.sampling import GREEDY
from gpt.serve import ServeConfig, create_app
from gpt.serve.server import GracefulServer, uvicorn_config

EOT = 50256


def alone(model, prompt: str, max_tokens: int) -> str:
    """What a greedy completion of `prompt` is with no server: the reference for what the server answers."""
    return generate_text(model, [prompt], max_tokens, sampling=GREEDY, stop_tokens=[EOT])[0]


def decisive_model(vocab_size: int = 50257) -> GPT:
    """A tiny model with GPT-2's vocabulary (so text round-trips; or `vocab_size`) and scaled weights (varied
    greedy paths, no ties)."""
    model = GPT(GPTConfig.preset("tiny", vocab_size=vocab_size, block_size=128), rngs=nnx.Rngs(0))
    state = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda p: p * 4.0 if p.ndim >= 2 else p, state))
    return model


class Server:
    """serve.py's server (its connection limits and graceful shutdown) on a thread, on an ephemeral port;
    `settings`: ServeConfig fields (api_key, max_connections, header_timeout_s, shutdown_deadline_s, ...).
    `delay_s` slows each engine round (to hold requests in flight); stop() always ends it. `warmup=False`
    starts it without compiling every program first (each compiles at its first use instead). `end_of_turn`:
    the ids a chat reply ends at beside the tokenizer's end of text."""

    def __init__(self, model, settings: dict | None = None, warmup: bool = True, end_of_turn=(), **engine_args):
        self.engine = Engine(model, **engine_args)
        self.delay_s = 0.0
        step = self.engine.step
        self.engine.step = lambda: (time.sleep(self.delay_s), step())[1]
        self.lines = []
        self.settings = ServeConfig(**{"shutdown_deadline_s": 2, **(settings or {})})
        app = create_app(self.engine, "tiny", warmup=warmup, log=self.lines.append, api_key=self.settings.api_key,
                         shutdown_deadline_s=self.settings.shutdown_deadline_s,
                         playground=not self.settings.no_playground,
                         status_interval_s=self.settings.status_interval_s, end_of_turn=end_of_turn)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = GracefulServer(uvicorn_config(app, self.settings), self.engine, self.settings.shutdown_deadline_s)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        while not self.server.started:
            assert self.thread.is_alive(), "the server did not start"
            time.sleep(0.05)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=self.settings.api_key or "unused", max_retries=0)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)
