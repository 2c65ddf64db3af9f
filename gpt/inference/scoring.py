"""Next-token scores from the LM head: each position's log-probability of a given token and, when asked,
its most likely alternatives. One computation for decoding's chosen tokens, a prompt's `echo` scores and
`gpt.eval`'s perplexity.

log p = logit - logsumexp(logits): one reduction over the vocabulary, never a [R, V] log_softmax. Many
positions are scored a block of rows at a time (`lax.map`), so that the float32 logits held at once stay
bounded at any batch and context: on a CPU a block whose logits stay in the last-level cache for the
reductions over them (`gpt.model.backend`'s `score_rows`), elsewhere the loss's budget of logits a chunk.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gpt.inference.sampling import TOP_LOGPROBS
from gpt.model.backend import choices
from gpt.model.transformer import Weights, lm_head

__all__ = ["token_scores", "scored_positions", "block_rows"]


def token_scores(logits_RV: jax.Array, tokens_R: jax.Array, wants_top: jax.Array | bool
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(logprob [R] of tokens_R, top ids int32 [R, J], their logprobs [R, J]) under float32 logits [R, V];
    the top J (`TOP_LOGPROBS`) only where `wants_top` (a traced bool: zeros otherwise, computed not). A
    token's logprob and its top-J entry come from the same logits, so they are equal when it is the most
    likely (how lm-evaluation-harness tells a greedy continuation)."""
    logsumexp_R1 = jax.nn.logsumexp(logits_RV, axis=-1, keepdims=True)
    logprob_R = (jnp.take_along_axis(logits_RV, tokens_R[:, None], axis=-1) - logsumexp_R1)[:, 0]
    R = tokens_R.shape[0]

    def top():
        top_logits_RJ, top_ids_RJ = jax.lax.top_k(logits_RV, TOP_LOGPROBS)
        return top_ids_RJ, top_logits_RJ - logsumexp_R1

    def none():
        return jnp.zeros((R, TOP_LOGPROBS), jnp.int32), jnp.zeros((R, TOP_LOGPROBS), jnp.float32)

    return logprob_R, *jax.lax.cond(wants_top, top, none)


def block_rows(vocab_size: int) -> int:
    """Positions a block: the backend's `score_rows`, else as many as the loss's chunk of logits holds."""
    return choices().score_rows or max(1, choices().loss_chunk_bytes // (4 * vocab_size))


def scored_positions(weights: Weights, x_RD: jax.Array, targets_R: jax.Array, wants_top: jax.Array | bool
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`token_scores` of R positions' final hidden states x [R, D] (the LM head run here) against their
    targets int32 [R], `block_rows` positions at a time."""
    R = targets_R.shape[0]
    rows = block_rows(jax.eval_shape(lm_head, weights, x_RD[None, :1]).shape[-1])  # the vocabulary's size

    def scores_of(x_rD, targets_r):
        return token_scores(lm_head(weights, x_rD[None])[0], targets_r, wants_top)

    if R <= rows:
        return scores_of(x_RD, targets_R)
    n = -(-R // rows)
    pad = lambda a: jnp.pad(a, [(0, n * rows - R)] + [(0, 0)] * (a.ndim - 1)).reshape(n, rows, *a.shape[1:])  # noqa: E731
    blocks = jax.lax.map(lambda block: scores_of(*block), (pad(x_RD), pad(targets_R)))
    return tuple(a.reshape(n * rows, *a.shape[2:])[:R] for a in blocks)
