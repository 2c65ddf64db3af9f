"""generate: KV-cache decoding against the plain forward, ragged batches, bucketing, stops, streaming and bad input."""

import concurrent.futures

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gpt import GPT, GPTConfig, KVCache
from gpt.errors import ConfigError
from gpt.generate import generate, generate_text
from gpt.inference.engine import Engine, compiled_programs
from gpt.inference.sampling import GREEDY, Sampling

POSITIONS = ("learned", "sinusoidal", "rope")
# The modern recipe's model: rotary positions, QK-norm, relu(x)^2, an untied head, no biases.
MODERN = dict(position="rope", qk_norm=True, activation="relu2", tied_head=False, bias=False)
# The quick tier decodes the modern model, whose cache keys rotate by position (the others: slow).
MODEL_POSITIONS = [pytest.param("learned", marks=pytest.mark.slow), pytest.param("sinusoidal", marks=pytest.mark.slow),
                   pytest.param("rope", marks=pytest.mark.slow), "modern"]


# Ragged prompts (3, 13, 1 and 7 tokens), all inside the smallest prompt bucket: with at most 16 new tokens
# the module's calls of each row count share one decode program (the ones of 2 and 4 rows among the tests).
PROMPTS = [[5, 17, 99], list(range(30, 43)), [200], [7, 7, 8, 9, 10, 250, 3]]


def scaled_model(position: str, scale: float = 4.0, seed: int = 0, **fields) -> GPT:
    """A tiny random model whose matrices are scaled up, so greedy paths are varied and far from ties;
    `position` "modern" is the modern recipe's model."""
    fields = {**MODERN, **fields} if position == "modern" else {"position": position, **fields}
    model = GPT(GPTConfig.preset("tiny", **fields), rngs=nnx.Rngs(seed))
    for path, param in nnx.iter_graph(model):
        if isinstance(param, nnx.Param) and param.ndim >= 2:
            param[...] = param[...] * scale
    return model


@pytest.fixture(scope="module", params=MODEL_POSITIONS)
def model(request):
    return scaled_model(request.param)


def test_cached_decoding_equals_plain_forward(model):
    # Two rows at different lengths in one cache: each row writes and reads at its own positions.
    rng = np.random.default_rng(0)
    lengths, prefill = [20, 13], [6, 2]
    rows = [rng.integers(0, 256, n) for n in lengths]
    cache = KVCache.init(model.config, 2, 32)
    cached = [[], []]
    insert = jax.jit(lambda cache, one, rows, lengths: cache.insert(one, rows, lengths))  # one program
    for row in range(2):  # each row's prompt enters on its own, as an engine admits a request
        one = KVCache.init(model.config, 1, 32)
        logits, one = model(jnp.asarray(rows[row][None, : prefill[row]]), cache=one)
        cached[row].append(np.asarray(logits)[0])
        cache = insert(cache, one, jnp.asarray([row]), jnp.asarray([prefill[row]]))
    for t in range(max(lengths) - min(prefill)):  # then both decode together, one token a step
        positions = np.asarray(cache.lengths)
        tokens = [rows[row][min(positions[row], lengths[row] - 1)] for row in range(2)]
        logits, cache = model(jnp.asarray(tokens, jnp.int32)[:, None], cache=cache)
        for row in range(2):
            if positions[row] < lengths[row]:
                cached[row].append(np.asarray(logits)[row])
    for row in range(2):
        plain = np.asarray(model(jnp.asarray(rows[row][None])))[0]
        np.testing.assert_allclose(np.concatenate(cached[row]), plain, atol=1e-5, rtol=0)


def test_ragged_batch_gives_what_each_prompt_gives_alone(model):
    prompts = PROMPTS
    batched = generate(model, prompts, 12, sampling=GREEDY)
    alone = [generate(model, [p], 12, sampling=GREEDY)[0] for p in prompts]
    assert batched == alone
    assert len({tuple(t) for t in batched}) == len(prompts)  # the rows really differ


@pytest.mark.slow
def test_prompts_beyond_max_batch_wait_for_a_row_and_give_the_same(monkeypatch):
    # A call's memory must not grow with its prompts (each slot holds a cache and a row of logits): past
    # max_batch they queue and enter as rows finish, and each still gives what it gives alone.
    model = scaled_model("learned")
    prompts = PROMPTS + [[1, 2]]
    slots = []
    monkeypatch.setattr("gpt.generate.Engine", lambda *a, **kw: slots.append(kw["slots"]) or Engine(*a, **kw))
    for knobs in (dict(sampling=GREEDY), dict(sampling=Sampling(temperature=0.8), seed=3)):
        assert generate(model, prompts, 12, max_batch=2, **knobs) == generate(model, prompts, 12, **knobs)
    assert slots == [2, 8, 2, 8]


def test_an_array_of_prompts_is_a_batch_of_rows(model):
    rows = [[5, 17, 99], [30, 31, 32], [200, 1, 2]]
    expected = generate(model, rows, 6, sampling=GREEDY)
    assert generate(model, np.array(rows, np.int32), 6, sampling=GREEDY) == expected
    assert generate(model, jnp.array(rows), 6, sampling=GREEDY) == expected


def test_new_weights_are_used_by_the_next_call():
    # generate keeps a decode-ready copy of the block weights between calls; it must notice new ones.
    model, other = scaled_model("learned", seed=0), scaled_model("learned", seed=1)
    prompt = [[5, 17, 42]]
    before = generate(model, prompt, 12, sampling=GREEDY)
    nnx.update(model, nnx.state(other))
    assert generate(model, prompt, 12, sampling=GREEDY) == generate(other, prompt, 12, sampling=GREEDY) != before


@pytest.mark.slow  # the quick tier's engine tests check that nothing compiles after a warm-up
def test_compile_count_is_flat_within_a_bucket():
    from gpt.inference import decoding, device_slots

    def programs():
        return {name: getattr(module, f"compiled_{name}")._cache_size()
                for module, names in ((device_slots, ("prefill", "decode")), (decoding, ("choose_first", "place")))
                for name in names}

    model = scaled_model("rope", rope_theta=5000.0)  # a config no other test compiles for
    before = programs()
    generate(model, [[1, 2, 3]], 5, sampling=GREEDY)
    first = programs()
    # One prefill and decode (the config is static in both); the first token's choice and the place take
    # only shapes, which a model of another config may have compiled them for already.
    assert [first[name] - before[name] for name in ("prefill", "decode")] == [1, 1]
    assert all(0 <= first[name] - before[name] <= 1 for name in ("choose_first", "place"))
    for length, new, temperature in [(4, 9, 0.0), (11, 16, 0.8), (16, 2, 1.0), (7, 13, 0.0)]:
        generate(model, [list(range(1, length + 1))], new,
                 sampling=Sampling(temperature=temperature, top_p=0.9, top_k=40))
    assert programs() == first
    # The next bucket: its prefill and decode (and place); the first token's choice depends on the rows alone.
    generate(model, [list(range(1, 18))], 5, sampling=GREEDY)
    after = programs()
    assert [after[name] - first[name] for name in ("prefill", "decode", "choose_first")] == [1, 1, 0]
    assert 0 <= after["place"] - first["place"] <= 1


@pytest.mark.slow  # its compiles (the quick tier refuses a cache over the memory: tests/test_engine.py)
def test_a_call_that_checks_its_memory_first_compiles_its_programs_once_and_refuses_what_cannot_fit(monkeypatch):
    import gpt.program_report
    from gpt.inference import device_slots
    from gpt.program_report import sharded_bytes

    model = scaled_model("rope", rope_theta=7000.0)  # a config no other test compiles for
    def programs() -> list[int]:
        return [getattr(device_slots, f"compiled_{name}")._cache_size() for name in ("prefill", "decode")]

    before = programs()
    prompts = [[1, 2, 3], list(range(1, 21))]  # the longer one's bucket (32) is the largest prefill
    checked = generate(model, prompts, 6, sampling=GREEDY, check_memory=True)
    assert [a - b for a, b in zip(programs(), before)] == [2, 1]  # both buckets' prefills, one decode: as without
    assert checked == generate(model, prompts, 6, sampling=GREEDY)

    # Room for nothing beside the weights: one line naming the setting, before anything runs.
    monkeypatch.setattr(gpt.program_report, "device_memory_bytes", lambda device: 2 * sharded_bytes(nnx.state(model)))
    with pytest.raises(ConfigError, match=r"^2 slots of 48 positions: the prefill of 1 x 32 tokens needs .*: "
                                          r"decode fewer prompts at once \(max_batch; sample.py: fewer --num_samples\)"):
        generate(model, prompts, 6, sampling=GREEDY, check_memory=True, draft="ngram")


def test_seeds_reproduce(model):
    sample = lambda seed: generate(model, [[1, 2, 3], [4]], 16, sampling=Sampling(), seed=seed)  # noqa: E731
    assert sample(3) == sample(3)
    assert sample(3) != sample(4)


def test_repetition_penalty_changes_greedy_path(model):
    plain = generate(model, [[1, 2, 3]], 16, sampling=GREEDY)[0]
    penalized = generate(model, [[1, 2, 3]], 16, sampling=Sampling(temperature=0, repetition_penalty=100.0))[0]
    assert len(set(penalized)) == len(penalized)  # with a huge penalty no token repeats
    assert len(set(plain)) < len(plain) or plain != penalized


def test_stop_tokens_end_each_row_on_its_own(model):
    prompts = PROMPTS[:2]
    free = generate(model, prompts, 16, sampling=GREEDY)
    stop = free[0][5]
    stopped = generate(model, prompts, 16, sampling=GREEDY, stop_tokens=[stop])
    for row in range(2):
        expected = free[row][: free[row].index(stop)] if stop in free[row] else free[row]
        assert stopped[row] == expected
    assert len(stopped[0]) == free[0].index(stop) < 16
    assert generate(model, prompts, np.int64(16), sampling=GREEDY, stop_tokens=stop) == stopped  # one id, numpy


@pytest.mark.slow  # a further case of a check the quick tier makes
def test_stop_strings_end_each_row_on_its_own():
    from gpt.tokenizer import get_tokenizer

    model = scaled_model("learned", vocab_size=50257)  # the real vocabulary, so text round-trips
    tokenizer = get_tokenizer()
    prompts = tokenizer.encode_batch(["Hello there", "The quick brown fox"])
    free = generate(model, prompts, 20, sampling=GREEDY)
    stop = tokenizer.decode(free[0][6:8])
    stopped = generate(model, prompts, 20, sampling=GREEDY, stop_strings=[stop])
    for row in range(2):
        cut = next((i + 1 for i in range(len(free[row])) if stop in tokenizer.decode(free[row][: i + 1])),
                   len(free[row]))
        assert stopped[row] == free[row][:cut]
    texts = generate_text(model, [tokenizer.decode(p) for p in prompts], 20, sampling=GREEDY, stop_strings=[stop])
    assert stop not in texts[0] and tokenizer.decode(free[0]).startswith(texts[0])
    assert generate_text(model, [tokenizer.decode(p) for p in prompts], 20, sampling=GREEDY, stop_strings=stop) == texts
    with pytest.raises(ConfigError, match="prompts must be a list of strings; prompt 0 is bytes"):
        generate_text(model, [b"Hello there"], 20)
    # Streamed, each row's pieces arrive as it decodes and add up to its text.
    pieces = {0: [], 1: []}
    streamed = generate_text(model, [tokenizer.decode(p) for p in prompts], 20, sampling=GREEDY, stop_strings=[stop],
                             on_text=lambda row, piece: pieces[row].append(piece))
    assert streamed == texts and all("".join(pieces[row]) == texts[row] for row in range(2))
    assert len(pieces[1]) > 1


def test_generate_is_reentrant_and_thread_safe(model):
    # Each call has its own engine: an on_token may call generate, and threads may call it at once.
    inner = []
    on_token = lambda row, token: inner or inner.append(generate(model, [[token]], 3, sampling=GREEDY)[0])  # noqa: E731
    out = generate(model, [[1, 2, 3]], 5, sampling=GREEDY, on_token=on_token)
    assert inner == [generate(model, [[out[0][0]]], 3, sampling=GREEDY)[0]]
    prompts = PROMPTS
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda p: generate(model, [p], 12, sampling=GREEDY)[0], prompts))
    assert together == generate(model, prompts, 12, sampling=GREEDY)


def test_streaming_hands_out_each_token_in_order(model):
    streamed = {}
    out = generate(model, [[1, 2], [3, 4, 5]], 10, sampling=Sampling(temperature=0.7), seed=1,
                   on_token=lambda row, token: streamed.setdefault(row, []).append(token))
    assert streamed == {0: out[0], 1: out[1]}


@pytest.mark.parametrize(
    "prompts, kwargs, message",
    [
        ([[]], {}, "prompt 0 is empty"),
        ([], {}, "non-empty list"),
        ([[1] * 60], dict(max_new_tokens=10), "that is 70, beyond the model's context of 64 tokens"),
        ([[1, 2]], dict(sampling=Sampling(temperature=-0.5)), "temperature must be >= 0"),
        ([[1, 2]], dict(sampling=Sampling(temperature="0.5")), "temperature must be a number, got '0.5'"),
        ([[1, 2]], dict(stop_tokens="5"), "stop_tokens must be a token id or a list of them, got '5'"),
        ([[1, 2]], dict(sampling=Sampling(temperature=float("inf"))),
         r"temperature must be >= 0 \(0 is greedy\) and finite, got inf"),
        ([[1, 2]], dict(sampling=Sampling(repetition_penalty=float("inf"))),
         "repetition_penalty must be > 0 .* and finite, got inf"),
        ([[1, 2]], dict(sampling=dict(temperature=0)), "sampling must be a gpt.inference.sampling.Sampling"),
        ([[1, 2]], dict(sampling=Sampling(top_p=0.0)), r"top_p must be in \(0, 1\]"),
        ([[1, 2]], dict(sampling=Sampling(top_p=1.5)), r"top_p must be in \(0, 1\]"),
        ([[1, 2]], dict(sampling=Sampling(top_k=0)), "top_k must be an integer >= 1"),
        ([[1, 256]], {}, r"token id 256 outside the vocabulary \[0, 256\)"),
        ([[1, -3]], {}, r"token id -3 outside the vocabulary"),
        ([[1, 2]], dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
        ([[1, 2]], dict(max_new_tokens=True), "max_new_tokens must be an integer >= 1, got True"),
        ([[1, 2]], dict(seed="a"), "seed must be an integer, got 'a'"),
        ([[1, 2]], dict(max_batch=0), "max_batch must be an integer >= 1, got 0"),
    ],
)
def test_bad_input_fails_before_compiling(prompts, kwargs, message):
    model = scaled_model("learned")
    size = compiled_programs()
    kwargs = {"max_new_tokens": 5, **kwargs}
    with pytest.raises(ConfigError, match=message):
        generate(model, prompts, **kwargs)
    assert compiled_programs() == size

