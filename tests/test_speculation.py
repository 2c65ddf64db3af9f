"""Speculative decoding with a prompt-lookup draft, an int8 self-draft and a draft model: the drafts prompt
lookup finds, the tokens each gives (those of decoding without a draft, greedy or sampled, under continuous
batching), the distribution it samples, a draft model's cache kept up with its rows, and when the engine
drafts."""

import dataclasses
import math

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
from gpt.inference.drafters import Drafter, make_drafter, ngram_drafts
from gpt.inference.engine import Engine
from gpt.inference.request import Request
from gpt.inference.speculation import count_standing
from gpt.model.kv_cache import KVCache

from serving import decisive_model


@pytest.fixture(scope="module")
def model():
    return decisive_model(vocab_size=256)


@pytest.fixture(scope="module")
def smaller():
    """A draft model: a GPT of another depth and width with the model's vocabulary and context."""
    return GPT(GPTConfig.preset("tiny", vocab_size=256, block_size=128, n_layer=1, n_embd=16, n_head=2),
               rngs=nnx.Rngs(9))


def the_draft(name, model, smaller):
    """A parameter's draft: a kind by name, "itself" (the model as its own draft model) or "smaller"."""
    return dict(itself=model, smaller=smaller).get(name, name)


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


PROMPTS = [  # ragged: a pattern the model may copy, text that does not repeat, a short loop
    [7, 3, 9, 1, 4, 7, 3, 9, 1, 4, 7, 3], list(range(30, 61)), [5, 6, 5, 6, 5], [200],
]


@pytest.mark.parametrize("knobs", [
    dict(temperature=0.0),
    dict(temperature=0.0, repetition_penalty=1.3),
    dict(temperature=1.0, seed=11),
    dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02, repetition_penalty=1.05, seed=5),
])
@pytest.mark.parametrize("draft, draft_tokens", [("ngram", 1), ("ngram", 4), ("int8", 3), ("itself", 4),
                                                  ("smaller", 2)])
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
    assert policy.drafts_accepted > 0 or knobs["temperature"] > 0 or draft is smaller
    if draft is model and knobs == dict(temperature=0.0):
        assert policy.drafts_accepted == policy.tokens_drafted


@pytest.mark.parametrize("draft", ["ngram", "int8", "itself"])
def test_stops_and_lengths_inside_a_draft_under_continuous_batching(model, smaller, draft):
    """Five requests through two slots (admitted as others end), stop tokens, stop strings and max tokens
    that land mid-draft, one step or several a call: each request's tokens and finish reason are those
    without a draft, and nothing compiles after the warm-up."""
    from gpt.tokenizer import get_tokenizer

    loop = [7, 3, 9, 1, 4] * 3
    greedy = generate(model, [loop, loop[:7]], 40, temperature=0.0)  # stops chosen from the paths taken
    stop_string = get_tokenizer().decode([greedy[1][12]])
    requests = [(loop, 40, dict(temperature=0.0)), (loop, 30, dict(temperature=0.0, stop_tokens=(greedy[0][11],))),
                (list(range(2, 19)), 23, dict(temperature=0.9, seed=3)),
                (loop[:7], 30, dict(temperature=0.0, stop_strings=(stop_string,))), ([1, 2, 1, 2], 3, dict(temperature=0.0))]

    def run(draft, steps_per_call):
        engine = Engine(model, slots=2, cache_length=64, steps_per_call=steps_per_call, prefill_chunk=16,
                        draft=draft, draft_tokens=3)
        engine.warmup(log=lambda line: None)
        compiled = engine.compiled_shapes()
        submitted = [engine.submit(Request(p, m, **k)) for p, m, k in requests]
        engine.run(submitted)
        assert engine.compiled_shapes() == compiled, "compiled after the warm-up"
        return [(c.tokens, c.finish_reason) for c in submitted]

    want = run(None, 1)
    assert [reason for _, reason in want] == ["length", "stop", "length", "stop", "length"]
    for steps_per_call in (1, 4):
        assert run(the_draft(draft, model, smaller), steps_per_call) == want


def test_a_draft_model_catches_up_with_each_rows_tokens_through_slot_reuse_and_chunked_prompts(model):
    """The model as its own draft model, greedy: six requests through three slots (each slot's draft cache
    emptied at admission and caught up over its new prompt, prompts of one token to several chunks, decode
    widths below the slots' as rows end), several steps a call: every guess stands and the tokens are
    decoding's without a draft. A draft cache that fell behind its row, or ran another row's tokens, would
    guess from the wrong past."""
    prompts = [[(7 * i + 3 * n) % 256 for i in range(n)] for n in (1, 40, 75, 3, 33, 90)]
    want = generate(model, prompts, 20, temperature=0.0)
    engine = Engine(model, slots=3, cache_length=128, prefill_chunk=32, steps_per_call=3, draft=model,
                    draft_tokens=3)
    engine.draft_policy.choose = lambda width, slots: 3
    completions = [engine.submit(Request(p, 20, temperature=0.0)) for p in prompts]
    engine.run(completions)
    assert [c.tokens for c in completions] == want
    assert engine.draft_policy.drafts_accepted == engine.draft_policy.tokens_drafted > 60


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EchoDraft(Drafter):
    """A drafter of a test's own: guesses each row's last token, `repeats` times over (a pytree: its one
    array is the decode program's argument)."""

    repeats: jax.Array

    def propose(self, config, slots, draft_tokens):
        drafts_RK = jnp.broadcast_to(slots.last_token[:, None] * self.repeats, (slots.last_token.shape[0], draft_tokens))
        return drafts_RK, jnp.full_like(slots.last_token, draft_tokens), slots


def test_a_drafter_of_ones_own_plugs_in_by_its_type_alone(model):
    """A new kind of draft is a Drafter and nothing else: the engine proposes through it, verifies its
    guesses and gives decoding's tokens; one made by `make_drafter` is made once and taken again as it is."""
    prompts = [[5, 5, 5, 5], [7, 3, 9, 1, 4, 7, 3]]
    want = generate(model, prompts, 24, temperature=0.0)
    engine = Engine(model, slots=2, cache_length=64, steps_per_call=8, draft=EchoDraft(jnp.int32(1)),
                    draft_tokens=2)
    engine.draft_policy.choose = lambda width, slots: 2
    completions = [engine.submit(Request(p, 24, temperature=0.0)) for p in prompts]
    engine.run(completions)
    assert [c.tokens for c in completions] == want and engine.draft_policy.tokens_drafted > 0
    drafter = make_drafter("int8", Decoder.of(model), 64)
    assert make_drafter(drafter, Decoder.of(model), 64) is drafter
    assert generate(model, prompts, 24, temperature=0.0, draft=drafter, draft_tokens=2) == want


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


def test_sample_takes_a_draft_of_a_shorter_context_where_its_rows_fit_as_generate_does(tmp_path):
    import io

    from gpt.model import gpt2
    from gpt.sample import SampleConfig, sample

    for name, block_size, seed in (("model", 128, 0), ("draft", 64, 1)):
        gpt2.save(GPT(GPTConfig.preset("tiny", vocab_size=50257, block_size=block_size), rngs=nnx.Rngs(seed)),
                  tmp_path / name)
    greedy = dict(init_from=str(tmp_path / "model"), start="def ", num_samples=2, max_new_tokens=12, temperature=0)
    plain = sample(SampleConfig(**greedy), io.StringIO())
    # Each row holds 16 + 16 positions, within the draft's 64 (it had been checked against the model's 128).
    assert sample(SampleConfig(**greedy, draft=str(tmp_path / "draft"), draft_tokens=3), io.StringIO()) == plain
    with pytest.raises(ConfigError, match="the draft's context of 64 positions is shorter than the 80 positions"):
        sample(SampleConfig(**{**greedy, "max_new_tokens": 60}, draft=str(tmp_path / "draft")), io.StringIO())


def test_trained_weights_give_the_same_tokens_and_accept_drafts(trained_run, corpus_text):
    """On the weights of a short training run, continuing source text it saw part of: greedy and sampled
    tokens equal decoding's without a draft, with either draft, and drafts stand."""
    from gpt.tokenizer import get_tokenizer
    from gpt.train.checkpoint import load_model

    trained = load_model(trained_run)
    text = corpus_text[300_000:301_200]
    prompts = [get_tokenizer().encode(text[i: i + 400])[:96] for i in (0, 500)]
    for knobs in (dict(temperature=0.0), dict(temperature=0.7, seed=2)):
        want = generate(trained, prompts, 24, **knobs)
        for draft in ("ngram", "int8", trained):
            engine = Engine(trained, slots=2, cache_length=128, steps_per_call=128, draft=draft)
            completions = [engine.submit(Request(p, 24, stream=i, **knobs)) for i, p in enumerate(prompts)]
            engine.run(completions)
            assert [c.tokens for c in completions] == want
            assert engine.draft_policy.drafts_accepted > 0


def sampled_pairs(model, prompt, draws, **knobs):
    """The first two tokens of `draws` seeded samples of `prompt`, with a draft (three asked for: a draft
    is never longer than the tokens a row may still emit, less the one the target adds)."""
    rows = generate(model, [prompt] * draws, 3, draft="ngram", draft_tokens=3, seed=0, max_batch=256, **knobs)
    return np.asarray([row[:2] for row in rows])


def chi_square_p_value(observed: np.ndarray, expected: np.ndarray) -> float:
    """Pearson's test of counts against probabilities (cells expected fewer than 5 times pooled), its
    p-value by Wilson and Hilferty's normal approximation of the chi-square distribution."""
    expected = expected / expected.sum() * observed.sum()
    small = expected < 5
    observed = np.append(observed[~small], observed[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    statistic = float(np.sum((observed - expected) ** 2 / np.maximum(expected, 1e-12)))
    k = len(observed) - 1
    z = ((statistic / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_sampling_with_a_draft_draws_from_the_models_distribution(monkeypatch):
    """Over a vocabulary of 8 whose every token is in the prompt (so the second token is always drafted),
    the joint distribution of the first two sampled tokens over 4000 seeds matches the model's own, and
    the same test fails when a draft is always accepted."""
    model = GPT(GPTConfig.preset("tiny", vocab_size=8, block_size=32), rngs=nnx.Rngs(5))
    nnx.update(model, jax.tree.map(lambda p: p * 3.0 if p.ndim >= 2 else p, nnx.state(model, nnx.Param)))
    prompt = [0, 1, 2, 3, 4, 5, 6, 7, 3, 1]
    first = jax.nn.softmax(model(jnp.asarray([prompt]))[0, -1])
    then = jax.nn.softmax(model(jnp.asarray([prompt + [t] for t in range(8)]))[:, -1], axis=-1)
    expected = np.asarray(first[:, None] * then).reshape(-1)

    def p_value():
        pairs = sampled_pairs(model, prompt, 4000, temperature=1.0)
        return chi_square_p_value(np.bincount(pairs[:, 0] * 8 + pairs[:, 1], minlength=64).astype(float), expected)

    assert p_value() > 1e-3
    monkeypatch.setattr(decoding, "count_standing", lambda target, drafts, count: count)  # every draft accepted
    jax.clear_caches()
    try:
        assert p_value() < 1e-6
    finally:
        monkeypatch.undo()
        jax.clear_caches()


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


def test_the_engine_runs_plain_steps_where_drafts_seldom_stand(model, monkeypatch):
    """With plain steps measured cheaper than any draft at every width, the engine's calls go plain (a draft
    only to probe), and the tokens stay the same."""
    engine = Engine(model, slots=2, cache_length=96, draft="ngram", draft_tokens=2)
    engine.warmup(log=lambda line: None)  # no call below compiles: each is timed as it runs
    engine.draft_policy.probe_every = 8  # some probes within the request's 39 calls
    ways = []
    original = engine.device.decode

    def decode(*args):
        ways.append(args[-1])
        return original(*args)

    monkeypatch.setattr(engine.device, "decode", decode)
    for width in engine.decode_widths:
        for k in engine.draft_policy.ladder:
            for _ in range(2):
                engine.draft_policy.record(width, k, 0.1 * (1 + 2 * k), 10, np.zeros(engine.num_slots),
                                     *np.zeros((2, engine.num_slots, k)))
    completion = engine.submit(Request([7, 3, 9, 1, 4] * 3, 40, temperature=0.0))
    engine.run([completion])
    assert completion.tokens == generate(model, [[7, 3, 9, 1, 4] * 3], 40, temperature=0.0)[0]
    assert ways.count(0) > len(ways) - ways.count(0) >= 1


@pytest.mark.parametrize("draft", ["ngram", "int8", "itself", "smaller"])
def test_every_k_of_the_ladder_changing_from_call_to_call_gives_decodings_tokens(model, smaller, draft):
    """Calls that verify 4, 0, 1, 2, 4, 2... guesses in turn (a draft model's cache kept through each), greedy
    and sampled, ragged rows: the tokens of decoding without a draft; the model as its own draft model has
    every greedy guess stand whatever the K."""
    ks = [4, 0, 1, 2, 4, 2, 1, 0]
    for knobs in (dict(temperature=0.0), dict(temperature=0.9, top_k=30, seed=3)):
        want = generate(model, PROMPTS, 30, **knobs)
        engine = Engine(model, slots=4, cache_length=64, steps_per_call=2, draft=the_draft(draft, model, smaller),
                        draft_tokens=4)
        calls = iter(ks * 20)
        engine.draft_policy.choose = lambda width, slots: next(calls)
        completions = [engine.submit(Request(p, 30, stream=i, **knobs)) for i, p in enumerate(PROMPTS)]
        engine.run(completions)
        assert [c.tokens for c in completions] == want
        assert engine.draft_policy.tokens_drafted > 0
        if draft == "itself" and knobs["temperature"] == 0:
            assert engine.draft_policy.drafts_accepted == engine.draft_policy.tokens_drafted


def test_a_server_with_a_draft_answers_as_one_without_and_counts_its_drafts(model):
    """serve.py's engine with --draft ngram: completions (greedy and seeded) equal those of a server
    without one, and /metrics counts the drafted tokens and those that stood."""
    import httpx

    from serving import Server

    prompt = PROMPTS[2]  # one whose greedy path (on these weights) drafts tokens that stand
    replies = []
    for draft in (None, "ngram"):
        server = Server(model, warmup=False, slots=2, cache_length=64, draft=draft)
        if draft is not None:  # every call with the draft (when the engine drafts is the policy's test)
            server.engine.draft_policy.choose = lambda width, slots: server.engine.draft_policy.ladder[-1]
        try:
            texts = [server.client.completions.create(model="tiny", prompt=prompt, max_tokens=30, seed=4,
                                                      **knobs).choices[0].text
                     for knobs in (dict(temperature=0), dict(temperature=0.9, top_p=0.95))]
            metrics = dict(line.split() for line in httpx.get(server.url + "/metrics").text.splitlines()
                           if line.startswith("gpt_draft_tokens"))
        finally:
            server.stop()
        replies.append((texts, metrics))
    assert replies[1][0] == replies[0][0]
    assert replies[0][1] == {"gpt_draft_tokens": "0.0", "gpt_draft_tokens_accepted": "0.0"}
    drafted, accepted = (float(replies[1][1][name]) for name in ("gpt_draft_tokens", "gpt_draft_tokens_accepted"))
    assert drafted >= accepted > 0


def test_an_int8_draft_needs_float_weights(model):
    with pytest.raises(ConfigError, match="draft int8 needs the target's weights in float"):
        generate(model, [[1, 2]], 4, draft="int8", quantize="int8")
