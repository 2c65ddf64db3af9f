"""A decoder-only GPT in JAX and Flax NNX."""

from gpt.config import GPTConfig
from gpt.kv_cache import KVCache
from gpt.model import GPT

__all__ = ["GPT", "GPTConfig", "KVCache"]
