"""The OpenAI-compatible completions server: the request parser (`protocol`, pure), the replies
(`replies`), the metrics, the ASGI app (`app`) and `serve.py`'s server with its connection limits and
graceful shutdown (`server`)."""

from gpt.serve.app import create_app
from gpt.serve.config import ServeConfig
from gpt.serve.server import serve

__all__ = ["ServeConfig", "create_app", "serve"]
