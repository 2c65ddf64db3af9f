"""Logit processors and token choice, all inside jit.

Every knob is a traced value (0 or 1 means "off"), a scalar or one per row (an engine's slots), so
changing temperature, top-k, top-p, min-p or the repetition penalty never compiles again.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from gpt.errors import ConfigError

__all__ = ["Sampling", "GREEDY", "check_sampling", "SamplingParams", "penalize_repetition", "filter_logits",
           "choose", "first_argmax", "TOP_LOGPROBS"]

TOP_LOGPROBS = 5  # J: the most alternatives a request may ask logprobs for (the OpenAI API's own bound)


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: the five knobs, declared here once for every entry point (`generate`,
    a `Request`, sample.py's flags, the server's fields). Host values; `check` bounds them and
    `SamplingParams.of` makes them the jitted step's.
    """

    temperature: float = 1.0
    """0 is greedy (argmax); otherwise logits are divided by it."""
    top_k: int | None = None
    """Keep the k most likely tokens (None keeps all)."""
    top_p: float | None = None
    """Keep the smallest set of most likely tokens whose probability reaches p (None keeps all)."""
    min_p: float | None = None
    """Keep tokens whose probability is at least min_p times the most likely one's (None keeps all)."""
    repetition_penalty: float = 1.0
    """CTRL's penalty on tokens already in the prompt or output: a positive logit is divided by it, a
    negative one multiplied (1 is off; > 1 discourages repeats)."""

    def check(self) -> Sampling:
        """Itself; ConfigError naming the first knob outside its bound (plain Python: nothing compiles)."""
        for field in dataclasses.fields(self):
            value, optional = getattr(self, field.name), field.default is None
            is_number = isinstance(value, (int, float, np.number)) and not isinstance(value, bool)
            if not (is_number or optional and value is None):
                raise ConfigError(f"{field.name} must be a number{' or None' if optional else ''}, got {value!r}")
        if not 0 <= self.temperature < float("inf"):
            raise ConfigError(f"temperature must be >= 0 (0 is greedy) and finite, got {self.temperature}")
        if self.top_k is not None and (int(self.top_k) != self.top_k or self.top_k < 1):
            raise ConfigError(f"top_k must be an integer >= 1 (or None for no limit), got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1] (or None), got {self.top_p}")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise ConfigError(f"min_p must be in [0, 1] (or None), got {self.min_p}")
        if not 0 < self.repetition_penalty < float("inf"):
            raise ConfigError(f"repetition_penalty must be > 0 (1 is off) and finite, got {self.repetition_penalty}")
        return self


GREEDY = Sampling(temperature=0.0)


def check_sampling(sampling) -> Sampling:
    """`sampling` checked (`Sampling.check`); ConfigError when it is not a Sampling at all."""
    if not isinstance(sampling, Sampling):
        raise ConfigError(f"sampling must be a gpt.inference.sampling.Sampling, got {sampling!r}")
    return sampling.check()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """`Sampling`'s knobs as the jitted step takes them: each a scalar, or an array [B] with one value per
    row (an engine's per-slot knobs), with "off" as a number (top_k 0, top_p 1, min_p 0).
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    repetition_penalty: jax.Array

    @classmethod
    def of(cls, sampling: Sampling) -> SamplingParams:
        """`sampling`, checked, as host (numpy) scalars: an engine stacks them into per-row arrays without a
        device round trip."""
        s = check_sampling(sampling)
        # A top-k past int32 keeps every token, as any k >= the vocabulary does; a top-p that float32
        # rounds to 0 keeps the most likely token only, as any p below its probability does.
        return cls(
            temperature=np.float32(s.temperature),
            top_k=np.int32(min(int(s.top_k or 0), np.iinfo(np.int32).max)),
            top_p=np.float32(1.0 if s.top_p is None else max(s.top_p, np.finfo(np.float32).tiny)),
            min_p=np.float32(s.min_p or 0.0),
            repetition_penalty=np.float32(s.repetition_penalty),
        )

    @classmethod
    def rows(cls, batch: int) -> SamplingParams:
        """Per-row knobs for `batch` rows, all greedy until set."""
        return cls(temperature=jnp.zeros((batch,), jnp.float32), top_k=jnp.zeros((batch,), jnp.int32),
                   top_p=jnp.ones((batch,), jnp.float32), min_p=jnp.zeros((batch,), jnp.float32),
                   repetition_penalty=jnp.ones((batch,), jnp.float32))


def penalize_repetition(logits_BV: jax.Array, seen_BV: jax.Array, penalty_B: jax.Array) -> jax.Array:
    """CTRL's repetition penalty [B] on the tokens marked in `seen_BV` (bool [B, V])."""
    penalty_B1 = jnp.asarray(penalty_B, jnp.float32).reshape(-1, 1)
    penalized = jnp.where(logits_BV > 0, logits_BV / penalty_B1, logits_BV * penalty_B1)
    return jnp.where(seen_BV, penalized, logits_BV)


def filter_logits(logits_BV: jax.Array, params: SamplingParams) -> jax.Array:
    """Temperature, then top-k, top-p and min-p, each row by its own knobs ([B] or scalars): excluded
    tokens get -inf. float32 [B, V] in and out. Rows with temperature 0 are divided by 1."""
    B, vocab = logits_BV.shape
    column = lambda x: jnp.broadcast_to(jnp.asarray(x), (B,))[:, None]  # noqa: E731  a knob as [B, 1]
    temperature_B1 = column(params.temperature)
    logits_BV = logits_BV / jnp.where(temperature_B1 > 0, temperature_B1, 1.0)
    k_B1 = column(jnp.where(params.top_k > 0, jnp.minimum(params.top_k, vocab), vocab))
    top_p_B1, min_p_B1 = column(params.top_p), column(params.min_p)
    # min-p: p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p). It needs no sort.
    min_p_threshold_B1 = logits_BV.max(-1, keepdims=True) + jnp.log(min_p_B1)

    def rank_thresholds():
        # top-k: the k-th largest logit. top-p: the smallest logit whose strictly larger tokens (within
        # the top k) hold less than p of the mass; every token at or above it is kept, the most likely
        # always. Both are found by bisection over the logits' order (`_bisect`), not a sort: XLA's CPU
        # sort of [8, 50257] took ~110 ms, longer than the rest of a GPT-2 decode step.
        key_BV = _order_key(logits_BV)
        # The k-th largest key is the smallest m with fewer than k keys above it.
        kth_key_B1 = _bisect(lambda m_B1: jnp.sum(key_BV > m_B1, -1, keepdims=True) < k_B1, B)
        in_top_k_BV = key_BV >= kth_key_B1
        probs_BV = jax.nn.softmax(jnp.where(in_top_k_BV, logits_BV, -jnp.inf), axis=-1)
        mass_above = lambda m_B1: jnp.sum(jnp.where(key_BV > m_B1, probs_BV, 0.0), -1, keepdims=True)  # noqa: E731
        top_p_key_B1 = _bisect(lambda m_B1: mass_above(m_B1) < top_p_B1, B)
        top_p_key_B1 = jnp.where(top_p_B1 < 1, top_p_key_B1, 0)  # p = 1 keeps all, whatever the rounding
        return _from_order_key(jnp.maximum(kth_key_B1, top_p_key_B1))

    # Ranking is most of a sampling step's cost over GPT-2's 50257 tokens: skip it when no row needs it.
    needs_rank = jnp.any((k_B1 < vocab) | (top_p_B1 < 1))
    rank_threshold_B1 = jax.lax.cond(needs_rank, rank_thresholds, lambda: jnp.full((B, 1), -jnp.inf))
    threshold_B1 = jnp.maximum(rank_threshold_B1, min_p_threshold_B1)
    return jnp.where(logits_BV >= threshold_B1, logits_BV, -jnp.inf)


def _order_key(x: jax.Array) -> jax.Array:
    """float32 -> uint32 with the same order (-inf lowest): flip a negative float's bits, set a
    non-negative one's sign bit."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _from_order_key(key: jax.Array) -> jax.Array:
    bits = jnp.where(key >> 31 == 1, key & jnp.uint32(0x7FFFFFFF), ~key)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _bisect(holds, rows: int) -> jax.Array:
    """The smallest order key m [B, 1] for which the monotone predicate `holds(m)` (False, then True as m
    grows; True at the top key) is True, per row: 32 halvings of the uint32 range, each one pass over
    [B, V]. Exact: the predicates here change value only at the logits' own keys."""

    def halve(_, bounds):
        lo, hi = bounds  # the answer lies in [lo, hi]
        mid = lo + (hi - lo) // 2
        ok = holds(mid)
        return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

    lo, hi = jnp.zeros((rows, 1), jnp.uint32), jnp.full((rows, 1), 0xFFFFFFFF, jnp.uint32)
    return jax.lax.fori_loop(0, 32, halve, (lo, hi))[0]


def first_argmax(logits_BV: jax.Array) -> jax.Array:
    """jnp.argmax over the last axis (the first index of the largest value, or of the first NaN), int32 [B].

    As a max and then one min over the indices that hold it (and the NaNs'): XLA's CPU runs argmax as one
    reduce over (value, index) pairs that it does not vectorize, about 3x slower over GPT-2's 50,257 logits
    (bench/RESULTS.md, "The greedy choice, and an int8 product in one kernel tried"; "Speculative
    decoding")."""
    V = logits_BV.shape[-1]
    index_V = jnp.arange(V, dtype=jnp.int32)
    largest_B1 = logits_BV.max(axis=-1, keepdims=True)
    # A NaN wins, as in jnp.argmax (XLA's CPU max skips NaNs at some shapes, propagates at others): in one
    # reduction, a NaN's index below V, the largest's index + V, anything else 2V.
    key_BV = jnp.where(jnp.isnan(logits_BV), index_V, jnp.where(logits_BV == largest_B1, index_V + V, 2 * V))
    first_B = jnp.min(key_BV, axis=-1)
    return jnp.where(first_B < V, first_B, first_B - V)


def choose(logits_BV: jax.Array, seen_BV: jax.Array, params: SamplingParams, keys_B: jax.Array) -> jax.Array:
    """The next token of each row, int32 [B]: argmax where the row's temperature is 0, else a draw from
    its filtered distribution with its own PRNG key (`keys_B`, a key array [B]), so a row's draw does
    not depend on what else is in the batch."""
    logits_BV = penalize_repetition(logits_BV.astype(jnp.float32), seen_BV, params.repetition_penalty)
    greedy_B = first_argmax(logits_BV)
    greedy_rows_B = jnp.broadcast_to(params.temperature == 0, greedy_B.shape)

    def draw():
        filtered_BV = filter_logits(logits_BV, params)
        drawn_B = jax.vmap(jax.random.categorical)(keys_B, filtered_BV).astype(jnp.int32)
        return jnp.where(greedy_rows_B, greedy_B, drawn_B)

    return jax.lax.cond(jnp.all(greedy_rows_B), lambda: greedy_B, draw)
