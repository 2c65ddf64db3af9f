"""A local layer's ring (its window and a step's writes, not the whole context): a decode through it, verification
forwards whose guesses are rolled back included, gives the plain forward's logits on XLA's path and the kernel's;
an engine's slots keep rings of that size, which compile-only holds too; prompts loaded from the prefix cache
enter them as they would run."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gpt import GPT, GPTConfig, KVCache
from gpt.inference.compile_only import compile_engine
from gpt.inference.drafters import CATCH_UP
from gpt.inference.engine import Engine
from gpt.inference.request import Request
from gpt.inference.sampling import GREEDY
from gpt.model.sharding import make_mesh
from gpt.model.transformer import forward, lm_head
from gpt.program_report import sharded_bytes

from conftest import KERNEL_ISAS

WINDOWED = GPTConfig.preset("tiny", position="rope", layer_kinds="lg", n_layer=2, sliding_window=5, n_kv_head=2,
                            block_size=64, vocab_size=256)


@pytest.fixture(scope="module")
def model():
    model = GPT(WINDOWED, rngs=nnx.Rngs(0))
    nnx.update(model, jax.tree.map(lambda p: p * 4.0 if p.ndim >= 2 else p, nnx.state(model, nnx.Param)))
    return model


# The quick tier's: the kernel's path, a CPU's own (XLA's, a GPU's or a TPU's, in the full suite).
@pytest.mark.parametrize("attention_path", [pytest.param("xla", marks=pytest.mark.slow), *KERNEL_ISAS], indirect=True)
def test_a_ring_decodes_as_the_plain_forward_through_rolled_back_guesses(attention_path, model):
    """Two rows enter a ring of 5 + 3 - 1 slots from a prefill; then forwards of 3 positions whose tokens past a
    row's accepted count are wrong guesses (rolled back by the lengths alone, as a verification's are), of 1
    position, and of 3 over a view of one row. Each accepted position's logits are the plain forward's over the
    true tokens: no wrong guess, and no position out of the window, is ever seen."""
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 256, (2, 40)), jnp.int32)
    want = np.asarray(model(tokens))
    prompt_lengths = jnp.asarray([9, 4], jnp.int32)
    prefill = KVCache.init(WINDOWED, 2, 12)
    prefill = model(tokens[:, :12], cache=prefill)[1]
    ring = KVCache.init(WINDOWED, 2, 40, page_length=8, writes=3).insert(prefill, jnp.arange(2), prompt_lengths)
    assert [ring.ring(layer) for layer in range(2)] == [7, None]
    assert [page.shape[1] for page in ring.k[0]] == [7] and sum(page.shape[1] for page in ring.k[1]) == 40
    weights = model.weights()

    @jax.jit  # traced here, on this test's path (`GPT.__call__`'s program may have been traced on another)
    def logits_and_cache(weights, tokens_BT, positions_BT, cache):
        x_BTD, cache = forward(WINDOWED, weights, tokens_BT, positions_BT, cache)
        return lm_head(weights, x_BTD), cache

    def run(cache, positions_BT, accepted_B, rows=(0, 1)):
        """The true tokens of `rows` at their first `accepted` positions, wrong ones after; logits checked there."""
        true_BT = jnp.take_along_axis(tokens[np.asarray(rows)], positions_BT, axis=1)
        fed = jnp.where(jnp.arange(positions_BT.shape[1]) < accepted_B[:, None], true_BT, (true_BT + 1) % 256)
        logits, cache = logits_and_cache(weights, fed, positions_BT, cache)
        for b, row in enumerate(rows):
            real = np.asarray(positions_BT[b, :int(accepted_B[b])])
            np.testing.assert_allclose(np.asarray(logits[b, :len(real)]), want[row][real], atol=2e-4, rtol=0)
        return cache

    for step, accepted in enumerate([(1, 3), (3, 2), (2, 1), (3, 3), (1, 1), (2, 3), (3, 1), (1, 2)]):
        accepted = jnp.asarray(accepted, jnp.int32)
        before = ring.lengths
        if step % 4 == 3:  # one position a row, all of it true
            ring = run(ring, before[:, None], jnp.ones((2,), jnp.int32))
            ring = KVCache(ring.k, ring.v, before + 1, ring.length)
            continue
        positions = before[:, None] + jnp.arange(3, dtype=jnp.int32)
        if step == 5:  # a view of row 1 alone (a decode over some of the slots)
            view = run(ring.select(jnp.asarray([1], jnp.int32)), positions[1:], accepted[1:], rows=(1,))
            ring = ring.merge(KVCache(view.k, view.v, before[1:] + accepted[1:], view.length, view.rows))
            continue
        ring = run(ring, positions, accepted)
        ring = KVCache(ring.k, ring.v, before + accepted, ring.length)
    assert int(ring.lengths.min()) > 5 + 7  # each row has gone round its ring more than once


@pytest.mark.slow  # an engine's and compile-only's compiles (a self-draft's rings: tests/test_sliding_window.py)
def test_an_engines_rings_hold_the_window_and_a_steps_guesses_and_compile_only_holds_the_same(model):
    """Verifying 3 guesses of a draft model a step, a local layer of window 5 keeps 5 + 4 - 1 slots a row, the global
    layer all 64, and the draft's own cache (written up to CATCH_UP positions a forward) 5 + 32 - 1; greedy tokens
    through them are the plain forward's; compile-only's slots are the engine's to the byte."""
    small = GPT(WINDOWED.replace(n_layer=1), rngs=nnx.Rngs(1))
    engine = Engine(model, slots=2, cache_length=64, prefill_chunk=16, draft=small, draft_tokens=3)
    slots = engine.device.slots
    assert [sum(page.shape[1] for page in slots.cache.k[layer]) for layer in range(2)] == [8, 64]
    assert [page.shape[1] for page in slots.draft_cache.k[0]] == [5 + CATCH_UP - 1]
    prompts = [np.random.default_rng(1).integers(0, 256, n).tolist() for n in (13, 3)]
    completions = [engine.submit(Request(prompt, 24, GREEDY)) for prompt in prompts]
    engine.run(completions)
    for prompt, completion in zip(prompts, completions):  # each token the plain forward's argmax after those before
        text = prompt + completion.tokens
        assert completion.tokens == np.argmax(model(jnp.asarray([text]))[0, len(prompt) - 1:-1], -1).tolist()
    mesh = make_mesh(data=1, devices=jax.devices("cpu")[:1])
    settings = dataclasses.replace(engine.settings, draft="a/draft")  # a draft model as the flag names one
    _, decode = compile_engine(model.config, settings, "none", mesh, draft_config=small.config)
    assert decode.held["slots and their cache"] == sharded_bytes(slots)


@pytest.mark.slow  # two engines' compiles; the quick tier's ring is the decode above
def test_a_conversation_loaded_from_the_prefix_cache_enters_the_rings_as_it_would_run(model):
    """Turns that reuse the history's blocks (past the window) generate the plain forward's greedy tokens, as they do
    without the cache."""
    results = {}
    for tokens in (0, 1024):
        rng = np.random.default_rng(2)
        engine = Engine(model, slots=2, cache_length=64, prefill_chunk=16, prefix_cache_tokens=tokens)
        prompt, turns = rng.integers(0, 256, 20).tolist(), []
        for _ in range(2):
            reply = engine.submit(Request(prompt, 6, GREEDY, reuse_prefix=True))
            engine.run([reply])
            turns.append(reply.tokens)
            plain = model(jnp.asarray([prompt + reply.tokens]))[0, len(prompt) - 1:-1]
            assert reply.tokens == np.argmax(plain, -1).tolist()
            prompt = prompt + reply.tokens + rng.integers(0, 256, 5).tolist()
        results[tokens] = turns, engine.prompt_tokens_reused
    assert results[1024][0] == results[0][0] and results[1024][1] > 5
