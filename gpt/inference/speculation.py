"""Speculative decoding's rule, inside jit: which of a draft's tokens stand.

A decode step that verifies K drafted tokens runs the model over K + 1 positions of each row at once (the
row's last token, then the drafts) and reads every weight once for all of them, where K + 1 plain steps
read them K + 1 times; every draft token that stands is a token nearly for free.

A draft is the sequence itself (prompt lookup), the model's own weights in int8, or a smaller GPT with
the same vocabulary, greedily (`gpt.inference.drafters`: one type, three kinds). Each is a fixed guess, a
point mass q, so the speculative-sampling rule (accept a draft d with probability min(1, p(d) / q(d)), else
draw from the normalized max(0, p - q)) is: accept d with probability p(d), else draw from p without d.
`count_standing` does that with the draw the step would make without a draft: the target's token t at
that position, drawn with the same key from the same p; d stands when t == d, and otherwise t is the
token. So P(d stands) = p(d), a rejection's token is distributed as p without d, and the tokens are the
ones decoding without a draft makes, token for token, greedy or sampled, whatever the knobs.

Shapes: R rows, C positions of a row's history (and of its caches), K draft tokens a step.
"""

from __future__ import annotations

from typing import Literal, get_args

import jax
import jax.numpy as jnp
import numpy as np

from gpt.errors import ConfigError

__all__ = ["count_standing", "check_draft", "not_a_draft", "Draft", "DRAFTS", "DEFAULT_DRAFT_TOKENS",
           "MAX_DRAFT_TOKENS"]

DEFAULT_DRAFT_TOKENS = 4  # K, when a draft is asked for without it


def count_standing(target_RK: jax.Array, drafts_RK: jax.Array, count_R: jax.Array) -> jax.Array:
    """How many of each row's drafted tokens stand, int32 [R]: the leading ones (of `count_R`) equal to
    the target's own token at their position (`target_RK`, drawn as decoding without a draft draws it;
    see the module docstring for why that is the speculative-sampling rule)."""
    K = drafts_RK.shape[1]
    agree_RK = (target_RK == drafts_RK) & (jnp.arange(K)[None, :] < count_R[:, None])
    return jnp.sum(jnp.cumprod(agree_RK.astype(jnp.int32), axis=1), axis=1)


Draft = Literal["none", "ngram", "int8"]  # the kinds of draft, as the scripts' flags offer them
DRAFTS = get_args(Draft)[1:]  # "none" (or None) decodes without one


def names_a_model(draft: str) -> bool:
    """Whether a script's --draft names a model to load (a directory, a hub name) rather than a kind of draft."""
    return draft != "none" and draft not in DRAFTS
MAX_DRAFT_TOKENS = 32  # the most drafted tokens one step verifies


def check_draft(draft, draft_tokens: int, names_a_model: bool = False) -> int:
    """K, the drafted tokens a step verifies: `draft_tokens` for a draft (one of DRAFTS, a model or a
    `gpt.inference.drafters.Drafter`), 0 for none; ConfigError naming a draft name that is not one of DRAFTS, or a
    draft_tokens outside [1, MAX_DRAFT_TOKENS]. names_a_model: any other name is where a model comes from
    (a script's --draft, checked before anything loads; `gpt.loading.load_draft` loads it)."""
    if draft is None or isinstance(draft, str) and draft == "none":
        return 0
    if isinstance(draft, str) and draft not in DRAFTS and not names_a_model:
        raise not_a_draft(draft)
    if isinstance(draft_tokens, bool) or not isinstance(draft_tokens, (int, np.integer)) \
            or not 1 <= draft_tokens <= MAX_DRAFT_TOKENS:
        raise ConfigError(f"draft_tokens must be an integer in [1, {MAX_DRAFT_TOKENS}], got {draft_tokens!r}")
    return int(draft_tokens)


def not_a_draft(draft) -> ConfigError:
    """The error for a `draft` that is no kind of draft."""
    return ConfigError(f"draft must be one of none, {', '.join(DRAFTS)} or a GPT; got {draft!r}")
