"""The KV cache: writes, inserts and pages against one buffer."""

import jax.numpy as jnp
import numpy as np
import pytest

from gpt import GPTConfig, KVCache


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


def test_a_cache_holds_the_key_heads_alone():
    # Grouped-query attention's memory win: 4 query heads over 1 key head, a quarter of the cache.
    config = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_kv_head=1, n_embd=16)
    cache = KVCache.init(config, 3, 20, page_length=8)
    assert [page.shape for page in cache.k[1]] == [(3, 8, 4), (3, 8, 4), (3, 4, 4)]
    assert sum(page.nbytes for layer in (*cache.k, *cache.v) for page in layer) == 2 * 2 * 3 * 20 * 1 * 4 * 4
