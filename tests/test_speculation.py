"""Speculative decoding's parts, quickly: the drafts prompt lookup finds, which guesses stand, the
verification's forward, the tokens each kind of draft gives (those of decoding without one; the slower
cases are marked slow), the refusals, and the draft policy's choices. The engine and server under drafts:
tests/test_speculation_engine.py."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gpt import GPT, GPTConfig
from gpt.errors import ConfigError
from gpt.generate import generate
from gpt.inference import decoding, speculation
from gpt.inference.decoder import Decoder
from gpt.inference.draft_policy import DraftPolicy, ladder
from gpt.inference.drafters import ngram_drafts
from gpt.inference.engine import Engine
from gpt.inference.sampling import GREEDY, Sampling
from gpt.inference.speculation import count_standing
from gpt.model.kv_cache import KVCache

import drafting
from conftest import some_quick
from drafting import PROMPTS, the_draft

model, smaller = drafting.model, drafting.smaller  # the module fixtures, shared


def drafts_of(history, draft_tokens=4):
    drafts, count = ngram_drafts(jnp.asarray([history + [0] * (32 - len(history))], jnp.int32),
                                 jnp.asarray([len(history) - 1], jnp.int32), draft_tokens)
    return [int(t) for t in drafts[0, : int(count[0])]]


@pytest.mark.parametrize("history, want", [
    ([5, 6, 7, 8, 9, 5, 6], [7, 8, 9, 5]),  # the tokens after the earlier "5 6", up to K
    ([1, 2, 3, 1, 2, 4, 9, 2], [4, 9, 2, 4]),  # after the latest earlier "2" (no 3- or 2-gram recurs), looped
    ([7, 2, 3, 9, 5, 2, 3, 8, 1, 7, 2, 3], [9, 5, 2, 3]),  # "7 2 3" found, not the later "2 3"
    ([4, 5, 6, 7], []),  # nothing recurs
    ([3], []),
    ([3, 3], [3, 3, 3, 3]),  # a loop of period 1
    ([1, 2, 3, 1, 2], [3, 1, 2, 3]),  # "a b c a b" drafts "c a b c"
])
def test_the_draft_follows_the_latest_earlier_occurrence_of_the_longest_suffix_and_loops(history, want):
    assert drafts_of(history) == want


def test_rows_draft_apart_and_the_draft_is_at_most_k():
    history = jnp.asarray([[1, 2, 1, 2, 1, 2, 0, 0], [9, 8, 7, 9, 8, 0, 0, 0]], jnp.int32)
    drafts, count = ngram_drafts(history, jnp.asarray([5, 4], jnp.int32), 2)
    assert count.tolist() == [2, 2] and drafts.tolist() == [[1, 2], [7, 9]]


def test_count_standing_counts_the_leading_agreement_within_the_draft():
    target = jnp.asarray([[1, 2, 3], [1, 9, 3], [4, 2, 3], [1, 2, 3]])
    drafts = jnp.asarray([[1, 2, 3], [1, 2, 3], [1, 2, 3], [1, 2, 3]])
    assert count_standing(target, drafts, jnp.asarray([3, 3, 3, 2])).tolist() == [3, 1, 0, 2]


def test_several_positions_a_row_over_a_paged_cache_and_a_view_equal_one_at_a_time():
    """The verification's forward (K + 1 positions a row, reading the pages or a view of some rows) gives
    the logits and the cache that K + 1 single-position steps give."""
    model = GPT(GPTConfig.preset("tiny", vocab_size=256, block_size=64), rngs=nnx.Rngs(3))
    config, weights = model.config, Decoder.of(model).weights
    forward = jax.jit(decoding.forward, static_argnames="config")
    tokens = jnp.asarray([[(5 * i + 11 * row) % 256 for i in range(40)] for row in range(3)], jnp.int32)
    cache = KVCache.init(config, 3, 64, page_length=16)
    _, cache = forward(config, weights, tokens[:, :20], jnp.broadcast_to(jnp.arange(20), (3, 20)), cache)
    cache = jax.tree.map(lambda x: x, cache)
    rows = jnp.asarray([2, 0], jnp.int32)
    for view in (None, rows):
        start = cache if view is None else cache.select(view)
        batch = tokens if view is None else tokens[view]
        lengths = start.lengths  # 20 each: the next 5 cross into page 1
        together, _ = forward(config, weights, batch[:, 20:25], lengths[:, None] + jnp.arange(5), start)
        one, step = [], start
        for t in range(5):
            x, step = forward(config, weights, batch[:, 20 + t: 21 + t], (lengths + t)[:, None], step)
            one.append(x)
        assert jnp.allclose(together, jnp.concatenate(one, axis=1), atol=2e-5)


KNOBS = [
    dict(sampling=GREEDY),
    dict(sampling=Sampling(temperature=0.0, repetition_penalty=1.3)),
    dict(sampling=Sampling(temperature=1.0), seed=11),
    dict(sampling=Sampling(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02, repetition_penalty=1.05), seed=5),
]
DRAFTS = [("ngram", 1), ("ngram", 4), ("int8", 3), ("itself", 4), ("smaller", 2)]


def quick(knobs: dict, draft: str, draft_tokens: int) -> bool:
    """The cases of the quick tier: every kind of draft greedy, and prompt lookup with every knob."""
    return knobs == KNOBS[0] and draft_tokens > 1 or knobs == KNOBS[-1] and draft == "ngram" and draft_tokens > 1


CASES = [(knobs, draft, k) for knobs in KNOBS for draft, k in DRAFTS]


@pytest.mark.parametrize("knobs, draft, draft_tokens", some_quick(CASES, [case for case in CASES if quick(*case)]))
def test_a_draft_gives_the_tokens_of_decoding_without_one(model, smaller, knobs, draft, draft_tokens):
    """Greedy or sampled, the same tokens token for token, on ragged rows with max tokens landing inside
    a draft; drafts were verified, and greedy ones stood (random weights' samples seldom repeat: the
    trained model's test below has sampled drafts stand); the model as its own draft model has every
    greedy guess stand (its cache kept up with each row's tokens)."""
    draft = the_draft(draft, model, smaller)
    want = generate(model, PROMPTS, 37, **knobs)
    engine_drafts = []
    original = Engine.__init__

    def keep(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.draft_policy.choose = lambda width, slots: draft_tokens  # every call drafts (the policy's own tests below)
        engine_drafts.append(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Engine, "__init__", keep)
        got = generate(model, PROMPTS, 37, draft=draft, draft_tokens=draft_tokens, **knobs)
    assert got == want
    (engine,) = engine_drafts
    policy = engine.draft_policy
    assert policy.tokens_drafted >= policy.drafts_accepted and policy.tokens_drafted > 0
    assert policy.drafts_accepted > 0 or knobs["sampling"].temperature > 0 or draft is smaller
    if draft is model and knobs == KNOBS[0]:
        assert policy.drafts_accepted == policy.tokens_drafted


@pytest.mark.parametrize("shape, message", [
    (dict(vocab_size=128), "the draft's vocabulary of 128 tokens differs from the model's 256: a draft must share "
                           "the model's tokenizer"),
    (dict(block_size=32), "the draft's context of 32 positions is shorter than the 64 positions a row may hold "
                          "(cache_length)"),
])
def test_a_draft_model_of_another_vocabulary_or_a_shorter_context_is_refused(model, shape, message):
    draft = GPT(GPTConfig.preset("tiny", **{"vocab_size": 256, "block_size": 128, **shape}), rngs=nnx.Rngs(1))
    with pytest.raises(ConfigError) as e:
        Engine(model, cache_length=64, draft=draft)
    assert str(e.value) == message


@pytest.mark.parametrize("draft, draft_tokens, message", [
    ("int4", 4, "draft must be one of none, ngram, int8 or a GPT; got 'int4'"),
    ("ngram", 0, "draft_tokens must be an integer in [1, 32], got 0"),
    ("ngram", 33, "draft_tokens must be an integer in [1, 32], got 33"),
    ("ngram", 2.5, "draft_tokens must be an integer in [1, 32], got 2.5"),
])
def test_bad_draft_settings_are_refused_in_one_line(model, draft, draft_tokens, message):
    with pytest.raises(ConfigError) as e:
        generate(model, [[1, 2]], 4, draft=draft, draft_tokens=draft_tokens)
    assert str(e.value) == message
    assert speculation.check_draft(None, 0) == 0 and speculation.check_draft("none", 99) == 0


def test_the_ladder_halves_the_largest_k_down_to_one():
    assert [ladder(k) for k in (1, 2, 4, 6, 32)] == [
        (0, 1), (0, 1, 2), (0, 1, 2, 4), (0, 1, 3, 6), (0, 1, 2, 4, 8, 16, 32)]


def steps_at(policy, width, k, seconds, runs=None, slot=0, compiled=False):
    """A call at `width` over two slots verifying k guesses a step: 10 steps in `seconds`; `runs`: how many
    of `slot`'s guesses stood at each step (every step verifying k), none of the other's."""
    drafted, reached, stood = np.zeros(2), np.zeros((2, k)), np.zeros((2, k))
    for run in runs or ():
        drafted[slot] += k
        reached[slot] += np.arange(k) <= run  # guess i is verified with those before it standing
        stood[slot] += np.arange(k) < run
    policy.record(width, k, seconds, 10, drafted, reached, stood, compiled=compiled)


def test_the_policy_measures_plain_steps_and_the_largest_k_then_runs_the_best_k_for_each_slots_guesses():
    """At batch 1 each slot gets the K its own guesses pay for: plain steps for guesses that never stand, the
    largest K for a copied stretch and for text that copies a third of the time (guesses standing in runs:
    one rate for every position would not say so), a K between for guesses that stand twice and then fail
    (priced on the line between its measured neighbours); every probe_every-th call runs the K measured
    longest ago."""
    policy = DraftPolicy(4, num_slots=2, probe_every=8, window=3, memory=0.0, catches_up=True)
    assert policy.ladder == (0, 1, 2, 4)
    for k, seconds in ((4, 0.2), (0, 0.1)):  # nothing measured: the largest K, as asked, then plain steps
        for call_seconds, compiled in ((9.0, True), (seconds, False)):  # a call that compiled is not timed
            assert policy.choose(1, [0]) == k
            steps_at(policy, 1, k, call_seconds, compiled=compiled)
    assert policy.seconds_per_step(1, 4) == pytest.approx(0.02) and policy.seconds_per_step(1, 2) is None

    steps_at(policy, 2, 4, 0.3, [4] * 10, slot=0)  # slot 0 copies: every guess stands
    steps_at(policy, 2, 4, 0.3, [0] * 10, slot=1)  # slot 1 says something new: none does
    # Each slot's own steps, and 2 steps' worth of the engine's recent rate (here, memory 0: the last call's)
    assert policy.chances([0])[0, 0] == pytest.approx((10 + 2 * 1 / 12) / 12)
    assert policy.chances([1])[0, 0] == pytest.approx((0 + 2 * 1 / 12) / 12)
    assert [policy.choose(1, [0]), policy.choose(1, [1])] == [4, 0]
    # Slot 1 copies at 3 steps in 10, and then every guess stands: 2.2 tokens in 0.02 s beat 1.6 in 0.015 (one
    # rate for every position, 12 / 19, would have said K = 2: 2.03 tokens in 0.015 s against 2.44 in 0.02)
    steps_at(policy, 2, 4, 0.3, [4, 0, 0, 0, 0, 0, 0, 4, 0, 4] * 3, slot=1)
    assert policy.choose(1, [1]) == 4
    assert policy.choose(1, [1]) == 1  # the 8th call at this width: K = 1, never measured here, probed
    steps_at(policy, 2, 4, 0.3, [2] * 10, slot=1)  # two guesses stand, the third never: 3 in 0.015 s beat 0.02
    assert policy.choose(1, [1]) == 2
    policy.enter([1])  # a new request in slot 1 starts from the engine's recent rates
    assert policy.chances([1])[0, 0] == pytest.approx(11 / 12) and policy.chances([0])[0, 0] == pytest.approx(
        (10 + 2 * 11 / 12) / 12)
    steps_at(policy, 1, 0, 7.0)  # the call after it is not timed (a draft model catches up there)
    policy.record(1, 0, 5.0, 0, np.zeros(2), np.zeros((2, 0)), np.zeros((2, 0)))  # no step ran: says nothing
    assert policy.seconds_per_step(1, 0) == pytest.approx(0.01)
    steps_at(policy, 1, 0, 0.1)
    steps_at(policy, 1, 0, 3.0)  # one slow call does not move the cost: the median of the window's 3
    assert policy.seconds_per_step(1, 0) == pytest.approx(0.01)
    for _ in range(2):  # two more do: it is slower now
        steps_at(policy, 1, 0, 3.0)
    assert policy.seconds_per_step(1, 0) == pytest.approx(0.3)
    beyond = policy.chances([0])[0, 2:]
    steps_at(policy, 2, 2, 0.3, [2] * 10, slot=0)  # a call at K = 2 says nothing of guesses 3 and 4: they keep
    assert policy.chances([0])[0, 2:] == pytest.approx(beyond) and policy.chances([0])[0, 2] > 0.8
    assert policy.tokens_drafted == 260 and policy.drafts_accepted == 116


def test_a_guess_position_no_call_has_reached_goes_as_the_one_before_it():
    """After calls at K = 2 whose guesses all stood, guesses 3 to 8 are taken to stand as guess 2 does, not
    as a coin toss: else K = 8 would be passed over for want of news of it, and never run to bring any."""
    policy = DraftPolicy(8, num_slots=1)
    policy.record(1, 2, 1.0, 20, np.asarray([40]), np.asarray([[20, 20]]), np.asarray([[20, 20]]))
    assert (policy.chances([0])[0] > 0.99).all()
    assert policy.expected_tokens([0])[-1] > 8.5  # K = 8: 1 + a_1 + ... + a_1...a_8


def test_an_int8_draft_needs_float_weights(model):
    with pytest.raises(ConfigError, match="draft int8 needs the target's weights in float"):
        generate(model, [[1, 2]], 4, draft="int8", quantize="int8")
