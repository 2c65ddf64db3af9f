"""The prefix cache: its host index (no JAX), and scored prompts (or a conversation's turns) that share a beginning
giving what they give alone while running only the rest."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gpt import GPT, GPTConfig
from gpt.errors import ConfigError
from gpt.inference.engine import Engine
from gpt.inference.prefix_cache_index import PrefixCacheIndex
from gpt.inference.request import Request
from gpt.inference.sampling import GREEDY


def scores(n):
    return [(None, None)] + [(-float(i), [(i, -float(i))]) for i in range(1, n)]


def test_the_index_finds_the_longest_run_of_whole_blocks_from_the_start():
    index = PrefixCacheIndex(blocks=8, block=4)
    prompt = list(range(10))
    assert index.add(prompt, 1, scores(10)) == [(0, 0), (4, 1)]  # two whole blocks; the last two tokens are not one
    blocks, held = index.match(prompt[:9] + [99], 1)
    assert [block for block, _ in blocks] == [0, 1] and held == 8
    assert index.match([99] + prompt[1:], 1) == ([], 0)  # a block is found only after the very same tokens
    assert index.match(prompt, 2) == ([], 0)  # another variant (more alternatives asked) is another entry
    assert index.match(prompt, 1)[0][1][1] == scores(10)[4:8]
    assert index.add(prompt + [10, 11], 1, scores(12)) == [(8, 2)]  # held blocks are not added twice


def test_past_its_whole_blocks_a_prompt_takes_the_block_after_them_that_agrees_with_it_longest():
    index = PrefixCacheIndex(blocks=8, block=4)
    index.add(list(range(8)), 1, scores(8))  # block 0: [0, 1, 2, 3], block 1: [4, 5, 6, 7]
    index.add([0, 1, 2, 3, 4, 5, 9, 9], 1, scores(8))  # block 2: [4, 5, 9, 9], after the same block 0
    blocks, held = index.match([0, 1, 2, 3, 4, 5, 6, 50, 51], 1)
    assert [block for block, _ in blocks] == [0, 1] and held == 7  # block 1 agrees on 4, 5, 6
    blocks, held = index.match([0, 1, 2, 3, 4, 5, 9, 7], 1)
    assert [block for block, _ in blocks] == [0, 2] and held == 7  # block 2 agrees on three, block 1 on two
    blocks, held = index.match([0, 1, 9], 1)
    assert [block for block, _ in blocks] == [0] and held == 2  # within the first block
    assert index.match([0, 1, 2, 3, 8], 1)[1] == 4  # no block after the first agrees at all
    assert index.match([0, 1, 2, 3, 4], 2) == ([], 0)  # nor does another variant's


def test_a_full_index_lets_the_least_recently_used_blocks_go():
    index = PrefixCacheIndex(blocks=4, block=2)
    index.add([1, 2, 3, 4], 0, scores(4))  # blocks 0, 1
    index.add([5, 6, 7, 8], 0, scores(4))  # blocks 2, 3
    index.match([1, 2, 3, 4], 0)  # [1, 2, ...] is now the most recently used
    assert index.add([9, 10], 0, scores(2)) == [(0, 2)]  # takes [5, 6]'s block
    assert index.match([5, 6, 7, 8], 0) == ([], 0)  # [5, 6, 7, 8] now begins with a block that is gone
    assert index.match([9, 6], 0)[1] == 1  # the block that took its place is found in its place
    assert len(index.match([1, 2, 3, 4], 0)[0]) == 2
    assert index.add(list(range(20, 30)), 0, scores(10)) == []  # five blocks never fit in four


@pytest.fixture(scope="module")
def model():
    model = GPT(GPTConfig.preset("tiny", block_size=128, n_kv_head=2), rngs=nnx.Rngs(0))  # blocks of 2 key heads
    nnx.update(model, jax.tree.map(lambda p: p * 4.0 if p.ndim >= 2 else p, nnx.state(model, nnx.Param)))
    return model


@pytest.mark.slow
@pytest.mark.parametrize("together", [False, True], ids=["one-by-one", "together"])
@pytest.mark.parametrize("cache_tokens", [4096, 64], ids=["roomy", "evicting"])
def test_scored_prompts_that_share_a_beginning_give_what_they_give_without_the_cache(model, cache_tokens, together):
    """Choices after one context, in an order that mixes in other prompts, scored with and without the cache:
    the same prompt logprobs (within float rounding: the rest runs over a longer cache), alternatives and
    first tokens, the context's positions loaded rather than run, and nothing compiled after warm-up.
    Submitted together, they load at their turns, after the blocks of those before them are in."""
    rng = np.random.default_rng(0)
    context, other = rng.integers(0, 256, 50).tolist(), rng.integers(0, 256, 40).tolist()
    prompts = [context + rng.integers(0, 256, n).tolist() for n in (3, 7, 20, 1)]
    prompts = [prompts[0], other, prompts[1], prompts[2], other + [5], prompts[3], context[:33], context[:31]]
    results = {}
    for tokens in (0, cache_tokens):
        engine = Engine(model, slots=2, max_queue=8, cache_length=128, prefill_chunk=16, prefix_cache_tokens=tokens)
        engine.warmup(log=lambda line: None)
        compiled = engine.compiled_shapes()
        completions = []
        for prompt in prompts:
            completions.append(engine.submit(Request(prompt, 2, GREEDY, logprobs=2, prompt_logprobs=True)))
            if not together:
                engine.run(completions[-1:])
        engine.run(completions)
        assert engine.compiled_shapes() == compiled
        results[tokens] = completions, engine.prompt_tokens_reused
    (alone, none_reused), (cached, reused) = results[0], results[cache_tokens]
    assert none_reused == 0
    # Roomy: the second and third choices load the context's 3 whole blocks but their last token (47),
    # `other` + [5] its 2 (31); the fourth also the first 2 tokens of the block the third left after them
    # (the context's last two: 49); context[:33] 2 blocks and the 1 token it shares with the next (32),
    # context[:31] 1 block and 15 of the next (30). Four blocks: the others' blocks push the context's out,
    # and only the third choice (47), context[:33] (32) and context[:31] (30) find theirs. Together, each
    # round's entrants run shortest first, an order of the engine's own.
    assert reused == (47 + 47 + 31 + 49 + 32 + 30 if cache_tokens == 4096 else 47 + 32 + 30) or together and reused > 0
    for prompt, a, b in zip(prompts, alone, cached):
        assert len(b.prompt_logprobs) == len(prompt) and b.prompt_logprobs[0] is None
        np.testing.assert_allclose(b.prompt_logprobs[1:], a.prompt_logprobs[1:], rtol=1e-5, atol=1e-5)
        assert [[t for t, _ in top] for top in b.prompt_top_logprobs[1:]] == \
               [[t for t, _ in top] for top in a.prompt_top_logprobs[1:]]
        assert b.tokens == a.tokens
        want = jax.nn.log_softmax(model(jnp.asarray([prompt]))[0], -1)
        np.testing.assert_allclose(b.prompt_logprobs[1:], want[np.arange(len(prompt) - 1), prompt[1:]], atol=1e-5)


@pytest.mark.slow
def test_a_conversations_turns_reuse_its_history_and_give_what_they_give_without_the_cache(model):
    """Each turn sends the whole conversation again (`Request.reuse_prefix`, as the chat endpoint asks): with the
    cache, a turn loads the blocks of the turn before and generates the tokens it generates without the cache,
    and a scored prompt with the same tokens does not take the unscored blocks (which have no scores)."""
    results = {}
    for tokens in (0, 1024):
        rng = np.random.default_rng(1)  # the same conversation each time
        history = rng.integers(0, 256, 30).tolist()
        engine = Engine(model, slots=2, max_queue=8, cache_length=128, prefill_chunk=16, prefix_cache_tokens=tokens)
        engine.warmup(log=lambda line: None)
        compiled, turns, prompt = engine.compiled_shapes(), [], history
        for turn in range(3):
            reply = engine.submit(Request(prompt, 6, GREEDY, reuse_prefix=True))
            engine.run([reply])
            turns.append(reply.tokens)
            prompt = prompt + reply.tokens + rng.integers(0, 256, 9).tolist()  # the reply, then the user's next turn
        reused = engine.prompt_tokens_reused
        scored = engine.submit(Request(prompt[:40], 1, GREEDY, prompt_logprobs=True))
        engine.run([scored])
        assert engine.compiled_shapes() == compiled
        results[tokens] = turns, reused, engine.prompt_tokens_reused - reused, scored
    (alone, none, _, _), (cached, reused, scored_reused, scored) = results[0], results[1024]
    assert cached == alone and none == 0
    assert reused == 15 + 31  # turns 2 and 3 load the 1 and 2 whole blocks the turn before kept, less a token each
    assert scored_reused == 0 and len(scored.prompt_logprobs) == 40  # scored afresh: its own blocks, its scores


def test_a_bad_cache_size_is_refused(model):
    with pytest.raises(ConfigError, match="prefix_cache_tokens must be an integer >= 0, got -1"):
        Engine(model, prefix_cache_tokens=-1)
