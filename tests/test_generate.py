"""KV-cache decoding against the plain forward, ragged batches, bucketing, sampling rules and bad input."""

import concurrent.futures

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gpt import GPT, GPTConfig, KVCache
from gpt.errors import ConfigError
from gpt.attention import attend, attend_paged
from gpt.decoding import compiled_programs
from gpt.engine import Engine
from gpt.generate import generate, generate_text
from gpt.sampling import SamplingParams, choose, filter_logits, penalize_repetition

POSITIONS = ("learned", "sinusoidal", "rope")
# The quick tier decodes with rotary positions, whose cache keys rotate by position (the others: slow).
MODEL_POSITIONS = [pytest.param("learned", marks=pytest.mark.slow), pytest.param("sinusoidal", marks=pytest.mark.slow),
                   "rope"]


def scaled_model(position: str, scale: float = 4.0, seed: int = 0, **fields) -> GPT:
    """A tiny random model whose matrices are scaled up, so greedy paths are varied and far from ties."""
    model = GPT(GPTConfig.preset("tiny", position=position, **fields), rngs=nnx.Rngs(seed))
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
    for row in range(2):  # each row's prompt enters on its own, as an engine admits a request
        one = KVCache.init(model.config, 1, 32)
        logits, one = model(jnp.asarray(rows[row][None, : prefill[row]]), cache=one)
        cached[row].append(np.asarray(logits)[0])
        cache = cache.insert(one, jnp.asarray([row]), jnp.asarray([prefill[row]]))
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


@pytest.mark.parametrize("page_length", [320, 128, 48, 13])
@pytest.mark.parametrize("furthest", [39, 150, 319])
def test_paged_decode_attention_equals_masked_attention(page_length, furthest):
    # attend_paged reads page 0 and every page that the furthest row has reached (one page: the whole
    # cache under the mask; 13: 25 pages, the last 8 slots long); either way it must equal plain attention
    # under the mask "slots 0..position", whatever the cache holds beyond each row's position.
    rng = np.random.default_rng(0)
    B, N, S, H = 4, 3, 320, 8
    q = jnp.asarray(rng.normal(size=(B, 1, N, H)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(B * N, S, H)), jnp.float32) for _ in range(2))
    positions = jnp.asarray([[0], [17], [furthest], [31]], jnp.int32)
    mask = jnp.arange(S)[None, None, :] <= positions[:, :, None]
    starts = range(0, S, page_length)
    k_pages, v_pages = (tuple(x[:, start:start + page_length] for start in starts) for x in (k, v))
    np.testing.assert_allclose(np.asarray(jax.jit(attend_paged)(q, k_pages, v_pages, positions)),
                               np.asarray(attend(q, k, v, mask)), atol=1e-5, rtol=0)


@pytest.mark.parametrize("page_length", [None, 8, 5])
def test_paged_cache_writes_and_inserts_like_one_buffer(page_length):
    # A prefill's cache inserted into some rows, then a decode write at each row's own position: every
    # page holds exactly the slots that one buffer would, and `layer` joins them back.
    config = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=8)
    rng = np.random.default_rng(1)
    B, N, H, S = 3, config.n_head, config.head_dim, 21
    fresh = KVCache.init(config, 2, 7)
    k_new, v_new = (jnp.asarray(rng.normal(size=(2, 7, N, H)), jnp.float32) for _ in range(2))
    fresh = fresh.write(1, k_new, v_new, jnp.broadcast_to(jnp.arange(7), (2, 7)))
    cache = KVCache.init(config, B, S, page_length).insert(fresh, jnp.asarray([2, 0]), jnp.asarray([7, 4]))
    k_step, v_step = (jnp.asarray(rng.normal(size=(B, 1, N, H)), jnp.float32) for _ in range(2))
    positions = jnp.asarray([[4], [19], [7]], jnp.int32)
    cache = cache.write(1, k_step, v_step, positions)

    want_k = np.zeros((B, N, S, H), np.float32)
    want_k[[2, 0], :, :7] = np.asarray(k_new).transpose(0, 2, 1, 3)
    want_k[np.arange(B), :, positions[:, 0]] = np.asarray(k_step)[:, 0]
    np.testing.assert_array_equal(np.asarray(cache.layer(1)[0]), want_k.reshape(B * N, S, H))
    np.testing.assert_array_equal(np.asarray(cache.layer(0)[0]), 0)
    assert [page.shape[1] for page in cache.pages(1)[0]] == (
        [S] if page_length is None else [page_length] * (S // page_length) + [S % page_length] * (S % page_length > 0))
    np.testing.assert_array_equal(np.asarray(cache.lengths), [4, 0, 7])


def test_ragged_batch_gives_what_each_prompt_gives_alone(model):
    prompts = [[5, 17, 99], list(range(30, 51)), [200], [7, 7, 8, 9, 10, 250, 3]]
    batched = generate(model, prompts, 12, temperature=0)
    alone = [generate(model, [p], 12, temperature=0)[0] for p in prompts]
    assert batched == alone
    assert len({tuple(t) for t in batched}) == len(prompts)  # the rows really differ


def test_prompts_beyond_max_batch_wait_for_a_row_and_give_the_same(monkeypatch):
    # A call's memory must not grow with its prompts (each slot holds a cache and a row of logits): past
    # max_batch they queue and enter as rows finish, and each still gives what it gives alone.
    model = scaled_model("learned")
    prompts = [[5, 17, 99], list(range(30, 51)), [200], [7, 7, 8, 9, 10, 250, 3], [1, 2]]
    slots = []
    monkeypatch.setattr("gpt.generate.Engine", lambda *a, **kw: slots.append(kw["slots"]) or Engine(*a, **kw))
    for knobs in (dict(temperature=0), dict(temperature=0.8, seed=3)):
        assert generate(model, prompts, 12, max_batch=2, **knobs) == generate(model, prompts, 12, **knobs)
    assert slots == [2, 8, 2, 8]


def test_an_array_of_prompts_is_a_batch_of_rows(model):
    rows = [[5, 17, 99], [30, 31, 32], [200, 1, 2]]
    expected = generate(model, rows, 6, temperature=0)
    assert generate(model, np.array(rows, np.int32), 6, temperature=0) == expected
    assert generate(model, jnp.array(rows), 6, temperature=0) == expected


def test_new_weights_are_used_by_the_next_call():
    # generate keeps a decode-ready copy of the block weights between calls; it must notice new ones.
    model, other = scaled_model("learned", seed=0), scaled_model("learned", seed=1)
    prompt = [[5, 17, 42]]
    before = generate(model, prompt, 12, temperature=0)
    nnx.update(model, nnx.state(other))
    assert generate(model, prompt, 12, temperature=0) == generate(other, prompt, 12, temperature=0) != before


def test_compile_count_is_flat_within_a_bucket():
    model = scaled_model("rope", rope_theta=5000.0)  # a config no other test compiles for
    size = compiled_programs()
    generate(model, [[1, 2, 3]], 5, temperature=0)
    assert compiled_programs() == size + 2  # one prefill, one decode
    for length, new, temperature in [(4, 9, 0.0), (11, 16, 0.8), (16, 2, 1.0), (7, 13, 0.0)]:
        generate(model, [list(range(1, length + 1))], new, temperature=temperature, top_p=0.9, top_k=40)
    assert compiled_programs() == size + 2
    generate(model, [list(range(1, 18))], 5, temperature=0)  # a longer prompt: the next bucket
    assert compiled_programs() == size + 4


def test_seeds_reproduce(model):
    sample = lambda seed: generate(model, [[1, 2, 3], [4]], 20, temperature=1.0, seed=seed)  # noqa: E731
    assert sample(3) == sample(3)
    assert sample(3) != sample(4)


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
    draws = _draws(LOGITS, SamplingParams.create(temperature=1.0, **knobs))
    assert set(draws.tolist()) == allowed  # every allowed token appears, no other one does


@pytest.mark.parametrize("extreme, meaning", [
    (dict(top_k=10**13), dict()),  # past int32: every token kept, as with any k >= the vocabulary
    (dict(top_p=1e-300), dict(top_k=1)),  # float32 rounds it to 0: the most likely token only
])
def test_extreme_knobs_keep_their_meaning(extreme, meaning):
    logits = LOGITS[::-1]  # the most likely token last: an all-excluded row would draw token 0
    draws = lambda knobs: _draws(logits, SamplingParams.create(temperature=1.0, **knobs), n=500)  # noqa: E731
    np.testing.assert_array_equal(draws(extreme), draws(meaning))


def test_filter_threshold_matches_definition():
    params = SamplingParams.create(temperature=1.0, top_p=0.6)
    kept = np.isfinite(np.asarray(filter_logits(jnp.asarray(LOGITS)[None], params))[0])
    assert kept.tolist() == [True, True, True, False, False, False, False, False]


def test_repetition_penalty_as_defined():
    logits = jnp.asarray([[2.0, -1.0, 0.5, 1.0]])
    seen = jnp.asarray([[True, True, False, False]])
    penalized = np.asarray(penalize_repetition(logits, seen, jnp.float32(2.0)))
    np.testing.assert_allclose(penalized, [[1.0, -2.0, 0.5, 1.0]])
    before, after = jax.nn.softmax(logits), jax.nn.softmax(jnp.asarray(penalized))
    assert after[0, 0] < before[0, 0] and after[0, 1] < before[0, 1]


def test_repetition_penalty_changes_greedy_path(model):
    plain = generate(model, [[1, 2, 3]], 30, temperature=0)[0]
    penalized = generate(model, [[1, 2, 3]], 30, temperature=0, repetition_penalty=100.0)[0]
    assert len(set(penalized)) == len(penalized)  # with a huge penalty no token repeats
    assert len(set(plain)) < len(plain) or plain != penalized


def test_stop_tokens_end_each_row_on_its_own(model):
    prompts = [[5, 17, 99], list(range(30, 51))]
    free = generate(model, prompts, 16, temperature=0)
    stop = free[0][5]
    stopped = generate(model, prompts, 16, temperature=0, stop_tokens=[stop])
    for row in range(2):
        expected = free[row][: free[row].index(stop)] if stop in free[row] else free[row]
        assert stopped[row] == expected
    assert len(stopped[0]) == free[0].index(stop) < 16
    assert generate(model, prompts, np.int64(16), temperature=0, stop_tokens=stop) == stopped  # one id, numpy


def test_stop_strings_end_each_row_on_its_own():
    from gpt.tokenizer import get_tokenizer

    model = scaled_model("learned", vocab_size=50257)  # the real vocabulary, so text round-trips
    tokenizer = get_tokenizer()
    prompts = tokenizer.encode_batch(["Hello there", "The quick brown fox"])
    free = generate(model, prompts, 20, temperature=0)
    stop = tokenizer.decode(free[0][6:8])
    stopped = generate(model, prompts, 20, temperature=0, stop_strings=[stop])
    for row in range(2):
        cut = next((i + 1 for i in range(len(free[row])) if stop in tokenizer.decode(free[row][: i + 1])),
                   len(free[row]))
        assert stopped[row] == free[row][:cut]
    texts = generate_text(model, [tokenizer.decode(p) for p in prompts], 20, temperature=0, stop_strings=[stop])
    assert stop not in texts[0] and tokenizer.decode(free[0]).startswith(texts[0])
    assert generate_text(model, [tokenizer.decode(p) for p in prompts], 20, temperature=0, stop_strings=stop) == texts
    with pytest.raises(ConfigError, match="prompts must be a list of strings; prompt 0 is bytes"):
        generate_text(model, [b"Hello there"], 20)
    # Streamed, each row's pieces arrive as it decodes and add up to its text.
    pieces = {0: [], 1: []}
    streamed = generate_text(model, [tokenizer.decode(p) for p in prompts], 20, temperature=0, stop_strings=[stop],
                             on_text=lambda row, piece: pieces[row].append(piece))
    assert streamed == texts and all("".join(pieces[row]) == texts[row] for row in range(2))
    assert len(pieces[1]) > 1


def test_generate_is_reentrant_and_thread_safe(model):
    # Each call has its own engine: an on_token may call generate, and threads may call it at once.
    inner = []
    on_token = lambda row, token: inner or inner.append(generate(model, [[token]], 3, temperature=0)[0])  # noqa: E731
    out = generate(model, [[1, 2, 3]], 5, temperature=0, on_token=on_token)
    assert inner == [generate(model, [[out[0][0]]], 3, temperature=0)[0]]
    prompts = [[5, 17, 99], list(range(30, 51)), [200], [7, 7, 8, 9, 10, 250, 3]]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda p: generate(model, [p], 12, temperature=0)[0], prompts))
    assert together == generate(model, prompts, 12, temperature=0)


def test_streaming_hands_out_each_token_in_order(model):
    streamed = {}
    out = generate(model, [[1, 2], [3, 4, 5]], 10, temperature=0.7, seed=1,
                   on_token=lambda row, token: streamed.setdefault(row, []).append(token))
    assert streamed == {0: out[0], 1: out[1]}


@pytest.mark.parametrize(
    "prompts, kwargs, message",
    [
        ([[]], {}, "prompt 0 is empty"),
        ([], {}, "non-empty list"),
        ([[1] * 60], dict(max_new_tokens=10), "that is 70, beyond the model's context of 64 tokens"),
        ([[1, 2]], dict(temperature=-0.5), "temperature must be >= 0"),
        ([[1, 2]], dict(temperature="0.5"), "temperature must be a number, got '0.5'"),
        ([[1, 2]], dict(stop_tokens="5"), "stop_tokens must be a token id or a list of them, got '5'"),
        ([[1, 2]], dict(temperature=float("inf")), r"temperature must be >= 0 \(0 is greedy\) and finite, got inf"),
        ([[1, 2]], dict(repetition_penalty=float("inf")), "repetition_penalty must be > 0 .* and finite, got inf"),
        ([[1, 2]], dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        ([[1, 2]], dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
        ([[1, 2]], dict(top_k=0), "top_k must be an integer >= 1"),
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
