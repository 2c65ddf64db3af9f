"""Speculative decoding's two rules, inside jit: where a draft comes from, and which of its tokens stand.

A decode step that verifies K drafted tokens runs the model over K + 1 positions of each row at once (the
row's last token, then the drafts) and reads every weight once for all of them, where K + 1 plain steps
read them K + 1 times; every draft token that stands is a token nearly for free.

A draft is the sequence itself (prompt lookup: the tokens that followed the latest earlier occurrence of
the row's last n tokens, `ngram_drafts`), the model's own weights in int8, or a smaller GPT with the same
vocabulary, greedily (`weights_drafts`, `draft_model_drafts`). Each is a fixed guess, a point mass q, so the
speculative-sampling rule (accept a draft d with probability min(1, p(d) / q(d)), else draw from the
normalized max(0, p - q)) is: accept d with probability p(d), else draw from p without d. `stands` does
that with the draw the step would make without a draft: the target's token t at that position, drawn
with the same key from the same p; d stands when t == d, and otherwise t is the token. So P(d stands) =
p(d), a rejection's token is distributed as p without d, and the tokens are the ones decoding without a
draft makes, token for token, greedy or sampled, whatever the knobs.

Shapes: R rows, C positions of a row's history (and of its caches), K draft tokens a step.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, get_args

import jax
import jax.numpy as jnp
import numpy as np

from gpt.errors import ConfigError
from gpt.inference.sampling import first_argmax
from gpt.model.config import GPTConfig
from gpt.model.kv_cache import KVCache
from gpt.model.transformer import Weights, forward, lm_head

__all__ = ["ngram_drafts", "weights_drafts", "draft_model_drafts", "stands", "check_draft", "check_draft_model",
           "Draft", "DRAFTS", "DEFAULT_DRAFT_TOKENS", "MAX_DRAFT_TOKENS", "MAX_NGRAM"]

DEFAULT_DRAFT_TOKENS = 4  # K, when a draft is asked for without it
MAX_NGRAM = 3  # the longest suffix looked up; shorter ones are tried when it is not found


def ngram_drafts(history_RC: jax.Array, last_R: jax.Array, draft_tokens: int) -> tuple[jax.Array, jax.Array]:
    """Up to K = `draft_tokens` tokens per row from its own history (prompt lookup).

    history_RC: int32 [R, C], each row's tokens so far at their positions (prompt, then output); last_R:
    int32 [R], the position of each row's latest token. For n = MAX_NGRAM down to 1, the row's last n
    tokens are looked for earlier in its history; at the latest earlier place they occur (the first n
    that has one), the tokens after them are the draft, repeated from there when they reach the latest
    token (a loop of that period).

    Returns (drafts int32 [R, K], count int32 [R]): the draft's tokens (past `count`, anything) and how
    many there are (K, or 0 when no suffix recurs).
    """
    R, C = history_RC.shape
    start_C = jnp.arange(C, dtype=jnp.int32)
    found_R = jnp.zeros((R,), jnp.bool_)
    after_R = jnp.zeros((R,), jnp.int32)  # where the draft starts: the position after the match
    for n in range(MAX_NGRAM, 0, -1):
        # A match at start j: history[j + m] == history[last - n + 1 + m] for m < n, and it ends before the
        # suffix itself does (j + n - 1 < last).
        match_RC = (start_C[None, :] + n - 1 < last_R[:, None]) & (last_R[:, None] >= n - 1)
        for m in range(n):
            wanted_R = jnp.take_along_axis(history_RC, jnp.maximum(last_R - n + 1 + m, 0)[:, None], axis=1)
            shifted_RC = jnp.roll(history_RC, -m, axis=1)  # shifted[j] = history[j + m] (wrapped: never a match)
            match_RC &= shifted_RC == wanted_R
        latest_R = jnp.max(jnp.where(match_RC, start_C[None, :], -1), axis=1)
        take_R = ~found_R & (latest_R >= 0)
        after_R = jnp.where(take_R, latest_R + n, after_R)
        found_R |= take_R
    # Where the tokens after the match run out (they reach the latest token), the text is taken to repeat
    # with that period: "a b c a b" drafts "c a b c ...".
    period_R = jnp.maximum(last_R - after_R + 1, 1)
    positions_RK = after_R[:, None] + jnp.arange(draft_tokens, dtype=jnp.int32)[None, :] % period_R[:, None]
    drafts_RK = jnp.take_along_axis(history_RC, jnp.minimum(positions_RK, C - 1), axis=1)
    return drafts_RK, jnp.where(found_R, draft_tokens, 0)


def weights_drafts(config: GPTConfig, weights: Weights, cache: KVCache, last_token_R: jax.Array, live_R: jax.Array,
                   draft_tokens: int) -> tuple[jax.Array, KVCache]:
    """K greedy tokens a row by `weights` (the model's own, in int8) after each row's last token (at its
    cache's length), reading the model's `cache` for the row's past and writing the guesses' keys and values
    where the verification then writes the model's. Returns (int32 [R, K], the cache with its lengths as
    they were)."""
    start_R = jnp.where(live_R, cache.lengths, 0)
    drafts_RK, written = _greedy(config, weights, cache, last_token_R[:, None], start_R[:, None], draft_tokens)
    return drafts_RK, dataclasses.replace(written, lengths=cache.lengths)


CATCH_UP = 32  # positions a row a draft model runs at once of those it has not run (a new prompt's)


def draft_model_drafts(config: GPTConfig, weights: Weights, cache: KVCache, history_RC: jax.Array,
                       lengths_R: jax.Array, last_token_R: jax.Array, live_R: jax.Array,
                       draft_tokens: int) -> tuple[jax.Array, KVCache]:
    """K greedy tokens a row by a draft model (`config`, `weights`) over its own `cache`, whose lengths say
    how many of each row's positions it has run. It first runs the row's tokens it has not (`_catch_up`,
    from the row's history, up to the one before the last); its first guessing forward then runs that one
    and the last token (at lengths_R), so that a step after which every guess stood, which leaves one
    position unrun, needs no catch-up. Returns (int32 [R, K], its cache; the lengths are the caller's to
    set once it knows which guesses stood)."""
    cache = _catch_up(config, weights, cache, history_RC, jnp.where(live_R, lengths_R - 1, 0))
    last_R = jnp.where(live_R, lengths_R, 1)  # the last token's position (>= 1: a prompt has a token)
    before_R = jnp.take_along_axis(history_RC, (last_R - 1)[:, None], axis=1)[:, 0]
    tokens_R2 = jnp.stack([before_R, last_token_R], axis=1)
    return _greedy(config, weights, cache, tokens_R2, last_R[:, None] + jnp.arange(-1, 1, dtype=jnp.int32),
                   draft_tokens)


def _catch_up(config: GPTConfig, weights: Weights, cache: KVCache, history_RC: jax.Array,
              target_R: jax.Array) -> KVCache:
    """The draft's cache with each row run up to position target_R (lengths >= target_R), CATCH_UP
    positions a row at a time from its history; a row that is not behind writes nowhere (past the end)."""
    C = history_RC.shape[1]
    chunk_T = jnp.arange(CATCH_UP, dtype=jnp.int32)

    def behind(cache: KVCache) -> jax.Array:
        return cache.lengths < target_R

    def run(cache: KVCache) -> KVCache:
        behind_R, ran_R = behind(cache), cache.lengths
        positions_RT = jnp.where(behind_R[:, None], ran_R[:, None], C) + chunk_T
        tokens_RT = jnp.take_along_axis(history_RC, jnp.minimum(positions_RT, C - 1), axis=1)
        cache = forward(config, weights, tokens_RT, positions_RT, cache)[1]
        ran_R = jnp.where(behind_R, jnp.minimum(ran_R + CATCH_UP, target_R), ran_R)
        return dataclasses.replace(cache, lengths=ran_R)

    return jax.lax.while_loop(lambda cache: jnp.any(behind(cache)), run, cache)


def _greedy(config: GPTConfig, weights: Weights, cache: KVCache, tokens_RT: jax.Array, positions_RT: jax.Array,
            draft_tokens: int) -> tuple[jax.Array, KVCache]:
    """K greedy tokens a row after tokens_RT (int32 [R, T], run at positions_RT over `cache`), each guess
    run at the next position for the one after it. Returns (int32 [R, K], the cache with their keys and
    values)."""
    next_R, drafts = positions_RT[:, -1] + 1, []
    for i in range(draft_tokens):
        x_RTD, cache = forward(config, weights, tokens_RT, positions_RT, cache)
        token_R = first_argmax(lm_head(weights, x_RTD[:, -1:])[:, 0])
        drafts.append(token_R)
        tokens_RT, positions_RT = token_R[:, None], (next_R + i)[:, None]
    return jnp.stack(drafts, axis=1), cache


def stands(target_RK: jax.Array, drafts_RK: jax.Array, count_R: jax.Array) -> jax.Array:
    """How many of each row's drafted tokens stand, int32 [R]: the leading ones (of `count_R`) equal to
    the target's own token at their position (`target_RK`, drawn as decoding without a draft draws it;
    see the module docstring for why that is the speculative-sampling rule)."""
    K = drafts_RK.shape[1]
    agree_RK = (target_RK == drafts_RK) & (jnp.arange(K)[None, :] < count_R[:, None])
    return jnp.sum(jnp.cumprod(agree_RK.astype(jnp.int32), axis=1), axis=1)


Draft = Literal["none", "ngram", "int8"]  # the kinds of draft, as the scripts' flags offer them
DRAFTS = get_args(Draft)[1:]  # "none" (or None) decodes without one
MAX_DRAFT_TOKENS = 32  # the most drafted tokens one step verifies


def check_draft(draft, draft_tokens: int, names_a_model: bool = False) -> int:
    """K, the drafted tokens a step verifies: `draft_tokens` for a draft (one of DRAFTS, or a model: see
    `check_draft_model`), 0 for none; ConfigError naming a draft name that is not one of DRAFTS, or a
    draft_tokens outside [1, MAX_DRAFT_TOKENS]. names_a_model: any other name is where a model comes from
    (a script's --draft, checked before anything loads; `gpt.loading.load_draft` loads it)."""
    if draft is None or isinstance(draft, str) and draft == "none":
        return 0
    if isinstance(draft, str) and draft not in DRAFTS and not names_a_model:
        raise ConfigError(f"draft must be one of none, {', '.join(DRAFTS)} or a GPT; got {draft!r}")
    if isinstance(draft_tokens, bool) or not isinstance(draft_tokens, (int, np.integer)) \
            or not 1 <= draft_tokens <= MAX_DRAFT_TOKENS:
        raise ConfigError(f"draft_tokens must be an integer in [1, {MAX_DRAFT_TOKENS}], got {draft_tokens!r}")
    return int(draft_tokens)


def check_draft_model(draft_config, config, cache_length: int) -> None:
    """ConfigError when a draft model (its GPTConfig, `draft_config`) cannot draft for a model of `config`
    over `cache_length` positions a row: another vocabulary (its ids would mean other tokens), or a
    context shorter than the rows it must follow."""
    if draft_config.vocab_size != config.vocab_size:
        raise ConfigError(f"the draft's vocabulary of {draft_config.vocab_size} tokens differs from the model's "
                          f"{config.vocab_size}: a draft must share the model's tokenizer")
    if draft_config.block_size < cache_length:
        raise ConfigError(f"the draft's context of {draft_config.block_size} positions is shorter than the "
                          f"{cache_length} positions a row may hold (cache_length)")
