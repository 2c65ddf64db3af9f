"""Logit processors and token choice, all inside jit.

Every knob is a traced scalar (0 or 1 means "off"), so changing temperature, top-k, top-p, min-p or the
repetition penalty never compiles again.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from gpt.errors import ConfigError

__all__ = ["SamplingParams", "penalize_repetition", "filter_logits", "choose"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen; construct with `SamplingParams.create`, which validates.

    temperature: 0 is greedy (argmax); otherwise logits are divided by it.
    top_k: keep the k most likely tokens (0 keeps all).
    top_p: keep the smallest set of most likely tokens whose probability reaches p (1 keeps all).
    min_p: keep tokens whose probability is at least min_p times the most likely one's (0 keeps all).
    repetition_penalty: CTRL's penalty on tokens already in the prompt or output: a positive logit is
      divided by it, a negative one multiplied (1 is off; > 1 discourages repeats).
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    repetition_penalty: jax.Array

    @classmethod
    def create(cls, temperature=1.0, top_k=None, top_p=None, min_p=None, repetition_penalty=1.0) -> SamplingParams:
        cls.check(temperature, top_k, top_p, min_p, repetition_penalty)
        return cls(
            temperature=jnp.float32(temperature),
            top_k=jnp.int32(top_k or 0),
            top_p=jnp.float32(1.0 if top_p is None else top_p),
            min_p=jnp.float32(min_p or 0.0),
            repetition_penalty=jnp.float32(repetition_penalty),
        )

    @staticmethod
    def check(temperature=1.0, top_k=None, top_p=None, min_p=None, repetition_penalty=1.0) -> None:
        """Raise ConfigError naming the first knob outside its bound (plain Python: nothing compiles)."""
        if temperature is None or not temperature >= 0:
            raise ConfigError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
        if top_k is not None and (int(top_k) != top_k or top_k < 1):
            raise ConfigError(f"top_k must be an integer >= 1 (or None for no limit), got {top_k}")
        if top_p is not None and not 0 < top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1] (or None), got {top_p}")
        if min_p is not None and not 0 <= min_p <= 1:
            raise ConfigError(f"min_p must be in [0, 1] (or None), got {min_p}")
        if not repetition_penalty > 0:
            raise ConfigError(f"repetition_penalty must be > 0 (1 is off), got {repetition_penalty}")


def penalize_repetition(logits_BV: jax.Array, seen_BV: jax.Array, penalty: jax.Array) -> jax.Array:
    """CTRL's repetition penalty on the tokens marked in `seen_BV` (bool [B, V])."""
    penalized = jnp.where(logits_BV > 0, logits_BV / penalty, logits_BV * penalty)
    return jnp.where(seen_BV, penalized, logits_BV)


def filter_logits(logits_BV: jax.Array, params: SamplingParams) -> jax.Array:
    """Temperature, then top-k, top-p and min-p: excluded tokens get -inf. float32 [B, V] in and out."""
    logits_BV = logits_BV / params.temperature
    vocab = logits_BV.shape[-1]
    # One descending sort serves top-k and top-p: both reduce to a per-row logit threshold.
    sorted_BV = -jnp.sort(-logits_BV, axis=-1)
    k = jnp.where(params.top_k > 0, jnp.minimum(params.top_k, vocab), vocab)
    kth_B1 = jnp.take_along_axis(sorted_BV, jnp.broadcast_to(k - 1, sorted_BV.shape[:-1])[:, None], axis=-1)
    sorted_BV = jnp.where(jnp.arange(vocab) < k, sorted_BV, -jnp.inf)
    probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
    # Keep a token if the mass strictly before it is below p; the most likely token is always kept.
    mass_before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
    kept_BV = (mass_before_BV < params.top_p) & (jnp.arange(vocab) < k)
    top_p_threshold_B1 = jnp.min(jnp.where(kept_BV, sorted_BV, jnp.inf), axis=-1, keepdims=True)
    # min-p: p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p).
    min_p_threshold_B1 = sorted_BV[:, :1] + jnp.log(params.min_p)
    threshold_B1 = jnp.maximum(jnp.maximum(kth_B1, top_p_threshold_B1), min_p_threshold_B1)
    return jnp.where(logits_BV >= threshold_B1, logits_BV, -jnp.inf)


def choose(logits_BV: jax.Array, seen_BV: jax.Array, params: SamplingParams, key: jax.Array) -> jax.Array:
    """The next token of each row, int32 [B]: argmax when temperature is 0, else a filtered draw."""
    logits_BV = penalize_repetition(logits_BV.astype(jnp.float32), seen_BV, params.repetition_penalty)
    return jax.lax.cond(
        params.temperature == 0,
        lambda: jnp.argmax(logits_BV, axis=-1).astype(jnp.int32),
        lambda: jax.random.categorical(key, filter_logits(logits_BV, params), axis=-1).astype(jnp.int32),
    )
