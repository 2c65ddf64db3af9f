"""`serve.py`'s settings, each a flag, checked before anything loads."""

from __future__ import annotations

import dataclasses
import math

import tyro

from gpt.compilation_cache import CompileCacheChoice
from gpt.errors import ConfigError
from gpt.hardware import CompileOnlyChoice
from gpt.inference.engine_settings import EngineSettings
from gpt.loading import ModelChoice

__all__ = ["ServeConfig"]


@dataclasses.dataclass(frozen=True)
class ServeConfig(ModelChoice, CompileCacheChoice, CompileOnlyChoice):
    """`python serve.py --help` lists these as flags (which model and how: `ModelChoice`; its programs compiled
    for a TPU topology instead: `CompileOnlyChoice`; and the engine's own, `engine`)."""

    engine: tyro.conf.OmitArgPrefixes[EngineSettings] = EngineSettings()
    """The engine's slots, queue, shapes and draft (each a flag of its own: --slots, --draft, ...)."""

    host: str = "127.0.0.1"
    port: int = 8000
    """0 picks a free port (the chosen one is printed)."""
    model_name: str | None = None
    """The name clients pass as `model`; default: the last part of init_from."""
    max_request_mb: float = 8.0
    """A larger request body gets HTTP 413, unread (64 prompts of 1024 token ids each are ~0.5 MB)."""
    shutdown_deadline_s: float = 10.0
    """On SIGTERM, how long running and waiting requests may take to finish; then each ends at once
    (a stream's last event has finish_reason "abort", a plain request gets 503)."""
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
    status_interval_s: float = 10.0
    """Seconds between the status lines printed while requests come (running and waiting requests, tokens/s,
    requests answered); none while idle; 0: never."""

    def check(self) -> None:
        """ConfigError naming the first setting out of its bound (before anything loads)."""
        self.engine.checked()  # but for the cache's bound (the model's context)
        if self.max_connections < 1:
            raise ConfigError(f"ServeConfig.max_connections must be >= 1, got {self.max_connections}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be in [0, 65535], got {self.port}")
        if not self.shutdown_deadline_s >= 0:
            raise ConfigError(f"--shutdown_deadline_s must be >= 0, got {self.shutdown_deadline_s}")
        if not 0 <= self.status_interval_s < math.inf:
            raise ConfigError(f"--status_interval_s must be >= 0 and finite, got {self.status_interval_s}")
        for name in ("header_timeout_s", "keep_alive_s"):
            if not 0 < getattr(self, name) < math.inf:
                raise ConfigError(f"--{name} must be positive and finite, got {getattr(self, name)}")
        if not 0 < self.max_request_mb < math.inf:
            raise ConfigError(f"--max_request_mb must be positive and finite, got {self.max_request_mb}")
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("--api_key is empty: give a key, or leave it out to serve without one")
