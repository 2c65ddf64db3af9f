"""A decoder-only GPT in JAX and Flax NNX."""

from gpt.model import gpt2
from gpt.model.config import GPTConfig
from gpt.model.kv_cache import KVCache
from gpt.model.transformer import GPT

__all__ = ["GPT", "GPTConfig", "KVCache", "gpt2"]
