"""`serve.py`'s settings, each a flag, checked before anything loads."""

from __future__ import annotations

import dataclasses
import math

from gpt.errors import ConfigError
from gpt.inference.shapes import MIN_PROMPT_BUCKET
from gpt.inference.speculation import DEFAULT_DRAFT_TOKENS, Draft, check_draft
from gpt.loading import ModelChoice

__all__ = ["ServeConfig"]


@dataclasses.dataclass(frozen=True)
class ServeConfig(ModelChoice):
    """`python serve.py --help` lists these as flags (which model and how: `ModelChoice`)."""

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
    max_request_mb: float = 8.0
    """A larger request body gets HTTP 413, unread (64 prompts of 1024 token ids each are ~0.5 MB)."""
    shutdown_deadline_s: float = 10.0
    """On SIGTERM, how long running and waiting requests may take to finish; then each ends at once
    (a stream's last event has finish_reason "abort", a plain request gets 503)."""
    compile_cache: bool = True
    """Keep compiled programs in the user's cache directory, so that a restart skips most of the warm-up."""
    api_key: str | None = None
    """Answer only requests that send 'Authorization: Bearer KEY' (others get 401; /health and /metrics stay
    open). The environment variable GPT_API_KEY sets it too, out of the process listing."""
    max_connections: int = 256
    """Open connections at most; one more is answered 503 and closed at once."""
    header_timeout_s: float = 10.0
    """A connection that has not sent a whole request's headers this long after it opened (or after its
    last reply) is closed."""
    keep_alive_s: float = 5.0
    """An idle keep-alive connection is closed after this long."""
    no_playground: bool = False
    """Serve no playground page at / (the API alone)."""
    draft: Draft = "none"
    """Guess each request's next tokens and verify them a few at once (the same tokens, sooner where the
    guesses stand), at the widths where that has measured faster: ngram from its prompt and output, int8
    by the model's own weights in int8."""
    draft_tokens: int = DEFAULT_DRAFT_TOKENS
    """The most guessed tokens one step verifies."""

    def check(self) -> None:
        """ConfigError naming the first setting out of its bound (before anything loads)."""
        for name in ("slots", "max_queue", "steps_per_call", "max_connections"):
            if getattr(self, name) < 1:
                raise ConfigError(f"ServeConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.prefix_cache_tokens < 0:
            raise ConfigError(f"--prefix_cache_tokens must be >= 0, got {self.prefix_cache_tokens}")
        if self.prefill_chunk < MIN_PROMPT_BUCKET:
            raise ConfigError(f"--prefill_chunk must be >= {MIN_PROMPT_BUCKET}, got {self.prefill_chunk}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be in [0, 65535], got {self.port}")
        if not self.shutdown_deadline_s >= 0:
            raise ConfigError(f"--shutdown_deadline_s must be >= 0, got {self.shutdown_deadline_s}")
        for name in ("header_timeout_s", "keep_alive_s"):
            if not 0 < getattr(self, name) < math.inf:
                raise ConfigError(f"--{name} must be positive and finite, got {getattr(self, name)}")
        if not 0 < self.max_request_mb < math.inf:
            raise ConfigError(f"--max_request_mb must be positive and finite, got {self.max_request_mb}")
        check_draft(self.draft, self.draft_tokens)
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("--api_key is empty: give a key, or leave it out to serve without one")
