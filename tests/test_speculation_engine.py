"""Speculative decoding through the engine and the server (slow: engines and servers warm up, a run
trains): stops and lengths inside a draft under continuous batching, a draft model kept up with its rows,
a drafter of one's own, trained weights, the distribution sampling with a draft draws from, when the
engine drafts, and a server with a draft."""

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
from gpt.inference import decoding
from gpt.inference.decoder import Decoder
from gpt.inference.drafters import Drafter, make_drafter
from gpt.inference.engine import Engine
from gpt.inference.request import Request
from gpt.inference.sampling import GREEDY, Sampling

import drafting
from drafting import PROMPTS, the_draft

pytestmark = pytest.mark.slow
model, smaller = drafting.model, drafting.smaller  # the module fixtures, shared


@pytest.mark.parametrize("draft, steps_per_call", [("ngram", (1, 4)), ("int8", (4,)), ("itself", (4,))],
                         ids=["ngram", "int8", "itself"])
def test_stops_and_lengths_inside_a_draft_under_continuous_batching(model, smaller, draft, steps_per_call):
    """Five requests through two slots (admitted as others end), stop tokens, stop strings and max tokens
    that land mid-draft, one step or several a call (the drafts' kinds share the calls' bookkeeping: one
    kind runs both): each request's tokens and finish reason are those without a draft, and nothing compiles
    after the warm-up."""
    from gpt.tokenizer import get_tokenizer

    loop = [7, 3, 9, 1, 4] * 3
    greedy = generate(model, [loop, loop[:7]], 40, sampling=GREEDY)  # stops chosen from the paths taken
    stop_string = get_tokenizer().decode([greedy[1][12]])
    requests = [(loop, 40, dict(sampling=GREEDY)), (loop, 30, dict(sampling=GREEDY, stop_tokens=(greedy[0][11],))),
                (list(range(2, 19)), 23, dict(sampling=Sampling(temperature=0.9), seed=3)),
                (loop[:7], 30, dict(sampling=GREEDY, stop_strings=(stop_string,))),
                ([1, 2, 1, 2], 3, dict(sampling=GREEDY))]

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
    for steps in steps_per_call:
        assert run(the_draft(draft, model, smaller), steps) == want


def test_a_draft_model_catches_up_with_each_rows_tokens_through_slot_reuse_and_chunked_prompts(model):
    """The model as its own draft model, greedy: six requests through three slots (each slot's draft cache
    emptied at admission and caught up over its new prompt, prompts of one token to several chunks, decode
    widths below the slots' as rows end), several steps a call: every guess stands and the tokens are
    decoding's without a draft. A draft cache that fell behind its row, or ran another row's tokens, would
    guess from the wrong past."""
    prompts = [[(7 * i + 3 * n) % 256 for i in range(n)] for n in (1, 40, 75, 3, 33, 90)]
    want = generate(model, prompts, 20, sampling=GREEDY)
    engine = Engine(model, slots=3, cache_length=128, prefill_chunk=32, steps_per_call=3, draft=model,
                    draft_tokens=3)
    engine.draft_policy.choose = lambda width, slots: 3
    completions = [engine.submit(Request(p, 20, GREEDY)) for p in prompts]
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
    want = generate(model, prompts, 24, sampling=GREEDY)
    engine = Engine(model, slots=2, cache_length=64, steps_per_call=8, draft=EchoDraft(jnp.int32(1)),
                    draft_tokens=2)
    engine.draft_policy.choose = lambda width, slots: 2
    completions = [engine.submit(Request(p, 24, GREEDY)) for p in prompts]
    engine.run(completions)
    assert [c.tokens for c in completions] == want and engine.draft_policy.tokens_drafted > 0
    drafter = make_drafter("int8", Decoder.of(model), 64)
    assert make_drafter(drafter, Decoder.of(model), 64) is drafter
    assert generate(model, prompts, 24, sampling=GREEDY, draft=drafter, draft_tokens=2) == want


def test_sample_takes_a_draft_of_a_shorter_context_where_its_rows_fit_as_generate_does(tmp_path):
    import io

    from gpt.model import gpt2
    from gpt.sample import SampleConfig, sample

    for name, block_size, seed in (("model", 128, 0), ("draft", 64, 1)):
        gpt2.save(GPT(GPTConfig.preset("tiny", vocab_size=50257, block_size=block_size), rngs=nnx.Rngs(seed)),
                  tmp_path / name)
    greedy = dict(init_from=str(tmp_path / "model"), start="def ", num_samples=2, max_new_tokens=12, sampling=GREEDY)
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
    for knobs in (dict(sampling=GREEDY), dict(sampling=Sampling(temperature=0.7), seed=2)):
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
        pairs = sampled_pairs(model, prompt, 4000, sampling=Sampling(temperature=1.0))
        return chi_square_p_value(np.bincount(pairs[:, 0] * 8 + pairs[:, 1], minlength=64).astype(float), expected)

    assert p_value() > 1e-3
    monkeypatch.setattr(decoding, "count_standing", lambda target, drafts, count: count)  # every draft accepted
    jax.clear_caches()
    try:
        assert p_value() < 1e-6
    finally:
        monkeypatch.undo()
        jax.clear_caches()


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
    completion = engine.submit(Request([7, 3, 9, 1, 4] * 3, 40, GREEDY))
    engine.run([completion])
    assert completion.tokens == generate(model, [[7, 3, 9, 1, 4] * 3], 40, sampling=GREEDY)[0]
    assert ways.count(0) > len(ways) - ways.count(0) >= 1


@pytest.mark.parametrize("draft", ["ngram", "int8", "itself", "smaller"])
def test_every_k_of_the_ladder_changing_from_call_to_call_gives_decodings_tokens(model, smaller, draft):
    """Calls that verify 4, 0, 1, 2, 4, 2... guesses in turn (a draft model's cache kept through each), greedy
    and sampled, ragged rows: the tokens of decoding without a draft; the model as its own draft model has
    every greedy guess stand whatever the K."""
    ks = [4, 0, 1, 2, 4, 2, 1, 0]
    for knobs in (dict(sampling=GREEDY), dict(sampling=Sampling(temperature=0.9, top_k=30), seed=3)):
        want = generate(model, PROMPTS, 30, **knobs)
        engine = Engine(model, slots=4, cache_length=64, steps_per_call=2, draft=the_draft(draft, model, smaller),
                        draft_tokens=4)
        calls = iter(ks * 20)
        engine.draft_policy.choose = lambda width, slots: next(calls)
        completions = [engine.submit(Request(p, 30, stream=i, **knobs)) for i, p in enumerate(PROMPTS)]
        engine.run(completions)
        assert [c.tokens for c in completions] == want
        assert engine.draft_policy.tokens_drafted > 0
        if draft == "itself" and knobs["sampling"] == GREEDY:
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
