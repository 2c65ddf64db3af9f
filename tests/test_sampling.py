"""Sampling rules: the filters (top-k, top-p, min-p) against their definitions and a full sort, extreme
knobs, the repetition penalty, and the greedy choice."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpt.inference.sampling import Sampling, SamplingParams, choose, filter_logits, first_argmax, penalize_repetition


def _draws(logits_V, params, n=4000):
    logits = jnp.broadcast_to(jnp.asarray(logits_V, jnp.float32), (n, len(logits_V)))
    seen = jnp.zeros(logits.shape, bool)
    return np.asarray(choose(logits, seen, params, jax.random.split(jax.random.key(0), n)))


LOGITS = np.log(np.array([0.30, 0.25, 0.15, 0.12, 0.08, 0.05, 0.03, 0.02]))


@pytest.mark.parametrize(
    "knobs, allowed",
    [
        (dict(top_k=3), {0, 1, 2}),
        (dict(top_p=0.6), {0, 1, 2}),  # 0.30 + 0.25 < 0.6, adding 0.15 reaches it
        (dict(top_p=0.25), {0}),
        (dict(min_p=0.45), {0, 1, 2}),  # p >= 0.45 * 0.30 = 0.135
        # top-k renormalizes over 5 tokens (0.90 in all), so the mass before token 4 is 0.82 / 0.90 > 0.9.
        (dict(top_k=5, top_p=0.9, min_p=0.3), {0, 1, 2, 3}),
    ],
)
def test_filters_never_emit_excluded_tokens(knobs, allowed):
    draws = _draws(LOGITS, SamplingParams.of(Sampling(**knobs)))
    assert set(draws.tolist()) == allowed  # every allowed token appears, no other one does


@pytest.mark.parametrize("extreme, meaning", [
    (dict(top_k=10**13), dict()),  # past int32: every token kept, as with any k >= the vocabulary
    (dict(top_p=1e-300), dict(top_k=1)),  # float32 rounds it to 0: the most likely token only
])
def test_extreme_knobs_keep_their_meaning(extreme, meaning):
    logits = LOGITS[::-1]  # the most likely token last: an all-excluded row would draw token 0
    draws = lambda knobs: _draws(logits, SamplingParams.of(Sampling(**knobs)), n=500)  # noqa: E731
    np.testing.assert_array_equal(draws(extreme), draws(meaning))


def test_filter_threshold_matches_definition():
    params = SamplingParams.of(Sampling(top_p=0.6))
    kept = np.isfinite(np.asarray(filter_logits(jnp.asarray(LOGITS)[None], params))[0])
    assert kept.tolist() == [True, True, True, False, False, False, False, False]


def test_repetition_penalty_as_defined():
    logits = jnp.asarray([[2.0, -1.0, 0.5, 1.0]])
    seen = jnp.asarray([[True, True, False, False]])
    penalized = np.asarray(penalize_repetition(logits, seen, jnp.float32(2.0)))
    np.testing.assert_allclose(penalized, [[1.0, -2.0, 0.5, 1.0]])
    before, after = jax.nn.softmax(logits), jax.nn.softmax(jnp.asarray(penalized))
    assert after[0, 0] < before[0, 0] and after[0, 1] < before[0, 1]


def _reference_threshold(logits_V, k, p):
    """top-k then top-p as defined by a descending sort (numpy, float64): the smallest kept logit."""
    order = np.sort(logits_V)[::-1]
    kept = order[:k]
    probs = np.exp(kept - kept.max())
    probs /= probs.sum()
    mass_before = np.cumsum(probs) - probs
    return kept[mass_before < p].min() if p < 1 else kept.min()


def test_top_k_and_top_p_keep_what_a_sort_would_keep():
    # Rows of GPT-2's vocabulary size with their own knobs; the ranking must agree with a full sort.
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((8, 50257)) * 3).astype(np.float32)
    top_k = np.array([0, 1, 40, 50257, 0, 7, 1000, 0], np.int32)
    top_p = np.array([0.9, 1.0, 0.5, 0.95, 1.0, 0.99, 0.2, 0.001], np.float32)
    params = SamplingParams(temperature=np.ones(8, np.float32), top_k=top_k, top_p=top_p,
                            min_p=np.zeros(8, np.float32), repetition_penalty=np.ones(8, np.float32))
    kept = np.isfinite(np.asarray(jax.jit(filter_logits)(jnp.asarray(logits), params)))
    for row in range(8):
        k = top_k[row] or 50257
        threshold = _reference_threshold(logits[row].astype(np.float64), k, float(top_p[row]))
        np.testing.assert_array_equal(kept[row], logits[row] >= threshold, err_msg=f"row {row}")


def test_first_argmax_is_numpys_argmax_with_ties_and_nans():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((8, 50257)).astype(np.float32)
    logits[0, [10, 20]] = [9.0, np.nan]  # a NaN after the largest value still wins
    logits[1, [7, 100, 50256]] = 9.0  # a tie: the first index wins
    logits[2, [300, 5000]] = np.nan  # a NaN: the first NaN wins, as jnp.argmax says
    logits[3, :] = -np.inf
    logits[4, -1] = np.inf
    logits[5, [0, 1]] = [np.nan, np.inf]
    for rows in range(1, 9):  # XLA's CPU reductions differ by shape (one skipped NaNs at some row counts)
        got = np.asarray(jax.jit(first_argmax)(jnp.asarray(logits[:rows])))
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, np.argmax(logits[:rows], axis=-1), err_msg=f"{rows} rows")
