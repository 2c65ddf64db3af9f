"""Speculative decoding's two rules, inside jit: where a draft comes from, and which of its tokens stand.

A decode step that verifies K drafted tokens runs the model over K + 1 positions of each row at once (the
row's last token, then the drafts) and reads every weight once for all of them, where K + 1 plain steps
read them K + 1 times; every draft token that stands is a token nearly for free.

A draft is the sequence itself (prompt lookup: the tokens that followed the latest earlier occurrence of
the row's last n tokens, `ngram_drafts`) or the model's own weights in int8, greedily
(`gpt.inference.decoding._model_drafts`). Either is a fixed guess, a point mass q, so the
speculative-sampling rule (accept a draft d with probability min(1, p(d) / q(d)), else draw from the
normalized max(0, p - q)) is: accept d with probability p(d), else draw from p without d. `stands` does
that with the draw the step would make without a draft: the target's token t at that position, drawn
with the same key from the same p; d stands when t == d, and otherwise t is the token. So P(d stands) =
p(d), a rejection's token is distributed as p without d, and the tokens are the ones decoding without a
draft makes, token for token, greedy or sampled, whatever the knobs.

Shapes: R rows, C positions of a row's history, K draft tokens a step.
"""

from __future__ import annotations

from typing import Literal, get_args

import jax
import jax.numpy as jnp
import numpy as np

from gpt.errors import ConfigError

__all__ = ["ngram_drafts", "stands", "check_draft", "Draft", "DRAFTS", "DEFAULT_DRAFT_TOKENS", "MAX_DRAFT_TOKENS", "MAX_NGRAM"]

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


def check_draft(draft: str | None, draft_tokens: int) -> int:
    """K, the drafted tokens a step verifies: `draft_tokens` for a draft, 0 for none; ConfigError naming
    a draft that is not one of DRAFTS, or a draft_tokens outside [1, MAX_DRAFT_TOKENS]."""
    if draft is None or draft == "none":
        return 0
    if draft not in DRAFTS:
        raise ConfigError(f"draft must be one of none, {', '.join(DRAFTS)}; got {draft!r}")
    if isinstance(draft_tokens, bool) or not isinstance(draft_tokens, (int, np.integer)) \
            or not 1 <= draft_tokens <= MAX_DRAFT_TOKENS:
        raise ConfigError(f"draft_tokens must be an integer in [1, {MAX_DRAFT_TOKENS}], got {draft_tokens!r}")
    return int(draft_tokens)
