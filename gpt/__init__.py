"""A decoder-only GPT in JAX and Flax NNX.

Its public names load on first use (`from gpt import GPT` imports JAX then), so that a command line's first
import, `gpt.errors`, takes its signals before JAX's import: a Ctrl-C then is one line, not a traceback."""

import importlib

__all__ = ["GPT", "GPTConfig", "KVCache", "gpt2"]

_HOMES = {"GPT": "gpt.model.transformer", "GPTConfig": "gpt.model.config", "KVCache": "gpt.model.kv_cache"}


def __getattr__(name: str):
    if name == "gpt2":
        return importlib.import_module("gpt.model.gpt2")
    if name not in _HOMES:
        raise AttributeError(f"module 'gpt' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
