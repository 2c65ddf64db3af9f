"""JAX's persistent compilation cache, on by default for the command-line tools.

A restart of `serve.py` (or `sample.py`, or a resumed `train.py`) then loads its compiled programs from
disk instead of compiling them again. The cache lives in the user's cache directory
($XDG_CACHE_HOME/gpt/jax, else ~/.cache/gpt/jax); `--no-compile_cache` turns it off.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import jax

__all__ = ["enable_compilation_cache", "default_directory", "CompileCacheChoice"]


@dataclasses.dataclass(frozen=True)
class CompileCacheChoice:
    """Whether a command keeps its compiled programs: a flag of train.py, sample.py and serve.py."""

    compile_cache: bool = True
    """Keep compiled programs in the user's cache directory,
    so that the next run (a resumed training, the next sample, a server's restart) skips most compiles."""


def default_directory() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "gpt" / "jax"


def enable_compilation_cache(enabled: bool = True, directory: str | os.PathLike | None = None) -> Path | None:
    """Point JAX's persistent cache at `directory` (default: `default_directory()`); returns it, or None
    when disabled. Programs that compile in under 50 ms are not worth a disk entry; the decoding layout's
    small programs (one per kind of matrix: about a tenth of a second each for int8) are."""
    if not enabled:
        return None
    path = Path(directory) if directory is not None else default_directory()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.05)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
