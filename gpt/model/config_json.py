"""A config.json's fields read with their types and bounds: a model directory is the least trusted input the
project reads, and a field that is missing, of another type or out of range is one line naming it, never a
KeyError, a ZeroDivisionError or an allocation of 10^12 positions later on."""

from __future__ import annotations

import math

from gpt.errors import ConfigError

__all__ = ["integer", "number", "flag", "mapping", "MAX_CONTEXT", "MAX_SIZE"]

MAX_CONTEXT = 1 << 24  # positions a context may have: 16M, past every released model's (1M at most)
MAX_SIZE = 1 << 24  # any other size (a width, a vocabulary, layers, heads): past every released model's
_REQUIRED = object()


def integer(hf: dict, name: str, default: object = _REQUIRED, high: int = MAX_SIZE, low: int = 1) -> int:
    """The integer `hf[name]` in [low, high], or `default` where it is absent (none: required)."""
    value = hf.get(name, default)
    if value is _REQUIRED:
        raise ConfigError(f"config.json: {name} is missing (an integer in [{low}, {high:,}])")
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ConfigError(f"config.json: {name} must be an integer in [{low}, {high:,}], got {value!r}")
    return value


def number(hf: dict, name: str, default: float) -> float:
    """The positive finite number `hf[name]`, or `default` where it is absent or null."""
    value = hf.get(name)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < math.inf:
        raise ConfigError(f"config.json: {name} must be a positive finite number, got {value!r}")
    return float(value)


def flag(hf: dict, name: str, default: bool) -> bool:
    """The boolean `hf[name]`, or `default` where it is absent or null."""
    value = hf.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigError(f"config.json: {name} must be true or false, got {value!r}")
    return value


def mapping(hf: dict, name: str) -> dict:
    """The JSON object `hf[name]`, or {} where it is absent or null."""
    value = hf.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"config.json: {name} must be a JSON object, got {type(value).__name__} {value!r:.60}")
    return value
