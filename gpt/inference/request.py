"""What a client asks the decoding engine for, and the checks it passes before anything runs.

`Request` is one completion to generate. Every entry point (`generate`, `sample.py`, `serve.py`) checks
what it was given here, on the caller's thread and before any compile, so that a bad value is one
ConfigError that names the field and its bound, and never reaches a round of the engine, where it would
end every running request.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from gpt.errors import ConfigError
from gpt.inference.sampling import TOP_LOGPROBS, Sampling, check_sampling

__all__ = ["Request", "check_request", "check_prompt", "check_prompts", "check_stop_tokens", "is_int"]


@dataclasses.dataclass(frozen=True)
class Request:
    """One completion to generate.

    sampling: how its tokens are chosen (`gpt.inference.sampling.Sampling`; `GREEDY` takes the argmax).
    seed, stream: integers (taken modulo 2**32; the server refuses seeds outside [0, 2**32)); the request's
      draws are a pure function of (seed, stream, model, prompt, sampling), whatever else the engine is
      running; `generate` gives the rows of one call streams 0, 1, ...
    stop_tokens: an id, or ids, that end the completion (not emitted). stop_strings: a text, or texts, that
      end it once its decoded output contains one (`Completion.text` is cut before it).
    logprobs: how many most likely alternatives to report for each token (0..5); the chosen token's own
      log-probability is always recorded.
    prompt_logprobs: score the prompt too: each of its tokens' log-probability given those before it
      (and its `logprobs` alternatives), computed in the prefill that runs it. With it, max_tokens may
      be 0: the prompt is scored and nothing generated.
    reuse_prefix: run the prompt through the engine's prefix cache (where it has one: `prefix_cache_tokens`)
      though it is not scored, loading what the cache holds of its beginning and leaving its blocks there for
      the next: a conversation's turns, which its next turn sends again (a scored prompt always does).
    """

    prompt: Sequence[int]
    max_tokens: int
    sampling: Sampling = Sampling()
    seed: int = 0
    stream: int = 0
    stop_tokens: int | Sequence[int] = ()
    stop_strings: Sequence[str] | str = ()
    logprobs: int = 0
    prompt_logprobs: bool = False
    reuse_prefix: bool = False


def is_int(value) -> bool:
    """A Python or numpy integer, and not a bool (which Python counts as one)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def check_prompt(prompt, vocab_size: int, name: str = "prompt") -> np.ndarray:
    """The prompt as int32 token ids [T]; ConfigError naming `name` when it is empty, not integer ids,
    or holds an id outside [0, vocab_size)."""
    ids = np.asarray([] if isinstance(prompt, (str, bytes)) else prompt)
    if ids.size == 0:
        raise ConfigError(f"{name} is empty: it needs at least one token")
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise ConfigError(f"{name} must be a list of integer token ids, got {ids.ndim}-D {ids.dtype}")
    if ids.min() < 0 or ids.max() >= vocab_size:
        bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
        raise ConfigError(f"{name} has token id {bad} outside the vocabulary [0, {vocab_size})")
    return ids.astype(np.int32)


def check_prompts(prompts, max_new_tokens: int, vocab_size: int, context: int) -> list[list[int]]:
    """A batch of prompts (token-id lists, or an integer array [B, T]) as lists of ids, each with room for
    `max_new_tokens` more within `context` positions; ConfigError naming the row and the bound."""
    if isinstance(prompts, (np.ndarray, jax.Array)) and prompts.ndim == 2:
        prompts = list(np.asarray(prompts))  # a batch of equal-length prompts, [B, T]
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ConfigError("prompts must be a non-empty list of token-id lists, or a 2-D array of them")
    if not is_int(max_new_tokens) or max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    checked = []
    for row, prompt in enumerate(prompts):
        ids = check_prompt(prompt, vocab_size, f"prompt {row}")
        if ids.size + max_new_tokens > context:
            raise ConfigError(
                f"prompt {row} has {ids.size} tokens; with max_new_tokens={max_new_tokens} that is "
                f"{ids.size + max_new_tokens}, beyond the model's context of {context} tokens")
        checked.append(ids.tolist())
    return checked


def check_stop_tokens(stop_tokens, vocab_size: int) -> tuple[int, ...]:
    """`stop_tokens` (one id or a list of them) as a tuple of ints; ConfigError when it is anything else
    or holds an id outside [0, vocab_size)."""
    if is_int(stop_tokens):
        stop_tokens = [stop_tokens]
    if not isinstance(stop_tokens, (list, tuple)) or not all(map(is_int, stop_tokens)):
        raise ConfigError(f"stop_tokens must be a token id or a list of them, got {stop_tokens!r}")
    if any(not 0 <= t < vocab_size for t in stop_tokens):
        raise ConfigError(f"stop_tokens {list(stop_tokens)} must be ids in [0, {vocab_size})")
    return tuple(int(t) for t in stop_tokens)


def check_request(request: Request, vocab_size: int, cache_length: int, max_stop_tokens: int) -> tuple[int, ...]:
    """Raise ConfigError naming the first field of `request` outside its bound (a prompt and max_tokens
    that fit `cache_length` positions, at most `max_stop_tokens` stop tokens); else return its stop
    tokens as `check_stop_tokens` does."""
    ids = check_prompt(request.prompt, vocab_size)
    for flag in ("prompt_logprobs", "reuse_prefix"):
        if not isinstance(getattr(request, flag), (bool, np.bool_)):
            raise ConfigError(f"{flag} must be true or false, got {getattr(request, flag)!r}")
    if not is_int(request.max_tokens) or request.max_tokens < 1 - request.prompt_logprobs:
        only = "; 0 only when the prompt is scored (prompt_logprobs)" if not request.prompt_logprobs else ""
        raise ConfigError(f"max_tokens must be an integer >= {1 - request.prompt_logprobs}, "
                          f"got {request.max_tokens!r}{only}")
    if ids.size + request.max_tokens > cache_length:
        raise ConfigError(
            f"the prompt has {ids.size} tokens; with max_tokens={request.max_tokens} that is "
            f"{ids.size + request.max_tokens}, beyond the context of {cache_length} tokens")
    check_sampling(request.sampling)
    stops = check_stop_tokens(request.stop_tokens, vocab_size)
    if len(stops) > max_stop_tokens:
        raise ConfigError(f"stop_tokens has {len(stops)} ids; at most {max_stop_tokens} are allowed")
    strings = request.stop_strings
    if not isinstance(strings, str) and (not isinstance(strings, (list, tuple))
                                         or not all(isinstance(s, str) for s in strings)):
        raise ConfigError(f"stop_strings must be a string or a list of strings, got {strings!r}")
    if not is_int(request.logprobs) or not 0 <= request.logprobs <= TOP_LOGPROBS:
        raise ConfigError(f"logprobs must be an integer in [0, {TOP_LOGPROBS}], got {request.logprobs!r}")
    for name in ("seed", "stream"):  # any integer: taken modulo 2**32
        if not is_int(getattr(request, name)):
            raise ConfigError(f"{name} must be an integer, got {getattr(request, name)!r}")
    return stops
