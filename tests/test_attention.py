"""Paged decode attention against plain attention under the mask."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpt.model.attention import attend, attend_paged


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
